// Section 3: prefix restore/capture, and the peer a user would pick today for an out-of-process
// KV store: Redis (LMCache's remote tier), started here on loopback.
//
// Restore/capture through memra-kvd is NOT measured yet: the daemon has no prefix-cache RPCs
// (another change builds them). The Redis side runs now so the comparison is ready: SET and
// GET of entries of a dense model's 1k / 32k / 128k tokens, in chunks of 256 tokens (LMCache's
// default chunk: one key per chunk), against memcpy of the same bytes in this process. Entry
// bytes are the session arena bytes of that context (core/admission.h SessionArenaBytes).

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/sections.h"
#include "core/admission.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"

namespace memra::bench {
namespace {

constexpr uint64_t kChunkTokens = 256;

struct EntrySize {
  uint64_t tokens;
  int reps;
};
constexpr EntrySize kEntries[] = {{1024, 10}, {32768, 3}, {131072, 2}};

// A dense model small enough that a 128k-token entry, its copy in Redis and the buffers on
// this side fit this machine: Llama-3.2-1B's geometry (16 layers, 8 KV heads of 64).
ModelPlan DenseModel() {
  ModelPlan plan = test_plans::DenseModel(16, 64, 8);
  plan.name = "llama-3.2-1b";
  return plan;
}

struct RedisDeleter {
  void operator()(redisContext* context) const { redisFree(context); }
};
using RedisConnection = std::unique_ptr<redisContext, RedisDeleter>;

struct ReplyDeleter {
  void operator()(redisReply* reply) const { freeReplyObject(reply); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// One command; UNAVAILABLE when the connection failed, INTERNAL for an error reply.
template <typename... Args>
absl::StatusOr<Reply> Command(redisContext* redis, const char* format, Args... args) {
  Reply reply(static_cast<redisReply*>(redisCommand(redis, format, args...)));
  if (reply == nullptr) return absl::UnavailableError(absl::StrCat("redis: ", redis->errstr));
  if (reply->type == REDIS_REPLY_ERROR) {
    return absl::InternalError(absl::StrCat("redis: ", std::string(reply->str, reply->len)));
  }
  return reply;
}

absl::StatusOr<RedisConnection> ConnectRedis(int port, ChildProcess& server) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (true) {
    RedisConnection redis(redisConnectWithTimeout("127.0.0.1", port, timeval{1, 0}));
    if (redis != nullptr && redis->err == 0 && Command(redis.get(), "PING").ok()) return redis;
    if (!server.Alive()) return absl::UnavailableError("redis-server exited at start-up");
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(absl::StrCat("redis-server not answering on port ", port));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

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

}  // namespace

absl::StatusOr<Json> RunPrefixAndRedis(const BenchOptions& options) {
  Json json;
  json["prefix_restore_capture"] =
      Json{{"status", "not measured - needs the prefix cache RPCs (capture, lookup, restore)"}};
  std::printf("\n== 3. prefix restore/capture: not measured - needs the prefix cache RPCs\n");

  const ModelPlan model = DenseModel();
  std::vector<std::pair<EntrySize, uint64_t>> entries;  // size, bytes
  for (const EntrySize& size : kEntries) {
    if (size.tokens > options.redis_max_tokens) continue;
    SessionRequest request;
    request.capacity = size.tokens;
    ASSIGN_OR_RETURN(uint64_t bytes,
                     SessionArenaBytes(model, FormatDefaults(), request,
                                       {.granularity = static_cast<uint64_t>(getpagesize())}));
    entries.push_back({size, bytes});
  }
  if (entries.empty()) return absl::InvalidArgumentError("--redis_max_tokens excludes every size");
  uint64_t max_bytes = 0;
  for (const auto& entry : entries) max_bytes = std::max(max_bytes, entry.second);

  ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("memra-redis"));
  ASSIGN_OR_RETURN(int port, FreeTcpPort());
  // Persistence off: what LMCache's remote tier measures is memory, not disk.
  ASSIGN_OR_RETURN(ChildProcess server,
                   ChildProcess::Spawn({options.redis_binary, "--port", absl::StrCat(port),
                                        "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                        "--dir", dir.path(), "--loglevel", "warning"},
                                       dir.File("redis.log")));
  // `server` is stopped on every path out of this function (~ChildProcess), and killed with the
  // benchmark if it dies (PR_SET_PDEATHSIG).
  ASSIGN_OR_RETURN(RedisConnection redis, ConnectRedis(port, server));
  ASSIGN_OR_RETURN(Reply info, Command(redis.get(), "INFO server"));
  std::string version = "unknown";
  if (info->type == REDIS_REPLY_STRING) {
    const std::string text(info->str, info->len);
    const size_t at = text.find("redis_version:");
    if (at != std::string::npos) version = text.substr(at + 14, text.find('\r', at) - at - 14);
  }

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
    ASSIGN_OR_RETURN(EntryResult r, MeasureEntry(redis.get(), size, bytes, reps, src, dst));
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
    table.Add({absl::StrCat(r.tokens / 1024, "k tokens"), absl::StrCat(r.bytes),
               absl::StrCat(r.chunks), Fixed(set, 2), Fixed(get, 2), Fixed(copy, 2),
               Ratio(copy / get)});
  }
  json["redis"] = Json{{"version", version},
                       {"model", "llama-3.2-1b geometry (16 layers, 8 KV heads of 64), formats "
                                 "q8_0 K / q5_1 V"},
                       {"chunk_tokens", kChunkTokens},
                       {"entries", rows}};
  table.Print(absl::StrCat("3b. Redis ", version,
                           " peer on loopback (SET/GET in 256-token chunks) vs memcpy"));
  return json;
}

}  // namespace memra::bench
