#ifndef MEMRA_SERVER_REMOTE_TIER_H_
#define MEMRA_SERVER_REMOTE_TIER_H_

// The prefix cache's remote tier: stored blocks and boundary states in a Redis Cluster
// (server/store/remote/redis_cluster.h), so a prefix captured by one daemon restores on another
// (docs/remote-tier.md). This module owns the keys, the value format and every bound that keeps a
// slow or dead cluster from blocking the cache: a write-behind queue bounded by bytes and entries
// (full: the write is dropped and counted, the capture never waits), read-through calls answered
// within a caller's deadline by a bounded pool of reader threads (past it: a miss), and a circuit
// breaker (after kBreakerFailures consecutive transport failures of reads, a caller's deadline
// passing included, or of writes, the tier is down for a back-off
// that doubles from breaker_initial to breaker_max; while down, reads are refused at once and
// writes dropped; the writer thread probes the cluster when the back-off ends, re-creating the
// client when the cluster was down at start-up). The prefix cache decides what to read and write
// and verifies what it reads (VerifyRemoteValue) before any byte reaches a session.
//
// Thread-safety: thread-safe. mu_ guards the queues, the breaker, the client pointer and the
// counters and is never held across network I/O (the one writer thread and the reader threads
// copy the client's shared_ptr and call it without mu_).

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/prefix_index.h"
#include "server/store/remote/redis_cluster.h"

namespace memra {

// ---- Keys ----
// memra-kv/v2/<scope>/b/<block key hex>: one stored block; .../s/<last chain key hex>: the
// boundary state at the end of that chain. <scope> is the hex SHA-256 of the cache scope, a
// literal prefix an operator can grant one ACL user (block keys already chain from the scoped
// shape, so the prefix separates nothing the key does not; it is for ACLs and operators). v2
// is the value format (below): a format change moves to a new prefix.
std::string RemoteBlockKey(absl::string_view scope, const BlockKey& block);
std::string RemoteBoundaryKey(absl::string_view scope, const BlockKey& last_block);

// ---- Values ----
// A 72-byte little-endian header, then the piece exactly as the local tier stores it:
//   0 magic "MKVR" | 4 version u16 (2) | 6 kind u8 | 7 reserved u8 (0) | 8 payload bytes u64 |
//   16 shape key prefix u64 (first 8 bytes of the scoped shape key) | 24 block_tokens u32 |
//   28 checksum slice bytes u32 | 32 boundary tokens u64 (0 for a block) |
//   40 payload checksum u64 (the local tier's: xxHash3 of the slice checksums, or the one slice's) |
//   48 layout digest u64 (RemoteLayoutDigest of the pieces) |
//   56 key digest u64 (RemoteKeyDigest of the key it was written under) |
//   64 xxHash3-64 of bytes [0, 64).
// The key digest binds a value to its key: every other field and both checksums hold for a
// value copied or renamed to another key of the same shape, whose bytes would then restore as
// another prefix's. Format 1 values (64-byte header, no key digest) live under memra-kv/v1/
// keys, which this build never reads (so neither build deletes the other's values during a
// rolling upgrade); one found under a v2 key reads as another build's value: a miss.
inline constexpr uint64_t kRemoteHeaderBytes = 72;
inline constexpr uint16_t kRemoteValueVersion = 2;

enum class RemoteValueKind : uint8_t { kBlock = 1, kBoundary = 2 };

// What a value says about itself; a reader fills every field but checksum and slice_bytes with
// what its own plan expects.
struct RemoteValueHeader {
  RemoteValueKind kind = RemoteValueKind::kBlock;
  uint64_t payload_bytes = 0;
  uint64_t shape_prefix = 0;
  uint32_t block_tokens = 0;
  uint32_t slice_bytes = 0;  // checksum slice bytes the writer sealed the payload with
  uint64_t boundary_tokens = 0;
  uint64_t checksum = 0;
  uint64_t layout_digest = 0;
};

// The first 8 bytes of a shape key as a little-endian u64.
uint64_t ShapePrefix(const PlanFingerprint& key);
// xxHash3-64 of a value's key (the header field that binds the value to it).
uint64_t RemoteKeyDigest(absl::string_view key);

// The kRemoteHeaderBytes of `header` for a value written under `key`, sealed (its own checksum
// last).
std::string EncodeRemoteHeader(absl::string_view key, const RemoteValueHeader& header);
// EncodeRemoteHeader(key, header) then room for header.payload_bytes; the caller fills the
// payload at kRemoteHeaderBytes.
std::string NewRemoteValue(absl::string_view key, const RemoteValueHeader& header);

// A verified value: its payload (a view into the value) and the slice checksums it was sealed
// with (header.slice_bytes slices).
struct VerifiedRemoteValue {
  absl::string_view payload;
  uint32_t slice_bytes = 0;
  std::vector<uint64_t> slice_checksums;
  uint64_t checksum = 0;
};

// Checks `value`, read from `key`, against what this reader expects, in order: magic and
// version (FAILED_PRECONDITION: another format, whose checksum lies elsewhere), length and
// header checksum (DATA_LOSS: the bytes are not what was written), key digest (DATA_LOSS:
// written under another key), kind, payload bytes, shape prefix, block_tokens, boundary
// tokens, layout digest (FAILED_PRECONDITION "shape mismatch": a valid value of another build
// or plan), slice size (DATA_LOSS when 0), then the payload's checksum (DATA_LOSS). Messages
// name the key, both numbers of a mismatch, never the bytes.
absl::StatusOr<VerifiedRemoteValue> VerifyRemoteValue(absl::string_view key,
                                                      absl::string_view value,
                                                      const RemoteValueHeader& expected);

// ---- The tier ----

// Where a queued write's value comes from: bytes the caller keeps readable (a piece of local
// storage it holds) until this object is destroyed, so a capture queues a reference, not a
// copy. The tier calls Read at most once, on its writer thread, and destroys the source as soon
// as the write leaves the queue, whichever way: read (before the SET goes out, so the hold
// covers the queue and the read, not the round trip), dropped (breaker open) or the tier
// destroyed. Never destroyed, nor read, under the tier's mutex.
class RemoteValueSource {
 public:
  virtual ~RemoteValueSource() = default;
  // The value's bytes (what the queue counts); constant.
  virtual uint64_t bytes() const = 0;
  // Fills `value` (bytes() long). An error drops the write (counted as a write error).
  virtual absl::Status Read(absl::Span<char> value) = 0;
};
struct RemoteTierOptions {
  RedisClusterOptions cluster;
  uint64_t queue_bytes = uint64_t{256} << 20;  // > 0; values queued for the writer, at most
  uint32_t queue_entries = 65536;               // > 0
  absl::Duration ttl = absl::ZeroDuration();    // expiry of written values; 0: none
  uint32_t reader_threads = 4;                  // 1..64
  uint32_t reader_queue = 256;                  // read calls waiting for a reader, at most; > 0
  absl::Duration breaker_initial = absl::Seconds(1);
  absl::Duration breaker_max = absl::Seconds(30);
  // Fault-injection seam for tests (empty in production): called on the writer thread, without
  // the tier's lock, before it reads a queued value's source, so a test can keep writes queued.
  std::function<void()> before_write_read;
};

struct RemoteTierStats {
  bool up = false;  // a client exists and the breaker is closed
  uint64_t queued_bytes = 0;
  uint64_t queued_writes = 0;  // queued or in flight (deletes of corrupt values included)
  uint64_t writes = 0;          // values written
  uint64_t written_bytes = 0;
  uint64_t dropped_writes = 0;  // queue full or tier down
  uint64_t write_errors = 0;
  uint64_t reads = 0;           // EXISTS / GET calls answered
  uint64_t read_errors = 0;     // failed calls (any code)
  // Lookups answered for some keys only (their node down or in back-off: those keys read as
  // misses); also counted in reads.
  uint64_t partial_lookups = 0;
  uint64_t read_timeouts = 0;   // calls the caller stopped waiting for (its deadline)
  uint64_t read_refusals = 0;   // calls refused at once: tier down or reader queue full
  uint64_t breaker_opens = 0;
  uint64_t probes = 0;
  // Counted by the prefix cache (RecordPull):
  uint64_t hits = 0;               // restores that pulled pieces from the tier
  uint64_t pulled_pieces = 0;
  uint64_t pulled_bytes = 0;
  uint64_t corrupt = 0;            // values refused as DATA_LOSS (deleted best-effort)
  uint64_t shape_mismatches = 0;   // values of another build or plan (a miss)
  RedisClusterStats cluster;
};

class RemoteTier {
 public:
  static constexpr int kBreakerFailures = 3;

  // INVALID_ARGUMENT for options that cannot work (the client's own refusals: TLS, a password
  // file that cannot be read, no seeds). A cluster that does not answer is NOT an error: the
  // tier starts down (logged, Stats().up false) and the writer keeps probing.
  static absl::StatusOr<std::unique_ptr<RemoteTier>> Create(RemoteTierOptions options);
  // Stops and joins the threads: each is at most inside one bounded client call.
  ~RemoteTier();
  RemoteTier(const RemoteTier&) = delete;
  RemoteTier& operator=(const RemoteTier&) = delete;

  // Whether writes of `bytes` in all would be queued now (so a capture copies only what will go);
  // false counts one dropped write.
  bool AdmitWrite(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues SET key <source's value>; never blocks. false: dropped (full or down) and counted,
  // the source destroyed before returning. Writes go in order (a capture queues its blocks
  // before its boundary state).
  bool Enqueue(std::string key, std::unique_ptr<RemoteValueSource> source)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same for a value already in memory.
  bool Enqueue(std::string key, std::string value) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the queue is empty and no write is in flight, or `timeout`; whether it emptied.
  bool Flush(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Shutdown: Flush(timeout), then drops what is still queued (a write in flight finishes),
  // counted in dropped_writes; returns how many writes it dropped.
  uint64_t FlushOrDrop(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  // Read-through, answered within `deadline`: DEADLINE_EXCEEDED past it (the call goes on in its
  // reader, bounded by the client's timeouts, and its answer is dropped), UNAVAILABLE at once
  // while the tier is down or the reader queue is full, else the client's status.
  absl::StatusOr<std::vector<bool>> ExistsEach(std::vector<std::string> keys,
                                               absl::Duration deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Values (nullopt: absent) of `keys`, fetched by up to reader_threads readers in parallel.
  absl::StatusOr<std::vector<std::optional<std::string>>> GetEach(std::vector<std::string> keys,
                                                                  absl::Duration deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Deletes a value found corrupt; best effort, queued behind the writes (never blocks).
  void Discard(std::string key) ABSL_LOCKS_EXCLUDED(mu_);

  // What a restore pulled and refused (the prefix cache counts; the tier reports).
  struct PullCounts {
    uint64_t pieces = 0;
    uint64_t bytes = 0;
    uint64_t corrupt = 0;
    uint64_t shape_mismatches = 0;
  };
  void RecordPull(const PullCounts& counts) ABSL_LOCKS_EXCLUDED(mu_);

  bool Up() const ABSL_LOCKS_EXCLUDED(mu_);
  RemoteTierStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One queued write (source null: a DEL of a corrupt value).
  struct Write {
    std::string key;
    std::unique_ptr<RemoteValueSource> source;
  };
  // A read call shared by its caller and the readers; outlives an abandoned caller.
  struct ReadCall;

  RemoteTier(RemoteTierOptions options, std::shared_ptr<RedisClusterClient> client);
  void WriterLoop() ABSL_LOCKS_EXCLUDED(mu_);
  void ReaderLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `jobs` (one per reader task) on the readers and waits for all of them or the deadline.
  absl::Status RunRead(std::vector<std::function<absl::Status(RedisClusterClient&)>> jobs,
                       absl::Duration deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // The breaker's view of a call's status: transport failures count, anything else resets the
  // count of its own path only (writer SETs to healthy masters say nothing of whether reads get
  // answered). kBreakerFailures consecutive failures on either path open the breaker. A call
  // the client refused without I/O because its node is in back-off says nothing either way:
  // one dead node is the client's to isolate (its slots miss), not a reason to stop serving
  // every other node's slots.
  enum class CallPath { kRead, kWrite };
  void Report(CallPath path, const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  void ReportLocked(CallPath path, const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OpenBreakerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Flush's wait, under mu_: whether the queue emptied (no write in flight) within `timeout`.
  bool AwaitDrainedLocked(absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the queue into `dropped` (destroy it after mu_ is released: sources release their
  // holds), counting its values (not deletes) in dropped_writes; returns that count.
  uint64_t DropQueuedLocked(std::deque<Write>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool UpLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The writer's probe when the back-off has passed: a client (re-)created or its slot map
  // refreshed closes the breaker.
  void Probe() ABSL_LOCKS_EXCLUDED(mu_);

  const RemoteTierOptions options_;

  mutable absl::Mutex mu_;
  std::shared_ptr<RedisClusterClient> client_ ABSL_GUARDED_BY(mu_);  // null: never reached
  std::deque<Write> writes_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a write is in flight
  std::deque<std::shared_ptr<ReadCall>> read_calls_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The breaker: open (down) until open_until_; backoff_ the next period.
  int consecutive_read_failures_ ABSL_GUARDED_BY(mu_) = 0;   // a caller's deadline counts
  int consecutive_write_failures_ ABSL_GUARDED_BY(mu_) = 0;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time open_until_ ABSL_GUARDED_BY(mu_);
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_);
  RemoteTierStats stats_ ABSL_GUARDED_BY(mu_);
  // Failed writes and partly answered lookups are logged at most once per kLogInterval each
  // (a dead node fails every call for its slots); the lines skipped are counted in the next.
  struct LogWindow {
    absl::Time last = absl::InfinitePast();
    uint64_t skipped = 0;
  };
  static constexpr absl::Duration kLogInterval = absl::Seconds(10);
  // Whether a line may be logged now; `skipped` is then the count to report (and is reset).
  bool AdmitLogLocked(LogWindow& window, uint64_t& skipped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  LogWindow write_failure_log_ ABSL_GUARDED_BY(mu_);
  LogWindow partial_lookup_log_ ABSL_GUARDED_BY(mu_);

  std::thread writer_;
  std::vector<std::thread> readers_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_REMOTE_TIER_H_
