#ifndef MEMRA_TESTS_HTTP_GET_H_
#define MEMRA_TESTS_HTTP_GET_H_

// A plain HTTP/1.1 GET against a daemon's metrics endpoint on loopback: what a Prometheus scrape
// sees, headers included.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace memra::testing {

// GET http://127.0.0.1:port/path, the whole response ("" when it cannot connect).
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    const std::string request =
        absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t got; (got = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, got);
    }
  }
  close(fd);
  return response;
}

}  // namespace memra::testing

#endif  // MEMRA_TESTS_HTTP_GET_H_
