// Section 3: prefix restore/capture through memra-kvd's KvPrefixCache, and the peer a user
// would pick today for an out-of-process KV store: Redis (LMCache's remote tier), started here on
// loopback.
//
// 3a. Redis: SET and GET of entries of a dense model's 1k / 32k / 128k tokens, in chunks of 256
// tokens (LMCache's default chunk: one key per chunk), against memcpy of the same bytes in this
// process. Entry bytes are the session arena bytes of that context (core/admission.h
// SessionArenaBytes).
// 3b. memra-kvd (host backend, --prefix_block_tokens=256): for a dense and a hybrid model and the
// same token counts, a session commits N rows with their token ids and Captures the boundary
// (timed; the entry is evicted between repetitions so every capture copies: the first capture
// of a size takes storage the daemon may never have touched, the later ones the storage the
// eviction just freed, as in a cache at its budget). Then Lookup +
// Restore is timed (lookup to ready: what an engine waits) into a recycled session (Reset
// between restores: an engine keeping its session slots) and into one created just before
// (first touch of its memory). A second daemon with --prefix_verify_checksums=false repeats the
// recycled restores: the price of integrity checking. Bytes moved are the entry's block_bytes +
// boundary_bytes (InspectPrefix); the baselines are memcpy of that many bytes in this process
// (between warm buffers, and into freshly mapped memory), measured in the same run, and the
// Redis GET of 3a at the same tokens.

#include <sys/mman.h>
#include <sys/time.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/prefix_session.h"
#include "bench/redis_peer.h"
#include "bench/sections.h"
#include "client/internal.h"
#include "client/prefix_client.h"
#include "common/grpc_status.h"
#include "core/admission.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"
#include "grpcpp/client_context.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"

namespace memra::bench {
namespace {

namespace pb = ::memra::kv::v1;

constexpr uint64_t kChunkTokens = 256;

struct EntrySize {
  uint64_t tokens;
  int reps;
};
constexpr EntrySize kEntries[] = {{1024, 10}, {32768, 5}, {131072, 4}};


// [offset, offset + bytes) of each chunk of an entry of `tokens`.
std::vector<std::pair<uint64_t, uint64_t>> Chunks(uint64_t entry_bytes, uint64_t tokens) {
  const uint64_t count = (tokens + kChunkTokens - 1) / kChunkTokens;
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t begin = entry_bytes * i / count;
    const uint64_t end = entry_bytes * (i + 1) / count;
    chunks.emplace_back(begin, end - begin);
  }
  return chunks;
}

struct EntryResult {
  uint64_t tokens = 0;
  uint64_t bytes = 0;
  size_t chunks = 0;
  Samples set, get, copy;
};

absl::StatusOr<EntryResult> MeasureEntry(redisContext* redis, const EntrySize& size,
                                         uint64_t bytes, int reps, const std::vector<uint8_t>& src,
                                         std::vector<uint8_t>& dst) {
  EntryResult result;
  result.tokens = size.tokens;
  result.bytes = bytes;
  const auto chunks = Chunks(bytes, size.tokens);
  result.chunks = chunks.size();
  for (int rep = 0; rep < reps; ++rep) {
    int64_t start = NowNs();
    for (size_t i = 0; i < chunks.size(); ++i) {
      const std::string key = absl::StrCat("entry:", size.tokens, ":", i);
      RETURN_IF_ERROR(Command(redis, "SET %b %b", key.data(), key.size(),
                              src.data() + chunks[i].first, static_cast<size_t>(chunks[i].second))
                          .status());
    }
    result.set.Add(NowNs() - start);

    std::memset(dst.data(), 0, bytes);  // a GET that did nothing must not pass the check
    start = NowNs();
    for (size_t i = 0; i < chunks.size(); ++i) {
      const std::string key = absl::StrCat("entry:", size.tokens, ":", i);
      ASSIGN_OR_RETURN(Reply reply, Command(redis, "GET %b", key.data(), key.size()));
      if (reply->type != REDIS_REPLY_STRING ||
          static_cast<uint64_t>(reply->len) != chunks[i].second) {
        return absl::InternalError(absl::StrCat("GET ", key, " answered type ", reply->type));
      }
      std::memcpy(dst.data() + chunks[i].first, reply->str, chunks[i].second);
    }
    result.get.Add(NowNs() - start);
    if (std::memcmp(dst.data(), src.data(), bytes) != 0) {
      return absl::DataLossError(absl::StrCat("Redis returned other bytes for ", size.tokens,
                                              " tokens"));
    }
  }
  for (int rep = 0; rep < std::max(reps, 3); ++rep) {
    const int64_t start = NowNs();
    std::memcpy(dst.data(), src.data(), bytes);
    result.copy.Add(NowNs() - start);
    KeepAlive(dst[bytes - 1]);
  }
  RETURN_IF_ERROR(Command(redis, "FLUSHALL").status());
  return result;
}

// 3a: Redis SET/GET vs memcpy into json["redis"]; GET GB/s (p50) by entry tokens into `get_gbps`.
absl::Status RunRedis(const BenchOptions& options, Json& json,
                      absl::flat_hash_map<uint64_t, double>& get_gbps) {
  const ModelPlan model = DenseModel();
  std::vector<std::pair<EntrySize, uint64_t>> entries;  // size, bytes
  for (const EntrySize& size : kEntries) {
    if (size.tokens > options.redis_max_tokens) continue;
    SessionShape request;
    request.capacity = size.tokens;
    ASSIGN_OR_RETURN(uint64_t bytes,
                     SessionArenaBytes(model, FormatDefaults(), request,
                                       {.granularity = static_cast<uint64_t>(getpagesize())}));
    entries.push_back({size, bytes});
  }
  if (entries.empty()) return absl::InvalidArgumentError("--redis_max_tokens excludes every size");
  uint64_t max_bytes = 0;
  for (const auto& entry : entries) max_bytes = std::max(max_bytes, entry.second);

  ASSIGN_OR_RETURN(std::unique_ptr<RedisPeer> peer, RedisPeer::Start(options));
  redisContext* const redis = peer->connection();
  const std::string& version = peer->version();

  std::vector<uint8_t> src(max_bytes), dst(max_bytes);
  std::mt19937_64 random(8);
  for (size_t i = 0; i + 8 <= src.size(); i += 8) {
    const uint64_t word = random();
    std::memcpy(&src[i], &word, 8);
  }

  Json rows = Json::array();
  Table table({"entry", "bytes", "chunks", "SET GB/s", "GET GB/s", "memcpy GB/s",
               "memcpy/GET"});
  for (const auto& [size, bytes] : entries) {
    const int reps = options.quick ? 1 : size.reps;
    ASSIGN_OR_RETURN(EntryResult r, MeasureEntry(redis, size, bytes, reps, src, dst));
    const double set = GBps(bytes, r.set.P50());
    const double get = GBps(bytes, r.get.P50());
    const double copy = GBps(bytes, r.copy.P50());
    rows.push_back(Json{{"tokens", r.tokens},
                        {"bytes", r.bytes},
                        {"chunks", r.chunks},
                        {"set", r.set.ToJson()},
                        {"get", r.get.ToJson()},
                        {"memcpy", r.copy.ToJson()},
                        {"set_gbps_p50", set},
                        {"get_gbps_p50", get},
                        {"memcpy_gbps_p50", copy},
                        {"ratio_memcpy_get_bandwidth", copy / get}});
    get_gbps[r.tokens] = get;
    table.Add({absl::StrCat(r.tokens / 1024, "k tokens"), absl::StrCat(r.bytes),
               absl::StrCat(r.chunks), Fixed(set, 2), Fixed(get, 2), Fixed(copy, 2),
               Ratio(copy / get)});
  }
  json["redis"] = Json{{"version", version},
                       {"model", "llama-3.2-1b geometry (16 layers, 8 KV heads of 64), formats "
                                 "q8_0 K / q5_1 V"},
                       {"chunk_tokens", kChunkTokens},
                       {"entries", rows}};
  table.Print(absl::StrCat("3a. Redis ", version,
                           " peer on loopback (SET/GET in 256-token chunks) vs memcpy"));
  return absl::OkStatus();
}

// ---- 3b. memra-kvd's prefix cache ----

constexpr uint32_t kBlockTokens = 256;

struct PrefixModel {
  std::string label;
  std::string description;
  ModelPlan plan;
};

std::vector<PrefixModel> PrefixModels() {
  // Qwen3-Next-style: 12 full-attention layers (2 KV heads of 256) + 36 Gated DeltaNet layers
  // whose 75 MiB of conv + SSM state is stored per captured boundary.
  return {{"dense", "llama-3.2-1b geometry (16 layers, 8 KV heads of 64)", DenseModel()},
          {"hybrid", "qwen3-next style (12 attention layers of 2x256, 36 Gated DeltaNet)",
           test_plans::Qwen3NextStyle()}};
}



struct PrefixResult {
  std::string model;
  uint64_t tokens = 0;
  uint64_t block_bytes = 0, boundary_bytes = 0;
  // The first capture of this size in the daemon (its storage partly fresh), then captures
  // after an eviction of the same bytes: storage recycled (what a cache at its budget sees).
  Samples capture_first, capture, lookup;
  Samples restore, ready;              // into a recycled (Reset) session; ready = lookup + restore
  Samples restore_fresh, ready_fresh;  // into a session created just before
  Samples copy, copy_fresh;            // memcpy between warm buffers / into fresh memory
  Samples restore_unverified;          // recycled session, daemon not verifying checksums
  // Restore bandwidth / memcpy bandwidth of each timed recycled restore and the memcpy run right
  // after it (ratios, not ns); the unverified pass's in restore_vs_paired_memcpy_unverified.
  Samples restore_vs_paired_memcpy, restore_vs_paired_memcpy_unverified;
  uint64_t Bytes() const { return block_bytes + boundary_bytes; }
};

// `restores_only`: one capture, then only the recycled-session restores (no fresh-session
// restores, no baselines): the second pass against a daemon that does not verify checksums.
// `client`'s deadline is kPrefixDeadline; Evict and Inspect (operator calls) go through the raw
// stub of `operator_client`, a client of the admin socket.
absl::StatusOr<PrefixResult> MeasurePrefix(KvClient& client, KvClient& operator_client,
                                           const PlanFingerprint& plan, const std::string& label,
                                           uint64_t tokens, int reps, bool restores_only) {
  pb::KvPrefixCache::Stub& prefix = ClientInternals::Prefix(operator_client);
  PrefixResult result;
  result.model = label;
  result.tokens = tokens;
  const std::vector<int32_t> ids = TokenIds(tokens, tokens);
  SessionOptions session_options;
  session_options.capacity = tokens;

  // Capture from a filled source session; evicted and captured again for each repetition.
  uint64_t entry_id = 0;
  {
    ASSIGN_OR_RETURN(std::unique_ptr<Session> source, client.CreateSession(plan, session_options));
    RETURN_IF_ERROR(FillSession(*source, ids));
    const int captures = restores_only ? 1 : std::max(reps, 3) + 1;
    for (int rep = 0; rep < captures; ++rep) {
      if (entry_id != 0) {
        pb::EvictPrefixRequest evict;
        evict.set_entry_id(entry_id);
        pb::EvictPrefixResponse evicted;
        RETURN_IF_ERROR(FromGrpcStatus(prefix.EvictPrefix(PrefixContext().get(), evict, &evicted)));
      }
      const int64_t start = NowNs();
      ASSIGN_OR_RETURN(PrefixCaptured captured, client.prefixes().Capture(*source, ids, tokens));
      (rep == 0 ? result.capture_first : result.capture).Add(NowNs() - start);
      if (captured.already_present) {
        return absl::InternalError(absl::StrCat("capture of ", tokens, " tokens copied nothing"));
      }
      entry_id = captured.entry_id;
    }
    RETURN_IF_ERROR(source->Release().status());
  }
  pb::InspectPrefixRequest inspect;
  inspect.set_entry_id(entry_id);
  pb::PrefixEntry entry;
  RETURN_IF_ERROR(FromGrpcStatus(prefix.InspectPrefix(PrefixContext().get(), inspect, &entry)));
  result.block_bytes = entry.block_bytes();
  result.boundary_bytes = entry.boundary_bytes();

  // Restores, Lookup + Restore timed as an engine waits. (a) Into a session created just before
  // (untimed): its memory is touched for the first time. (b) Into one recycled session, Reset
  // between repetitions: an engine that keeps its session slots.
  auto restore_into = [&](Session& session, Samples& restore,
                          Samples& ready) -> absl::StatusOr<int64_t> {
    const int64_t start = NowNs();
    ASSIGN_OR_RETURN(PrefixMatch found, client.prefixes().Lookup(plan, session_options, ids));
    const int64_t looked_up = NowNs();
    ASSIGN_OR_RETURN(PrefixRestored restored,
                     client.prefixes().Restore(session, ids, found.entry_id));
    const int64_t done = NowNs();
    if (found.outcome != LookupOutcome::kHit || found.matched_tokens != tokens ||
        restored.restored_tokens != tokens || restored.state.committed_len != tokens) {
      return absl::InternalError(absl::StrCat(
          "lookup/restore of ", tokens, " tokens: outcome ", static_cast<int>(found.outcome),
          ", matched ", found.matched_tokens, ", restored ", restored.restored_tokens));
    }
    result.lookup.Add(looked_up - start);
    restore.Add(done - looked_up);
    ready.Add(done - start);
    return done - looked_up;
  };
  for (int rep = 0; rep < (restores_only ? 0 : reps); ++rep) {
    ASSIGN_OR_RETURN(std::unique_ptr<Session> fresh, client.CreateSession(plan, session_options));
    RETURN_IF_ERROR(restore_into(*fresh, result.restore_fresh, result.ready_fresh).status());
    RETURN_IF_ERROR(fresh->Release().status());
  }
  {
    ASSIGN_OR_RETURN(std::unique_ptr<Session> slot, client.CreateSession(plan, session_options));
    // Untimed restores first: on this VM a page reaches full copy speed only from about its
    // fourth write (0.3, 5, 10, 12, 14 GB/s over the first five; bench/README.md), and a
    // recycled slot's pages are rewritten every time it is reused.
    // Each timed restore is followed by a memcpy of as many bytes between warm buffers: the
    // pair's ratio is taken under the same load (other tenants of this VM swing memcpy 2x
    // between minutes, and a separately timed baseline then moves every ratio).
    std::vector<uint8_t> pair_src(result.Bytes(), 0x5a), pair_dst(result.Bytes(), 0);
    std::memcpy(pair_dst.data(), pair_src.data(), pair_src.size());
    constexpr int kWarmups = 4;
    for (int rep = 0; rep < kWarmups + reps; ++rep) {
      Samples warmup;
      const bool timed = rep >= kWarmups;
      ASSIGN_OR_RETURN(const int64_t restore_ns,
                       restore_into(*slot, timed ? result.restore : warmup,
                                    timed ? result.ready : warmup));
      RETURN_IF_ERROR(slot->Reset().status());
      if (!timed) continue;
      const int64_t start = NowNs();
      std::memcpy(pair_dst.data(), pair_src.data(), pair_src.size());
      const int64_t copy_ns = NowNs() - start;
      KeepAlive(pair_dst[pair_dst.size() - 1]);
      result.restore_vs_paired_memcpy.Add(static_cast<double>(copy_ns) /
                                          static_cast<double>(restore_ns));
    }
    RETURN_IF_ERROR(slot->Release().status());
  }
  pb::EvictPrefixRequest evict;
  evict.set_entry_id(entry_id);
  pb::EvictPrefixResponse evicted;
  RETURN_IF_ERROR(FromGrpcStatus(prefix.EvictPrefix(PrefixContext().get(), evict, &evicted)));
  if (restores_only) return result;

  // memcpy of the same bytes: between buffers touched before (the warm baseline), and into
  // memory mapped just before (what a first touch costs this machine).
  std::vector<uint8_t> src(result.Bytes(), 0x5a), dst(result.Bytes(), 0);
  for (int rep = 0; rep < std::max(reps, 3); ++rep) {
    const int64_t start = NowNs();
    std::memcpy(dst.data(), src.data(), src.size());
    result.copy.Add(NowNs() - start);
    KeepAlive(dst[dst.size() - 1]);
  }
  for (int rep = 0; rep < reps; ++rep) {
    void* fresh = mmap(nullptr, src.size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
    if (fresh == MAP_FAILED) return absl::ResourceExhaustedError("mmap for the fresh baseline");
    const int64_t start = NowNs();
    std::memcpy(fresh, src.data(), src.size());
    result.copy_fresh.Add(NowNs() - start);
    KeepAlive(static_cast<uint8_t*>(fresh)[src.size() - 1]);
    munmap(fresh, src.size());
  }
  return result;
}

absl::StatusOr<Json> RunPrefixCache(const BenchOptions& options,
                                    const absl::flat_hash_map<uint64_t, double>& get_gbps) {
  // --quick: one tiny entry (two blocks) per model.
  std::vector<EntrySize> sizes;
  if (options.quick) {
    sizes.push_back({2 * kBlockTokens, 1});
  } else {
    for (const EntrySize& size : kEntries) {
      if (size.tokens <= options.redis_max_tokens) sizes.push_back(size);
    }
  }
  if (sizes.empty()) return absl::InvalidArgumentError("--redis_max_tokens excludes every size");

  Json rows = Json::array();
  Json models = Json::array();
  Table table({"model", "entry", "bytes", "first capture GB/s", "capture GB/s",
               "capture/memcpy", "restore GB/s", "lookup->ready ms", "restore/paired memcpy",
               "memcpy GB/s", "restore/memcpy", "unverified GB/s", "unverified/memcpy",
               "restore/GET (verified / not)", "fresh: restore GB/s",
               "memcpy GB/s", "restore/memcpy"});
  for (const PrefixModel& model : PrefixModels()) {
    // Budget: the source session, the entry (cache), the restored session, and slack.
    SessionShape request;
    request.capacity = sizes.back().tokens;
    ASSIGN_OR_RETURN(uint64_t session_bytes,
                     SessionArenaBytes(model.plan, FormatDefaults(), request,
                                       {.granularity = static_cast<uint64_t>(getpagesize())}));
    const uint64_t cache_budget = session_bytes + (256ull << 20);
    // One daemon per pass: the default (checksums verified on restore) measures everything;
    // one with --prefix_verify_checksums=false measures the recycled restores again.
    auto run_pass = [&](bool verify) -> absl::StatusOr<std::vector<PrefixResult>> {
      ASSIGN_OR_RETURN(
          std::unique_ptr<Kvd> kvd,
          Kvd::Start(options, 2 * session_bytes + cache_budget + (256ull << 20),
                     {absl::StrCat("--prefix_cache_budget_bytes=", cache_budget),
                      absl::StrCat("--prefix_block_tokens=", kBlockTokens),
                      absl::StrCat("--prefix_verify_checksums=", verify ? "true" : "false")}));
      ClientOptions client_options;
      client_options.deadline = kPrefixDeadline;
      ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                       KvClient::Connect(kvd->socket_path(), client_options));
      RETURN_IF_ERROR(client->Attach("bench-prefix"));
      ASSIGN_OR_RETURN(std::unique_ptr<KvClient> operator_client,
                       KvClient::Connect(kvd->admin_socket_path(), client_options));
      ASSIGN_OR_RETURN(PlanFingerprint plan, client->RegisterPlan(model.plan));
      std::vector<PrefixResult> results;
      for (const EntrySize& size : sizes) {
        ASSIGN_OR_RETURN(results.emplace_back(),
                         MeasurePrefix(*client, *operator_client, plan, model.label, size.tokens,
                                       options.quick ? 1 : size.reps, /*restores_only=*/!verify));
      }
      client->Detach();
      client.reset();
      if (const int code = kvd->Stop(); code != 0) {
        return absl::InternalError(
            absl::StrCat("memra-kvd exited ", code, " after the prefix runs"));
      }
      return results;
    };
    ASSIGN_OR_RETURN(std::vector<PrefixResult> results, run_pass(true));
    ASSIGN_OR_RETURN(std::vector<PrefixResult> unverified, run_pass(false));
    for (size_t i = 0; i < results.size(); ++i) {
      results[i].restore_unverified = std::move(unverified[i].restore);
      results[i].restore_vs_paired_memcpy_unverified =
          std::move(unverified[i].restore_vs_paired_memcpy);
    }
    models.push_back(Json{{"label", model.label}, {"model", model.description}});
    for (const PrefixResult& r : results) {
      const double capture_first = GBps(r.Bytes(), r.capture_first.P50());
      const double capture = GBps(r.Bytes(), r.capture.P50());
      const double restore = GBps(r.Bytes(), r.restore.P50());
      const double ready = GBps(r.Bytes(), r.ready.P50());
      const double copy = GBps(r.Bytes(), r.copy.P50());
      const double restore_fresh = GBps(r.Bytes(), r.restore_fresh.P50());
      const double copy_fresh = GBps(r.Bytes(), r.copy_fresh.P50());
      const double unverified = GBps(r.Bytes(), r.restore_unverified.P50());
      const auto get = get_gbps.find(r.tokens);
      Json row{{"model", r.model},
               {"tokens", r.tokens},
               {"bytes", r.Bytes()},
               {"block_bytes", r.block_bytes},
               {"boundary_bytes", r.boundary_bytes},
               {"capture_first", r.capture_first.ToJson()},
               {"capture", r.capture.ToJson()},
               {"lookup", r.lookup.ToJson()},
               {"restore", r.restore.ToJson()},
               {"lookup_to_ready", r.ready.ToJson()},
               {"restore_fresh_session", r.restore_fresh.ToJson()},
               {"lookup_to_ready_fresh_session", r.ready_fresh.ToJson()},
               {"memcpy", r.copy.ToJson()},
               {"memcpy_into_fresh_memory", r.copy_fresh.ToJson()},
               {"capture_first_gbps_p50", capture_first},
               {"capture_gbps_p50", capture},
               {"ratio_capture_memcpy_bandwidth", capture / copy},
               {"restore_gbps_p50", restore},
               {"lookup_to_ready_gbps_p50", ready},
               {"restore_fresh_session_gbps_p50", restore_fresh},
               {"memcpy_gbps_p50", copy},
               {"memcpy_into_fresh_memory_gbps_p50", copy_fresh},
               {"ratio_restore_memcpy_bandwidth", restore / copy},
               {"ratio_ready_memcpy_bandwidth", ready / copy},
               {"ratio_restore_fresh_memcpy_fresh_bandwidth", restore_fresh / copy_fresh},
               {"restore_unverified", r.restore_unverified.ToJson()},
               {"restore_unverified_gbps_p50", unverified},
               {"ratio_restore_unverified_memcpy_bandwidth", unverified / copy},
               {"ratio_restore_paired_memcpy_bandwidth_p50", r.restore_vs_paired_memcpy.P50()},
               {"ratio_restore_paired_memcpy_bandwidth_min",
                r.restore_vs_paired_memcpy.Percentile(0)},
               {"ratio_restore_unverified_paired_memcpy_bandwidth_p50",
                r.restore_vs_paired_memcpy_unverified.P50()}};
      std::string vs_get = "-";
      if (get != get_gbps.end() && get->second > 0) {
        row["redis_get_gbps_p50"] = get->second;
        row["ratio_restore_redis_get_bandwidth"] = restore / get->second;
        row["ratio_restore_unverified_redis_get_bandwidth"] = unverified / get->second;
        vs_get = absl::StrCat(Ratio(restore / get->second), " / ", Ratio(unverified / get->second));
      }
      rows.push_back(std::move(row));
      table.Add({r.model,
                 absl::StrCat(r.tokens >= 1024 ? absl::StrCat(r.tokens / 1024, "k")
                                               : absl::StrCat(r.tokens),
                              " tokens"),
                 absl::StrCat(r.Bytes()), Fixed(capture_first, 2), Fixed(capture, 2),
                 Ratio(capture / copy), Fixed(restore, 2),
                 Fixed(r.ready.P50() / 1e6, 2), Ratio(r.restore_vs_paired_memcpy.P50()),
                 Fixed(copy, 2), Ratio(restore / copy),
                 Fixed(unverified, 2), Ratio(unverified / copy), vs_get,
                 Fixed(restore_fresh, 2), Fixed(copy_fresh, 2),
                 Ratio(restore_fresh / copy_fresh)});
    }
  }
  table.Print("3b. memra-kvd prefix cache (host backend, 256-token blocks): capture (first, "
              "then into recycled storage), lookup + restore into a recycled session vs memcpy "
              "and Redis GET; fresh: restore into a new session vs memcpy into new memory");
  return Json{{"block_tokens", kBlockTokens},
              {"backend", "host"},
              {"models", models},
              {"entries", rows},
              {"note", "capture: after an eviction of the same entry (recycled slab storage); "
                       "capture_first: the first capture of that size in the daemon; "
                       "restore GB/s = entry bytes / Restore RPC time, into a recycled (Reset) "
                       "session; lookup_to_ready = Lookup + Restore as an engine waits; "
                       "*_fresh_session: into a session created just before (untimed), whose "
                       "memory is touched for the first time, against memcpy into memory "
                       "mmapped just before; restore_unverified: the recycled restores again "
                       "against a daemon with prefix_verify_checksums=false"}};
}

}  // namespace

absl::StatusOr<Json> RunPrefixAndRedis(const BenchOptions& options) {
  std::printf("\n== 3. prefix restore/capture and the Redis peer\n");
  Json json;
  absl::flat_hash_map<uint64_t, double> get_gbps;
  // Redis first, in its own scope: its server and buffers are gone before the daemon's sessions.
  absl::Status redis = RunRedis(options, json, get_gbps);
  if (!redis.ok()) json["redis"] = Json{{"error", redis.ToString()}};
  ASSIGN_OR_RETURN(json["prefix_restore_capture"], RunPrefixCache(options, get_gbps));
  RETURN_IF_ERROR(redis);
  return json;
}

}  // namespace memra::bench
