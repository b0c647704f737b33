#include "bench/redis_peer.h"

#include <sys/time.h>

#include "absl/time/clock.h"
#include "core/status_macros.h"

namespace memra::bench {
namespace {

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

}  // namespace

absl::StatusOr<std::unique_ptr<RedisPeer>> RedisPeer::Start(const BenchOptions& options) {
  ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("memra-redis"));
  ASSIGN_OR_RETURN(int port, FreeTcpPort());
  ASSIGN_OR_RETURN(ChildProcess server,
                   ChildProcess::Spawn({options.redis_binary, "--port", absl::StrCat(port),
                                        "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                        "--dir", dir.path(), "--loglevel", "warning"},
                                       dir.File("redis.log")));
  ASSIGN_OR_RETURN(RedisConnection redis, ConnectRedis(port, server));
  ASSIGN_OR_RETURN(Reply info, Command(redis.get(), "INFO server"));
  std::string version = "unknown";
  if (info->type == REDIS_REPLY_STRING) {
    const std::string text(info->str, info->len);
    const size_t at = text.find("redis_version:");
    if (at != std::string::npos) version = text.substr(at + 14, text.find('\r', at) - at - 14);
  }
  return std::unique_ptr<RedisPeer>(
      new RedisPeer(std::move(dir), std::move(server), std::move(redis), std::move(version)));
}

}  // namespace memra::bench
