#ifndef MEMRA_COMMON_STEP_CHANNEL_H_
#define MEMRA_COMMON_STEP_CHANNEL_H_

// The step channel's shared-memory layout (docs/step-channel.md): the one definition the daemon
// (server/edge/step_channel.h) and the engine library (client/step_channel_client.h) both use.
//
// The daemon creates one region per engine (a sealed memfd, handed to that engine only over the
// handoff socket, with an eventfd the engine writes to wake the daemon). The region holds
//
//   [0, 4096)                                  StepChannelHeader
//   [submissions_offset, + slots x 64)         submission ring: SubmissionRecord[slots]
//   [completions_offset, + slots x 96)         completion ring: CompletionRecord[slots]
//   [submission_side_offset, + slots x 1 KiB)  submission side area: ring slot i owns span i
//   [completion_side_offset, + slots x 8 KiB)  completion side area: ring slot i owns span i
//
// Ring counters are free-running u32s (an index is counter % slots; slots is a power of two).
// Who writes what: the engine writes submission records, sq_tail and cq_head; the daemon writes
// completion records, sq_head, cq_tail, daemon_sleeping and closed. Each side keeps its own
// counters privately and never reads them back from the region (the engine can write anything
// anywhere in it); it reads the other side's counters once per round and bounds-checks them.

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/transaction.h"

namespace memra::step_channel {

inline constexpr uint32_t kMagic = 0x4d4b5343;  // "CSKM" little-endian: memra kv step channel
// Version 2: records carry plain numbers only (version 1's completions named protobuf's
// StepResult payload field and carried a plan as PrepareAppendResponse wire bytes). The header
// and every submission record carry it; the daemon refuses a record of another version.
inline constexpr uint32_t kVersion = 2;
inline constexpr uint32_t kPreviousVersion = 1;  // refused: named in the refusal
inline constexpr uint32_t kSlots = 512;  // records in flight per ring; a power of two
inline constexpr uint32_t kSubmissionSideBytes = 1024;  // per slot: 256 token ids
inline constexpr uint32_t kCompletionSideBytes = 8192;  // per slot: a message or layer plans
inline constexpr size_t kHeaderBytes = 4096;
// The most entries one Step may carry, on either path: the Step RPC refuses more
// (server/edge/cache_service.h), and the engine library sends such a Step over gRPC for that
// refusal.
inline constexpr int kMaxStepEntries = 65536;

// Submission record operations: the session operations a record may carry (the daemon decodes
// each straight into its SessionOp, server/session/session_ops.h). A completion echoes its
// record's operation (CompletionRecord::op), which says which of its fields are set.
//
// Room to grow: 7 to 15 are reserved for session lifecycle records (issue 32 item 2: create
// and release of pooled sessions); a new kind takes the next free value, raises kMaxOp, and
// documents its fields in docs/step-channel.md. A daemon refuses operations above its kMaxOp
// (INVALID_ARGUMENT naming the range), so an engine library learns at its first record that
// the daemon is older. An operation that changes which session a slot names (a release, a
// create) must also end the daemon's batch of slot lookups (server/edge/step_channel.h).
enum class Op : uint8_t {
  kBegin = 1,    // -> generation, base_len
  kPrepare = 2,  // -> generation, target, the plan (LayerAppendRecord[] in the side span)
  kPublish = 3,  // -> staged_len
  kCommit = 4,   // -> committed_len
  kAbort = 5,    // -> committed_len
  kAdvance = 6,  // -> committed_len, published; with next rows: generation, target, the plan
};
inline constexpr uint8_t kMaxOp = 6;

// What a completion's side span holds.
enum class CompletionSide : uint8_t {
  kNone = 0,
  kMessage = 1,  // the refusal message (UTF-8)
  kLayers = 2,   // the prepared append's plan: LayerAppendRecord[side_length / 40], layer order
  // The append was prepared but its plan (side_length bytes) does not fit the side span: only
  // for a session over kMaxKvLayers, which engines step over gRPC instead.
  kLayersTooLarge = 3,
};

// One K/V layer of a prepared append (core's LayerAppend): where its rows go.
struct LayerAppendRecord {
  uint32_t layer = 0;
  uint8_t flags = 0;  // kLayerRing | kLayerRebase
  uint8_t reserved[3] = {};
  uint64_t write_row = 0;  // physical row of the first appended row
  uint64_t src_row = 0;    // a rebase: move keep_rows rows from src_row to row 0 first
  uint64_t keep_rows = 0;
  uint64_t new_base = 0;  // a rebase: the ring's base after publish
};
static_assert(sizeof(LayerAppendRecord) == 40);
inline constexpr uint8_t kLayerRing = 1;    // a ring layer (core: ring_append is set)
inline constexpr uint8_t kLayerRebase = 2;  // its append rebases the ring first

// Sessions of at most this many K/V layers are stepped over the channel: their prepared plan
// always fits a completion side span (128 x 40 bytes < kCompletionSideBytes).
inline constexpr uint32_t kMaxKvLayers = 128;
static_assert(kMaxKvLayers * sizeof(LayerAppendRecord) <= kCompletionSideBytes);

// Engine -> daemon: one session operation addressed by slot.
struct SubmissionRecord {
  uint64_t user_data = 0;  // echoed in the completion
  uint32_t slot = 0;
  uint8_t op = 0;  // Op
  // kVersion. Version 1 had no such field (its reserved bytes were zero): a version-1 record
  // reads as version 0 and is refused naming both versions.
  uint8_t version = kVersion;
  uint8_t reserved[2] = {};
  uint64_t generation = 0;
  uint64_t rows = 0;            // Prepare rows; Commit / Advance accepted_rows
  uint64_t next_rows = 0;       // Advance
  uint64_t side_offset = 0;     // token ids (int32, little-endian) in the submission side area
  uint32_t side_length = 0;     // bytes: 4 x token ids
  uint32_t reserved2 = 0;
  uint64_t reserved3 = 0;
};
static_assert(sizeof(SubmissionRecord) == 64);

// Daemon -> engine: one record's outcome.
struct CompletionRecord {
  uint64_t user_data = 0;
  int32_t code = 0;       // google.rpc.Code (0 = OK)
  uint8_t op = 0;         // OK: the record's Op, saying which fields below are set; else 0
  uint8_t published = 0;  // Advance
  uint8_t has_prepared = 0;  // Prepare, or Advance with next rows: the plan is in the side span
  uint8_t side_kind = 0;     // CompletionSide
  uint64_t generation = 0;   // Begin; Prepare / Advance's prepared
  uint64_t base_len = 0;     // Begin
  uint64_t target = 0;       // Prepare / Advance's prepared
  uint64_t staged_len = 0;   // Publish
  uint64_t committed_len = 0;  // Commit, Abort, Advance
  uint64_t restart_previous_epoch = 0;  // the restart error's epochs (common/daemon_restart.h)
  uint64_t restart_epoch = 0;
  uint64_t side_offset = 0;  // in the completion side area
  uint32_t side_length = 0;
  uint32_t reserved = 0;
  uint64_t reserved2 = 0;
};
static_assert(sizeof(CompletionRecord) == 96);

// Why the daemon stopped reading a channel (StepChannelHeader.closed).
enum class CloseReason : uint32_t {
  kOpen = 0,
  kEngineReclaimed = 1,  // the lease ended and the engine was reclaimed
  kReplaced = 2,         // the engine opened a new channel
  kCorrupt = 3,          // an absurd counter: the engine broke the protocol
  kShutdown = 4,         // the daemon stopped
};

struct alignas(64) StepChannelHeader {
  // Constant after creation (the daemon writes them before handing the region over).
  uint32_t magic;
  uint32_t version;
  uint32_t slots;
  uint32_t submission_record_bytes;
  uint32_t completion_record_bytes;
  uint32_t submission_side_bytes;  // per slot
  uint32_t completion_side_bytes;  // per slot
  uint32_t reserved0;
  uint64_t region_bytes;
  uint64_t submissions_offset;
  uint64_t completions_offset;
  uint64_t submission_side_offset;
  uint64_t completion_side_offset;
  // Submission ring.
  alignas(64) std::atomic<uint32_t> sq_tail;  // engine: records written
  alignas(64) std::atomic<uint32_t> sq_head;  // daemon: records taken (informational)
  // Completion ring. cq_tail is also the engine's futex word (FUTEX_WAIT on the shared mapping).
  alignas(64) std::atomic<uint32_t> cq_tail;  // daemon: completions written
  std::atomic<uint32_t> engine_waiting;       // engine: non-zero while in FUTEX_WAIT on cq_tail
  alignas(64) std::atomic<uint32_t> cq_head;  // engine: completions read
  // Wake-ups of the daemon: while daemon_sleeping is non-zero, an engine that publishes
  // sq_tail writes 1 to the channel's eventfd.
  alignas(64) std::atomic<uint32_t> daemon_sleeping;
  std::atomic<uint32_t> closed;  // CloseReason; non-zero: the daemon reads no more
};
static_assert(sizeof(StepChannelHeader) <= kHeaderBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

// Where each part of the region lies (the header's constant fields).
struct Layout {
  uint64_t submissions_offset = 0;
  uint64_t completions_offset = 0;
  uint64_t submission_side_offset = 0;
  uint64_t completion_side_offset = 0;
  uint64_t region_bytes = 0;
};
// The layout of a channel of `slots` ring slots (every part page-aligned).
Layout LayoutFor(uint32_t slots);

// Core's LayerAppend as a record and back (the one conversion, for the daemon and the client).
LayerAppendRecord ToRecord(const LayerAppend& layer);
LayerAppend FromRecord(const LayerAppendRecord& record);

// Writes the constant fields and zeroes the counters. REQUIRES: `region` holds
// LayoutFor(kSlots).region_bytes zeroed bytes.
void InitializeHeader(void* region);

// The engine's check of a region it was handed (`bytes` as the handoff frame said):
// INVALID_ARGUMENT naming the field and both values when a constant field disagrees with this
// library's layout (another version, sizes, offsets) or the region is smaller than it claims.
absl::Status CheckHeader(const StepChannelHeader& header, uint64_t bytes);

// FUTEX_WAIT on a word of a MAP_SHARED mapping (shared futex: not FUTEX_PRIVATE_FLAG) while it
// holds `expected`, for at most `timeout`. Returns after a wake, a timeout, a signal or when
// the word already differs; callers re-check what they wait for.
void FutexWait(std::atomic<uint32_t>& word, uint32_t expected, absl::Duration timeout);
// FUTEX_WAKE of every waiter on `word` (shared futex).
void FutexWakeAll(std::atomic<uint32_t>& word);

}  // namespace memra::step_channel

#endif  // MEMRA_COMMON_STEP_CHANNEL_H_
