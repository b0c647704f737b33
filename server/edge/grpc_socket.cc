#include "server/edge/grpc_socket.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/server_builder.h"

namespace memra {
namespace {

// Leaves server reflection out of one server. Linking gRPC's reflection library registers its
// plugin for every server; its streams are synchronous (a thread each, opened by any client),
// and it is the operators' tool (grpcurl), so only the admin socket keeps it.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string reflection = grpc::reflection::ProtoServerReflectionPlugin().name();
    std::erase_if(*plugins, [&](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
      return plugin->name() == reflection;
    });
  }
};

}  // namespace

absl::StatusOr<GrpcSocket> ServeGrpcSocket(
    const GrpcSocketOptions& options, const std::vector<grpc::Service*>& services,
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors) {
  GrpcSocket socket;
  ASSIGN_OR_RETURN(socket.gate,
                   ConnectionGate::Listen(options.path, options.group, options.mode,
                                          absl::StrCat("socket ", options.path), options.limits));
  grpc::ServerBuilder builder;
  for (grpc::Service* service : services) builder.RegisterService(service);
  if (!options.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  // Every synchronous call in flight holds a thread: without a cap, open streams (reflection,
  // SubscribeEvents) grew the daemon by a thread each.
  grpc::ResourceQuota threads(absl::StrCat("memra-kvd ", options.path));
  threads.SetMaxThreads(kMaxRpcThreadsPerSocket);
  builder.SetResourceQuota(threads);
  // Idle connections hold descriptors.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(options.idle_timeout_ms));
  if (!interceptors.empty()) {
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  socket.server = builder.BuildAndStart();
  if (socket.server == nullptr) {
    socket.gate->Stop();
    return absl::UnavailableError(
        absl::StrCat("could not start the gRPC server for unix:", options.path));
  }
  socket.gate->Start(socket.server.get());
  return socket;
}

}  // namespace memra
