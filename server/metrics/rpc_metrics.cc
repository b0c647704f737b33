#include "server/metrics/rpc_metrics.h"

#include <chrono>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/server_context.h"

namespace memra::metrics {
namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::Interceptor;
using grpc::experimental::InterceptorBatchMethods;
using grpc::experimental::ServerInterceptorFactoryInterface;
using grpc::experimental::ServerRpcInfo;


// "OK", "RESOURCE_EXHAUSTED", ...: gRPC's codes are Abseil's, number for number.
std::string CodeName(grpc::StatusCode code) {
  const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? absl::StrCat("CODE_", static_cast<int>(code)) : name;
}

// "/service/method" with neither part empty.
bool IsFullMethodName(std::string_view name) {
  if (name.size() < 4 || name.front() != '/') return false;
  const size_t slash = name.find('/', 1);
  return slash != std::string_view::npos && slash > 1 && slash + 1 < name.size() &&
         name.find('/', slash + 1) == std::string_view::npos;
}

// The families every interceptor records into; owned by the factory.
struct RpcFamilies {
  CounterFamily* requests;
  HistogramFamily* durations;
};

// One per call (gRPC creates it when the call arrives and destroys it when the call is done).
class RpcMetricsInterceptor final : public Interceptor {
 public:
  RpcMetricsInterceptor(const RpcFamilies& families, std::string method, ServerRpcInfo* info)
      : families_(families),
        method_(std::move(method)),
        info_(info),
        start_(std::chrono::steady_clock::now()) {}

  ~RpcMetricsInterceptor() override {
    if (!recorded_) Record(grpc::StatusCode::CANCELLED);
  }

  void Intercept(InterceptorBatchMethods* methods) override {
    // Recorded before proceeding, so the count is visible by the time the client has the status.
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) &&
        !recorded_) {
      // A handler whose stream was cut off (client cancel, deadline, lost connection) usually
      // still returns OK, but that status never reaches the client: count what the client saw.
      Record(info_->server_context()->IsCancelled() ? grpc::StatusCode::CANCELLED
                                                    : methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Record(grpc::StatusCode code) {
    recorded_ = true;
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start_;
    // WithLabels fails only on a wrong label count, which the two fixed labels here rule out.
    if (absl::StatusOr<Counter*> requests = families_.requests->WithLabels({method_, CodeName(code)});
        requests.ok()) {
      (*requests)->Increment();
    }
    if (absl::StatusOr<Histogram*> duration = families_.durations->WithLabels({method_});
        duration.ok()) {
      (*duration)->Observe(elapsed.count());
    }
  }

  // Constant after construction
  const RpcFamilies families_;
  const std::string method_;
  ServerRpcInfo* const info_;  // owns this interceptor, so outlives it
  const std::chrono::steady_clock::time_point start_;
  // gRPC runs a call's interceptions one at a time, so no lock.
  bool recorded_ = false;
};

class RpcMetricsInterceptorFactory final : public ServerInterceptorFactoryInterface {
 public:
  RpcMetricsInterceptorFactory(RpcFamilies families,
                               absl::flat_hash_set<std::string> served_methods)
      : families_(families), served_methods_(std::move(served_methods)) {}

  Interceptor* CreateServerInterceptor(ServerRpcInfo* info) override {
    const char* method = info->method();
    const bool served = method != nullptr && served_methods_.contains(method);
    return new RpcMetricsInterceptor(
        families_, served ? std::string(method) : std::string(kUnknownMethodLabel), info);
  }

 private:
  // Constant after construction
  const RpcFamilies families_;
  const absl::flat_hash_set<std::string> served_methods_;
};

}  // namespace

const std::vector<double>& RpcDurationBucketBounds() {
  static const std::vector<double>* const bounds = new std::vector<double>{
      0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
      0.025,   0.05,     0.1,     0.25,   0.5,     1,      2.5,   5,      10};
  return *bounds;
}

absl::StatusOr<std::vector<std::string>> ProtoServiceMethods(std::string_view service_full_name) {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          std::string(service_full_name));
  if (service == nullptr) {
    return absl::NotFoundError(absl::StrCat("gRPC service \"", std::string(service_full_name),
                                            "\" is not in this binary's protobuf descriptors"));
  }
  std::vector<std::string> methods;
  methods.reserve(service->method_count());
  for (int i = 0; i < service->method_count(); ++i) {
    methods.push_back(absl::StrCat("/", service->full_name(), "/", service->method(i)->name()));
  }
  return methods;
}

absl::StatusOr<std::vector<std::unique_ptr<ServerInterceptorFactoryInterface>>>
MakeRpcMetricsInterceptors(Registry* registry, absl::Span<const std::string> served_methods) {
  for (const std::string& method : served_methods) {
    if (!IsFullMethodName(method)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "served method \"", method, "\" is not a full gRPC method name (/package.Service/Method)"));
    }
  }
  absl::StatusOr<CounterFamily*> requests = registry->AddCounterFamily(
      kRpcRequestsMetric, "gRPC calls finished, by full method name and final status code.",
      {"method", "code"});
  if (!requests.ok()) return requests.status();
  absl::StatusOr<HistogramFamily*> durations = registry->AddHistogramFamily(
      kRpcDurationMetric,
      "Seconds from a gRPC call's arrival to its status being sent (a stream's whole life).",
      {"method"}, RpcDurationBucketBounds());
  if (!durations.ok()) return durations.status();

  std::vector<std::unique_ptr<ServerInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<RpcMetricsInterceptorFactory>(
      RpcFamilies{.requests = *requests, .durations = *durations},
      absl::flat_hash_set<std::string>(served_methods.begin(), served_methods.end())));
  return factories;
}

}  // namespace memra::metrics
