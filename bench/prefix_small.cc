// Section 3c (`--sections=prefix_small`): a small entry's restore and capture (the dense model
// at 1k tokens, 4 blocks of 256 tokens) against memcpy of the same bytes in the same run, and
// where such a call's time goes.
//
// a) The copy engine alone, in this process: the daemon's SliceCopier over a HostBackend (the
//    same code and backend as the daemon's), hashing and copying 4 pieces like the entry's, on
//    one thread and split over two (the pool's helper already started, as in a running daemon),
//    at sizes from 1 MiB to the entry's; each timed copy paired with a memcpy of as many bytes
//    run right after it. What this decides: from what size a second copy thread pays
//    (SliceCopierOptions::parallel_copy_bytes). Also what creating and joining a thread costs
//    (what each parallel copy paid before the pool) and what a pooled hand-off costs (a copy of
//    two 64-byte pieces split over two threads: wake, job hand-off, join).
// b) The daemon: captures of the entry into recycled storage (the entry evicted between them,
//    untimed) and restores into a recycled session (Reset between them, untimed; after four
//    untimed warm-ups), each paired with a memcpy of the entry's bytes right after it; the
//    same connection's GetSessionState round trip (a call that copies nothing) as the RPC's
//    fixed share. Two daemons (the default, and prefix_copy_threads=1) are measured alternately
//    rep by rep, so both see the same load. The machine's load average is recorded with every
//    run: ratios move with it.

#include <sys/sysinfo.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/prefix_session.h"
#include "bench/sections.h"
#include "client/internal.h"
#include "client/prefix_client.h"
#include "common/grpc_status.h"
#include "core/admission.h"
#include "core/status_macros.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "server/config.h"
#include "server/device/host_backend.h"
#include "server/store/slice_copier.h"

namespace memra::bench {
namespace {

namespace pb = ::memra::kv::v1;

constexpr uint64_t kEntryTokens = 1024;
constexpr uint64_t kBlockTokens = 256;
constexpr uint64_t kPieces = kEntryTokens / kBlockTokens;

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return absl::StrCat(one, " ", five, " ", fifteen);
}

// memcpy of `bytes` between warm buffers, timed.
class PairedMemcpy {
 public:
  explicit PairedMemcpy(uint64_t bytes) : src_(bytes, 0x5a), dst_(bytes, 0) { Run(); }
  int64_t Run() {
    const int64_t start = NowNs();
    std::memcpy(dst_.data(), src_.data(), src_.size());
    const int64_t ns = NowNs() - start;
    KeepAlive(dst_[dst_.size() - 1]);
    return ns;
  }

 private:
  std::vector<uint8_t> src_, dst_;
};

// 3c a): the copy engine in process.
absl::StatusOr<Json> MeasureCopyEngine(uint64_t entry_bytes, int reps, Table& table) {
  const uint64_t arena_bytes = (entry_bytes + 4095) / 4096 * 4096;
  HostBackendOptions backend_options;
  backend_options.total_bytes = 2 * arena_bytes;
  backend_options.name_prefix = "memra-bench";
  ASSIGN_OR_RETURN(std::unique_ptr<HostBackend> backend, HostBackend::Create(backend_options));
  ASSIGN_OR_RETURN(ArenaId session, backend->CreateArena(arena_bytes, ArenaVisibility::kPrivate));
  ASSIGN_OR_RETURN(ArenaId slab, backend->CreateArena(arena_bytes, ArenaVisibility::kPrivate));
  RETURN_IF_ERROR(backend->Memset(session, 0, 0x5a, arena_bytes));
  RETURN_IF_ERROR(backend->Memset(slab, 0, 0, arena_bytes));
  SliceCopier one(backend.get(), {.copy_threads = 1, .parallel_copy_bytes = 1});
  SliceCopier two(backend.get(), {.copy_threads = 2, .parallel_copy_bytes = 1});
  // `bytes` as the entry's pieces: kPieces spans of the slab, one range each.
  auto pieces_of = [&](uint64_t bytes) {
    std::vector<PieceCopy> pieces(kPieces);
    const uint64_t each = bytes / kPieces;
    for (uint64_t i = 0; i < kPieces; ++i) {
      pieces[i].ranges = {{.dst_offset = 0, .src_offset = i * each, .bytes = each}};
      pieces[i].bytes = each;
      pieces[i].span = {.slab = slab, .offset = i * each, .bytes = each};
    }
    return pieces;
  };
  Json rows = Json::array();
  std::vector<uint64_t> sizes = {uint64_t{1} << 20, uint64_t{2} << 20, uint64_t{4} << 20,
                                 uint64_t{8} << 20, entry_bytes / kPieces * kPieces};
  for (uint64_t bytes : sizes) {
    const std::vector<PieceCopy> pieces = pieces_of(bytes);
    PairedMemcpy memcpy_of(bytes);
    Samples ns[2], ratio[2];
    for (int rep = 0; rep < 3 + reps; ++rep) {
      for (int threads = 0; threads < 2; ++threads) {
        const SliceCopier& copier = threads == 0 ? one : two;
        const int64_t start = NowNs();
        RETURN_IF_ERROR(
            copier.Copy(CopyDirection::kToStorage, session, pieces, true, EntryId{}).status());
        const int64_t copy_ns = NowNs() - start;
        const int64_t paired = memcpy_of.Run();
        if (rep < 3) continue;  // warm-up: pages, caches and the helper
        ns[threads].Add(copy_ns);
        ratio[threads].Add(static_cast<double>(paired) / copy_ns);
      }
    }
    rows.push_back(Json{{"bytes", bytes},
                        {"one_thread", ns[0].ToJson()},
                        {"two_threads", ns[1].ToJson()},
                        {"one_thread_vs_paired_memcpy_p50", ratio[0].P50()},
                        {"two_threads_vs_paired_memcpy_p50", ratio[1].P50()}});
    table.Add({absl::StrCat(bytes >> 10, " KiB"), Us(ns[0].P50()), Ratio(ratio[0].P50()),
               Us(ns[1].P50()), Ratio(ratio[1].P50())});
  }
  // A thread created and joined (each parallel copy's cost before the pool), and a pooled
  // hand-off (two tiny pieces over two threads: the helper woken, a job taken, joined).
  Samples spawn, handoff;
  const std::vector<PieceCopy> tiny = [&] {
    std::vector<PieceCopy> pieces = pieces_of(kPieces * 64);
    pieces.resize(2);
    return pieces;
  }();
  for (int rep = 0; rep < 50; ++rep) {
    int64_t start = NowNs();
    std::thread([] {}).join();
    spawn.Add(NowNs() - start);
    start = NowNs();
    RETURN_IF_ERROR(two.Copy(CopyDirection::kToStorage, session, tiny, true, EntryId{}).status());
    handoff.Add(NowNs() - start);
  }
  table.Add({"thread create + join", Us(spawn.P50()), "", "pooled hand-off", Us(handoff.P50())});
  return Json{{"sizes", rows},
              {"thread_create_join", spawn.ToJson()},
              {"pooled_handoff_two_tiny_pieces", handoff.ToJson()}};
}

// 3c b): one daemon under test, with its source session (filled) and its recycled slot.
struct DaemonUnderTest {
  std::string label;
  uint32_t copy_threads = 0;
  std::unique_ptr<Kvd> kvd;
  std::unique_ptr<KvClient> client, operator_client;
  PlanFingerprint plan;
  std::unique_ptr<Session> source, slot;
  uint64_t entry_id = 0;
  Samples capture, capture_ratio, restore, restore_ratio, round_trip;
};

absl::StatusOr<std::unique_ptr<DaemonUnderTest>> StartDaemon(const BenchOptions& options,
                                                             const std::string& label,
                                                             uint32_t copy_threads,
                                                             const std::vector<int32_t>& ids) {
  auto daemon = std::make_unique<DaemonUnderTest>();
  daemon->label = label;
  daemon->copy_threads = copy_threads;
  const ModelPlan model = DenseModel();
  SessionShape request;
  request.capacity = kEntryTokens;
  ASSIGN_OR_RETURN(uint64_t session_bytes,
                   SessionArenaBytes(model, FormatDefaults(), request,
                                     {.granularity = static_cast<uint64_t>(getpagesize())}));
  const uint64_t cache_budget = 2 * session_bytes + (64ull << 20);
  ASSIGN_OR_RETURN(daemon->kvd,
                   Kvd::Start(options, 3 * session_bytes + cache_budget + (64ull << 20),
                              {absl::StrCat("--prefix_cache_budget_bytes=", cache_budget),
                               absl::StrCat("--prefix_block_tokens=", kBlockTokens),
                               absl::StrCat("--prefix_copy_threads=", copy_threads)}));
  ClientOptions client_options;
  client_options.deadline = kPrefixDeadline;
  ASSIGN_OR_RETURN(daemon->client, KvClient::Connect(daemon->kvd->socket_path(), client_options));
  RETURN_IF_ERROR(daemon->client->Attach(absl::StrCat("bench-prefix-small-", copy_threads)));
  ASSIGN_OR_RETURN(daemon->operator_client,
                   KvClient::Connect(daemon->kvd->admin_socket_path(), client_options));
  ASSIGN_OR_RETURN(daemon->plan, daemon->client->RegisterPlan(model));
  SessionOptions session_options;
  session_options.capacity = kEntryTokens;
  ASSIGN_OR_RETURN(daemon->source, daemon->client->CreateSession(daemon->plan, session_options));
  RETURN_IF_ERROR(FillSession(*daemon->source, ids));
  ASSIGN_OR_RETURN(daemon->slot, daemon->client->CreateSession(daemon->plan, session_options));
  return daemon;
}

absl::Status Evict(DaemonUnderTest& daemon) {
  pb::EvictPrefixRequest evict;
  evict.set_entry_id(daemon.entry_id);
  pb::EvictPrefixResponse evicted;
  return FromGrpcStatus(ClientInternals::Prefix(*daemon.operator_client)
                            .EvictPrefix(PrefixContext().get(), evict, &evicted));
}

// One capture into recycled storage (the entry evicted first, untimed), then one restore into
// the recycled slot (Reset after it, untimed), each paired with `memcpy_of`; recorded when
// `timed`.
absl::Status CaptureAndRestore(DaemonUnderTest& daemon, const std::vector<int32_t>& ids,
                               PairedMemcpy& memcpy_of, bool timed) {
  if (daemon.entry_id != 0) RETURN_IF_ERROR(Evict(daemon));
  int64_t start = NowNs();
  ASSIGN_OR_RETURN(PrefixCaptured captured,
                   daemon.client->prefixes().Capture(*daemon.source, ids, kEntryTokens));
  const int64_t capture_ns = NowNs() - start;
  int64_t paired = memcpy_of.Run();
  if (captured.already_present) return absl::InternalError("a capture copied nothing");
  daemon.entry_id = captured.entry_id;
  if (timed) {
    daemon.capture.Add(capture_ns);
    daemon.capture_ratio.Add(static_cast<double>(paired) / capture_ns);
  }
  start = NowNs();
  ASSIGN_OR_RETURN(PrefixRestored restored,
                   daemon.client->prefixes().Restore(*daemon.slot, ids, daemon.entry_id));
  const int64_t restore_ns = NowNs() - start;
  paired = memcpy_of.Run();
  if (restored.restored_tokens != kEntryTokens) {
    return absl::InternalError(absl::StrCat("restored ", restored.restored_tokens, " tokens"));
  }
  start = NowNs();
  RETURN_IF_ERROR(daemon.slot->State().status());
  const int64_t state_ns = NowNs() - start;
  RETURN_IF_ERROR(daemon.slot->Reset().status());
  if (timed) {
    daemon.restore.Add(restore_ns);
    daemon.restore_ratio.Add(static_cast<double>(paired) / restore_ns);
    daemon.round_trip.Add(state_ns);
  }
  return absl::OkStatus();
}

// The default daemon and one held to a single copy thread (how every entry under 64 MiB was
// copied before copy threads were scaled by size), measured alternately rep by rep so both see
// the same load.
absl::StatusOr<Json> MeasureDaemons(const BenchOptions& options, int reps, Table& table,
                                    uint64_t& entry_bytes) {
  const std::vector<int32_t> ids = TokenIds(kEntryTokens, kEntryTokens);
  std::vector<std::unique_ptr<DaemonUnderTest>> daemons;
  for (uint32_t threads : {static_cast<uint32_t>(DaemonConfig{}.prefix.copy_threads), 1u}) {
    ASSIGN_OR_RETURN(daemons.emplace_back(),
                     StartDaemon(options, threads == 1 ? "prefix_copy_threads=1" : "default",
                                 threads, ids));
  }
  {
    DaemonUnderTest& first = *daemons.front();
    ASSIGN_OR_RETURN(PrefixCaptured captured,
                     first.client->prefixes().Capture(*first.source, ids, kEntryTokens));
    first.entry_id = captured.entry_id;
    pb::InspectPrefixRequest inspect;
    inspect.set_entry_id(first.entry_id);
    pb::PrefixEntry entry;
    RETURN_IF_ERROR(FromGrpcStatus(ClientInternals::Prefix(*first.operator_client)
                                       .InspectPrefix(PrefixContext().get(), inspect, &entry)));
    entry_bytes = entry.block_bytes() + entry.boundary_bytes();
  }
  PairedMemcpy memcpy_of(entry_bytes);
  // Four untimed rounds first: fresh slabs, and a page reaches full copy speed only from about
  // its fourth write on this VM.
  constexpr int kWarmups = 4;
  for (int rep = 0; rep < kWarmups + reps; ++rep) {
    for (auto& daemon : daemons) {
      RETURN_IF_ERROR(CaptureAndRestore(*daemon, ids, memcpy_of, rep >= kWarmups));
    }
  }
  Json out = Json::array();
  auto spread = [](const Samples& ratios) {
    return absl::StrCat(Ratio(ratios.Percentile(0)), " - ", Ratio(ratios.Percentile(100)));
  };
  for (auto& daemon : daemons) {
    RETURN_IF_ERROR(Evict(*daemon));
    RETURN_IF_ERROR(daemon->source->Release().status());
    RETURN_IF_ERROR(daemon->slot->Release().status());
    daemon->client->Detach();
    daemon->client.reset();
    if (const int code = daemon->kvd->Stop(); code != 0) {
      return absl::InternalError(absl::StrCat("memra-kvd exited ", code, " after the small runs"));
    }
    table.Add({daemon->label, "capture (recycled storage)", Us(daemon->capture.P50()),
               Ratio(daemon->capture_ratio.P50()), spread(daemon->capture_ratio),
               Us(daemon->round_trip.P50())});
    table.Add({daemon->label, "restore (recycled session)", Us(daemon->restore.P50()),
               Ratio(daemon->restore_ratio.P50()), spread(daemon->restore_ratio),
               Us(daemon->round_trip.P50())});
    out.push_back(Json{{"prefix_copy_threads", daemon->copy_threads},
                       {"capture", daemon->capture.ToJson()},
                       {"capture_vs_paired_memcpy_p50", daemon->capture_ratio.P50()},
                       {"capture_vs_paired_memcpy_min", daemon->capture_ratio.Percentile(0)},
                       {"restore", daemon->restore.ToJson()},
                       {"restore_vs_paired_memcpy_p50", daemon->restore_ratio.P50()},
                       {"restore_vs_paired_memcpy_min", daemon->restore_ratio.Percentile(0)},
                       {"get_session_state_round_trip", daemon->round_trip.ToJson()}});
  }
  return Json{{"entry_bytes", entry_bytes}, {"daemons", out}};
}

}  // namespace

absl::StatusOr<Json> RunPrefixSmall(const BenchOptions& options) {
  const int reps = options.quick ? 1 : 30;
  const std::string load_before = LoadAverage();
  Table daemon_table({"daemon", "1k-token entry", "p50", "vs paired memcpy (p50)", "min - max",
                      "GetSessionState round trip"});
  uint64_t entry_bytes = 0;
  ASSIGN_OR_RETURN(Json daemon, MeasureDaemons(options, reps, daemon_table, entry_bytes));
  daemon_table.Print(absl::StrCat("3c. small entry: ", entry_bytes,
                                  " bytes, load average before ", load_before, ", after ",
                                  LoadAverage()));
  Table copy_table({"bytes (4 pieces)", "1 thread", "vs memcpy", "2 threads", "vs memcpy"});
  ASSIGN_OR_RETURN(Json engine, MeasureCopyEngine(entry_bytes, reps, copy_table));
  copy_table.Print("3c. the copy engine in process (SliceCopier, hash + copy)");
  return Json{{"load_average_before", load_before},
              {"load_average_after", LoadAverage()},
              {"cpus", std::thread::hardware_concurrency()},
              {"daemon", daemon},
              {"copy_engine", engine}};
}

}  // namespace memra::bench
