// Section 7: restore from each prefix tier, and capture into recycled storage (issue 18's
// numbers). One entry of a dense model (bench/prefix_session.h, 256-token blocks) is restored
// through memra-kvd (host backend) from
//   device  the daemon's own slabs (daemon A: the entry was captured there);
//   disk    the disk tier (daemon D: its device tier holds 1 MiB, so the capture is demoted to
//           files and every restore reads them back through io_uring and verifies them; the
//           restore RPC also pays the demotion back to disk when it unpins);
//   remote  a 3-master Redis Cluster on loopback (daemon B: A wrote the entry behind its capture;
//           each restore on B looks up (REMOTE), pulls every block with GETs spread over its
//           readers, verifies, stores them in slabs and restores; B's copy is evicted before
//           the next repetition so each one pulls again);
// each timed as the Restore RPC (lookup excluded) into a recycled session, against memcpy of the
// same bytes and a plain GET of the same values (the remote keys, one by one, through one
// RedisClusterClient: no verification, no copy), both measured in the same run. Capture: the
// captures after an eviction of the same entry (recycled slab storage) against memcpy, on a
// daemon without a remote tier (C) and on A, whose captures also queue each new piece for the
// remote tier's writer thread (which reads it from its slab; the eviction waits for that).

#include <hiredis/hiredis.h>

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
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
#include "server/store/remote/redis_cluster.h"

namespace memra::bench {
namespace {

namespace pb = ::memra::kv::v1;

constexpr uint32_t kBlockTokens = 256;
constexpr int kClusterNodes = 3;

// A 3-master Redis Cluster (no replicas, no password, persistence off) on loopback ports.
struct BenchCluster {
  TempDir dir;
  std::vector<int> ports;
  std::vector<ChildProcess> servers;
  std::string NodeList() const {
    std::vector<std::string> nodes;
    for (const int port : ports) nodes.push_back(absl::StrCat("127.0.0.1:", port));
    return absl::StrJoin(nodes, ",");
  }
};

// One command on one node over plain hiredis; the reply's text (arrays: a line each).
absl::StatusOr<std::string> NodeCommand(int port, const std::vector<std::string>& argv) {
  std::unique_ptr<redisContext, void (*)(redisContext*)> context(
      redisConnectWithTimeout("127.0.0.1", port, timeval{2, 0}), redisFree);
  if (context == nullptr || context->err != 0) {
    return absl::UnavailableError(absl::StrCat("redis node ", port, " does not answer"));
  }
  std::vector<const char*> words;
  std::vector<size_t> lengths;
  for (const std::string& word : argv) {
    words.push_back(word.data());
    lengths.push_back(word.size());
  }
  std::unique_ptr<redisReply, void (*)(void*)> reply(
      static_cast<redisReply*>(redisCommandArgv(context.get(), static_cast<int>(words.size()),
                                                words.data(), lengths.data())),
      freeReplyObject);
  if (reply == nullptr || reply->type == REDIS_REPLY_ERROR) {
    return absl::InternalError(absl::StrCat("redis node ", port, ": ", argv[0], " failed"));
  }
  std::string text;
  if (reply->type == REDIS_REPLY_ARRAY) {
    for (size_t i = 0; i < reply->elements; ++i) {
      text.append(reply->element[i]->str, reply->element[i]->len);
      text.push_back('\n');
    }
  } else if (reply->type == REDIS_REPLY_STRING || reply->type == REDIS_REPLY_STATUS) {
    text.assign(reply->str, reply->len);
  } else if (reply->type == REDIS_REPLY_INTEGER) {
    text = absl::StrCat(reply->integer);
  }
  return text;
}

absl::StatusOr<BenchCluster> StartCluster(const BenchOptions& options) {
  ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("memra-tiers"));
  BenchCluster cluster{.dir = std::move(dir), .ports = {}, .servers = {}};
  while (static_cast<int>(cluster.ports.size()) < kClusterNodes) {
    ASSIGN_OR_RETURN(const int port, FreeTcpPort());
    if (port + 10000 <= 65535 &&
        std::find(cluster.ports.begin(), cluster.ports.end(), port) == cluster.ports.end()) {
      cluster.ports.push_back(port);
    }
  }
  for (const int port : cluster.ports) {
    ASSIGN_OR_RETURN(
        cluster.servers.emplace_back(),
        ChildProcess::Spawn({options.redis_binary, "--port", absl::StrCat(port), "--bind",
                             "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file",
                             cluster.dir.File(absl::StrCat("nodes-", port, ".conf")), "--save",
                             "", "--appendonly", "no", "--dir", cluster.dir.path(),
                             "--loglevel", "warning"},
                            cluster.dir.File(absl::StrCat("redis-", port, ".log"))));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (const int port : cluster.ports) {
    while (!NodeCommand(port, {"PING"}).ok()) {
      if (absl::Now() > deadline) return absl::UnavailableError("redis-server did not start");
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  // redis-cli sits beside redis-server in Debian's packages.
  const std::string cli =
      options.redis_binary.substr(0, options.redis_binary.rfind('/') + 1) + "redis-cli";
  std::vector<std::string> create = {cli, "--cluster", "create"};
  for (const int port : cluster.ports) create.push_back(absl::StrCat("127.0.0.1:", port));
  create.insert(create.end(), {"--cluster-replicas", "0", "--cluster-yes"});
  ASSIGN_OR_RETURN(ChildProcess creating,
                   ChildProcess::Spawn(create, cluster.dir.File("create.log")));
  while (creating.Alive()) {
    if (absl::Now() > deadline) return absl::DeadlineExceededError("redis-cli --cluster create");
    absl::SleepFor(absl::Milliseconds(20));
  }
  for (const int port : cluster.ports) {
    while (true) {
      absl::StatusOr<std::string> info = NodeCommand(port, {"CLUSTER", "INFO"});
      if (info.ok() && absl::StrContains(*info, "cluster_state:ok")) break;
      if (absl::Now() > deadline) return absl::UnavailableError("the cluster never became ok");
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  return cluster;
}

// A daemon and its engine and operator clients.
struct Daemon {
  std::unique_ptr<Kvd> kvd;
  std::unique_ptr<KvClient> client;
  std::unique_ptr<KvClient> operator_client;
  PlanFingerprint plan{};
};

absl::StatusOr<Daemon> StartDaemon(const BenchOptions& options, uint64_t budget,
                                   std::vector<std::string> flags, const ModelPlan& model) {
  Daemon daemon;
  flags.push_back(absl::StrCat("--prefix_block_tokens=", kBlockTokens));
  ASSIGN_OR_RETURN(daemon.kvd, Kvd::Start(options, budget, flags));
  ClientOptions client_options;
  client_options.deadline = kPrefixDeadline;
  ASSIGN_OR_RETURN(daemon.client, KvClient::Connect(daemon.kvd->socket_path(), client_options));
  RETURN_IF_ERROR(daemon.client->Attach("bench-tiers"));
  ASSIGN_OR_RETURN(daemon.operator_client,
                   KvClient::Connect(daemon.kvd->admin_socket_path(), client_options));
  ASSIGN_OR_RETURN(daemon.plan, daemon.client->RegisterPlan(model));
  return daemon;
}

absl::Status StopDaemon(Daemon& daemon) {
  daemon.client->Detach();
  daemon.client.reset();
  daemon.operator_client.reset();
  if (const int code = daemon.kvd->Stop(); code != 0) {
    return absl::InternalError(absl::StrCat("memra-kvd exited ", code));
  }
  return absl::OkStatus();
}

absl::StatusOr<pb::ListPrefixesResponse> List(Daemon& daemon) {
  pb::ListPrefixesResponse listed;
  RETURN_IF_ERROR(FromGrpcStatus(ClientInternals::Prefix(*daemon.operator_client)
                                     .ListPrefixes(PrefixContext().get(), {}, &listed)));
  return listed;
}

absl::Status Evict(Daemon& daemon, uint64_t entry_id) {
  pb::EvictPrefixRequest evict;
  evict.set_entry_id(entry_id);
  pb::EvictPrefixResponse evicted;
  return FromGrpcStatus(ClientInternals::Prefix(*daemon.operator_client)
                            .EvictPrefix(PrefixContext().get(), evict, &evicted));
}

// Waits (at most 120 s) until `daemon`'s remote write-behind queue is empty: every queued piece
// read and written (or dropped), so its storage is free again.
absl::Status AwaitWriteBehind(Daemon& daemon) {
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (true) {
    ASSIGN_OR_RETURN(pb::ListPrefixesResponse listed, List(daemon));
    if (!listed.stats().has_remote() || listed.stats().remote().queued_writes() == 0) {
      return absl::OkStatus();
    }
    if (absl::Now() > deadline) return absl::DeadlineExceededError("remote write-behind");
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Fills a source session and captures it `captures` times (evicting in between, once the
// previous capture's write-behind has read its pieces: their storage is recycled only then);
// the capture times after the first (recycled storage) go to `recycled`. Returns the kept
// entry's id.
absl::StatusOr<uint64_t> CaptureEntry(Daemon& daemon, const std::vector<int32_t>& ids,
                                      int captures, Samples* recycled) {
  SessionOptions session_options;
  session_options.capacity = ids.size();
  ASSIGN_OR_RETURN(std::unique_ptr<Session> source,
                   daemon.client->CreateSession(daemon.plan, session_options));
  RETURN_IF_ERROR(FillSession(*source, ids));
  uint64_t entry_id = 0;
  for (int rep = 0; rep < captures; ++rep) {
    if (entry_id != 0) {
      RETURN_IF_ERROR(AwaitWriteBehind(daemon));
      RETURN_IF_ERROR(Evict(daemon, entry_id));
    }
    const int64_t start = NowNs();
    ASSIGN_OR_RETURN(PrefixCaptured captured,
                     daemon.client->prefixes().Capture(*source, ids, ids.size()));
    if (rep > 0 && recycled != nullptr) recycled->Add(NowNs() - start);
    entry_id = captured.entry_id;
  }
  RETURN_IF_ERROR(source->Release().status());
  return entry_id;
}

// Lookup (which must report `medium`) + timed Restore into one recycled session, `reps` times
// after `warmups` untimed ones; `between` runs after each restore (untimed).
absl::Status TimeRestores(Daemon& daemon, const std::vector<int32_t>& ids, StorageMedium medium,
                          int warmups, int reps, Samples& restores,
                          const std::function<absl::Status()>& between) {
  SessionOptions session_options;
  session_options.capacity = ids.size();
  ASSIGN_OR_RETURN(std::unique_ptr<Session> slot,
                   daemon.client->CreateSession(daemon.plan, session_options));
  for (int rep = 0; rep < warmups + reps; ++rep) {
    ASSIGN_OR_RETURN(PrefixMatch found,
                     daemon.client->prefixes().Lookup(daemon.plan, session_options, ids));
    if (found.outcome != LookupOutcome::kHit || found.medium != medium) {
      return absl::InternalError(absl::StrCat(
          "lookup of ", ids.size(), " tokens: outcome ", static_cast<int>(found.outcome),
          ", medium ", std::string(StorageMediumName(found.medium)), ", wanted ",
          std::string(StorageMediumName(medium))));
    }
    const int64_t start = NowNs();
    ASSIGN_OR_RETURN(PrefixRestored restored,
                     daemon.client->prefixes().Restore(*slot, ids, found.entry_id));
    const int64_t elapsed = NowNs() - start;
    if (restored.restored_tokens != ids.size()) {
      return absl::InternalError(absl::StrCat("restored ", restored.restored_tokens, " of ",
                                              ids.size(), " tokens"));
    }
    if (rep >= warmups) restores.Add(elapsed);
    RETURN_IF_ERROR(slot->Reset().status());
    if (between) RETURN_IF_ERROR(between());
  }
  return slot->Release().status();
}

}  // namespace

absl::StatusOr<Json> RunPrefixTiers(const BenchOptions& options) {
  std::printf("\n== 7. prefix restore by tier (device, disk, Redis Cluster) and capture\n");
  const ModelPlan model = DenseModel();
  const uint64_t tokens = options.quick ? 2 * kBlockTokens : 32768;
  const int reps = options.quick ? 1 : 5;
  const std::vector<int32_t> ids = TokenIds(tokens, 7);
  SessionShape request;
  request.capacity = tokens;
  ASSIGN_OR_RETURN(const uint64_t session_bytes,
                   SessionArenaBytes(model, FormatDefaults(), request,
                                     {.granularity = static_cast<uint64_t>(getpagesize())}));
  const uint64_t cache_budget = session_bytes + (64ull << 20);
  const uint64_t daemon_budget = 3 * session_bytes + cache_budget + (256ull << 20);

  ASSIGN_OR_RETURN(BenchCluster cluster, StartCluster(options));
  const std::vector<std::string> remote_flags = {
      "--prefix_remote_redis_nodes=" + cluster.NodeList(),
      "--prefix_remote_lookup_timeout_ms=5000", "--prefix_remote_fetch_timeout_ms=120000",
      "--prefix_remote_redis_timeout_ms=5000",
      absl::StrCat("--prefix_remote_queue_bytes=", 2 * session_bytes)};

  // Device (and the write-behind that feeds the remote tier): daemon A.
  std::vector<std::string> a_flags = remote_flags;
  a_flags.push_back(absl::StrCat("--prefix_cache_budget_bytes=", cache_budget));
  ASSIGN_OR_RETURN(Daemon a, StartDaemon(options, daemon_budget, a_flags, model));
  Samples capture, capture_remote, device, disk, remote, copy, get;
  ASSIGN_OR_RETURN(const uint64_t entry_id,
                   CaptureEntry(a, ids, std::max(reps, 3) + 1, &capture_remote));
  pb::InspectPrefixRequest inspect;
  inspect.set_entry_id(entry_id);
  pb::PrefixEntry entry;
  RETURN_IF_ERROR(FromGrpcStatus(ClientInternals::Prefix(*a.operator_client)
                                     .InspectPrefix(PrefixContext().get(), inspect, &entry)));
  const uint64_t bytes = entry.block_bytes() + entry.boundary_bytes();
  RETURN_IF_ERROR(AwaitWriteBehind(a));
  {
    ASSIGN_OR_RETURN(pb::ListPrefixesResponse listed, List(a));
    if (listed.stats().remote().writes() == 0) {
      return absl::InternalError("daemon A wrote nothing to the remote tier");
    }
  }
  RETURN_IF_ERROR(TimeRestores(a, ids, StorageMedium::kDevice, 3, reps, device, nullptr));
  RETURN_IF_ERROR(StopDaemon(a));

  // Capture without a remote tier: daemon C.
  {
    ASSIGN_OR_RETURN(Daemon c, StartDaemon(options, daemon_budget,
                                           {absl::StrCat("--prefix_cache_budget_bytes=",
                                                         cache_budget)},
                                           model));
    RETURN_IF_ERROR(CaptureEntry(c, ids, std::max(reps, 3) + 1, &capture).status());
    RETURN_IF_ERROR(StopDaemon(c));
  }

  // Disk: daemon D, 1 MiB of device tier.
  {
    ASSIGN_OR_RETURN(TempDir disk_dir, TempDir::Create("memra-tiers-disk"));
    ASSIGN_OR_RETURN(
        Daemon d, StartDaemon(options, daemon_budget,
                              {"--prefix_cache_budget_bytes=1MiB", "--prefix_slab_bytes=1MiB",
                               "--prefix_disk_dir=" + disk_dir.path() + "/tier",
                               absl::StrCat("--prefix_disk_bytes=", 2 * session_bytes)},
                              model));
    RETURN_IF_ERROR(CaptureEntry(d, ids, 1, nullptr).status());
    RETURN_IF_ERROR(TimeRestores(d, ids, StorageMedium::kDisk, 1, reps, disk, nullptr));
    RETURN_IF_ERROR(StopDaemon(d));
  }

  // Remote: daemon B pulls what A wrote; its copy is evicted after each restore.
  {
    std::vector<std::string> b_flags = remote_flags;
    b_flags.push_back(absl::StrCat("--prefix_cache_budget_bytes=", cache_budget));
    ASSIGN_OR_RETURN(Daemon b, StartDaemon(options, daemon_budget, b_flags, model));
    auto evict_all = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(pb::ListPrefixesResponse listed, List(b));
      for (const pb::PrefixEntry& pulled : listed.entries()) {
        RETURN_IF_ERROR(Evict(b, pulled.entry_id()));
      }
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(TimeRestores(b, ids, StorageMedium::kRemote, 1, reps, remote, evict_all));
    ASSIGN_OR_RETURN(pb::ListPrefixesResponse listed, List(b));
    if (listed.stats().remote().corrupt() != 0 ||
        listed.stats().remote().hits() != static_cast<uint64_t>(reps + 1)) {
      return absl::InternalError(absl::StrCat("daemon B pulled ", listed.stats().remote().hits(),
                                              " times, refused ",
                                              listed.stats().remote().corrupt(), " values"));
    }
    RETURN_IF_ERROR(StopDaemon(b));
  }

  // Baselines, same run: memcpy of the entry's bytes; plain GETs of its values, one by one.
  std::vector<uint8_t> src(bytes, 0x5a), dst(bytes, 0);
  std::memcpy(dst.data(), src.data(), bytes);
  for (int rep = 0; rep < std::max(reps, 3); ++rep) {
    const int64_t start = NowNs();
    std::memcpy(dst.data(), src.data(), bytes);
    copy.Add(NowNs() - start);
    KeepAlive(dst[bytes - 1]);
  }
  std::vector<std::string> keys;
  for (const int port : cluster.ports) {
    ASSIGN_OR_RETURN(std::string listed, NodeCommand(port, {"KEYS", "memra-kv/*"}));
    for (absl::string_view key : absl::StrSplit(listed, '\n', absl::SkipEmpty())) {
      keys.emplace_back(key);
    }
  }
  RedisClusterOptions client_options;
  ASSIGN_OR_RETURN(client_options.seed_nodes, ParseRedisNodeList(cluster.NodeList()));
  client_options.command_timeout = absl::Seconds(5);
  ASSIGN_OR_RETURN(std::unique_ptr<RedisClusterClient> redis,
                   RedisClusterClient::Create(client_options));
  uint64_t got_bytes = 0;
  for (int rep = 0; rep < std::max(reps, 3); ++rep) {
    got_bytes = 0;
    const int64_t start = NowNs();
    for (const std::string& key : keys) {
      ASSIGN_OR_RETURN(std::optional<std::string> value, redis->Get(key));
      if (!value.has_value()) return absl::InternalError(absl::StrCat("GET ", key, ": absent"));
      got_bytes += value->size();
    }
    get.Add(NowNs() - start);
  }

  const double copy_gbps = GBps(bytes, copy.P50());
  const double get_gbps = GBps(got_bytes, get.P50());
  Json rows = Json::array();
  Table table({"tier", "restore GB/s p50", "min", "max", "restore/memcpy", "restore/GET"});
  for (const auto& [tier, samples] : std::vector<std::pair<std::string, const Samples*>>{
           {"device", &device}, {"disk", &disk}, {"remote", &remote}}) {
    const double p50 = GBps(bytes, samples->P50());
    const double slowest = GBps(bytes, samples->Percentile(100));
    const double fastest = GBps(bytes, samples->Percentile(0));
    rows.push_back(Json{{"tier", tier},
                        {"restore", samples->ToJson()},
                        {"restore_gbps_p50", p50},
                        {"restore_gbps_min", slowest},
                        {"restore_gbps_max", fastest},
                        {"ratio_restore_memcpy_bandwidth", p50 / copy_gbps},
                        {"ratio_restore_redis_get_bandwidth", p50 / get_gbps}});
    table.Add({tier, Fixed(p50, 2), Fixed(slowest, 2), Fixed(fastest, 2),
               Ratio(p50 / copy_gbps), Ratio(p50 / get_gbps)});
  }
  const double capture_gbps = GBps(bytes, capture.P50());
  const double capture_remote_gbps = GBps(bytes, capture_remote.P50());
  table.Add({"capture (recycled)", Fixed(capture_gbps, 2),
             Fixed(GBps(bytes, capture.Percentile(100)), 2),
             Fixed(GBps(bytes, capture.Percentile(0)), 2), Ratio(capture_gbps / copy_gbps), "-"});
  table.Add({"capture + remote queue", Fixed(capture_remote_gbps, 2),
             Fixed(GBps(bytes, capture_remote.Percentile(100)), 2),
             Fixed(GBps(bytes, capture_remote.Percentile(0)), 2),
             Ratio(capture_remote_gbps / copy_gbps), "-"});
  table.Add({"memcpy", Fixed(copy_gbps, 2), "-", "-", "1.00x", "-"});
  table.Add({"plain GET", Fixed(get_gbps, 2), "-", "-", Ratio(get_gbps / copy_gbps), "1.00x"});
  table.Print(absl::StrCat("7. restore of a ", tokens / 1024, "k-token dense entry (", bytes,
                           " bytes, ", keys.size(), " remote values) by tier, into a recycled "
                           "session; capture into recycled storage"));
  return Json{{"tokens", tokens},
              {"bytes", bytes},
              {"block_tokens", kBlockTokens},
              {"remote_values", keys.size()},
              {"tiers", rows},
              {"capture_recycled", capture.ToJson()},
              {"capture_recycled_gbps_p50", capture_gbps},
              {"ratio_capture_memcpy_bandwidth", capture_gbps / copy_gbps},
              {"capture_recycled_with_remote_tier", capture_remote.ToJson()},
              {"capture_recycled_with_remote_tier_gbps_p50", capture_remote_gbps},
              {"ratio_capture_with_remote_tier_memcpy_bandwidth",
               capture_remote_gbps / copy_gbps},
              {"memcpy", copy.ToJson()},
              {"memcpy_gbps_p50", copy_gbps},
              {"redis_get", get.ToJson()},
              {"redis_get_gbps_p50", get_gbps},
              {"note", "restore = the Restore RPC (lookup excluded) into a recycled session; disk "
                       "restores include the demotion back to disk at unpin; remote restores "
                       "pull every block (GET, verify, copy into slabs) before the restore; "
                       "plain GET = the same values GET one by one through one cluster client "
                       "(no verification, no copy)"}};
}

}  // namespace memra::bench
