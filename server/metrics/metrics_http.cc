#include "server/metrics/metrics_http.h"

#include <arpa/inet.h>
#include <civetweb.h>

#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace memra::metrics {
namespace {

// Debian's Abseil predates absl::string_view being std::string_view.
absl::string_view AbslView(std::string_view view) { return {view.data(), view.size()}; }

// mg_check_feature's bit for IPv6 support (civetweb.h documents the bits).
constexpr unsigned kCivetwebFeatureIpv6 = 8;

constexpr std::string_view kExpositionContentType = "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kPlainTextContentType = "text/plain; charset=utf-8";

absl::Status BadAddress(std::string_view address, std::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("metrics listen address \"", AbslView(address),
                                                 "\" is invalid: ", AbslView(why)));
}

// The whole response; keep-alive is off, so the connection closes after it.
int Respond(mg_connection* connection, int status, std::string_view reason,
            std::string_view content_type, std::string_view body,
            std::string_view extra_headers = "") {
  const std::string head = absl::StrCat(
      "HTTP/1.1 ", status, " ", AbslView(reason), "\r\nContent-Type: ", AbslView(content_type),
      "\r\nContent-Length: ", body.size(), "\r\n", AbslView(extra_headers),
      "Connection: close\r\n\r\n");
  mg_write(connection, head.data(), head.size());
  mg_write(connection, body.data(), body.size());
  return status;
}

}  // namespace

absl::StatusOr<ListenAddress> ParseListenAddress(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) {
    return BadAddress(address, "expected host:port, e.g. 127.0.0.1:9464 or [::1]:9464");
  }
  std::string_view host = address.substr(0, colon);
  const std::string_view port = address.substr(colon + 1);

  ListenAddress parsed;
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string_view::npos) {
    return BadAddress(address, absl::StrCat("port \"", AbslView(port),
                                            "\" is not a number from 0 to 65535"));
  }
  parsed.port = std::stoi(std::string(port));
  if (parsed.port > 65535) {
    return BadAddress(address, absl::StrCat("port ", parsed.port, " is above 65535"));
  }

  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
    parsed.is_ipv6 = true;
  }
  parsed.host = std::string(host);
  in6_addr ignored;
  if (inet_pton(parsed.is_ipv6 ? AF_INET6 : AF_INET, parsed.host.c_str(), &ignored) != 1) {
    return BadAddress(address,
                      parsed.is_ipv6
                          ? absl::StrCat("\"", parsed.host, "\" is not an IPv6 address")
                          : absl::StrCat("host \"", parsed.host,
                                         "\" is not an IPv4 address (IPv6 goes in brackets; "
                                         "host names are not resolved)"));
  }
  return parsed;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    std::string_view address, const Registry* registry) {
  absl::StatusOr<ListenAddress> listen = ParseListenAddress(address);
  if (!listen.ok()) return listen.status();
  if (listen->is_ipv6 && mg_check_feature(kCivetwebFeatureIpv6) == 0) {
    return BadAddress(address, "this civetweb library was built without IPv6 support");
  }

  static std::once_flag civetweb_initialized;
  std::call_once(civetweb_initialized, [] { mg_init_library(0); });

  // civetweb's own syntax for one listening port: "host:port" or "[v6]:port".
  const std::string listening_port =
      listen->is_ipv6 ? absl::StrCat("[", listen->host, "]:", listen->port)
                      : absl::StrCat(listen->host, ":", listen->port);
  const char* options[] = {
      "listening_ports", listening_port.c_str(),
      // Scrapes come every few seconds from one or two Prometheus servers.
      "num_threads", "2",
      "enable_keep_alive", "no",
      // A scraper that stalls mid-request must not hold a thread for ever.
      "request_timeout_ms", "10000",
      nullptr,
  };
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.begin_request = &MetricsHttpServer::HandleRequest;
  callbacks.log_message = &MetricsHttpServer::HandleLogMessage;

  // The constructor is private, hence no make_unique.
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(registry));
  mg_init_data init = {.callbacks = &callbacks,
                       .user_data = server.get(),
                       .configuration_options = options};
  char error_text[256] = "";
  unsigned error_code = 0;
  mg_error_data error = {
      .code = &error_code, .text = error_text, .text_buffer_size = sizeof(error_text)};
  server->context_ = mg_start2(&init, &error);

  absl::MutexLock lock(&server->mu_);
  server->starting_ = false;
  if (server->context_ == nullptr) {
    // civetweb's log says why (e.g. "cannot bind to 127.0.0.1:9464: 98 (Address already in
    // use)"); error_text only says that it failed.
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", AbslView(address), ": ",
                     server->startup_log_.empty() ? error_text : server->startup_log_));
  }
  mg_server_port port;
  if (mg_get_server_ports(server->context_, 1, &port) != 1) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", AbslView(address),
                                               ": civetweb reports no listening port"));
  }
  server->bound_port_ = port.port;
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_ != nullptr) mg_stop(context_);
}

int MetricsHttpServer::HandleRequest(mg_connection* connection) {
  const auto* server =
      static_cast<const MetricsHttpServer*>(mg_get_user_data(mg_get_context(connection)));
  const mg_request_info* request = mg_get_request_info(connection);
  const std::string_view method = request->request_method;
  const std::string_view path = request->local_uri != nullptr ? request->local_uri : "";

  if (method != "GET") {
    return Respond(connection, 405, "Method Not Allowed", kPlainTextContentType,
                   absl::StrCat("method ", AbslView(method), " is not allowed; use GET\n"),
                   "Allow: GET\r\n");
  }
  if (path == "/metrics") {
    return Respond(connection, 200, "OK", kExpositionContentType, server->registry_->Render());
  }
  if (path == "/") {
    return Respond(connection, 200, "OK", kPlainTextContentType,
                   "memra-kvd: Prometheus metrics are at /metrics\n");
  }
  return Respond(connection, 404, "Not Found", kPlainTextContentType,
                 "not found; Prometheus metrics are at /metrics\n");
}

int MetricsHttpServer::HandleLogMessage(const mg_connection* connection, const char* message) {
  auto* server = static_cast<MetricsHttpServer*>(mg_get_user_data(mg_get_context(connection)));
  if (server == nullptr) return 0;  // not ours: let civetweb print it
  absl::MutexLock lock(&server->mu_);
  if (server->starting_) {
    absl::StrAppend(&server->startup_log_, server->startup_log_.empty() ? "" : "; ", message);
  } else {
    spdlog::warn("metrics http server: {}", message);
  }
  return 1;
}

}  // namespace memra::metrics
