#ifndef MEMRA_CLIENT_PREFIX_CLIENT_H_
#define MEMRA_CLIENT_PREFIX_CLIENT_H_

// The prefix cache (proto/memra/kv/v1/prefix.proto, docs/architecture.md) as an engine calls it:
// a view of a KvClient (KvClient::prefixes()) over its one connection and lease.
//
//   memra::PrefixClient prefixes = client->prefixes();
//   ASSIGN_OR_RETURN(memra::PrefixMatch match, prefixes.Lookup(plan, options, token_ids));
//   if (match.outcome != memra::LookupOutcome::kMiss) {
//     ASSIGN_OR_RETURN(memra::PrefixRestored restored,
//                      prefixes.Restore(*session, token_ids, match.entry_id));
//   }
//
// Refusals keep the daemon's codes and messages.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "core/model_plan.h"
#include "core/prefix_index.h"

namespace memra {

class ClientConnection;

struct PrefixCaptured {
  uint64_t entry_id = 0;
  uint64_t boundary_tokens = 0;
  bool already_present = false;  // the boundary was stored before: nothing was copied
  uint64_t added_bytes = 0;      // bytes this capture added (shared blocks not counted again)
  uint64_t stored_bytes = 0;     // the whole cache after the capture
  PlanFingerprint shape_fingerprint{};  // what the entry is keyed by (prefix.proto "Keys")
};

struct PrefixMatch {
  LookupOutcome outcome = LookupOutcome::kMiss;
  uint64_t entry_id = 0;        // 0 on a miss
  uint64_t matched_tokens = 0;  // tokens PrefixClient::Restore would restore (whole blocks)
  uint32_t block_tokens = 0;
  // The slowest tier a matched piece is in (kDisk: the restore reads it back first).
  StorageMedium medium = StorageMedium::kDevice;
};

struct PrefixRestored {
  uint64_t entry_id = 0;
  uint64_t restored_tokens = 0;  // == state.committed_len
  SessionSnapshot state;
};

// One message of PrefixClient::SubscribeEvents. `gap`: the subscriber missed events the
// daemon no longer buffers; drop what is known of this daemon and resync (only sequence and
// epoch are set then: the newest sequence).
struct PrefixCacheEvent {
  bool gap = false;
  uint64_t sequence = 0;
  uint64_t epoch = 0;
  PrefixEventKind kind = PrefixEventKind::kStored;
  PlanFingerprint shape_fingerprint{};
  std::vector<BlockKey> block_keys;      // chain order
  std::optional<BlockKey> boundary_key;  // set when a boundary state was stored or freed
  std::string reason;
  std::string cache_scope;  // the entry's scope (the subscriber's own on the engine socket)
  StorageMedium medium = StorageMedium::kDevice;  // kMoved: where the bytes are now
  // What routers index (prefix.proto PrefixEvent 20-25): the origin of the blocks, their
  // identities as their engine knows them (block store hashes, else the block keys), the
  // parent's, their token ids when known.
  PrefixEventOrigin origin;
  bool operator==(const PrefixCacheEvent&) const = default;
};

// Cache events as they come (PrefixClient::SubscribeEvents). Thread-compatible; Cancel() may
// be called from another thread to end a Next() that is waiting.
class PrefixEventStream {
 public:
  ~PrefixEventStream();  // cancels
  PrefixEventStream(const PrefixEventStream&) = delete;
  PrefixEventStream& operator=(const PrefixEventStream&) = delete;

  // The next event, waiting for it; nullopt once the stream ended (cancelled, the daemon
  // stopping), with the reason in the status when it ended with an error (FAILED_PRECONDITION
  // when it was subscribed through a view whose KvClient was gone).
  absl::StatusOr<std::optional<PrefixCacheEvent>> Next();
  void Cancel();

 private:
  friend class PrefixClient;
  struct Call;
  explicit PrefixEventStream(std::unique_ptr<Call> call);
  std::unique_ptr<Call> call_;
};

// A view of a KvClient: cheap to copy (one weak reference to the client's connection), no
// channel or lease of its own. Valid while its KvClient lives: a call after the KvClient is
// destroyed changes nothing and is refused with FAILED_PRECONDITION ("... after its KvClient was
// destroyed"); a call in flight when it is destroyed completes. Thread-safe.
class PrefixClient {
 public:
  // Copies `session`'s committed state at `boundary_tokens` into the cache; `token_ids` are the
  // session's committed token ids from position 0 (at least boundary_tokens of them). Carries
  // the session's wait event.
  absl::StatusOr<PrefixCaptured> Capture(const Session& session,
                                         absl::Span<const int32_t> token_ids,
                                         uint64_t boundary_tokens) const;
  // The longest restorable prefix of `token_ids`, in this engine's cache scope, for sessions of
  // `plan` with `shape`'s layer range and ranks (its capacity and the rest are ignored).
  // REQUIRES: the KvClient is attached (FAILED_PRECONDITION otherwise).
  absl::StatusOr<PrefixMatch> Lookup(const PlanFingerprint& plan, const SessionOptions& shape,
                                     absl::Span<const int32_t> token_ids) const;
  // Restores entry `entry_id` (0: the longest match) into the FRESH `session`; `token_ids` the
  // conversation's from position 0. Carries the session's wait event.
  absl::StatusOr<PrefixRestored> Restore(const Session& session,
                                         absl::Span<const int32_t> token_ids,
                                         uint64_t entry_id = 0) const;
  // The cache's events after (epoch, last_sequence) (0, 0: from the start of the daemon's
  // buffer), then live ones until the stream is cancelled. No deadline. On the engine socket
  // an attached engine's, of its cache scope only; on the admin socket every scope's. The
  // stream keeps the connection's channel while it lives, even past its KvClient.
  std::unique_ptr<PrefixEventStream> SubscribeEvents(uint64_t epoch = 0,
                                                     uint64_t last_sequence = 0) const;

 private:
  friend class KvClient;
  explicit PrefixClient(std::weak_ptr<ClientConnection> connection)
      : connection_(std::move(connection)) {}

  std::weak_ptr<ClientConnection> connection_;
};

}  // namespace memra

#endif  // MEMRA_CLIENT_PREFIX_CLIENT_H_
