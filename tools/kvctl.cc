#include "tools/kvctl.h"

#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "tools/kvctl_connection.h"

namespace memra::kvctl {
namespace {

namespace pb = ::memra::kv::v1;

// Prints a failed call and says which exit code it is.
int ReportCallFailure(const Invocation& invocation, absl::string_view method,
                      const grpc::Status& grpc_status, std::ostream& err) {
  const absl::Status status = FromGrpcStatus(grpc_status);
  // Code and message only: ToString() would also dump the payloads.
  const std::string reason =
      absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
  if (status.code() == absl::StatusCode::kUnavailable ||
      status.code() == absl::StatusCode::kDeadlineExceeded) {
    err << "memra-kvctl: memra-kvd on " << invocation.socket_path << " did not answer " << method
        << ": " << reason << "\n  " << UnreachableHint(invocation.socket_path, status.code())
        << "\n";
    return kExitUnreachable;
  }
  err << "memra-kvctl: memra-kvd refused " << method << ": " << reason << "\n"
      << RefusalDetails(status);
  return kExitRefused;
}

int UsageFailure(const absl::Status& status, absl::string_view command, std::ostream& err) {
  err << UsageMessage(status, command);
  return kExitUsage;
}

// Connects, makes one call, prints the answer. A `request` that could not be built (an input
// file) is a usage error; `render(response)` is the human output; `fits_nothing(response)`
// selects exit code 5.
template <typename Stub, typename Request, typename Response, typename Render>
int CallAndPrint(const Invocation& invocation, absl::string_view method,
                 StubCall<Stub, Request, Response> call, const absl::StatusOr<Request>& request,
                 Render render, std::ostream& out, std::ostream& err,
                 bool (*fits_nothing)(const Response&) = nullptr) {
  if (!request.ok()) return UsageFailure(request.status(), invocation.command, err);
  absl::StatusOr<Connection> connection = Connect(invocation);
  if (!connection.ok()) {
    err << "memra-kvctl: cannot reach memra-kvd at unix:" << invocation.socket_path << ": "
        << connection.status().message() << "\n  "
        << UnreachableHint(invocation.socket_path, connection.status().code()) << "\n";
    return kExitUnreachable;
  }
  grpc::ClientContext context;
  context.set_deadline(connection->deadline);
  Response response;
  const grpc::Status status = (StubOf<Stub>(*connection).*call)(&context, *request, &response);
  if (!status.ok()) return ReportCallFailure(invocation, method, status, err);
  if (invocation.json) {
    absl::StatusOr<std::string> json = RenderJson(response);
    if (!json.ok()) {
      err << "memra-kvctl: " << json.status() << "\n";
      return kExitInternal;
    }
    out << *json << "\n";
  } else {
    out << render(response);
  }
  return fits_nothing != nullptr && fits_nothing(response) ? kExitFitsNothing : kExitOk;
}

absl::StatusOr<std::string> ReadFile(absl::string_view flag, const std::string& path) {
  FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return PosixError(absl::StrCat(flag, "=", path), errno);
  std::string text;
  char buffer[1 << 16];
  size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, got);
  const bool failed = std::ferror(file) != 0;
  const int read_errno = errno;
  std::fclose(file);
  if (failed) return PosixError(absl::StrCat(flag, "=", path), read_errno);
  return text;
}

pb::SessionShape ShapeOf(const Invocation& invocation) {
  pb::SessionShape shape;
  shape.set_capacity(invocation.context);
  shape.set_layer_lo(invocation.layer_lo);
  if (invocation.layer_hi.has_value()) shape.set_layer_hi(*invocation.layer_hi);
  shape.set_tp_ranks(invocation.tp_ranks);
  shape.set_spec_snapshot(invocation.spec_snapshot);
  return shape;
}

// A request of a model query: model and shape.
template <typename Request>
absl::StatusOr<Request> QueryRequest(const Invocation& invocation) {
  Request request;
  ASSIGN_OR_RETURN(*request.mutable_model(), LoadModelSelector(invocation));
  *request.mutable_shape() = ShapeOf(invocation);
  return request;
}

absl::StatusOr<pb::ImportModelRequest> ImportRequest(const Invocation& invocation) {
  pb::ImportModelRequest request;
  ASSIGN_OR_RETURN(*request.mutable_hf_config_json(),
                   ReadFile("--hf-config", invocation.hf_config_path));
  request.set_name(invocation.name);
  request.set_index_pool(invocation.index_pool);
  request.set_register_(invocation.register_plan);
  request.set_swa_ring(invocation.swa_ring);
  request.set_kv_dtype(invocation.kv_dtype);
  if (invocation.index_ring_rows.has_value())
    request.set_index_ring_rows(*invocation.index_ring_rows);
  return request;
}

bool NoSessionFitsNow(const pb::FitResponse& fit) { return fit.sessions_now() == 0; }
bool NoContextFitsNow(const pb::MaxContextResponse& max) { return max.max_context_now() == 0; }

}  // namespace

absl::StatusOr<pb::ModelSelector> LoadModelSelector(const Invocation& invocation) {
  pb::ModelSelector selector;
  if (!invocation.model_fingerprint.empty()) {
    selector.set_plan_fingerprint(invocation.model_fingerprint);
  } else if (!invocation.hf_config_path.empty()) {
    ASSIGN_OR_RETURN(*selector.mutable_hf_config_json(),
                     ReadFile("--hf-config", invocation.hf_config_path));
  } else {
    ASSIGN_OR_RETURN(const std::string text, ReadFile("--plan", invocation.plan_path));
    const google::protobuf::util::Status parsed =
        google::protobuf::util::JsonStringToMessage(text, selector.mutable_plan());
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--plan=", invocation.plan_path,
                       ": not a ModelPlan in protobuf JSON: ", parsed.ToString()));
    }
  }
  return selector;
}

int RunKvctl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Invocation> parsed = ParseArgs(args);
  if (!parsed.ok()) return UsageFailure(parsed.status(), CommandWord(args), err);
  const Invocation& invocation = *parsed;
  const std::string& command = invocation.command;

  if (command == "help") {
    absl::StatusOr<std::string> help = HelpText(invocation.help_topic);
    if (!help.ok()) return UsageFailure(help.status(), "", err);
    out << *help;
    return kExitOk;
  }
  using Stub = pb::KvAdmin::Stub;
  if (command == "status") {
    return CallAndPrint(invocation, "GetStatus", &Stub::GetStatus,
                        absl::StatusOr<pb::GetStatusRequest>(pb::GetStatusRequest()), RenderStatus,
                        out, err);
  }
  if (command == "engines") {
    return CallAndPrint(invocation, "ListEngines", &Stub::ListEngines,
                        absl::StatusOr<pb::ListEnginesRequest>(pb::ListEnginesRequest()),
                        RenderEngines, out, err);
  }
  if (command == "sessions") {
    pb::ListSessionsRequest request;
    request.set_engine_id(invocation.engine_id);
    return CallAndPrint(invocation, "ListSessions", &Stub::ListSessions,
                        absl::StatusOr<pb::ListSessionsRequest>(request), RenderSessions, out, err);
  }
  if (command == "prefixes") {
    return CallAndPrint(invocation, "ListPrefixes", &pb::KvPrefixCache::Stub::ListPrefixes,
                        absl::StatusOr<pb::ListPrefixesRequest>(pb::ListPrefixesRequest()),
                        RenderPrefixes, out, err);
  }
  if (command == "evict") {
    pb::EvictPrefixRequest request;
    request.set_entry_id(invocation.entry_id);
    return CallAndPrint(invocation, "EvictPrefix", &pb::KvPrefixCache::Stub::EvictPrefix,
                        absl::StatusOr<pb::EvictPrefixRequest>(request), RenderEvict, out, err);
  }
  if (command == "drain") {
    return CallAndPrint(invocation, "Drain", &Stub::Drain,
                        absl::StatusOr<pb::DrainRequest>(pb::DrainRequest()), RenderDrain, out,
                        err);
  }
  if (command == "undrain") {
    return CallAndPrint(
        invocation, "Undrain", &Stub::Undrain,
        absl::StatusOr<pb::UndrainRequest>(pb::UndrainRequest()),
        [](const pb::UndrainResponse&) { return "accepting new engines and sessions\n"; }, out,
        err);
  }
  if (command == "import-model") {
    return CallAndPrint(invocation, "ImportModel", &Stub::ImportModel, ImportRequest(invocation),
                        RenderImport, out, err);
  }
  if (command == "cost") {
    return CallAndPrint(invocation, "GetCost", &Stub::GetCost,
                        QueryRequest<pb::CostRequest>(invocation), RenderCost, out, err);
  }
  if (command == "fit") {
    return CallAndPrint(
        invocation, "GetFit", &Stub::GetFit, QueryRequest<pb::FitRequest>(invocation),
        [&](const pb::FitResponse& fit) { return RenderFit(fit, invocation.context); }, out, err,
        NoSessionFitsNow);
  }
  if (command == "max-context") {
    return CallAndPrint(invocation, "GetMaxContext", &Stub::GetMaxContext,
                        QueryRequest<pb::MaxContextRequest>(invocation), RenderMaxContext, out, err,
                        NoContextFitsNow);
  }
  err << "memra-kvctl: internal error: command '" << command << "' has no handler\n";
  return kExitInternal;
}

}  // namespace memra::kvctl
