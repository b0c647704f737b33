#include "server/metrics/metrics_http.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/metrics/metrics.h"
#include "tests/status_matchers.h"

namespace memra::metrics {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

struct HttpResponse {
  std::string status_line;
  std::string headers;  // every header line after the status line, each ending in \r\n
  std::string body;
};

// A connected TCP socket to 127.0.0.1:port, or the errno of the failure.
absl::StatusOr<int> ConnectToLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  // Only a guard against a hung test: no assertion depends on it.
  timeval receive_timeout = {.tv_sec = 60, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &receive_timeout, sizeof(receive_timeout));
  sockaddr_in loopback = {};
  loopback.sin_family = AF_INET;
  loopback.sin_port = htons(static_cast<uint16_t>(port));
  loopback.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&loopback), sizeof(loopback)) != 0) {
    const int error = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to port ", port, ": ",
                                               std::strerror(error)));
  }
  return fd;
}

// Sends one HTTP/1.1 request with Connection: close and reads the response to end of stream.
absl::StatusOr<HttpResponse> Request(int port, std::string_view method, std::string_view path) {
  absl::StatusOr<int> fd = ConnectToLoopback(port);
  if (!fd.ok()) return fd.status();
  const std::string request =
      absl::StrCat(std::string(method), " ", std::string(path),
                   " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  if (send(*fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    close(*fd);
    return absl::InternalError("send failed");
  }
  std::string raw;
  char buffer[4096];
  ssize_t received;
  while ((received = recv(*fd, buffer, sizeof(buffer), 0)) > 0) raw.append(buffer, received);
  close(*fd);
  if (received < 0) return absl::InternalError(absl::StrCat("recv: ", std::strerror(errno)));

  const size_t status_end = raw.find("\r\n");
  const size_t headers_end = raw.find("\r\n\r\n");
  if (status_end == std::string::npos || headers_end == std::string::npos) {
    return absl::InternalError(absl::StrCat("not an HTTP response: ", raw));
  }
  return HttpResponse{.status_line = raw.substr(0, status_end),
                      .headers = raw.substr(status_end + 2, headers_end - status_end),
                      .body = raw.substr(headers_end + 4)};
}

class MetricsHttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<Counter*> counter = registry_.AddCounter("memra_test_total", "A test counter.");
    ASSERT_THAT(counter, IsOk());
    counter_ = *counter;
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
        MetricsHttpServer::Start("127.0.0.1:0", &registry_);
    ASSERT_THAT(server, IsOk());
    server_ = *std::move(server);
    ASSERT_GT(server_->bound_port(), 0);
  }

  Registry registry_;
  Counter* counter_ = nullptr;
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpServerTest, ServesTheCurrentExposition) {
  counter_->Increment(7);
  absl::StatusOr<HttpResponse> response = Request(server_->bound_port(), "GET", "/metrics");
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status_line, "HTTP/1.1 200 OK");
  EXPECT_THAT(response->headers,
              HasSubstr("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
  EXPECT_EQ(response->body,
            "# HELP memra_test_total A test counter.\n"
            "# TYPE memra_test_total counter\n"
            "memra_test_total 7\n");

  counter_->Increment();
  response = Request(server_->bound_port(), "GET", "/metrics?x=1");
  ASSERT_THAT(response, IsOk());
  EXPECT_THAT(response->body, HasSubstr("memra_test_total 8\n"));
}

TEST_F(MetricsHttpServerTest, RootPointsToMetrics) {
  absl::StatusOr<HttpResponse> response = Request(server_->bound_port(), "GET", "/");
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status_line, "HTTP/1.1 200 OK");
  EXPECT_THAT(response->body, HasSubstr("/metrics"));
  EXPECT_THAT(response->body, Not(HasSubstr("memra_test_total")));
}

TEST_F(MetricsHttpServerTest, UnknownPathIsNotFound) {
  for (std::string_view path : {"/metricsx", "/metrics/", "/favicon.ico"}) {
    absl::StatusOr<HttpResponse> response = Request(server_->bound_port(), "GET", path);
    ASSERT_THAT(response, IsOk());
    EXPECT_EQ(response->status_line, "HTTP/1.1 404 Not Found") << path;
    EXPECT_THAT(response->body, Not(HasSubstr("memra_test_total"))) << path;
  }
}

TEST_F(MetricsHttpServerTest, OtherMethodsAreNotAllowed) {
  absl::StatusOr<HttpResponse> response = Request(server_->bound_port(), "POST", "/metrics");
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status_line, "HTTP/1.1 405 Method Not Allowed");
  EXPECT_THAT(response->headers, HasSubstr("Allow: GET\r\n"));
  EXPECT_THAT(response->body, HasSubstr("method POST is not allowed"));
}

TEST_F(MetricsHttpServerTest, PortInUseIsUnavailableNamingTheAddress) {
  const std::string taken = absl::StrCat("127.0.0.1:", server_->bound_port());
  EXPECT_THAT(MetricsHttpServer::Start(taken, &registry_),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstrs(absl::StrCat("cannot serve metrics on ", taken),
                                  "Address already in use")));
  // The first server is unharmed.
  absl::StatusOr<HttpResponse> response = Request(server_->bound_port(), "GET", "/metrics");
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status_line, "HTTP/1.1 200 OK");
}

TEST_F(MetricsHttpServerTest, DestructorStopsListening) {
  const int port = server_->bound_port();
  server_.reset();
  EXPECT_THAT(ConnectToLoopback(port),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("Connection refused")));
}

TEST(ParseListenAddressTest, AcceptsIpv4AndBracketedIpv6) {
  absl::StatusOr<ListenAddress> v4 = ParseListenAddress("0.0.0.0:9464");
  ASSERT_THAT(v4, IsOk());
  EXPECT_EQ(v4->host, "0.0.0.0");
  EXPECT_EQ(v4->port, 9464);
  EXPECT_FALSE(v4->is_ipv6);

  absl::StatusOr<ListenAddress> v6 = ParseListenAddress("[::1]:0");
  ASSERT_THAT(v6, IsOk());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 0);
  EXPECT_TRUE(v6->is_ipv6);
}

TEST(ParseListenAddressTest, RefusesMalformedAddressesNamingThem) {
  EXPECT_THAT(ParseListenAddress("9464"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("\"9464\" is invalid", "expected host:port")));
  EXPECT_THAT(ParseListenAddress("127.0.0.1:"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("port \"\" is not a number from 0 to 65535")));
  EXPECT_THAT(ParseListenAddress("127.0.0.1:-1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("port \"-1\" is not a number")));
  EXPECT_THAT(ParseListenAddress("127.0.0.1:65536"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("\"127.0.0.1:65536\"", "port 65536 is above 65535")));
  EXPECT_THAT(ParseListenAddress("localhost:9464"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("host \"localhost\" is not an IPv4 address",
                                  "host names are not resolved")));
  EXPECT_THAT(ParseListenAddress("::1:9464"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("\"::1:9464\" is invalid", "IPv6 goes in brackets")));
  EXPECT_THAT(ParseListenAddress("[1.2.3.4]:9464"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("\"1.2.3.4\" is not an IPv6 address")));
}

TEST(MetricsHttpServerStartTest, RefusesAMalformedAddress) {
  Registry registry;
  EXPECT_THAT(MetricsHttpServer::Start("127.0.0.1:http", &registry),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("\"127.0.0.1:http\"", "port \"http\" is not a number")));
}

TEST(MetricsHttpServerStartTest, Ipv6NeedsACivetwebBuiltWithIt) {
  Registry registry;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("[::1]:0", &registry);
  if (mg_check_feature(8) == 0) {
    EXPECT_THAT(server, StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstrs("\"[::1]:0\"", "built without IPv6 support")));
  } else {
    // A machine without an IPv6 loopback refuses to bind: still a status, not an abort.
    EXPECT_TRUE(server.ok() || server.status().code() == absl::StatusCode::kUnavailable)
        << server.status();
  }
}

TEST(MetricsHttpServerStartTest, AnAddressNotOnThisMachineIsUnavailable) {
  Registry registry;
  // TEST-NET-1 (RFC 5737): never assigned to a local interface.
  EXPECT_THAT(MetricsHttpServer::Start("192.0.2.1:0", &registry),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstrs("cannot serve metrics on 192.0.2.1:0", "cannot bind")));
}

}  // namespace
}  // namespace memra::metrics
