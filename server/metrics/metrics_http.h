#ifndef MEMRA_SERVER_METRICS_HTTP_H_
#define MEMRA_SERVER_METRICS_HTTP_H_

// The HTTP endpoint Prometheus scrapes: GET /metrics renders a metrics::Registry (text format
// 0.0.4), GET / points there, any other path is 404 and any other method 405. Served by civetweb
// on its own two threads, so a slow scraper never holds a gRPC thread.
//
// Thread-safety: Start and the destructor must not race with each other; bound_port() may be
// called from any thread. Requests are served concurrently; Registry::Render is thread-safe.
//
// Invariants:
//  (1) Start returns only a server that is listening: a malformed address is INVALID_ARGUMENT and
//      a failure to listen (port in use, address not local) is UNAVAILABLE, both naming the
//      address; nothing aborts.
//  (2) The destructor stops accepting, finishes the requests in flight and joins civetweb's
//      threads before returning, so the registry need only outlive the server.

#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/metrics/metrics.h"

struct mg_connection;
struct mg_context;

namespace memra::metrics {

// Where to listen: "a.b.c.d:port" (0.0.0.0 for every interface) or "[v6]:port", port 0..65535 with
// 0 asking the kernel for a free one. Host names are refused: a metrics port should not depend on
// name resolution at start-up.
struct ListenAddress {
  std::string host;  // the IP literal, without brackets
  int port = 0;
  bool is_ipv6 = false;
};

// INVALID_ARGUMENT naming `address` and what is wrong with it.
absl::StatusOr<ListenAddress> ParseListenAddress(std::string_view address);

class MetricsHttpServer {
 public:
  // Starts listening on `address` (see ListenAddress). REQUIRES: `registry` outlives the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(std::string_view address,
                                                                   const Registry* registry);

  // Stops serving (invariant 2).
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The port actually listened on: the kernel's choice when 0 was asked for.
  int bound_port() const { return bound_port_; }

 private:
  explicit MetricsHttpServer(const Registry* registry) : registry_(registry) {}

  // civetweb callbacks; the server is the context's user data.
  static int HandleRequest(mg_connection* connection);
  static int HandleLogMessage(const mg_connection* connection, const char* message);

  // Constant after construction
  const Registry* const registry_;
  // Set once by Start, before the server is handed out.
  mg_context* context_ = nullptr;
  int bound_port_ = 0;

  absl::Mutex mu_;
  // While Start runs, civetweb's complaints are kept here to explain a failure.
  bool starting_ ABSL_GUARDED_BY(mu_) = true;
  std::string startup_log_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra::metrics

#endif  // MEMRA_SERVER_METRICS_HTTP_H_
