#ifndef MEMRA_SERVER_REDIS_CLUSTER_H_
#define MEMRA_SERVER_REDIS_CLUSTER_H_

// A small Redis Cluster client over Debian's hiredis 0.14 (which speaks to one node and knows
// nothing of clusters): the slot map from CLUSTER SLOTS, MOVED and ASK redirects, one
// connection per node re-made after a node dies, and a timeout on every connect and command, so
// a slow or dead cluster costs a caller a bounded wait and a Status, never a hang. It is the
// transport of the prefix cache's remote tier (docs/remote-tier.md); it knows nothing of
// prefixes.
//
// Status codes, chosen by what the caller does next:
//   UNAVAILABLE        a node refused or dropped the connection, the cluster is down
//                      (CLUSTERDOWN), or redirects ran past max_redirects: retry later. Also
//                      a call refused at once because its node is in back-off after a failure
//                      (IsRedisNodeDownRefusal): no I/O was done.
//   DEADLINE_EXCEEDED  a connect or command ran past its timeout: retry later.
//   UNAUTHENTICATED    the node refused the credentials (or wants some and has none).
//   INTERNAL           a reply the protocol does not allow here (our bug or a foreign server).
//   UNIMPLEMENTED      TLS was asked for: hiredis 0.14 has none (hiredis_ssl came with 1.0).
//   INVALID_ARGUMENT   options that cannot work (a node list that does not parse, ...).
// Messages name the operation, the node (host:port) and the slot; never a password.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

struct redisContext;
struct redisReply;

namespace memra {

inline constexpr int kRedisClusterSlots = 16384;

// The slot Redis Cluster assigns `key`: CRC16 (XMODEM) of the key, or of its hash tag (the text
// between the first '{' and the first '}' after it, when not empty), mod 16384.
uint16_t RedisKeySlot(absl::string_view key);

// Why TLS to Redis is refused (the config check and Create both say it): Debian's hiredis 0.14
// has no TLS.
absl::string_view RedisTlsUnsupportedReason();

struct RedisNodeAddress {
  std::string host;
  int port = 0;
  std::string ToString() const;  // "host:port", "[v6]:port"
  bool operator==(const RedisNodeAddress&) const = default;
};

// "host:port,host:port,[::1]:port" (spaces around entries allowed) -> addresses. INVALID_ARGUMENT
// naming the entry for an empty list, a missing or out-of-range port.
absl::StatusOr<std::vector<RedisNodeAddress>> ParseRedisNodeList(absl::string_view list);

struct RedisClusterOptions {
  // Nodes asked for the slot map (any node of the cluster will do; more survive more failures).
  std::vector<RedisNodeAddress> seed_nodes;
  // Authentication. Empty password_file: none. Otherwise the file holds the password (one
  // trailing newline ignored) and every connection starts with AUTH <password> (requirepass,
  // the "default" ACL user) or, when `user` is set, AUTH <user> <password> (an ACL user).
  std::string user;
  std::string password_file;
  // Refused (UNIMPLEMENTED): kept as an option so a config asking for TLS fails loudly instead
  // of sending KV bytes and a password in the clear.
  bool tls = false;
  absl::Duration connect_timeout = absl::Milliseconds(200);
  absl::Duration command_timeout = absl::Milliseconds(500);
  // MOVED / ASK / TRYAGAIN replies followed for one call before it fails UNAVAILABLE.
  int max_redirects = 5;
  // A node whose connect or command failed (I/O or a timeout) is not tried again for a
  // back-off that doubles from node_retry_initial to node_retry_max and is reset by a reply:
  // meanwhile calls for its slots fail at once (UNAVAILABLE, IsRedisNodeDownRefusal) instead
  // of each paying a connect or command timeout, and the other nodes' slots keep serving. A
  // call that finds a failed node's one retry in flight is refused the same way rather than
  // queue behind it. (A refused AUTH is not a failure of the node: no back-off.)
  absl::Duration node_retry_initial = absl::Milliseconds(100);
  absl::Duration node_retry_max = absl::Seconds(2);
};

// Whether `status` is a call refused without any I/O because its node was in back-off.
bool IsRedisNodeDownRefusal(const absl::Status& status);

// ExistsEach's answer: one entry per key, in order.
struct RedisExistsResult {
  std::vector<std::optional<bool>> exists;  // nullopt: the key's node could not be asked
  size_t unanswered = 0;                    // keys left nullopt
  absl::Status first_failure;               // why the first of them was not answered
};

// Counters since Create (monotonic), for metrics and tests.
struct RedisClusterStats {
  uint64_t moved_redirects = 0;  // MOVED replies followed
  uint64_t ask_redirects = 0;    // ASK replies followed (ASKING + the command on the named node)
  uint64_t slot_map_refreshes = 0;  // CLUSTER SLOTS answered and applied
  uint64_t connects = 0;            // connections made (first ones and re-made ones)
  uint64_t connection_failures = 0;  // connects or commands that failed for I/O or a timeout
  uint64_t node_down_refusals = 0;   // calls refused at once: their node was in back-off
};

// Thread-safe: any number of threads may call any method at once. A call holds mu_ only to read
// or update the slot map and the node table, never across network I/O; the I/O happens under
// the one node's own mutex, so calls to different nodes run in parallel and calls to one node
// queue on its single connection (the bound: one connection per node).
//
// Time bound of one call: at most max_redirects + 1 attempts, each at most one connect
// (connect_timeout + command_timeout for AUTH) and one command (command_timeout); a slot-map
// refresh before an attempt asks at most kMaxRefreshNodes nodes, each bounded the same way.
class RedisClusterClient {
 public:
  static constexpr int kMaxRefreshNodes = 3;

  // Reads the password file, then fetches the slot map from the first seed node that answers.
  // UNAVAILABLE / DEADLINE_EXCEEDED when none does; UNAUTHENTICATED when the credentials are
  // refused; INVALID_ARGUMENT for options that cannot work; UNIMPLEMENTED for tls.
  static absl::StatusOr<std::unique_ptr<RedisClusterClient>> Create(RedisClusterOptions options);

  ~RedisClusterClient();
  RedisClusterClient(const RedisClusterClient&) = delete;
  RedisClusterClient& operator=(const RedisClusterClient&) = delete;

  // The value, or nullopt when the key does not exist.
  absl::StatusOr<std::optional<std::string>> Get(absl::string_view key);
  // SET key value, with PX <ttl in ms> when ttl > 0 (rounded up to a whole millisecond).
  absl::Status Set(absl::string_view key, absl::string_view value,
                   absl::Duration ttl = absl::ZeroDuration());
  // Whether the key existed (and was deleted).
  absl::StatusOr<bool> Del(absl::string_view key);
  // Existence of each key, in order. Keys may lie in any slots: they are grouped by the node
  // owning their slot and each node gets its EXISTS commands in one pipelined round trip; a
  // key whose reply is a redirect is retried alone through the redirect rules. A node that
  // fails leaves only its own keys unanswered: the others' answers stand. first_failure is the
  // first failure that did I/O when there is one (else a back-off refusal).
  RedisExistsResult ExistsEach(absl::Span<const std::string> keys);
  // OK, or the back-off refusal a call for `key` would get now without any I/O (its node is
  // in back-off): lets a caller skip preparing a call that cannot go out.
  absl::Status KeyNodeBackOff(absl::string_view key) const;

  // Asks the cluster for its slot map now (normally done on demand: at Create, after MOVED,
  // after a connection failure).
  absl::Status RefreshSlotMap();
  // The node the slot map currently sends `slot` to (nullopt when no node owns it).
  std::optional<RedisNodeAddress> NodeForSlot(uint16_t slot) const;
  RedisClusterStats Stats() const;

 private:
  // One cluster node and this client's one connection to it.
  struct Node {
    explicit Node(RedisNodeAddress address_in)
        : address(std::move(address_in)), name(address.ToString()) {}
    ~Node();

    // Constant after construction.
    const RedisNodeAddress address;
    const std::string name;  // address.ToString(): the key in nodes_ and slot_owner_

    // Whether the last connect or command on this node worked: slot-map refreshes ask the
    // nodes that answered last time first.
    std::atomic<bool> answered{true};
    // Unix ns before which no connect is tried (the back-off after a failure); atomic so a
    // refresh can order candidates without taking every node's mutex.
    std::atomic<int64_t> retry_after_ns{0};
    // A call holds the node's connection (set and cleared under mu): with `answered` false,
    // that call is the failed node's one retry and other callers are refused, not queued.
    std::atomic<bool> in_flight{false};

    absl::Mutex mu;
    redisContext* context ABSL_GUARDED_BY(mu) = nullptr;  // null: not connected
    absl::Duration retry_backoff ABSL_GUARDED_BY(mu);     // zero: no failure since a reply
    std::string last_failure ABSL_GUARDED_BY(mu);         // the message that started it

    bool InBackOff(absl::Time now) const {
      return absl::ToUnixNanos(now) < retry_after_ns.load(std::memory_order_relaxed);
    }
  };
  struct ReplyDeleter {
    void operator()(redisReply* reply) const;
  };
  using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;
  // Where one attempt goes.
  struct Target {
    std::shared_ptr<Node> node;
    bool asking = false;  // send ASKING first (the node named by an ASK reply)
  };

  RedisClusterClient(RedisClusterOptions options, std::string password);

  // Runs `argv` (argv[1] is the key) on the node owning the key's slot, following redirects.
  // A non-redirect error reply is returned as a Status; any other reply is returned as is. A
  // back-off refusal is returned only when this call did no I/O that failed: when its map
  // refresh failed for real, that failure is returned instead (so a cluster whose every node
  // is dead is reported as such, not as refusals a breaker ignores).
  absl::StatusOr<ReplyPtr> Execute(absl::string_view operation, absl::string_view key,
                                   std::vector<absl::string_view> argv);
  // Sends the commands in one write and reads their replies in order, (re)connecting first when
  // the node has no connection. A connection that fails is closed (the next call re-makes it)
  // and the slot map is marked stale.
  absl::StatusOr<std::vector<ReplyPtr>> RunOnNode(
      Node& node, absl::string_view operation, std::optional<uint16_t> slot,
      const std::vector<std::vector<absl::string_view>>& commands) ABSL_LOCKS_EXCLUDED(node.mu);
  absl::StatusOr<std::vector<ReplyPtr>> RunOnNodeLocked(
      Node& node, absl::string_view operation, std::optional<uint16_t> slot,
      const std::vector<std::vector<absl::string_view>>& commands)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(node.mu);
  // A back-off refusal of a call for `node` (counted; marked IsRedisNodeDownRefusal).
  absl::Status BackOffRefusal(const Node& node, absl::string_view operation,
                              std::optional<uint16_t> slot, absl::string_view why)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ConnectLocked(Node& node, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(node.mu);
  // A connect or command on `node` failed with `status`: closes its connection, starts or
  // doubles its back-off, counts the failure and marks the slot map stale. Returns `status`.
  absl::Status NodeFailedLocked(Node& node, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(node.mu) ABSL_LOCKS_EXCLUDED(mu_);

  // Fetches CLUSTER SLOTS from one node and installs it.
  absl::Status RefreshSlotMapFrom(const std::shared_ptr<Node>& node);
  // OK when the map is fresh or was refreshed; else the first real failure of the nodes asked,
  // or a back-off refusal when every known node is in back-off (none asked).
  absl::Status RefreshIfStale();
  std::shared_ptr<Node> NodeFor(const RedisNodeAddress& address) ABSL_LOCKS_EXCLUDED(mu_);
  std::shared_ptr<Node> NodeForKeySlot(uint16_t slot) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const RedisClusterOptions options_;
  const std::string password_;  // empty: no AUTH

  mutable absl::Mutex mu_;
  // Every node this client has heard of (seeds and slot-map owners), one connection each.
  absl::flat_hash_map<std::string, std::shared_ptr<Node>> nodes_ ABSL_GUARDED_BY(mu_);
  // slot -> key of nodes_ owning it; empty = unowned / unknown.
  std::vector<std::string> slot_owner_ ABSL_GUARDED_BY(mu_);
  // Set by a connection failure: the next call refreshes the map before its first attempt.
  bool slot_map_stale_ ABSL_GUARDED_BY(mu_) = true;
  // When a slot map was last applied. A call refused for a node in back-off marks the map
  // stale only when it is older than kDownNodeRefreshInterval: a failover is learned that
  // soon after it happens, without one CLUSTER SLOTS per refused call.
  absl::Time last_refresh_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  static constexpr absl::Duration kDownNodeRefreshInterval = absl::Milliseconds(250);
  RedisClusterStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_REDIS_CLUSTER_H_
