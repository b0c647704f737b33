#include "tools/kvctl.h"

#include <algorithm>
#include <optional>
#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/group_file.h"
#include "common/codec.h"
#include "common/errors.h"
#include "common/grpc_status.h"
#include "core/group_layout.h"
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

// Connects to invocation.socket_path and makes one call into `response`; a failure is printed
// to `err` and returned as its exit code (kExitOk: answered).
template <typename Stub, typename Request, typename Response>
int CallOne(const Invocation& invocation, absl::string_view method,
            StubCall<Stub, Request, Response> call, const Request& request, Response& response,
            std::ostream& err) {
  absl::StatusOr<Connection> connection = Connect(invocation);
  if (!connection.ok()) {
    err << "memra-kvctl: cannot reach memra-kvd at unix:" << invocation.socket_path << ": "
        << connection.status().message() << "\n  "
        << UnreachableHint(invocation.socket_path, connection.status().code()) << "\n";
    return kExitUnreachable;
  }
  grpc::ClientContext context;
  context.set_deadline(connection->deadline);
  const grpc::Status status = (StubOf<Stub>(*connection).*call)(&context, request, &response);
  if (!status.ok()) return ReportCallFailure(invocation, method, status, err);
  return kExitOk;
}

// Prints --json's line or the human text; kExitInternal when the JSON cannot be printed.
int PrintAnswer(const Invocation& invocation, const absl::StatusOr<std::string>& json,
                const std::string& human, std::ostream& out, std::ostream& err) {
  if (!invocation.json) {
    out << human;
    return kExitOk;
  }
  if (!json.ok()) {
    err << "memra-kvctl: " << json.status() << "\n";
    return kExitInternal;
  }
  out << *json << "\n";
  return kExitOk;
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
  Response response;
  const int called = CallOne(invocation, method, call, *request, response, err);
  if (called != kExitOk) return called;
  const int printed = PrintAnswer(
      invocation, invocation.json ? RenderJson(response) : absl::StatusOr<std::string>(""),
      invocation.json ? std::string() : std::string(render(response)), out, err);
  if (printed != kExitOk) return printed;
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

// ---- a group of daemons (docs/groups.md#memra-kvctl) ----------------------------------------

absl::StatusOr<GroupFile> ResolveGroup(const Invocation& invocation) {
  if (!invocation.group_path.empty()) return ReadGroupFile(invocation.group_path);
  GroupShape shape;
  shape.pp = invocation.pp == 0 ? 1 : invocation.pp;
  const uint64_t sockets = invocation.group_sockets.size();
  // Without --tp every socket is a rank: tp = sockets / pp (GroupFromSockets names a mismatch).
  shape.tp = invocation.tp_ranks != 0
                 ? invocation.tp_ranks
                 : static_cast<uint32_t>(std::max<uint64_t>(1, sockets / shape.pp));
  shape.stage_layers = invocation.stage_layers;
  return GroupFromSockets("cli", shape, invocation.group_sockets, "--socket");
}

// The invocation that asks one rank's daemon: its admin socket when the group file names one.
Invocation ForRank(const Invocation& invocation, const GroupRankEndpoint& endpoint) {
  Invocation rank = invocation;
  rank.socket_path = endpoint.admin_socket.empty() ? endpoint.socket : endpoint.admin_socket;
  return rank;
}

// `layout`: the model's layout (fit, max-context), or null (status).
GroupView ViewOf(const Invocation& invocation, const GroupFile& group, const GroupLayout* layout) {
  GroupView view{group.name, group.shape.tp, group.shape.pp, {}};
  for (const GroupRankEndpoint& endpoint : group.ranks) {
    GroupRankRow row;
    row.rank = endpoint.rank;
    row.socket = ForRank(invocation, endpoint).socket_path;
    row.stage = endpoint.rank / group.shape.tp;
    row.tp_rank = endpoint.rank % group.shape.tp;
    if (layout != nullptr) {
      const RankLayout& rank = layout->ranks[endpoint.rank];
      row.has_shard = true;
      row.layer_lo = rank.shape.layer_lo;
      row.layer_hi = rank.shape.layer_hi.value_or(rank.shape.layer_lo);
      row.kv_shard = rank.kv_shard;
      row.kv_shards = layout->stages[rank.stage].kv_shards;
    }
    view.ranks.push_back(std::move(row));
  }
  return view;
}

// Asks every rank in rank order; the first failure is printed, with its rank, and ends it.
template <typename Stub, typename Request, typename Response>
int CallEveryRank(const Invocation& invocation, const GroupFile& group, absl::string_view method,
                  StubCall<Stub, Request, Response> call, const std::vector<Request>& requests,
                  std::vector<Response>& responses, std::ostream& err) {
  responses.assign(group.ranks.size(), Response());
  for (size_t rank = 0; rank < group.ranks.size(); ++rank) {
    const int called = CallOne(ForRank(invocation, group.ranks[rank]), method, call,
                               requests[rank], responses[rank], err);
    if (called != kExitOk) {
      err << "  (rank " << rank << " of group " << group.name << ": the group has no answer)\n";
      return called;
    }
  }
  return kExitOk;
}

template <typename Response>
int PrintGroup(const Invocation& invocation, const GroupView& view,
               const std::vector<Response>& responses, const std::string& human,
               std::ostream& out, std::ostream& err) {
  std::vector<const google::protobuf::Message*> answers;
  for (const Response& response : responses) answers.push_back(&response);
  return PrintAnswer(invocation,
                     invocation.json ? RenderGroupJson(view, answers)
                                     : absl::StatusOr<std::string>(""),
                     human, out, err);
}

// The plan a group is laid out from and every rank prices, inline, so that all price the same
// plan: --plan's file, or --hf-config imported once (not registered) by rank 0's daemon.
int GroupPlan(const Invocation& invocation, const GroupFile& group, pb::ModelPlan& plan,
              std::ostream& err) {
  if (!invocation.plan_path.empty()) {
    absl::StatusOr<pb::ModelSelector> selector = LoadModelSelector(invocation);
    if (!selector.ok()) return UsageFailure(selector.status(), invocation.command, err);
    plan = selector->plan();
    return kExitOk;
  }
  absl::StatusOr<pb::ImportModelRequest> request = ImportRequest(invocation);
  if (!request.ok()) return UsageFailure(request.status(), invocation.command, err);
  pb::ImportModelResponse imported;
  const int called = CallOne(ForRank(invocation, group.ranks[0]), "ImportModel",
                             &pb::KvAdmin::Stub::ImportModel, *request, imported, err);
  if (called != kExitOk) return called;
  plan = imported.plan();
  return kExitOk;
}

// fit / max-context for every rank's shard of the model, and the group's answer.
template <typename Request, typename Response, typename Render>
int RunGroupQuery(const Invocation& invocation, const GroupFile& group, absl::string_view method,
                  StubCall<pb::KvAdmin::Stub, Request, Response> call, Render render,
                  uint64_t (Response::*now)() const, std::ostream& out, std::ostream& err) {
  pb::ModelPlan plan_proto;
  const int planned = GroupPlan(invocation, group, plan_proto, err);
  if (planned != kExitOk) return planned;
  absl::StatusOr<ModelPlan> plan = ModelPlanFromProto(plan_proto);
  if (!plan.ok()) return UsageFailure(plan.status(), invocation.command, err);
  absl::StatusOr<GroupLayout> layout = PlanGroupLayout(*plan, group.shape);
  if (!layout.ok()) {
    return UsageFailure(
        absl::InvalidArgumentError(absl::StrCat("group ", group.name, " (tp ", group.shape.tp,
                                                " x pp ", group.shape.pp, ") cannot hold ",
                                                plan->name, ": ", layout.status().message())),
        invocation.command, err);
  }
  std::vector<Request> requests(group.ranks.size());
  for (size_t rank = 0; rank < requests.size(); ++rank) {
    const SessionShape shape = WithRequest(layout->ranks[rank], invocation.context,
                                           invocation.spec_snapshot);
    *requests[rank].mutable_model()->mutable_plan() = plan_proto;
    pb::SessionShape& wire = *requests[rank].mutable_shape();
    wire.set_capacity(shape.capacity);
    wire.set_layer_lo(shape.layer_lo);
    if (shape.layer_hi.has_value()) wire.set_layer_hi(*shape.layer_hi);
    wire.set_tp_ranks(shape.tp_ranks);
    wire.set_spec_snapshot(shape.spec_snapshot);
  }
  std::vector<Response> responses;
  const int called = CallEveryRank(invocation, group, method, call, requests, responses, err);
  if (called != kExitOk) return called;
  const GroupView view = ViewOf(invocation, group, &*layout);
  const int printed = PrintGroup(invocation, view, responses, render(view, responses), out, err);
  if (printed != kExitOk) return printed;
  for (const Response& response : responses) {
    if ((response.*now)() == 0) return kExitFitsNothing;  // the group is as full as its fullest
  }
  return kExitOk;
}

// Each rank's group reservations (KvGroup.ListGroupRanks), where its daemon lists them: the
// admin socket does, the engine socket refuses (nullopt: the table shows "-").
std::vector<std::optional<pb::ListGroupRanksResponse>> GroupReservationsOf(
    const Invocation& invocation, const GroupFile& group) {
  std::vector<std::optional<pb::ListGroupRanksResponse>> listed;
  for (const GroupRankEndpoint& endpoint : group.ranks) {
    listed.emplace_back();
    absl::StatusOr<Connection> connection = Connect(ForRank(invocation, endpoint));
    if (!connection.ok()) continue;
    grpc::ClientContext context;
    context.set_deadline(connection->deadline);
    pb::ListGroupRanksResponse response;
    if (connection->group_stub->ListGroupRanks(&context, pb::ListGroupRanksRequest(), &response)
            .ok()) {
      listed.back() = std::move(response);
    }
  }
  return listed;
}

int RunGroup(const Invocation& invocation, std::ostream& out, std::ostream& err) {
  absl::StatusOr<GroupFile> group = ResolveGroup(invocation);
  if (!group.ok()) return UsageFailure(group.status(), invocation.command, err);
  using Stub = pb::KvAdmin::Stub;
  if (invocation.command == "status") {
    std::vector<pb::GetStatusResponse> responses;
    const int called = CallEveryRank(
        invocation, *group, "GetStatus", &Stub::GetStatus,
        std::vector<pb::GetStatusRequest>(group->ranks.size()), responses, err);
    if (called != kExitOk) return called;
    const std::vector<std::optional<pb::ListGroupRanksResponse>> reservations =
        GroupReservationsOf(invocation, *group);
    const GroupView view = ViewOf(invocation, *group, nullptr);
    std::vector<const google::protobuf::Message*> answers;
    for (const pb::GetStatusResponse& response : responses) answers.push_back(&response);
    return PrintAnswer(invocation,
                       invocation.json ? RenderGroupJson(view, answers, reservations)
                                       : absl::StatusOr<std::string>(""),
                       RenderGroupStatus(view, responses, reservations), out, err);
  }
  if (invocation.command == "fit") {
    return RunGroupQuery(
        invocation, *group, "GetFit", &Stub::GetFit,
        [&](const GroupView& view, const std::vector<pb::FitResponse>& fits) {
          return RenderGroupFit(view, fits, invocation.context);
        },
        &pb::FitResponse::sessions_now, out, err);
  }
  if (invocation.command == "max-context") {
    return RunGroupQuery(invocation, *group, "GetMaxContext", &Stub::GetMaxContext,
                         RenderGroupMaxContext, &pb::MaxContextResponse::max_context_now, out,
                         err);
  }
  err << "memra-kvctl: internal error: command '" << invocation.command
      << "' has no group handler\n";
  return kExitInternal;
}

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
  if (invocation.IsGroup()) return RunGroup(invocation, out, err);
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
