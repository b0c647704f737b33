// Section 5: scale.
//  a. Live sessions in memra-kvd (a tiny plan, small capacity): the daemon's memory per session
//     (/proc/<pid>/status: VmRSS, and its RssAnon part, the daemon's own bookkeeping, apart from
//     RssShmem, the arena pages it touched), and the decode-step latency for 1 and 64 sessions
//     as the population grows (each step looks its sessions up among all live ones). The step
//     commits 0 of its 1 row (a full spec rejection) so lengths never run out.
//  b. core's PrefixIndex in process with up to 100,000 blocks: heap bytes per block
//     (mallinfo2: in-use chunks + mmapped blocks) and Lookup time as the index grows. Lookup hashes the query's blocks
//     (ChainBlockKeys, SHA-256), a cost independent of the index size, so that part is timed
//     on its own too and the index's share is the difference.

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/sections.h"
#include "core/admission.h"
#include "core/prefix_index.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"

namespace memra::bench {
namespace {

constexpr uint64_t kTinyCapacity = 16;
constexpr size_t kWideBatch = 64;
constexpr uint32_t kBlockTokens = 16;
constexpr uint64_t kEntryTokens = 1024;  // 64 blocks per captured entry

// Heap bytes in use: small chunks plus the mmapped ones (large hash-table arrays live there).
size_t HeapInUse() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

// 100, 1000, 10000, ... up to `limit`, and `limit` itself.
std::vector<uint64_t> Stages(uint64_t first, uint64_t limit) {
  std::vector<uint64_t> stages;
  for (uint64_t s = first; s < limit; s *= 10) stages.push_back(s);
  stages.push_back(limit);
  return stages;
}

// Step latency of `sessions` (decode step, commit 0 rows) after a short warm-up.
absl::StatusOr<Samples> TimeSteps(KvClient& client, std::vector<Session*> sessions, int steps) {
  ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> stepper,
                   DecodeStepper::Create(client, std::move(sessions), /*accepted_rows=*/0));
  Samples samples;
  for (int i = 0; i < steps + 10; ++i) {
    const int64_t start = NowNs();
    RETURN_IF_ERROR(stepper->Step());
    if (i >= 10) samples.Add(NowNs() - start);
  }
  return samples;
}

// The section's daemon: one engine grows the population to --scale_sessions, so the per-engine
// session and arena limits (policies for shared GPUs: 4096 sessions, half the arenas by default)
// are raised to it; the section measures what a daemon pays per live session, not that policy.
std::vector<std::string> ScaleDaemonFlags(const BenchOptions& options) {
  return {absl::StrCat("--max_engine_sessions=", options.scale_sessions),
          absl::StrCat("--max_engine_arenas=", options.scale_sessions)};
}

}  // namespace

absl::Status CheckScaleLimits(const BenchOptions& options) {
  ASSIGN_OR_RETURN(DaemonConfig config, BenchDaemonConfig(ScaleDaemonFlags(options)));
  RETURN_IF_ERROR(ValidateConfig(config));
  const uint64_t arenas = EffectiveMaxArenas(config);
  for (uint64_t stage : Stages(100, options.scale_sessions)) {
    if (stage > config.sessions.max_engine_sessions) {
      return absl::FailedPreconditionError(absl::StrCat(
          "scale: the stage of ", stage, " sessions on one engine is past the bench daemon's "
          "max_engine_sessions ", config.sessions.max_engine_sessions));
    }
    if (stage > EffectiveMaxEngineArenas(config, arenas)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "scale: the stage of ", stage, " sessions on one engine is past the bench daemon's "
          "max_engine_arenas ", EffectiveMaxEngineArenas(config, arenas)));
    }
    if (stage > arenas) {
      return absl::FailedPreconditionError(absl::StrCat(
          "scale: the stage of ", stage, " sessions (one arena each) is past the bench "
          "daemon's arena limit ", arenas, " (max_arenas, or 3/4 of vm.max_map_count)"));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<Json> RunSessionScale(const BenchOptions& options, Table& table) {
  RETURN_IF_ERROR(CheckScaleLimits(options));
  const ModelPlan model = test_plans::DenseModel(1, 32, 1);
  SessionShape request;
  request.capacity = kTinyCapacity;
  ASSIGN_OR_RETURN(uint64_t session_bytes,
                   SessionArenaBytes(model, FormatDefaults(), request,
                                     {.granularity = static_cast<uint64_t>(getpagesize())}));
  ASSIGN_OR_RETURN(std::unique_ptr<Kvd> kvd,
                   Kvd::Start(options, options.scale_sessions * session_bytes + (64 << 20),
                              ScaleDaemonFlags(options)));
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, kvd->Attach("bench-scale"));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, client->RegisterPlan(model));
  SessionOptions session_options;
  session_options.capacity = kTinyCapacity;
  ASSIGN_OR_RETURN(ProcMemory base, kvd->Memory());

  const int steps = options.quick ? 3 : 300;
  std::vector<std::unique_ptr<Session>> sessions;
  Json rows = Json::array();
  for (uint64_t stage : Stages(100, options.scale_sessions)) {
    const size_t first_new = sessions.size();
    const int64_t start = NowNs();
    ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Session>> added,
                     CreateSessions(*client, fingerprint, session_options, stage - first_new));
    const double create_ns = static_cast<double>(NowNs() - start) / added.size();
    for (auto& session : added) sessions.push_back(std::move(session));
    ASSIGN_OR_RETURN(ProcMemory memory, kvd->Memory());

    // Stepped sessions: spread over this stage's new ones (never stepped before).
    const size_t fresh = sessions.size() - first_new;
    const size_t wide = std::min(kWideBatch, fresh - 1);
    std::vector<Session*> batch;
    for (size_t i = 0; i < wide; ++i) batch.push_back(sessions[first_new + 1 + i * (fresh - 1) / wide].get());
    ASSIGN_OR_RETURN(Samples one, TimeSteps(*client, {sessions[first_new].get()}, steps));
    ASSIGN_OR_RETURN(Samples many, TimeSteps(*client, batch, steps));

    const double n = static_cast<double>(sessions.size());
    rows.push_back(Json{
        {"live_sessions", sessions.size()},
        {"create_us_mean", create_ns / 1e3},
        {"daemon_rss_bytes", memory.rss},
        {"rss_per_session_bytes", (memory.rss - std::min(memory.rss, base.rss)) / n},
        {"anon_per_session_bytes", (memory.rss_anon - std::min(memory.rss_anon, base.rss_anon)) / n},
        {"shmem_per_session_bytes",
         (memory.rss_shmem - std::min(memory.rss_shmem, base.rss_shmem)) / n},
        {"step_1_session", one.ToJson()},
        {"step_batch_sessions", wide},
        {"step_batch", many.ToJson()},
    });
    table.Add({absl::StrCat(sessions.size(), " live sessions"),
               Fixed((memory.rss - std::min(memory.rss, base.rss)) / n, 0),
               Fixed((memory.rss_anon - std::min(memory.rss_anon, base.rss_anon)) / n, 0),
               Us(one.P50()), Us(one.P99()), absl::StrCat(wide), Us(many.P50()),
               Us(many.P99())});
  }
  const int64_t start = NowNs();
  const size_t count = sessions.size();
  for (auto& session : sessions) RETURN_IF_ERROR(session->Release().status());
  const double release_ns = static_cast<double>(NowNs() - start) / count;
  sessions.clear();
  client.reset();
  return Json{{"model", "tiny: 1 layer, 1 KV head of 32"},
              {"capacity_tokens", kTinyCapacity},
              {"arena_bytes_per_session", session_bytes},
              {"daemon_base_rss_bytes", base.rss},
              {"release_us_mean", release_ns / 1e3},
              {"stages", rows}};
}

std::vector<int32_t> EntryTokens(uint64_t seed) {
  std::mt19937 random(static_cast<uint32_t>(seed));
  std::uniform_int_distribution<int32_t> token(0, 151935);
  std::vector<int32_t> tokens(kEntryTokens);
  for (int32_t& t : tokens) t = token(random);
  return tokens;
}

absl::StatusOr<Json> RunPrefixIndexScale(const BenchOptions& options, Table& table) {
  ModelPlan model = test_plans::DenseModel(16, 64, 8);
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, FingerprintModelPlan(model, FormatDefaults()));
  SessionShape request;
  request.capacity = kEntryTokens;
  ASSIGN_OR_RETURN(CostReport cost,
                   SessionCost(model, FormatDefaults(), request,
                               {.granularity = static_cast<uint64_t>(getpagesize())}));
  PrefixModelTraits traits;
  traits.position_addressed_only = true;
  traits.block_bytes = cost.breakdown.bytes_per_token * kBlockTokens;

  const size_t heap_before = HeapInUse();
  ASSIGN_OR_RETURN(PrefixIndex index,
                   PrefixIndex::Create({.block_tokens = kBlockTokens,
                                        .budget_bytes = uint64_t{1} << 62,
                                        .epoch = 1}));
  const int lookups = options.quick ? 20 : 2000;
  uint64_t entries = 0;
  uint64_t next_handle = 1;
  Json rows = Json::array();
  size_t previous_heap = heap_before;
  uint64_t previous_blocks = 0;
  for (uint64_t stage : Stages(1000, options.prefix_blocks)) {
    while (index.BlockCount() < stage) {
      const std::vector<int32_t> tokens = EntryTokens(entries);
      ASSIGN_OR_RETURN(CapturePlan plan,
                       index.PlanCapture(fingerprint, tokens, kEntryTokens, traits));
      CaptureCommit commit;
      for (uint64_t b = 0; b < plan.new_block_count(); ++b) {
        commit.new_blocks.push_back({next_handle, next_handle * 0x9e3779b97f4a7c15ULL});
        ++next_handle;
      }
      RETURN_IF_ERROR(index.CommitCapture(plan, commit, entries + 1).status());
      ++entries;
    }
    const size_t heap = HeapInUse();

    // Queries prepared outside the clock: hits on stored entries, misses on fresh tokens.
    std::mt19937_64 pick(stage);
    std::vector<std::vector<int32_t>> hits, misses;
    for (int i = 0; i < 64; ++i) {
      hits.push_back(EntryTokens(pick() % entries));
      misses.push_back(EntryTokens((uint64_t{1} << 40) + pick()));
    }
    Samples hit, miss, hashing;
    for (int i = 0; i < lookups; ++i) {
      const auto& query = hits[i % hits.size()];
      int64_t start = NowNs();
      LookupResult result = index.Lookup(fingerprint, query, traits);
      hit.Add(NowNs() - start);
      if (result.outcome != LookupOutcome::kHit) {
        return absl::InternalError(absl::StrCat("a stored entry missed at ", stage, " blocks"));
      }
      start = NowNs();
      result = index.Lookup(fingerprint, misses[i % misses.size()], traits);
      miss.Add(NowNs() - start);
      start = NowNs();
      ASSIGN_OR_RETURN(std::vector<BlockKey> keys, ChainBlockKeys(fingerprint, query, kBlockTokens));
      hashing.Add(NowNs() - start);
      KeepAlive(keys.data());
    }
    const uint64_t blocks = index.BlockCount();
    const double per_block = static_cast<double>(heap - heap_before) / blocks;
    const double marginal =
        static_cast<double>(heap - previous_heap) / static_cast<double>(blocks - previous_blocks);
    previous_heap = heap;
    previous_blocks = blocks;
    rows.push_back(Json{{"blocks", blocks},
                        {"entries", entries},
                        {"heap_bytes", heap - heap_before},
                        {"heap_bytes_per_block", per_block},
                        {"heap_bytes_per_block_since_previous_stage", marginal},
                        {"lookup_hit_64_blocks", hit.ToJson()},
                        {"lookup_miss", miss.ToJson()},
                        {"chain_block_keys_64_blocks", hashing.ToJson()},
                        {"lookup_hit_minus_hashing_p50_us", (hit.P50() - hashing.P50()) / 1e3}});
    table.Add({absl::StrCat(blocks, " blocks"), Fixed(per_block, 0), Fixed(marginal, 0),
               Us(hit.P50()), Us(hit.P99()), Us(miss.P50()), Us(hashing.P50()),
               Us(hit.P50() - hashing.P50())});
  }
  return Json{{"block_tokens", kBlockTokens},
              {"entry_tokens", kEntryTokens},
              {"note", "heap bytes include the index's event log (up to 4096 events)"},
              {"stages", rows}};
}

}  // namespace

absl::StatusOr<Json> RunScale(const BenchOptions& options) {
  Json json;
  Table sessions_table({"population", "RSS B/session", "anon B/session", "step(1) p50",
                        "p99", "batch", "step(batch) p50", "p99"});
  ASSIGN_OR_RETURN(json["sessions"], RunSessionScale(options, sessions_table));
  sessions_table.Print("5a. live sessions in memra-kvd (times in us)");
  Table prefix_table({"index size", "heap B/block", "B/block since prev", "hit p50", "hit p99",
                      "miss p50", "hashing p50", "hit - hashing"});
  ASSIGN_OR_RETURN(json["prefix_index"], RunPrefixIndexScale(options, prefix_table));
  prefix_table.Print("5b. core PrefixIndex in process, 64-block queries (times in us)");
  return json;
}

}  // namespace memra::bench
