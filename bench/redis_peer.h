#ifndef MEMRA_BENCH_REDIS_PEER_H_
#define MEMRA_BENCH_REDIS_PEER_H_

// The Redis peer the benchmark compares memra-kvd with (LMCache's remote tier): a redis-server
// started on loopback with persistence off (what the tier measures is memory, not disk), and
// one connection to it. Sections 3 (prefix_redis.cc) and 7 (block_store_bench.cc) use it.

#include <hiredis/hiredis.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/harness.h"
#include "bench/kvd.h"

namespace memra::bench {

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

// The server is stopped with this object (and killed with the benchmark: PR_SET_PDEATHSIG).
class RedisPeer {
 public:
  static absl::StatusOr<std::unique_ptr<RedisPeer>> Start(const BenchOptions& options);
  redisContext* connection() const { return connection_.get(); }
  const std::string& version() const { return version_; }

 private:
  RedisPeer(TempDir dir, ChildProcess server, RedisConnection connection, std::string version)
      : dir_(std::move(dir)),
        server_(std::move(server)),
        connection_(std::move(connection)),
        version_(std::move(version)) {}

  TempDir dir_;
  ChildProcess server_;
  RedisConnection connection_;
  std::string version_;
};

}  // namespace memra::bench

#endif  // MEMRA_BENCH_REDIS_PEER_H_
