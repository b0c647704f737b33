#include "server/store/remote/redis_cluster.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status_macros.h"

namespace memra {
namespace {

// A password is a line, not a file's worth of bytes: anything longer is the wrong file.
constexpr size_t kMaxPasswordBytes = 4096;
// A TRYAGAIN reply (a slot mid-migration) is retried after this pause, within max_redirects.
constexpr absl::Duration kTryAgainPause = absl::Milliseconds(10);

std::string Where(const std::string& node, std::optional<uint16_t> slot) {
  return slot.has_value() ? absl::StrCat("node ", node, ", slot ", *slot)
                          : absl::StrCat("node ", node);
}

// A failed hiredis context (connect or command) as a Status. hiredis 0.14 reports both kinds
// of timeout as REDIS_ERR_IO with strerror's text: ETIMEDOUT for connect, EAGAIN for a read or
// write past SO_RCVTIMEO / SO_SNDTIMEO.
absl::Status ContextStatus(const redisContext& context, absl::string_view operation,
                           const std::string& where, absl::Duration timeout) {
  const std::string what(context.errstr);
  if (context.err == REDIS_ERR_IO &&
      (what == std::strerror(EAGAIN) || what == std::strerror(ETIMEDOUT) ||
       what == std::strerror(EWOULDBLOCK))) {
    return absl::DeadlineExceededError(
        absl::StrCat("redis cluster ", operation, ": ", where, ": timed out after ",
                     absl::ToInt64Milliseconds(timeout), " ms (", what, ")"));
  }
  const std::string message = absl::StrCat("redis cluster ", operation, ": ", where, ": ", what);
  switch (context.err) {
    case REDIS_ERR_PROTOCOL:
      return absl::InternalError(absl::StrCat(message, " (protocol error)"));
    case REDIS_ERR_OOM:
      return absl::ResourceExhaustedError(message);
    default:  // REDIS_ERR_IO, REDIS_ERR_EOF, REDIS_ERR_OTHER (name resolution)
      return absl::UnavailableError(message);
  }
}

bool IsRedirect(absl::string_view error) {
  return absl::StartsWith(error, "MOVED ") || absl::StartsWith(error, "ASK ") ||
         absl::StartsWith(error, "TRYAGAIN");
}

// An error reply that is not a redirect.
absl::Status ErrorReplyStatus(absl::string_view operation, const std::string& where,
                              absl::string_view error) {
  const std::string message =
      absl::StrCat("redis cluster ", operation, ": ", where, " replied: ", error);
  if (absl::StartsWith(error, "CLUSTERDOWN") || absl::StartsWith(error, "LOADING") ||
      absl::StartsWith(error, "MASTERDOWN") || absl::StartsWith(error, "TRYAGAIN")) {
    return absl::UnavailableError(message);
  }
  if (absl::StartsWith(error, "NOAUTH") || absl::StartsWith(error, "WRONGPASS")) {
    return absl::UnauthenticatedError(message);
  }
  if (absl::StartsWith(error, "NOPERM")) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

// "<host>:<port>" as Redis writes it in MOVED / ASK / CLUSTER SLOTS (IPv6 unbracketed; an empty
// host means "the node you asked").
absl::StatusOr<RedisNodeAddress> ParseEndpoint(absl::string_view endpoint,
                                               absl::string_view asked_host) {
  const size_t colon = endpoint.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(endpoint.substr(colon + 1), &port) ||
      port <= 0 || port > 65535) {
    return absl::InternalError(absl::StrCat("endpoint '", endpoint, "' is not host:port"));
  }
  std::string host(endpoint.substr(0, colon));
  if (host.empty() || host == "?") host = std::string(asked_host);
  return RedisNodeAddress{std::move(host), port};
}

absl::string_view ReplyText(const redisReply& reply) { return {reply.str, reply.len}; }

// Marks a refusal made without I/O because the node is in back-off (the payload's value is
// unused; its presence is the mark).
constexpr char kNodeDownPayload[] = "memra.kv/redis-node-in-back-off";

}  // namespace

bool IsRedisNodeDownRefusal(const absl::Status& status) {
  return status.GetPayload(kNodeDownPayload).has_value();
}

namespace {

absl::Status MarkedRefusal(std::string message) {
  absl::Status refused = absl::UnavailableError(std::move(message));
  refused.SetPayload(kNodeDownPayload, absl::Cord());
  return refused;
}

// `call`, unless it is a back-off refusal and `refreshed` (the same call's map refresh) failed
// for real: then that failure, the I/O this call did.
absl::Status PreferRealFailure(absl::Status call, const absl::Status& refreshed) {
  if (IsRedisNodeDownRefusal(call) && !refreshed.ok() && !IsRedisNodeDownRefusal(refreshed)) {
    return refreshed;
  }
  return call;
}

}  // namespace

absl::string_view RedisTlsUnsupportedReason() {
  return "this build's Redis client is Debian's hiredis 0.14, which has no TLS (hiredis_ssl "
         "arrived in hiredis 1.0); refusing rather than sending KV bytes and the password in "
         "the clear. Reach the cluster over a private network or a local TLS tunnel (stunnel, "
         "spiped) and turn the TLS setting off";
}

uint16_t RedisKeySlot(absl::string_view key) {
  const size_t open = key.find('{');
  if (open != absl::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != absl::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  uint16_t crc = 0;  // CRC16-CCITT (XMODEM): polynomial 0x1021, initial 0, no reflection
  for (const char c : key) {
    crc ^= static_cast<uint16_t>(static_cast<uint8_t>(c)) << 8;
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                                : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc % kRedisClusterSlots;
}

std::string RedisNodeAddress::ToString() const {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

absl::StatusOr<std::vector<RedisNodeAddress>> ParseRedisNodeList(absl::string_view list) {
  std::vector<RedisNodeAddress> nodes;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    const auto refuse = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("redis node list '", list, "': entry '",
                                                     entry, "' ", why,
                                                     " (expected host:port or [v6]:port)"));
    };
    if (entry.empty()) return refuse("is empty");
    absl::string_view host;
    absl::string_view port_text;
    if (entry.front() == '[') {
      const size_t close = entry.find("]:");
      if (close == absl::string_view::npos) return refuse("has no ]:port");
      host = entry.substr(1, close - 1);
      port_text = entry.substr(close + 2);
    } else {
      const size_t colon = entry.rfind(':');
      if (colon == absl::string_view::npos) return refuse("has no port");
      host = entry.substr(0, colon);
      port_text = entry.substr(colon + 1);
    }
    int port = 0;
    if (host.empty()) return refuse("has no host");
    if (!absl::SimpleAtoi(port_text, &port) || port <= 0 || port > 65535) {
      return refuse("has a port outside 1..65535");
    }
    nodes.push_back({std::string(host), port});
  }
  return nodes;
}

RedisClusterClient::Node::~Node() {
  if (context != nullptr) redisFree(context);
}

void RedisClusterClient::ReplyDeleter::operator()(redisReply* reply) const {
  freeReplyObject(reply);
}

absl::StatusOr<std::unique_ptr<RedisClusterClient>> RedisClusterClient::Create(
    RedisClusterOptions options) {
  if (options.tls) {
    return absl::UnimplementedError(
        absl::StrCat("redis cluster: TLS was asked for: ", RedisTlsUnsupportedReason()));
  }
  if (options.seed_nodes.empty()) {
    return absl::InvalidArgumentError("redis cluster: no seed nodes given");
  }
  if (options.connect_timeout <= absl::ZeroDuration() ||
      options.command_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("redis cluster: timeouts must be positive (connect ",
                     absl::FormatDuration(options.connect_timeout), ", command ",
                     absl::FormatDuration(options.command_timeout), ")"));
  }
  if (options.node_retry_initial <= absl::ZeroDuration() ||
      options.node_retry_max < options.node_retry_initial) {
    return absl::InvalidArgumentError(absl::StrCat(
        "redis cluster: node back-off ", absl::FormatDuration(options.node_retry_initial),
        " to ", absl::FormatDuration(options.node_retry_max), " must be positive and not shrink"));
  }
  if (options.max_redirects < 0) {
    return absl::InvalidArgumentError(absl::StrCat("redis cluster: max_redirects ",
                                                   options.max_redirects, " is negative"));
  }
  if (!options.user.empty() && options.password_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "redis cluster: user '", options.user, "' given without a password file"));
  }
  std::string password;
  if (!options.password_file.empty()) {
    std::ifstream file(options.password_file, std::ios::binary);
    if (!file) {
      return absl::FailedPreconditionError(
          absl::StrCat("redis cluster: cannot open the password file ", options.password_file,
                       ": ", std::strerror(errno)));
    }
    std::ostringstream contents;
    contents << file.rdbuf();
    password = contents.str();
    if (absl::EndsWith(password, "\n")) password.pop_back();
    if (absl::EndsWith(password, "\r")) password.pop_back();
    if (password.empty() || password.size() > kMaxPasswordBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("redis cluster: the password file ", options.password_file, " holds ",
                       password.size(), " bytes; a password of 1..", kMaxPasswordBytes,
                       " bytes is expected"));
    }
  }
  std::unique_ptr<RedisClusterClient> client(
      new RedisClusterClient(std::move(options), std::move(password)));
  RETURN_IF_ERROR(client->RefreshSlotMap());
  return client;
}

RedisClusterClient::RedisClusterClient(RedisClusterOptions options, std::string password)
    : options_(std::move(options)), password_(std::move(password)) {
  absl::MutexLock lock(&mu_);
  slot_owner_.resize(kRedisClusterSlots);
  for (const RedisNodeAddress& seed : options_.seed_nodes) {
    auto node = std::make_shared<Node>(seed);
    nodes_.emplace(node->name, std::move(node));
  }
}

RedisClusterClient::~RedisClusterClient() = default;

absl::StatusOr<std::optional<std::string>> RedisClusterClient::Get(absl::string_view key) {
  ASSIGN_OR_RETURN(ReplyPtr reply, Execute("GET", key, {"GET", key}));
  if (reply->type == REDIS_REPLY_NIL) return std::nullopt;
  if (reply->type != REDIS_REPLY_STRING) {
    return absl::InternalError(absl::StrCat("redis cluster GET: slot ", RedisKeySlot(key),
                                            ": reply of type ", reply->type,
                                            ", expected a bulk string or nil"));
  }
  return std::string(ReplyText(*reply));
}

absl::Status RedisClusterClient::Set(absl::string_view key, absl::string_view value,
                                     absl::Duration ttl) {
  std::string ttl_ms;
  std::vector<absl::string_view> argv = {"SET", key, value};
  if (ttl > absl::ZeroDuration()) {
    ttl_ms = absl::StrCat(absl::ToInt64Milliseconds(absl::Ceil(ttl, absl::Milliseconds(1))));
    argv.push_back("PX");
    argv.push_back(ttl_ms);
  }
  ASSIGN_OR_RETURN(ReplyPtr reply, Execute("SET", key, std::move(argv)));
  if (reply->type != REDIS_REPLY_STATUS || ReplyText(*reply) != "OK") {
    return absl::InternalError(absl::StrCat("redis cluster SET: slot ", RedisKeySlot(key),
                                            ": reply of type ", reply->type,
                                            ", expected +OK"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> RedisClusterClient::Del(absl::string_view key) {
  ASSIGN_OR_RETURN(ReplyPtr reply, Execute("DEL", key, {"DEL", key}));
  if (reply->type != REDIS_REPLY_INTEGER) {
    return absl::InternalError(absl::StrCat("redis cluster DEL: slot ", RedisKeySlot(key),
                                            ": reply of type ", reply->type,
                                            ", expected an integer"));
  }
  return reply->integer > 0;
}

RedisExistsResult RedisClusterClient::ExistsEach(absl::Span<const std::string> keys) {
  RedisExistsResult result;
  result.exists.resize(keys.size());
  // The first failure that did I/O wins over a back-off refusal, whatever came first.
  const auto unanswered = [&result](absl::Status why) {
    if (result.unanswered++ == 0 || (IsRedisNodeDownRefusal(result.first_failure) &&
                                     !IsRedisNodeDownRefusal(why))) {
      result.first_failure = std::move(why);
    }
  };
  const absl::Status refreshed = RefreshIfStale();
  struct Group {
    std::shared_ptr<Node> node;
    std::vector<size_t> key_indexes;
  };
  absl::flat_hash_map<std::string, Group> groups;
  for (size_t i = 0; i < keys.size(); ++i) {
    const uint16_t slot = RedisKeySlot(keys[i]);
    std::shared_ptr<Node> node = NodeForKeySlot(slot);
    if (node == nullptr) {
      unanswered(refreshed.ok() ? absl::UnavailableError(absl::StrCat(
                                      "redis cluster EXISTS: no node owns slot ", slot,
                                      " (key ", i, ")"))
                                : refreshed);
      continue;
    }
    Group& group = groups[node->name];
    group.node = std::move(node);
    group.key_indexes.push_back(i);
  }
  for (auto& [name, group] : groups) {
    std::vector<std::vector<absl::string_view>> commands;
    commands.reserve(group.key_indexes.size());
    for (const size_t i : group.key_indexes) commands.push_back({"EXISTS", keys[i]});
    absl::StatusOr<std::vector<ReplyPtr>> replies =
        RunOnNode(*group.node, "EXISTS", std::nullopt, commands);
    if (!replies.ok()) {
      for (size_t j = 0; j < group.key_indexes.size(); ++j) unanswered(replies.status());
      continue;
    }
    for (size_t j = 0; j < replies->size(); ++j) {
      const size_t i = group.key_indexes[j];
      ReplyPtr reply = std::move((*replies)[j]);
      if (reply->type == REDIS_REPLY_ERROR) {
        if (!IsRedirect(ReplyText(*reply))) {
          unanswered(ErrorReplyStatus("EXISTS", Where(name, RedisKeySlot(keys[i])),
                                      ReplyText(*reply)));
          continue;
        }
        absl::StatusOr<ReplyPtr> redirected = Execute("EXISTS", keys[i], {"EXISTS", keys[i]});
        if (!redirected.ok()) {
          unanswered(redirected.status());
          continue;
        }
        reply = *std::move(redirected);
      }
      if (reply->type != REDIS_REPLY_INTEGER) {
        unanswered(absl::InternalError(absl::StrCat("redis cluster EXISTS: ",
                                                    Where(name, RedisKeySlot(keys[i])),
                                                    ": reply of type ", reply->type,
                                                    ", expected an integer")));
        continue;
      }
      result.exists[i] = reply->integer > 0;
    }
  }
  if (result.unanswered > 0) {
    result.first_failure = PreferRealFailure(std::move(result.first_failure), refreshed);
  }
  return result;
}

absl::StatusOr<RedisClusterClient::ReplyPtr> RedisClusterClient::Execute(
    absl::string_view operation, absl::string_view key, std::vector<absl::string_view> argv) {
  const absl::Status refreshed = RefreshIfStale();
  const uint16_t slot = RedisKeySlot(key);
  Target target{NodeForKeySlot(slot), false};
  if (target.node == nullptr) {
    if (!refreshed.ok()) return refreshed;
    return absl::UnavailableError(
        absl::StrCat("redis cluster ", operation, ": no node owns slot ", slot));
  }
  for (int redirects = 0;;) {
    std::vector<std::vector<absl::string_view>> commands;
    if (target.asking) commands.push_back({"ASKING"});
    commands.push_back(argv);
    absl::StatusOr<std::vector<ReplyPtr>> replies =
        RunOnNode(*target.node, operation, slot, commands);
    if (!replies.ok()) return PreferRealFailure(replies.status(), refreshed);
    ReplyPtr reply = std::move(replies->back());
    if (reply->type != REDIS_REPLY_ERROR) return reply;
    const absl::string_view error = ReplyText(*reply);
    if (!IsRedirect(error)) {
      return ErrorReplyStatus(operation, Where(target.node->name, slot), error);
    }
    if (++redirects > options_.max_redirects) {
      return absl::UnavailableError(absl::StrCat(
          "redis cluster ", operation, ": ", Where(target.node->name, slot), ": gave up after ",
          options_.max_redirects, " redirects (last reply: ", error, ")"));
    }
    if (absl::StartsWith(error, "TRYAGAIN")) {
      absl::SleepFor(kTryAgainPause);
      continue;
    }
    // "MOVED <slot> <endpoint>" / "ASK <slot> <endpoint>"
    const std::vector<absl::string_view> words = absl::StrSplit(error, ' ');
    absl::StatusOr<RedisNodeAddress> address =
        words.size() == 3 ? ParseEndpoint(words[2], target.node->address.host)
                          : absl::InternalError("not three words");
    if (!address.ok()) {
      return absl::InternalError(absl::StrCat("redis cluster ", operation, ": ",
                                              Where(target.node->name, slot),
                                              ": malformed redirect '", error,
                                              "': ", address.status().message()));
    }
    std::shared_ptr<Node> next = NodeFor(*address);
    if (absl::StartsWith(error, "MOVED ")) {
      // The slot has a new owner: send it there now, and refresh the whole map before the
      // next call (a reshard or failover usually moved more than this one slot).
      absl::MutexLock lock(&mu_);
      slot_owner_[slot] = next->name;
      slot_map_stale_ = true;
      ++stats_.moved_redirects;
      target = {std::move(next), false};
    } else {
      // Mid-migration: only this command goes to the importing node; the map stays.
      absl::MutexLock lock(&mu_);
      ++stats_.ask_redirects;
      target = {std::move(next), true};
    }
  }
}

absl::Status RedisClusterClient::BackOffRefusal(const Node& node, absl::string_view operation,
                                                std::optional<uint16_t> slot,
                                                absl::string_view why) {
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    ++stats_.node_down_refusals;
    if (now - last_refresh_ >= kDownNodeRefreshInterval) slot_map_stale_ = true;
  }
  return MarkedRefusal(
      absl::StrCat("redis cluster ", operation, ": ", Where(node.name, slot), ": ", why));
}

absl::StatusOr<std::vector<RedisClusterClient::ReplyPtr>> RedisClusterClient::RunOnNode(
    Node& node, absl::string_view operation, std::optional<uint16_t> slot,
    const std::vector<std::vector<absl::string_view>>& commands) {
  // A call in flight on a node whose last call failed is that node's one retry: wait for
  // nothing (a stalled node would hold every queued caller for its whole timeout). A caller
  // that races past this check queues as any caller of a busy node does.
  if (!node.answered.load() && node.in_flight.load()) {
    return BackOffRefusal(node, operation, slot,
                          "its last call failed and its one retry is in flight");
  }
  absl::MutexLock node_lock(&node.mu);
  struct InFlight {
    std::atomic<bool>& flag;
    explicit InFlight(std::atomic<bool>& f) : flag(f) { flag.store(true); }
    ~InFlight() { flag.store(false); }
  } in_flight(node.in_flight);
  return RunOnNodeLocked(node, operation, slot, commands);
}

absl::StatusOr<std::vector<RedisClusterClient::ReplyPtr>> RedisClusterClient::RunOnNodeLocked(
    Node& node, absl::string_view operation, std::optional<uint16_t> slot,
    const std::vector<std::vector<absl::string_view>>& commands) {
  if (node.context == nullptr) {
    const absl::Time now = absl::Now();
    if (node.InBackOff(now)) {
      const absl::Duration left =
          absl::FromUnixNanos(node.retry_after_ns.load(std::memory_order_relaxed)) - now;
      return BackOffRefusal(
          node, operation, slot,
          absl::StrCat("not tried for another ",
                       absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
                       " ms (back-off after: ", node.last_failure, ")"));
    }
  }
  // A connection that worked before may have been closed by the node since (a restart, an
  // idle timeout): it gets one fresh connection before the call fails. A timeout does not
  // (it would double the wait on a stalled node).
  bool may_reconnect = node.context != nullptr;
  for (;;) {
    if (node.context == nullptr) RETURN_IF_ERROR(ConnectLocked(node, operation));
    redisContext* context = node.context;
    std::vector<const char*> words;
    std::vector<size_t> lengths;
    for (const std::vector<absl::string_view>& command : commands) {
      words.clear();
      lengths.clear();
      for (const absl::string_view word : command) {
        words.push_back(word.data());
        lengths.push_back(word.size());
      }
      if (redisAppendCommandArgv(context, static_cast<int>(words.size()), words.data(),
                                 lengths.data()) != REDIS_OK) {
        // Commands buffered before this one must not be sent ahead of a later call's.
        redisFree(node.context);
        node.context = nullptr;
        return absl::ResourceExhaustedError(absl::StrCat(
            "redis cluster ", operation, ": ", Where(node.name, slot), ": cannot buffer command"));
      }
    }
    std::vector<ReplyPtr> replies;
    bool failed = false;
    for (size_t i = 0; i < commands.size(); ++i) {
      void* reply = nullptr;
      if (redisGetReply(context, &reply) != REDIS_OK || reply == nullptr) {
        failed = true;
        break;
      }
      replies.emplace_back(static_cast<redisReply*>(reply));
    }
    if (!failed) {
      node.answered.store(true);
      node.retry_backoff = absl::ZeroDuration();  // a reply: the next failure starts afresh
      return replies;
    }
    const absl::Status status =
        ContextStatus(*context, operation, Where(node.name, slot), options_.command_timeout);
    if (!may_reconnect || status.code() == absl::StatusCode::kDeadlineExceeded) {
      return NodeFailedLocked(node, status);
    }
    redisFree(node.context);
    node.context = nullptr;
    {
      absl::MutexLock lock(&mu_);
      ++stats_.connection_failures;
      slot_map_stale_ = true;
    }
    may_reconnect = false;
  }
}

absl::Status RedisClusterClient::NodeFailedLocked(Node& node, absl::Status status) {
  if (node.context != nullptr) {
    redisFree(node.context);
    node.context = nullptr;
  }
  node.answered.store(false);
  node.retry_backoff = node.retry_backoff == absl::ZeroDuration()
                           ? options_.node_retry_initial
                           : std::min(node.retry_backoff * 2, options_.node_retry_max);
  node.retry_after_ns.store(absl::ToUnixNanos(absl::Now() + node.retry_backoff),
                            std::memory_order_relaxed);
  node.last_failure = std::string(status.message());
  absl::MutexLock lock(&mu_);
  ++stats_.connection_failures;
  slot_map_stale_ = true;
  return status;
}

absl::Status RedisClusterClient::ConnectLocked(Node& node, absl::string_view operation) {
  const auto fail = [&](absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(node.mu) {
    return NodeFailedLocked(node, std::move(status));
  };
  const std::string where = Where(node.name, std::nullopt);
  redisContext* context = redisConnectWithTimeout(node.address.host.c_str(), node.address.port,
                                                  absl::ToTimeval(options_.connect_timeout));
  if (context == nullptr) {
    return fail(absl::ResourceExhaustedError(
        absl::StrCat("redis cluster ", operation, ": ", where, ": cannot allocate a context")));
  }
  std::unique_ptr<redisContext, void (*)(redisContext*)> owned(context, redisFree);
  if (context->err != 0) {
    return fail(ContextStatus(*context, absl::StrCat(operation, " (connect)"), where,
                              options_.connect_timeout));
  }
  if (redisSetTimeout(context, absl::ToTimeval(options_.command_timeout)) != REDIS_OK) {
    return fail(ContextStatus(*context, absl::StrCat(operation, " (set timeout)"), where,
                              options_.command_timeout));
  }
  if (!password_.empty()) {
    std::vector<const char*> words = {"AUTH"};
    std::vector<size_t> lengths = {4};
    if (!options_.user.empty()) {
      words.push_back(options_.user.data());
      lengths.push_back(options_.user.size());
    }
    words.push_back(password_.data());
    lengths.push_back(password_.size());
    ReplyPtr reply(static_cast<redisReply*>(
        redisCommandArgv(context, static_cast<int>(words.size()), words.data(), lengths.data())));
    if (reply == nullptr) {
      return fail(ContextStatus(*context, absl::StrCat(operation, " (AUTH)"), where,
                                options_.command_timeout));
    }
    if (reply->type == REDIS_REPLY_ERROR) {
      const std::string who =
          options_.user.empty() ? "the requirepass password"
                                : absl::StrCat("user '", options_.user, "' and its password");
      // The node answered: a configuration problem, not the node's failure (no back-off).
      node.answered.store(true);
      return absl::UnauthenticatedError(
          absl::StrCat("redis cluster ", operation, ": ", where, " refused ", who, " from ",
                       options_.password_file, ": ", ReplyText(*reply)));
    }
  }
  node.context = owned.release();
  node.answered.store(true);
  absl::MutexLock lock(&mu_);
  ++stats_.connects;
  return absl::OkStatus();
}

absl::Status RedisClusterClient::RefreshSlotMap() {
  {
    absl::MutexLock lock(&mu_);
    slot_map_stale_ = true;
  }
  return RefreshIfStale();
}

absl::Status RedisClusterClient::RefreshIfStale() {
  std::vector<std::shared_ptr<Node>> candidates;
  {
    absl::MutexLock lock(&mu_);
    if (!slot_map_stale_) return absl::OkStatus();
    for (const auto& [name, node] : nodes_) candidates.push_back(node);
  }
  // Nodes that answered last time first, then the others; a node in back-off is not asked (it
  // would be refused without I/O). Ranks are taken once: other threads change them meanwhile.
  const absl::Time now = absl::Now();
  std::vector<std::pair<int, std::shared_ptr<Node>>> ranked;
  size_t in_back_off = 0;
  for (std::shared_ptr<Node>& node : candidates) {
    if (node->InBackOff(now)) {
      ++in_back_off;
      continue;
    }
    ranked.emplace_back(node->answered.load() ? 0 : 1, std::move(node));
  }
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  absl::Status first_failure;
  int asked = 0;
  for (const auto& [rank, node] : ranked) {
    if (asked++ == kMaxRefreshNodes) break;
    absl::Status refreshed = RefreshSlotMapFrom(node);
    if (refreshed.ok() || refreshed.code() == absl::StatusCode::kUnauthenticated) {
      return refreshed;
    }
    if (first_failure.ok()) first_failure = std::move(refreshed);
  }
  if (!first_failure.ok()) return first_failure;
  return MarkedRefusal(absl::StrCat("redis cluster: the slot map is stale and all ", in_back_off,
                                    " known nodes are in back-off"));
}

absl::Status RedisClusterClient::RefreshSlotMapFrom(const std::shared_ptr<Node>& node) {
  ASSIGN_OR_RETURN(std::vector<ReplyPtr> replies,
                   RunOnNode(*node, "CLUSTER SLOTS", std::nullopt, {{"CLUSTER", "SLOTS"}}));
  const redisReply& reply = *replies.front();
  const std::string where = Where(node->name, std::nullopt);
  if (reply.type == REDIS_REPLY_ERROR) {
    return ErrorReplyStatus("CLUSTER SLOTS", where, ReplyText(reply));
  }
  const auto malformed = [&](size_t range, absl::string_view why) {
    return absl::InternalError(absl::StrCat("redis cluster CLUSTER SLOTS: ", where, ": range ",
                                            range, " ", why));
  };
  if (reply.type != REDIS_REPLY_ARRAY) return malformed(0, "the reply is not an array");
  std::vector<std::string> owners(kRedisClusterSlots);
  std::vector<RedisNodeAddress> masters;
  for (size_t r = 0; r < reply.elements; ++r) {
    const redisReply& range = *reply.element[r];
    if (range.type != REDIS_REPLY_ARRAY || range.elements < 3 ||
        range.element[0]->type != REDIS_REPLY_INTEGER ||
        range.element[1]->type != REDIS_REPLY_INTEGER ||
        range.element[2]->type != REDIS_REPLY_ARRAY || range.element[2]->elements < 2 ||
        range.element[2]->element[0]->type != REDIS_REPLY_STRING ||
        range.element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
      return malformed(r, "is not [start, end, [host, port, ...], ...]");
    }
    const long long first = range.element[0]->integer;
    const long long last = range.element[1]->integer;
    if (first < 0 || first > last || last >= kRedisClusterSlots) {
      return malformed(r, absl::StrCat("covers slots ", first, "..", last, ", outside 0..",
                                       kRedisClusterSlots - 1));
    }
    const long long port = range.element[2]->element[1]->integer;
    if (port <= 0 || port > 65535) {
      return malformed(r, absl::StrCat("names port ", port));
    }
    std::string host(ReplyText(*range.element[2]->element[0]));
    if (host.empty() || host == "?") host = node->address.host;
    RedisNodeAddress master{std::move(host), static_cast<int>(port)};
    const std::string name = master.ToString();
    for (long long slot = first; slot <= last; ++slot) owners[slot] = name;
    masters.push_back(std::move(master));
  }
  absl::MutexLock lock(&mu_);
  for (RedisNodeAddress& master : masters) {
    std::string name = master.ToString();
    if (!nodes_.contains(name)) {
      nodes_.emplace(std::move(name), std::make_shared<Node>(std::move(master)));
    }
  }
  slot_owner_ = std::move(owners);
  slot_map_stale_ = false;
  last_refresh_ = absl::Now();
  ++stats_.slot_map_refreshes;
  return absl::OkStatus();
}

std::shared_ptr<RedisClusterClient::Node> RedisClusterClient::NodeFor(
    const RedisNodeAddress& address) {
  std::string name = address.ToString();
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = nodes_.try_emplace(name, nullptr);
  if (inserted) it->second = std::make_shared<Node>(address);
  return it->second;
}

std::shared_ptr<RedisClusterClient::Node> RedisClusterClient::NodeForKeySlot(uint16_t slot) {
  absl::MutexLock lock(&mu_);
  const std::string& owner = slot_owner_[slot];
  if (owner.empty()) return nullptr;
  auto it = nodes_.find(owner);
  return it != nodes_.end() ? it->second : nullptr;
}

absl::Status RedisClusterClient::KeyNodeBackOff(absl::string_view key) const {
  const uint16_t slot = RedisKeySlot(key);
  std::shared_ptr<Node> node;
  {
    absl::MutexLock lock(&mu_);
    auto it = nodes_.find(slot_owner_[slot]);
    if (it == nodes_.end()) return absl::OkStatus();
    node = it->second;
  }
  const absl::Time now = absl::Now();
  if (!node->InBackOff(now)) return absl::OkStatus();
  return MarkedRefusal(absl::StrCat("redis cluster: ", Where(node->name, slot),
                                    " is in back-off"));
}

std::optional<RedisNodeAddress> RedisClusterClient::NodeForSlot(uint16_t slot) const {
  absl::MutexLock lock(&mu_);
  if (slot >= kRedisClusterSlots || slot_owner_[slot].empty()) return std::nullopt;
  auto it = nodes_.find(slot_owner_[slot]);
  if (it == nodes_.end()) return std::nullopt;
  return it->second->address;
}

RedisClusterStats RedisClusterClient::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace memra
