// Section 4: session create/release through the client (admission, arena allocation and export,
// the engine's mapping, release and unmapping), and the admission queries: through KvAdmin's
// GetCost/GetFit when the daemon implements them, and core/admission.h in process always.

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/echo_floor.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/sections.h"
#include "client/internal.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/admission.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"

namespace memra::bench {
namespace {

namespace pb = ::memra::kv::v1;

struct Shape {
  const char* name;
  ModelPlan model;
  uint64_t capacity;
  int iterations;
};

// Ops per second from a mean latency.
double OpsPerSecond(const Samples& samples) { return samples.Mean() > 0 ? 1e9 / samples.Mean() : 0; }

Json OpJson(const Samples& samples) {
  Json json = samples.ToJson();
  json["ops_per_s"] = OpsPerSecond(samples);
  return json;
}

// Times `op` `iterations` times, `batch` calls per sample (for operations too short for one
// clock read each); samples are per call.
template <typename Op>
absl::StatusOr<Samples> TimeOp(int iterations, int batch, Op op) {
  Samples samples;
  for (int i = 0; i < iterations; ++i) {
    const int64_t start = NowNs();
    for (int b = 0; b < batch; ++b) RETURN_IF_ERROR(op());
    samples.Add(static_cast<double>(NowNs() - start) / batch);
  }
  return samples;
}

// The two calls of a create+release through the client as raw RPCs, for their serialized
// sizes (the gRPC floor's calls are shaped like them). The session is released again.
struct LifecycleSizes {
  uint64_t create_request = 0, create_response = 0;
  uint64_t release_request = 0, release_response = 0;
};
absl::StatusOr<LifecycleSizes> MeasureLifecycleSizes(KvClient& client,
                                                     const PlanFingerprint& fingerprint,
                                                     uint64_t capacity) {
  pb::CreateSessionRequest create;
  ASSIGN_OR_RETURN(*create.mutable_engine(), ClientInternals::Engine(client));
  create.set_plan_fingerprint(FingerprintToBytes(fingerprint));
  create.set_capacity(capacity);
  pb::CreateSessionResponse created;
  RETURN_IF_ERROR(FromGrpcStatus(ClientInternals::Cache(client).CreateSession(
      ClientInternals::NewContext(client).get(), create, &created)));
  pb::SessionRequest release;
  *release.mutable_session() = created.session();
  pb::ReleaseSessionResponse released;
  RETURN_IF_ERROR(FromGrpcStatus(ClientInternals::Cache(client).ReleaseSession(
      ClientInternals::NewContext(client).get(), release, &released)));
  return LifecycleSizes{create.ByteSizeLong(), created.ByteSizeLong(), release.ByteSizeLong(),
                        released.ByteSizeLong()};
}

}  // namespace

absl::StatusOr<Json> RunAdmission(const BenchOptions& options) {
  const uint64_t page = static_cast<uint64_t>(getpagesize());
  std::vector<Shape> shapes = {
      {"tiny (1 layer, 1 KV head of 32) @16 tokens", test_plans::DenseModel(1, 32, 1), 16, 300},
      {"llama-3-8b @1024 tokens", test_plans::Llama3_8B(), 1024, 40},
  };
  Json json;
  Table table({"operation", "p50 us", "p99 us", "ops/s"});
  Json lifecycle = Json::array();
  // The create+release loop twice in this run: against a daemon without the arena pool (the
  // baseline: a new arena and a new mapping per session) and one with it (the default).
  struct PoolMode {
    const char* name;
    bool pooled;
    std::vector<std::string> flags;
  };
  const PoolMode modes[] = {{"no pool", false, {"--arena_pool_engine_bytes=0"}},
                            {"pool", true, {}}};
  std::unique_ptr<Kvd> kvd;
  std::unique_ptr<KvClient> client;
  std::vector<PlanFingerprint> fingerprints;
  std::vector<double> baseline_p50;  // per shape: create+release p50 without the pool
  // With the pool, each create+release is followed by the gRPC floor of its two calls: two
  // unary calls of the same sizes to bench/echo_server (alternating, so load lands on both).
  ASSIGN_OR_RETURN(std::unique_ptr<EchoFloor> floor, EchoFloor::Start(options.echo_binary));
  for (const PoolMode& mode : modes) {
    const bool pooled = mode.pooled;
    client.reset();
    kvd.reset();
    ASSIGN_OR_RETURN(kvd, Kvd::Start(options, uint64_t{2} << 30, mode.flags));
    ASSIGN_OR_RETURN(client, kvd->Attach("bench-admission"));
    fingerprints.clear();
    for (size_t s = 0; s < shapes.size(); ++s) {
      const Shape& shape = shapes[s];
      ASSIGN_OR_RETURN(PlanFingerprint fingerprint, client->RegisterPlan(shape.model));
      fingerprints.push_back(fingerprint);
      SessionOptions session_options;
      session_options.capacity = shape.capacity;
      Samples create, release, both, floor_both;
      // Pooled pairs are cheap: ten times the samples.
      const int iterations = options.quick ? 3 : shape.iterations * (pooled ? 10 : 1);
      EchoCall floor_create, floor_release;
      if (pooled) {
        ASSIGN_OR_RETURN(LifecycleSizes sizes,
                         MeasureLifecycleSizes(*client, fingerprint, shape.capacity));
        floor_create = EchoFloor::Shape(sizes.create_request, sizes.create_response);
        floor_release = EchoFloor::Shape(sizes.release_request, sizes.release_response);
      }
      const size_t opens_before = client->mapper().OpenCount();
      for (int i = 0; i < iterations + 2; ++i) {  // 2 warm-up pairs
        const int64_t start = NowNs();
        ASSIGN_OR_RETURN(std::unique_ptr<Session> session,
                         client->CreateSession(fingerprint, session_options));
        const int64_t created = NowNs();
        RETURN_IF_ERROR(session->Release().status());
        const int64_t released = NowNs();
        if (pooled) {
          RETURN_IF_ERROR(floor->Call(floor_create));
          RETURN_IF_ERROR(floor->Call(floor_release));
        }
        const int64_t floor_done = NowNs();
        if (i < 2) continue;
        create.Add(created - start);
        release.Add(released - created);
        both.Add(released - start);
        if (pooled) floor_both.Add(floor_done - released);
      }
      const size_t new_mappings = client->mapper().OpenCount() - opens_before;
      SessionShape request;
      request.capacity = shape.capacity;
      ASSIGN_OR_RETURN(uint64_t bytes, SessionArenaBytes(shape.model, FormatDefaults(), request,
                                                         {.granularity = page}));
      Json entry{{"shape", shape.name},
                 {"arena_pool", mode.name},
                 {"arena_bytes", bytes},
                 {"sessions", iterations + 2},
                 {"new_mappings", new_mappings},
                 {"create", OpJson(create)},
                 {"release", OpJson(release)},
                 {"create_and_release", OpJson(both)}};
      if (pooled) {
        entry["floor_two_calls"] = OpJson(floor_both);
        entry["create_and_release_p50_vs_floor"] = both.P50() / floor_both.P50();
        entry["floor_bytes"] = Json{{"create_request", floor_create.request_size},
                                    {"create_response", floor_create.response_size},
                                    {"release_request", floor_release.request_size},
                                    {"release_response", floor_release.response_size}};
      }
      if (baseline_p50.size() > s) {
        entry["create_and_release_p50_vs_no_pool"] = both.P50() / baseline_p50[s];
      } else {
        baseline_p50.push_back(both.P50());
      }
      lifecycle.push_back(entry);
      for (const auto& [what, samples] :
           {std::pair<const char*, const Samples*>{"create", &create},
            {"release", &release},
            {"create+release", &both}}) {
        table.Add({absl::StrCat(what, " [", mode.name, "]: ", shape.name), Us(samples->P50()),
                   Us(samples->P99()), Fixed(OpsPerSecond(*samples), 0)});
      }
      table.Add({absl::StrCat("  new mappings in the engine [", mode.name, "]: ", new_mappings,
                              " for ", iterations + 2, " sessions"),
                 "-", "-", "-"});
      if (pooled) {
        table.Add({absl::StrCat("  gRPC floor of the two calls (", floor_create.request_size, "+",
                                floor_create.response_size, " B, ", floor_release.request_size,
                                "+", floor_release.response_size, " B)"),
                   Us(floor_both.P50()), Us(floor_both.P99()),
                   Fixed(OpsPerSecond(floor_both), 0)});
        table.Add({absl::StrCat("  create+release p50, pool / gRPC floor: ",
                                Fixed(both.P50() / floor_both.P50(), 2), "x"),
                   "-", "-", "-"});
      }
      if (entry.contains("create_and_release_p50_vs_no_pool")) {
        table.Add({absl::StrCat("  create+release p50, pool / no pool: ",
                                Fixed(both.P50() / baseline_p50[s], 3), "x"),
                   "-", "-", "-"});
      }
    }
  }
  json["session_lifecycle"] = lifecycle;

  // Admission queries through the daemon, when it answers them.
  const Shape& query_shape = shapes.back();
  const std::string fingerprint_bytes(fingerprints.back().begin(), fingerprints.back().end());
  pb::CostRequest cost_request;
  cost_request.mutable_model()->set_plan_fingerprint(fingerprint_bytes);
  cost_request.mutable_shape()->set_capacity(4096);
  pb::FitRequest fit_request;
  *fit_request.mutable_model() = cost_request.model();
  *fit_request.mutable_shape() = cost_request.shape();
  auto get_cost = [&]() -> absl::Status {
    pb::CostResponse response;
    return FromGrpcStatus(ClientInternals::Admin(*client).GetCost(
        ClientInternals::NewContext(*client).get(), cost_request, &response));
  };
  auto get_fit = [&]() -> absl::Status {
    pb::FitResponse response;
    return FromGrpcStatus(ClientInternals::Admin(*client).GetFit(
        ClientInternals::NewContext(*client).get(), fit_request, &response));
  };
  const int rpc_iterations = options.quick ? 3 : 1000;
  Json rpc;
  if (absl::Status probe = get_cost(); absl::IsUnimplemented(probe)) {
    rpc["status"] = "pending: this memra-kvd answers KvAdmin.GetCost/GetFit UNIMPLEMENTED";
    table.Add({"GetCost/GetFit RPC: pending (UNIMPLEMENTED in this daemon)", "-", "-", "-"});
  } else {
    RETURN_IF_ERROR(probe);
    ASSIGN_OR_RETURN(Samples cost, TimeOp(rpc_iterations, 1, get_cost));
    ASSIGN_OR_RETURN(Samples fit, TimeOp(rpc_iterations, 1, get_fit));
    rpc["get_cost"] = OpJson(cost);
    rpc["get_fit"] = OpJson(fit);
    table.Add({"GetCost RPC (llama-3-8b @4096)", Us(cost.P50()), Us(cost.P99()),
               Fixed(OpsPerSecond(cost), 0)});
    table.Add({"GetFit RPC (llama-3-8b @4096)", Us(fit.P50()), Us(fit.P99()),
               Fixed(OpsPerSecond(fit), 0)});
  }
  json["admission_rpc"] = rpc;
  client.reset();

  // The same questions in process (what the daemon computes per query).
  SessionShape request;
  request.capacity = 4096;
  AdmissionLedger ledger(uint64_t{80} << 30);
  ASSIGN_OR_RETURN(uint64_t session_bytes, SessionArenaBytes(query_shape.model, FormatDefaults(),
                                                             request, {.granularity = page}));
  const int iterations = options.quick ? 10 : 2000;
  ASSIGN_OR_RETURN(Samples cost, TimeOp(iterations, 1, [&]() -> absl::Status {
                     ASSIGN_OR_RETURN(CostReport report,
                                      SessionCost(query_shape.model, FormatDefaults(), request,
                                                  {.granularity = page}));
                     KeepAlive(report.arena_bytes);
                     return absl::OkStatus();
                   }));
  ASSIGN_OR_RETURN(Samples fit, TimeOp(iterations, 100, [&]() -> absl::Status {
                     ASSIGN_OR_RETURN(SessionFit result, FitSessions(ledger, session_bytes));
                     KeepAlive(result.now);
                     return absl::OkStatus();
                   }));
  ASSIGN_OR_RETURN(Samples max_context,
                   TimeOp(options.quick ? 3 : 200, 1, [&]() -> absl::Status {
                     ASSIGN_OR_RETURN(uint64_t tokens,
                                      MaxContextThatFits(query_shape.model, FormatDefaults(),
                                                         request, ledger.free(),
                                                         {.granularity = page}));
                     KeepAlive(tokens);
                     return absl::OkStatus();
                   }));
  json["admission_in_process"] = Json{{"model", "llama-3-8b @4096 tokens"},
                                      {"session_cost", OpJson(cost)},
                                      {"fit_sessions", OpJson(fit)},
                                      {"max_context_that_fits", OpJson(max_context)},
                                      {"fit_sessions_note", "timed in batches of 100 calls"}};
  table.Add({"SessionCost in process (llama-3-8b @4096)", Us(cost.P50()), Us(cost.P99()),
             Fixed(OpsPerSecond(cost), 0)});
  table.Add({"FitSessions in process (per call, batches of 100)", Us(fit.P50()), Us(fit.P99()),
             Fixed(OpsPerSecond(fit), 0)});
  table.Add({"MaxContextThatFits in process", Us(max_context.P50()), Us(max_context.P99()),
             Fixed(OpsPerSecond(max_context), 0)});
  table.Print("4. sessions and admission (through the client unless 'in process')");
  return json;
}

}  // namespace memra::bench
