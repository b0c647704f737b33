#ifndef MEMRA_CLIENT_CLIENT_H_
#define MEMRA_CLIENT_CLIENT_H_

// The library an engine links to use memra-kvd: attach (the lease is kept alive on its own
// thread), register a model plan, create sessions whose planes resolve to pointers in this
// process, and drive every state change through typed calls returning absl::Status(Or). Every
// unary RPC carries a deadline (ClientOptions::deadline).
//
// Opening an arena is expensive (a CUDA IPC open costs ~1 ms), so opens stay off the per-step
// path: a session maps its arena once at creation (the mapper caches by handle and never
// re-opens), Reset() makes it empty again on the same arena, only Grow() maps a new one, and a
// released arena stays mapped for the next session that gets it back (the arena pool, below).
//
//   ASSIGN_OR_RETURN(std::unique_ptr<memra::KvClient> client,
//                    memra::KvClient::Connect("/run/memra-kv/gpu0.sock"));
//   RETURN_IF_ERROR(client->Attach("my-engine"));
//   ASSIGN_OR_RETURN(memra::PlanFingerprint plan, client->RegisterPlan(model_plan));
//   memra::SessionOptions options;
//   options.capacity = 8192;  // tokens
//   ASSIGN_OR_RETURN(std::unique_ptr<memra::Session> session,
//                    client->CreateSession(plan, options));
//   ASSIGN_OR_RETURN(memra::PlaneView k0, session->Plane(0, memra::PlaneKind::kKeys));
//   // A plan in an element format (bf16, f16, f32, fp8): the same plane as an array,
//   // element type + shape (rows, heads, head_dim) + byte strides (docs/rules.md#formats).
//   ASSIGN_OR_RETURN(memra::TypedPlaneView k0t, session->TypedPlane(0, memra::PlaneKind::kKeys));
//   ASSIGN_OR_RETURN(memra::Transaction tx, session->Begin());
//   ASSIGN_OR_RETURN(memra::PreparedAppend append, session->PrepareAppend(tx.generation, 4));
//   ... kernels write 4 rows at append.layers[i].write_row (after any ring rebase copy) ...
//   RETURN_IF_ERROR(session->PublishAppend(tx.generation).status());
//   ASSIGN_OR_RETURN(uint64_t committed, session->Commit(tx.generation, /*accepted_rows=*/3));
//
// Everything here is the project's own types (core/ values and the structs below); the wire's
// generated protobuf / gRPC types stay inside client/ and common/. Bad-input tests and operator
// tools that need the raw calls use client/internal.h.
//
// One KvClient is one connection: the gRPC channel, the lease and the handoff connection. The
// session calls are here; the prefix cache and the block store are views over the same
// connection, each in its own header: client->prefixes() (client/prefix_client.h: Capture /
// Lookup / Restore / SubscribeEvents) and client->block_store() (client/block_store_client.h:
// OfferPoolBuffer / RegisterPool / Lookup / Store / Load / Unpin ...). A view is cheap and
// valid while its KvClient lives; after that its calls are refused (FAILED_PRECONDITION).
//
// A batched engine sends one Step() for all its sessions per decode step (StepBatch), reusing
// one batch and one outcomes vector across steps. Which entries to send:
//   * the hot path: ONE StepBatch::Advance per session per step (finish the previous step's
//     transaction, publishing and committing its accepted rows, and prepare the next step's
//     rows). Same rules and refusals as the separate entries, all or nothing, and a quarter of
//     the entries (bench/README.md section 1b).
//   * the separate Begin / Prepare / Publish / Commit / Abort entries (or unary calls) when the
//     engine needs a state between them, e.g. mirrors published before its kernels run, or
//     an Abort.
//   * StepBatch(StepAddressing::kSlot) names each session by the dense slot CreateSession gave
//     it (Session::slot()) instead of id + token: a cheaper lookup, only for this engine's own
//     sessions (the Step carries the engine's credentials).
//
//   StepBatch batch(memra::StepAddressing::kSlot);
//   for (Session* s : sessions) batch.Advance(*s, /*generation=*/0, 0, /*next_rows=*/1);
//   RETURN_IF_ERROR(client->Step(batch, outcomes));           // outcomes[i].prepared: rows
//   while (decoding) {
//     ... kernels write each session's row, the model runs, the sampler accepts ...
//     batch.Clear();
//     for (size_t i = 0; i < sessions.size(); ++i) {
//       batch.Advance(*sessions[i], outcomes[i].begun.generation, /*accepted_rows=*/1, 1);
//     }
//     RETURN_IF_ERROR(client->Step(batch, outcomes));
//   }
//
// The step channel (docs/step-channel.md): when the daemon offers one (config step_channel,
// default on), Attach also maps a shared-memory ring pair handed to this engine alone, and Step
// carries a slot-addressed batch through it as fixed-size records instead of a Step RPC: no
// serialization, no socket round trip, a futex wake only when a side sleeps. Which path a batch
// takes (KvClient::Step decides; StepBatch::ChannelEligible says):
//   * the channel: StepAddressing::kSlot, no wait event, sessions of at most 128 K/V layers,
//     at most 256 token ids per entry. The decode loop above, on the host backend.
//   * gRPC: everything else (id + token addressing, a batch carrying a cuda wait event, huge
//     models), ClientOptions::force_grpc_step, or a daemon without the channel.
// Both paths reach the same dispatcher in the daemon: the same outcomes, codes and messages. A
// channel failure (the daemon closed it, e.g. at a reclaim, or answered nothing within the
// deadline) is that Step's UNAVAILABLE; the client then steps over gRPC.
//
// Arena pool: ReleaseSession keeps the session's arena in this engine's pool in the daemon
// (arena_pool_engine_bytes), and this client keeps it mapped; the next CreateSession of the same
// size gets it back under the same handle, so a request-per-session engine opens no new
// mapping in steady state. The daemon frees pooled arenas when admission needs the room or the
// lease ends, and the next CreateSession / ReleaseSession reply tells this client to unmap them.
//
// Engine process settings worth making (bench/README.md measured both): Debian's Abseil checks
// every absl::Mutex acquisition for lock-order cycles, so call
// absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore) at the top of main(); and
// glibc's default malloc trim threshold returns a big step's freed memory to the kernel after
// every step, so consider mallopt(M_TRIM_THRESHOLD, ...) as memra-kvd does (server/main.cc).
//
// Ordering: the daemon touches device memory in SpecSnapshot, SpecRollback, Grow, prefix
// Capture / Restore and when it writes the length/base mirrors (PublishAppend, Commit, Abort,
// Rewind, Reset). On the cuda backend, finish the kernels that read or write those planes before
// such a call: synchronize, or record an interprocess event and pass it (Session::SetWaitEvent).
// Every such call replies only after the daemon's own copies are complete in device memory. On
// the host backend the call order is the order.

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/mapper.h"
#include "common/daemon_restart.h"
#include "core/model_plan.h"
#include "core/sizing.h"
#include "core/transaction.h"

namespace memra {

struct ClientOptions {
  // Deadline of every unary RPC, and of Connect's wait for the socket.
  absl::Duration deadline = absl::Seconds(10);
  // Maps arena exports. Null: a HostArenaMapper (the host backend). An engine on the cuda
  // backend passes a CudaArenaMapper.
  std::shared_ptr<ArenaMapper> mapper;
  // The daemon's handoff socket (its handoff_socket_path): Attach gets its ticket there, and
  // host arenas' descriptors come over it. Empty: the socket path given to Connect with
  // ".sock" replaced by ".handoff.sock" (appended when it does not end in ".sock"), as the
  // daemon derives it by default.
  std::string handoff_socket_path;
  // The prefix-cache scope to attach in (proto Hello.cache_scope): empty = this user's own
  // ("uid:<uid>"); a named one must be allowed by the daemon's cache_scope_allow.
  std::string cache_scope;
  // Step over gRPC even when the daemon offers the step channel (docs/step-channel.md):
  // KvClient::Step then never uses shared memory. For comparisons and for a daemon whose
  // channel an operator wants unused.
  bool force_grpc_step = false;
};

// The handoff socket beside `socket_path` when none is configured (ClientOptions).
std::string DefaultHandoffSocketPath(absl::string_view socket_path);

struct SessionOptions {
  uint64_t capacity = 0;  // context capacity, tokens
  uint32_t layer_lo = 0;
  std::optional<uint32_t> layer_hi;  // unset: every layer
  uint32_t tp_ranks = 1;
  bool spec_snapshot = false;
  // From KvClient::Reserve for this shape (0: admit at creation). A session created from a
  // reservation is never refused for room.
  uint64_t reservation_id = 0;
};

// What KvClient::Reserve holds: exactly the bytes the session will take, for ttl.
struct SessionReservation {
  uint64_t id = 0;
  uint64_t bytes = 0;
  absl::Duration ttl;
};

struct Transaction {
  uint64_t generation = 0;
  uint64_t base_len = 0;  // rows committed when it began
};

struct PreparedAppend {
  uint64_t generation = 0;
  uint64_t target = 0;              // staged rows after the append
  std::vector<LayerAppend> layers;  // one per K/V layer; ring rebases to perform first
};

// ---- A session's memory as the daemon exported it (proto SessionLayout) ----

// One exported memory region; the session maps it once (client/mapper.h).
struct SessionArena {
  std::string backend;  // "host" or "cuda"
  // host, and cuda in VMM mode: an opaque token naming the arena to the handoff socket
  // (docs/handoff.md), which hands its fd to the owning engine only; cuda IPC mode: the 64
  // bytes of cudaIpcMemHandle_t.
  std::string handle;
  uint64_t bytes = 0;
  bool operator==(const SessionArena&) const = default;
};

// One plane of a layer: `bytes` at `offset` in arena `arena` (an index into
// SessionLayout::arenas), `rows` rows of `row_bytes` (1 row for mirrors and recurrent state).
struct SessionPlane {
  PlaneKind kind = PlaneKind::kKeys;
  uint32_t arena = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
  bool operator==(const SessionPlane&) const = default;
};

// One layer with state of its own; the fields are LayerGeometry's (core/sizing.h).
struct SessionLayer {
  uint32_t layer = 0;
  StateKind kind = StateKind::kNone;
  KvFormats formats;           // K/V layers: resolved formats (docs/rules.md#formats)
  uint64_t k_token_bytes = 0;  // rank-local
  uint64_t v_token_bytes = 0;
  uint64_t head_dim_k = 0;     // K/V layers: elements per head
  uint64_t head_dim_v = 0;
  uint64_t n_head_kv = 0;      // rank-local heads
  std::vector<float> k_scale;  // fp8 element formats: the plan's scales (empty = 1.0)
  std::vector<float> v_scale;
  ElementFormat latent_format = ElementFormat::kF32;  // latent layers
  uint64_t window = 0;         // sliding layers
  uint64_t physical_rows = 0;  // K/V rows allocated: ring rows, or capacity
  bool ring = false;           // physical row = absolute row - ring base
  uint64_t latent_width = 0;
  uint64_t index_width = 0;
  uint64_t index_pool = 0;
  uint64_t index_physical_rows = 0;  // 0: no indexer
  bool index_ring = false;
  std::vector<SessionPlane> planes;
  bool operator==(const SessionLayer&) const = default;
};

struct SessionLayout {
  uint64_t version = 0;   // starts at 1; Grow adds one
  uint64_t capacity = 0;  // tokens
  std::vector<SessionArena> arenas;
  std::vector<SessionLayer> layers;  // in layer order
  bool operator==(const SessionLayout&) const = default;
};

// ---- A session's lengths as the daemon holds them (proto SessionState) ----

struct LayerSnapshot {
  uint32_t layer = 0;
  int64_t length = 0;      // the layer's length mirror, rows
  uint64_t ring_base = 0;  // ring layers: absolute row at physical row 0 (else 0)
  bool ring = false;
  uint64_t index_pools_ready = 0;  // latent layers with an indexer: pools whose keys are final
  bool operator==(const LayerSnapshot&) const = default;
};

struct SessionSnapshot {
  uint64_t layout_version = 0;
  uint64_t capacity = 0;           // tokens
  uint64_t committed_len = 0;      // rows
  uint64_t staged_len = 0;         // rows (== committed_len outside a transaction)
  uint64_t position = 0;           // tokens (== committed_len except after SpecRollback)
  uint64_t active_generation = 0;  // 0: no transaction
  uint64_t next_generation = 0;    // what the next Begin gets
  bool tainted = false;
  bool spec_snapshot_valid = false;
  bool grow_pending = false;  // a grow awaits its acknowledgement
  std::vector<LayerSnapshot> layers;
  bool operator==(const SessionSnapshot&) const = default;
};

// One plane resolved in this process.
struct PlaneView {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
};

// A plane of `layer` in `layout` whose arenas are mapped at `bases` (one per layout arena).
// NOT_FOUND when the layer has no such plane.
absl::StatusOr<PlaneView> ResolvePlane(const SessionLayout& layout,
                                       const std::vector<uint8_t*>& bases, uint32_t layer,
                                       PlaneKind kind);

// A plane of element-format values seen as an array, as a kernel or torch indexes it: element
// [row][head][i] is at data + row * strides[0] + head * strides[1] + i * strides[2] (strides in
// bytes). K / V planes: (rows, rank-local n_head_kv, head_dim_k / head_dim_v) in the layer's
// element format; latent rows: (rows, 1, latent_width) in its latent format; the f32 indexer,
// pool-key, conv and SSM planes: (rows, 1, row_bytes / 4) f32. `data` is a device pointer on
// the cuda backend. The 8-byte tail pad of K/V planes is outside the shape.
struct TypedPlaneView {
  uint8_t* data = nullptr;
  ElementFormat element = ElementFormat::kF32;
  uint64_t element_bytes = 0;
  std::array<uint64_t, 3> shape{};    // rows, heads, head_dim
  std::array<uint64_t, 3> strides{};  // bytes
  std::vector<float> scale;           // fp8: the plan's k_scale / v_scale (empty = 1.0)
};
// FAILED_PRECONDITION for a plane in a block format (q8_0, q5_1, q4_0, fp8: read them as bytes
// through ResolvePlane; layouts in docs/rules.md#formats) and for the i32 mirrors, naming the
// layer, plane and format; NOT_FOUND as ResolvePlane.
absl::StatusOr<TypedPlaneView> ResolveTypedPlane(const SessionLayout& layout,
                                                 const std::vector<uint8_t*>& bases,
                                                 uint32_t layer, PlaneKind kind);

// True when `status` is the error for "memra-kvd restarted and this did not come back"
// (common/daemon_restart.h: FAILED_PRECONDITION naming both epochs; GetDaemonRestart reads
// them). The engine must create that session (or attach) again: its old memory is not served.
// Sessions the restarted daemon re-adopted carry on without this error.
inline bool IsDaemonRestarted(const absl::Status& status) {
  return GetDaemonRestart(status).has_value();
}

// One entry's result; which fields are set depends on the entry's operation.
struct StepOutcome {
  absl::Status status;
  Transaction begun;                       // Begin; Advance with next rows
  std::optional<PreparedAppend> prepared;  // Prepare; Advance with next rows
  uint64_t staged_len = 0;                 // Publish
  uint64_t committed_len = 0;              // Commit, Abort, Advance
  bool published = false;                  // Advance: it published the finished append
};

class BlockStoreClient;
class ClientConnection;
class ClientInternals;
class KvClient;
class PrefixClient;

// Thread-compatible (one engine thread drives a session; calls on different sessions may run
// concurrently). REQUIRES: the KvClient outlives its sessions.
class Session {
 public:
  ~Session();  // Release(), best effort
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint64_t id() const { return id_; }
  // The dense slot the daemon handed out (StepAddressing::kSlot names the session by it).
  uint32_t slot() const { return slot_; }
  const SessionLayout& layout() const { return layout_; }

  // Cross-process device ordering (cuda backend; proto DeviceOrdering). The engine creates one
  // event with cudaEventInterprocess | cudaEventDisableTiming, sets its cudaIpcGetEventHandle
  // here once, and records it on its stream after its last kernel on this session before each
  // call: every later call that makes the daemon touch the session's device memory (publish,
  // commit, abort, rewind, hydrate, reset, spec snapshot/rollback, grow, release, and
  // PrefixClient::Capture / Restore of this session) carries it, and the daemon waits
  // for it first. Replies come after the daemon's own device work is complete. Empty (the
  // default): the engine synchronizes its stream before such calls itself. Host backend: leave
  // it empty (the daemon refuses events there).
  void SetWaitEvent(std::string ipc_event_handle) { wait_event_ = std::move(ipc_event_handle); }
  const std::string& wait_event() const { return wait_event_; }

  // A plane of `layer` resolved to this process's mapping. NOT_FOUND when the layer has no such
  // plane. Pointers stay valid until Grow() or Release().
  absl::StatusOr<PlaneView> Plane(uint32_t layer, PlaneKind kind) const;
  // The same plane typed (ResolveTypedPlane): shape (rows, heads, head_dim), element type,
  // strides. Valid as long as Plane()'s pointers.
  absl::StatusOr<TypedPlaneView> TypedPlane(uint32_t layer, PlaneKind kind) const;
  absl::StatusOr<uint8_t*> PlanePointer(uint32_t layer, PlaneKind kind) const;

  absl::StatusOr<Transaction> Begin();
  // On a DSA indexer tail ring, a prepare that would overwrite the live tail an Abort (or a
  // commit of every published row) needs is FAILED_PRECONDITION naming the room left: start a
  // chunk longer than the ring at a pool boundary (docs/rules.md, "Indexer residency"). Abort
  // is then never refused for residency.
  absl::StatusOr<PreparedAppend> PrepareAppend(uint64_t generation, uint64_t rows);
  absl::StatusOr<uint64_t> PublishAppend(uint64_t generation);                   // staged rows
  // `token_ids`: the accepted rows' token ids, in order (exactly accepted_rows of them), or none
  // (proto CommitRequest.token_ids: the daemon keeps them for the prefix cache). Returns the
  // committed length.
  absl::StatusOr<uint64_t> Commit(uint64_t generation, uint64_t accepted_rows,
                                  absl::Span<const int32_t> token_ids = {});
  absl::StatusOr<uint64_t> Abort(uint64_t generation);                           // committed rows
  // One decode step in one call (StepBatch::Advance, as a one-entry Step carrying this
  // session's wait event). The outcome's Advance fields are set (StepOutcome); a refusal is the
  // returned status and changed nothing.
  absl::StatusOr<StepOutcome> Advance(uint64_t generation, uint64_t accepted_rows,
                                      uint64_t next_rows,
                                      absl::Span<const int32_t> token_ids = {});

  absl::StatusOr<SessionSnapshot> Rewind(uint64_t target);
  absl::StatusOr<bool> CanRewind(uint64_t target);
  // Fresh session only: publishes `logical_len` rows already written through the mapped planes.
  // `resident_starts` per K/V layer (empty: flat 0, ring layers their aligned live window).
  absl::StatusOr<SessionSnapshot> Hydrate(uint64_t logical_len,
                                          const std::vector<uint64_t>& resident_starts = {});
  absl::StatusOr<SessionSnapshot> SpecSnapshot();
  absl::StatusOr<SessionSnapshot> SpecRollback(uint64_t accept_len);
  // Empty again on the same arena: nothing is re-opened.
  absl::StatusOr<SessionSnapshot> Reset();
  absl::StatusOr<SessionSnapshot> Taint(const std::string& reason);
  absl::StatusOr<SessionSnapshot> State();

  // Regrows to `target_capacity`: maps the new arena, acknowledges the new layout (the daemon
  // then frees the old arena) and unmaps the old one. REQUIRES: no kernel uses old pointers.
  absl::StatusOr<SessionSnapshot> Grow(uint64_t target_capacity);

  // Frees the session's memory in the daemon and unmaps it here. Returns the bytes freed.
  absl::StatusOr<uint64_t> Release();

 private:
  friend class KvClient;
  friend class ClientInternals;
  Session(KvClient* client, uint64_t id, std::string token, uint32_t slot)
      : client_(client), id_(id), token_(std::move(token)), slot_(slot) {}

  // Maps every arena of `layout` (cache hits for arenas already mapped).
  absl::Status Adopt(SessionLayout layout);
  void UnmapAll(const SessionLayout& layout);

  KvClient* const client_;
  const uint64_t id_;
  const std::string token_;  // proto SessionRef.session_token: the session's capability
  const uint32_t slot_;
  std::string wait_event_;
  SessionLayout layout_;
  std::vector<uint8_t*> arena_bases_;  // parallel to layout_.arenas
  bool released_ = false;
};

// How a StepBatch names its sessions: by id and token (any client holding both), or by the
// dense slot (cheaper for the daemon to look up; only the attached engine that created the
// session, so the Step carries this client's engine credentials).
enum class StepAddressing { kSessionToken, kSlot };

// Per-step transaction calls for many sessions, sent as one Step RPC.
class StepBatch {
 public:
  explicit StepBatch(StepAddressing addressing = StepAddressing::kSessionToken);
  ~StepBatch();
  StepBatch(const StepBatch&) = delete;
  StepBatch& operator=(const StepBatch&) = delete;

  // The daemon waits for this interprocess event (Session::SetWaitEvent) before any entry.
  void SetWaitEvent(std::string ipc_event_handle);
  void Begin(const Session& session);
  void Prepare(const Session& session, uint64_t generation, uint64_t rows);
  void Publish(const Session& session, uint64_t generation);
  // `token_ids` as Session::Commit's.
  void Commit(const Session& session, uint64_t generation, uint64_t accepted_rows,
              absl::Span<const int32_t> token_ids = {});
  void Abort(const Session& session, uint64_t generation);
  // The decode loop's one entry per session per step (proto StepAdvance): finishes transaction
  // `generation` (publishing its prepared append first when not yet published, then committing
  // `accepted_rows`, with `token_ids` as Session::Commit's) and begins the next, preparing
  // `next_rows`. generation 0: the first step (nothing to finish); next_rows 0: the last (no
  // next transaction). The same rules and refusals as the separate entries, all or nothing.
  // Typical loop: Advance(s, 0, 0, n) once; then per step write the prepared rows, run the
  // model, Advance(s, outcome.begun.generation, accepted, n).
  void Advance(const Session& session, uint64_t generation, uint64_t accepted_rows,
               uint64_t next_rows, absl::Span<const int32_t> token_ids = {});
  size_t size() const;
  // Empties the batch for the next step; its storage is kept (protobuf keeps cleared entries).
  void Clear();
  // Whether KvClient::Step may carry this batch over the step channel: addressed by slot, no
  // wait event, every session of at most step_channel::kMaxKvLayers layers and every entry's
  // token ids within a record's side span (256). Otherwise it goes over gRPC.
  bool ChannelEligible() const;

 private:
  friend class KvClient;
  friend class ClientInternals;
  // The request and its reply memory (client.cc).
  struct Wire;
  const std::unique_ptr<Wire> wire_;
};


// Thread-safe.
class KvClient {
 public:
  // Connects to the daemon's Unix socket, waiting up to options.deadline (UNAVAILABLE).
  static absl::StatusOr<std::unique_ptr<KvClient>> Connect(const std::string& socket_path,
                                                           ClientOptions options = {});
  ~KvClient();  // Detach()

  // Connects to the handoff socket, opens the lease with its ticket and starts the thread that
  // keeps the lease alive (a heartbeat every third of the lease timeout). FAILED_PRECONDITION
  // when already attached; UNAVAILABLE when the handoff socket does not answer.
  //
  // When the lease stream breaks (the daemon restarted, or the connection dropped), the lease
  // thread, which reads the stream's answers as they come, notices at once and re-attaches as
  // the same engine (proto Hello.resume, with a fresh handoff connection's ticket and the same
  // cache scope) every 100 ms until the daemon answers:
  // a daemon that still knows the engine (or re-adopted it from its restart journal) gives the
  // lease back and the engine carries on with the same sessions and mappings; one that does not
  // answers with the restart error, which lease_lost() then holds, and re-attaching stops.
  // UNAVAILABLE goes on: no daemon yet, or (a crash loop) a ticket of a daemon that died before
  // the Attach reached the next one, which refuses another instance's ticket so.
  absl::Status Attach(const std::string& engine_name);
  // Ends the lease: the daemon frees this engine's sessions after its grace period.
  void Detach();
  // False once the daemon ended the lease (or the connection broke), until a re-attach.
  bool lease_alive() const;
  // Why re-attaching stopped (the daemon no longer knows this engine: IsDaemonRestarted, or
  // NOT_FOUND when it reclaimed it); OK while the lease is live or being re-attached.
  absl::Status lease_lost() const;
  // Re-attaches done after the lease stream broke (each kept the engine and its sessions).
  uint64_t reattaches() const;
  uint64_t engine_id() const;
  // The epoch of the daemon the lease is held with (Attached.epoch); 0 before Attach.
  uint64_t epoch() const;
  // The lease timeout the daemon announced.
  absl::Duration lease_timeout() const;
  // The prefix-cache scope the daemon attached this engine in (empty before Attach).
  std::string cache_scope() const;

  // REQUIRES: Attach() succeeded (the plan counts against this engine's max_engine_plans).
  absl::StatusOr<PlanFingerprint> RegisterPlan(const ModelPlan& plan);
  // REQUIRES: Attach() succeeded.
  absl::StatusOr<std::unique_ptr<Session>> CreateSession(const PlanFingerprint& plan,
                                                         const SessionOptions& options);
  // Admission ahead of creation: RESOURCE_EXHAUSTED carries the AdmissionRefusal numbers
  // (core/admission.h GetAdmissionRefusal). options.reservation_id is ignored.
  absl::StatusOr<SessionReservation> Reserve(const PlanFingerprint& plan,
                                             const SessionOptions& options);
  // Returns the reservation's bytes to the budget.
  absl::StatusOr<uint64_t> CancelReservation(uint64_t reservation_id);
  // Runs a batch; one outcome per entry, in order, into `outcomes` (resized). The RPC's own
  // failure is the returned status. A batch the step channel can carry (StepBatch::
  // ChannelEligible) goes over it when the daemon offered one and force_grpc_step is off: the
  // same outcomes, codes and messages as over gRPC (one dispatcher in the daemon), without an
  // RPC; a channel failure (the daemon closed it, no answer within the deadline) is the
  // returned UNAVAILABLE, and later steps go over gRPC. For a decode loop: keep one StepBatch (Clear() it between
  // steps) and one outcomes vector, and a step reuses their memory instead of allocating.
  // Not concurrently on one batch.
  absl::Status Step(StepBatch& batch, std::vector<StepOutcome>& outcomes);
  // The same, returning fresh outcomes.
  absl::StatusOr<std::vector<StepOutcome>> Step(StepBatch& batch);

  // The prefix cache and the block store, as views over this client's one connection and
  // lease (client/prefix_client.h, client/block_store_client.h; include the view's header to
  // use it). Cheap, copyable, usable before Attach (calls that need the lease say so); valid
  // while this KvClient lives, and refused with FAILED_PRECONDITION (never undefined
  // behaviour) once it is destroyed.
  PrefixClient prefixes() const;
  BlockStoreClient block_store() const;

  ArenaMapper& mapper();

  // Whether Step uses the step channel now (offered, opened, not broken, not forced off).
  bool step_channel_active() const;
  // Why no channel is in use: OK when one is, or the refusal that kept it closed (not offered,
  // forced off, the open failed, it broke).
  absl::Status step_channel_status() const;

 private:
  friend class ClientInternals;
  explicit KvClient(std::shared_ptr<ClientConnection> connection);

  // The channel, lease, handoff connection and step channel (client/connection.h); the views
  // hold weak references to it. Constant after construction.
  const std::shared_ptr<ClientConnection> connection_;
};

}  // namespace memra

#endif  // MEMRA_CLIENT_CLIENT_H_
