// Section 2: a spec-decode round of a hybrid model. SpecSnapshot copies every recurrent layer's
// conv and SSM state into the session's snapshot buffers; SpecRollback copies them back (and
// rewrites the length mirrors). Each is one unary RPC to memra-kvd, whose host backend copies
// inside the session's shared-memory arena. The baseline is memcpy of the same planes, plane by
// plane, in this process (buffers touched beforehand, like the daemon's after its warm-up).

#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/sections.h"
#include "core/admission.h"
#include "core/sizing.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"

namespace memra::bench {
namespace {

constexpr uint64_t kCapacity = 256;
constexpr int kRounds = 30;
constexpr int kWarmupRounds = 2;

struct Plane {
  std::vector<uint8_t> src, dst;
};

}  // namespace

absl::StatusOr<Json> RunSpecDecode(const BenchOptions& options) {
  const ModelPlan model = test_plans::Qwen3NextStyle();
  SessionShape request;
  request.capacity = kCapacity;
  request.spec_snapshot = true;
  ASSIGN_OR_RETURN(SessionPlan session_plan, PlanSession(model, FormatDefaults(), request));
  ASSIGN_OR_RETURN(uint64_t session_bytes,
                   SessionArenaBytes(model, FormatDefaults(), request,
                                     {.granularity = static_cast<uint64_t>(getpagesize())}));
  // The bytes one snapshot (and one rollback) copies: every recurrent plane, once.
  uint64_t bytes = 0;
  size_t recurrent_layers = 0;
  std::vector<Plane> planes;
  for (const PlaneSpec& plane : session_plan.planes) {
    if (plane.kind != PlaneKind::kConvState && plane.kind != PlaneKind::kSsmState) continue;
    bytes += plane.bytes;
    if (plane.kind == PlaneKind::kSsmState) ++recurrent_layers;
    planes.push_back({std::vector<uint8_t>(plane.bytes, 1), std::vector<uint8_t>(plane.bytes, 2)});
  }

  ASSIGN_OR_RETURN(std::unique_ptr<Kvd> kvd, Kvd::Start(options, session_bytes + (64 << 20)));
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, kvd->Attach("bench-spec-decode"));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, client->RegisterPlan(model));
  SessionOptions session_options;
  session_options.capacity = kCapacity;
  session_options.spec_snapshot = true;
  ASSIGN_OR_RETURN(std::unique_ptr<Session> session,
                   client->CreateSession(fingerprint, session_options));

  Samples snapshot, rollback, copy;
  const int rounds = options.quick ? 1 : kRounds;
  for (int round = 0; round < kWarmupRounds + rounds; ++round) {
    const bool record = round >= kWarmupRounds;
    int64_t start = NowNs();
    RETURN_IF_ERROR(session->SpecSnapshot().status());
    if (record) snapshot.Add(NowNs() - start);
    start = NowNs();
    ASSIGN_OR_RETURN(SessionSnapshot state, session->SpecRollback(0));
    if (record) rollback.Add(NowNs() - start);
    if (state.committed_len != 0) {
      return absl::InternalError(
          absl::StrCat("SpecRollback(0) left ", state.committed_len, " rows, expected 0"));
    }
    start = NowNs();
    for (Plane& plane : planes) std::memcpy(plane.dst.data(), plane.src.data(), plane.src.size());
    if (record) copy.Add(NowNs() - start);
    KeepAlive(planes.front().dst[0]);
  }
  RETURN_IF_ERROR(session->Release().status());
  session.reset();
  client.reset();

  const double memcpy_gbps = GBps(bytes, copy.P50());
  Json json{{"model", "qwen3-next-style hybrid (36 Gated DeltaNet + 12 attention layers)"},
            {"recurrent_layers", recurrent_layers},
            {"bytes_per_copy", bytes},
            {"snapshot", snapshot.ToJson()},
            {"rollback", rollback.ToJson()},
            {"memcpy", copy.ToJson()},
            {"snapshot_gbps_p50", GBps(bytes, snapshot.P50())},
            {"rollback_gbps_p50", GBps(bytes, rollback.P50())},
            {"memcpy_gbps_p50", memcpy_gbps},
            {"ratio_snapshot_memcpy_bandwidth", GBps(bytes, snapshot.P50()) / memcpy_gbps},
            {"ratio_rollback_memcpy_bandwidth", GBps(bytes, rollback.P50()) / memcpy_gbps}};
  Table table({"operation", "p50 us", "p99 us", "GB/s (p50)", "vs memcpy"});
  for (const auto& [name, samples] : {std::pair<const char*, const Samples*>{"SpecSnapshot RPC", &snapshot},
                                      {"SpecRollback RPC", &rollback},
                                      {"memcpy in process", &copy}}) {
    table.Add({name, Us(samples->P50()), Us(samples->P99()),
               Fixed(GBps(bytes, samples->P50()), 2),
               Ratio(GBps(bytes, samples->P50()) / memcpy_gbps)});
  }
  table.Print(absl::StrCat("2. spec-decode round: ", recurrent_layers, " recurrent layers, ",
                           Fixed(bytes / 1048576.0, 1), " MiB per copy"));
  return json;
}

}  // namespace memra::bench
