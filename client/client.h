#ifndef MEMRA_CLIENT_CLIENT_H_
#define MEMRA_CLIENT_CLIENT_H_

// The library an engine links to use memra-kvd: attach (the lease is kept alive on its own
// thread), register a model plan, create sessions whose planes resolve to pointers in this
// process, and drive every state change through typed calls returning absl::Status(Or). Every
// unary RPC carries a deadline (ClientOptions::deadline).
//
// Opening an arena is expensive (a CUDA IPC open costs ~1 ms), so opens stay off the per-step
// path: a session maps its arena once at creation (the mapper caches by handle and never
// re-opens), Reset() makes it empty again on the same arena, and only Grow() maps a new one.
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
//   ASSIGN_OR_RETURN(memra::Transaction tx, session->Begin());
//   ASSIGN_OR_RETURN(memra::PreparedAppend append, session->PrepareAppend(tx.generation, 4));
//   ... kernels write 4 rows at append.layers[i].write_row (after any ring rebase copy) ...
//   RETURN_IF_ERROR(session->PublishAppend(tx.generation).status());
//   ASSIGN_OR_RETURN(uint64_t committed, session->Commit(tx.generation, /*accepted_rows=*/3));
//
// A batched engine sends one Step() for all its sessions per decode step (StepBatch), reusing
// one batch and one outcomes vector across steps.
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

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "google/protobuf/arena.h"
#include "client/mapper.h"
#include "core/model_plan.h"
#include "core/sizing.h"
#include "core/transaction.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/cache.grpc.pb.h"

namespace memra {

struct ClientOptions {
  // Deadline of every unary RPC, and of Connect's wait for the socket.
  absl::Duration deadline = absl::Seconds(10);
  // Maps arena exports. Null: a HostArenaMapper (the host backend). An engine on the cuda
  // backend passes a CudaArenaMapper.
  std::shared_ptr<ArenaMapper> mapper;
};

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

// One plane resolved in this process.
struct PlaneView {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
};

// A plane of `layer` in `layout` whose arenas are mapped at `bases` (one per layout arena).
// NOT_FOUND when the layer has no such plane.
absl::StatusOr<PlaneView> ResolvePlane(const memra::kv::v1::SessionLayout& layout,
                                       const std::vector<uint8_t*>& bases, uint32_t layer,
                                       PlaneKind kind);

class KvClient;

// Thread-compatible (one engine thread drives a session; calls on different sessions may run
// concurrently). REQUIRES: the KvClient outlives its sessions.
class Session {
 public:
  ~Session();  // Release(), best effort
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  uint64_t id() const { return ref_.session_id(); }
  const memra::kv::v1::SessionRef& ref() const { return ref_; }
  const memra::kv::v1::SessionLayout& layout() const { return layout_; }

  // Cross-process device ordering (cuda backend; proto DeviceOrdering). The engine creates one
  // event with cudaEventInterprocess | cudaEventDisableTiming, sets its cudaIpcGetEventHandle
  // here once, and records it on its stream after its last kernel on this session before each
  // call: every later call that makes the daemon touch the session's device memory (publish,
  // commit, abort, rewind, hydrate, reset, spec snapshot/rollback, grow, release) carries it,
  // and the daemon waits for it first. Replies come after the daemon's own device work is
  // complete. Empty (the default): the engine synchronizes its stream before such calls itself.
  // Host backend: leave it empty (the daemon refuses events there). KvPrefixCache Capture and
  // Restore read / overwrite the session's planes too: callers building those requests set
  // their `ordering.wait_event` to wait_event() under the same contract.
  void SetWaitEvent(std::string ipc_event_handle) { wait_event_ = std::move(ipc_event_handle); }
  const std::string& wait_event() const { return wait_event_; }

  // A plane of `layer` resolved to this process's mapping. NOT_FOUND when the layer has no such
  // plane. Pointers stay valid until Grow() or Release().
  absl::StatusOr<PlaneView> Plane(uint32_t layer, PlaneKind kind) const;
  absl::StatusOr<uint8_t*> PlanePointer(uint32_t layer, PlaneKind kind) const;

  absl::StatusOr<Transaction> Begin();
  absl::StatusOr<PreparedAppend> PrepareAppend(uint64_t generation, uint64_t rows);
  absl::StatusOr<uint64_t> PublishAppend(uint64_t generation);                   // staged rows
  // `token_ids`: the accepted rows' token ids, in order (exactly accepted_rows of them), or none
  // (proto CommitRequest.token_ids: the daemon keeps them for the prefix cache). Returns the
  // committed length.
  absl::StatusOr<uint64_t> Commit(uint64_t generation, uint64_t accepted_rows,
                                  absl::Span<const int32_t> token_ids = {});
  absl::StatusOr<uint64_t> Abort(uint64_t generation);                           // committed rows

  absl::StatusOr<memra::kv::v1::SessionState> Rewind(uint64_t target);
  absl::StatusOr<bool> CanRewind(uint64_t target);
  // Fresh session only: publishes `logical_len` rows already written through the mapped planes.
  // `resident_starts` per K/V layer (empty: flat 0, ring layers their aligned live window).
  absl::StatusOr<memra::kv::v1::SessionState> Hydrate(
      uint64_t logical_len, const std::vector<uint64_t>& resident_starts = {});
  absl::StatusOr<memra::kv::v1::SessionState> SpecSnapshot();
  absl::StatusOr<memra::kv::v1::SessionState> SpecRollback(uint64_t accept_len);
  // Empty again on the same arena: nothing is re-opened.
  absl::StatusOr<memra::kv::v1::SessionState> Reset();
  absl::StatusOr<memra::kv::v1::SessionState> Taint(const std::string& reason);
  absl::StatusOr<memra::kv::v1::SessionState> State();

  // Regrows to `target_capacity`: maps the new arena, acknowledges the new layout (the daemon
  // then frees the old arena) and unmaps the old one. REQUIRES: no kernel uses old pointers.
  absl::StatusOr<memra::kv::v1::SessionState> Grow(uint64_t target_capacity);

  // Frees the session's memory in the daemon and unmaps it here. Returns the bytes freed.
  absl::StatusOr<uint64_t> Release();

 private:
  friend class KvClient;
  Session(KvClient* client, memra::kv::v1::SessionRef ref)
      : client_(client), ref_(std::move(ref)) {}

  // Maps every arena of `layout` (cache hits for arenas already mapped).
  absl::Status Adopt(memra::kv::v1::SessionLayout layout);
  void UnmapAll(const memra::kv::v1::SessionLayout& layout);

  KvClient* const client_;
  const memra::kv::v1::SessionRef ref_;
  std::string wait_event_;
  memra::kv::v1::SessionLayout layout_;
  std::vector<uint8_t*> arena_bases_;  // parallel to layout_.arenas()
  bool released_ = false;
};

// Per-step transaction calls for many sessions, sent as one Step RPC.
class StepBatch {
 public:
  // The daemon waits for this interprocess event (Session::SetWaitEvent) before any entry.
  void SetWaitEvent(std::string ipc_event_handle) {
    request_.mutable_ordering()->set_wait_event(std::move(ipc_event_handle));
  }
  void Begin(const Session& session);
  void Prepare(const Session& session, uint64_t generation, uint64_t rows);
  void Publish(const Session& session, uint64_t generation);
  // `token_ids` as Session::Commit's.
  void Commit(const Session& session, uint64_t generation, uint64_t accepted_rows,
              absl::Span<const int32_t> token_ids = {});
  void Abort(const Session& session, uint64_t generation);
  size_t size() const { return static_cast<size_t>(request_.entries_size()); }
  // Empties the batch for the next step; its storage is kept (protobuf keeps cleared entries).
  void Clear() { request_.Clear(); }
  const memra::kv::v1::StepRequest& request() const { return request_; }

 private:
  friend class KvClient;
  memra::kv::v1::StepEntry* Add(const Session& session);
  // The reply of KvClient::Step(batch, outcomes), parsed into `reply_arena_`, whose first block
  // is `reply_block_`: sized to the largest reply so far, it is reused (Arena::Reset keeps a
  // caller's initial block), so a steady decode loop allocates nothing for its replies.
  memra::kv::v1::StepResponse* NewReply();
  void RecycleReply();

  memra::kv::v1::StepRequest request_;
  std::vector<char> reply_block_;
  std::unique_ptr<google::protobuf::Arena> reply_arena_;
};

// One entry's result; which fields are set depends on the entry's operation.
struct StepOutcome {
  absl::Status status;
  Transaction begun;                       // Begin
  std::optional<PreparedAppend> prepared;  // Prepare
  uint64_t staged_len = 0;                 // Publish
  uint64_t committed_len = 0;              // Commit, Abort
};

// Thread-safe.
class KvClient {
 public:
  // Connects to the daemon's Unix socket, waiting up to options.deadline (UNAVAILABLE).
  static absl::StatusOr<std::unique_ptr<KvClient>> Connect(const std::string& socket_path,
                                                           ClientOptions options = {});
  ~KvClient();  // Detach()

  // Opens the lease and starts the thread that keeps it alive (a heartbeat every third of the
  // lease timeout). FAILED_PRECONDITION when already attached.
  absl::Status Attach(const std::string& engine_name) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the lease: the daemon frees this engine's sessions after its grace period.
  void Detach() ABSL_LOCKS_EXCLUDED(mu_);
  // False once the daemon ended the lease (or the connection broke).
  bool lease_alive() const { return lease_alive_.load(); }
  uint64_t engine_id() const ABSL_LOCKS_EXCLUDED(mu_);
  // The lease timeout the daemon announced.
  absl::Duration lease_timeout() const ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<PlanFingerprint> RegisterPlan(const ModelPlan& plan);
  // REQUIRES: Attach() succeeded.
  absl::StatusOr<std::unique_ptr<Session>> CreateSession(const PlanFingerprint& plan,
                                                         const SessionOptions& options)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Admission ahead of creation: RESOURCE_EXHAUSTED carries the AdmissionRefusal numbers
  // (core/admission.h GetAdmissionRefusal). options.reservation_id is ignored.
  absl::StatusOr<SessionReservation> Reserve(const PlanFingerprint& plan, const SessionOptions& options)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Returns the reservation's bytes to the budget.
  absl::StatusOr<uint64_t> CancelReservation(uint64_t reservation_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs a batch; one outcome per entry, in order, into `outcomes` (resized). The RPC's own
  // failure is the returned status. For a decode loop: keep one StepBatch (Clear() it between
  // steps) and one outcomes vector, and a step reuses their memory instead of allocating.
  // Not concurrently on one batch.
  absl::Status Step(StepBatch& batch, std::vector<StepOutcome>& outcomes);
  // The same, returning fresh outcomes.
  absl::StatusOr<std::vector<StepOutcome>> Step(StepBatch& batch);

  // KvAdmin.GetStatus.
  absl::StatusOr<memra::kv::v1::GetStatusResponse> GetStatus();

  // Raw stubs, for callers that need a call this class does not wrap (and bad-input tests).
  memra::kv::v1::KvCache::Stub& cache_stub() { return *cache_; }
  memra::kv::v1::KvAdmin::Stub& admin_stub() { return *admin_; }
  ArenaMapper& mapper() { return *options_.mapper; }
  // A context whose deadline is options.deadline from now.
  std::unique_ptr<grpc::ClientContext> NewContext() const;

 private:
  friend class Session;
  KvClient(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  void KeepLease(absl::Duration period) ABSL_LOCKS_EXCLUDED(mu_);
  // The engine's identity; FAILED_PRECONDITION before Attach (`what` names the call).
  absl::StatusOr<memra::kv::v1::EngineRef> AttachedEngine(absl::string_view what) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<memra::kv::v1::KvCache::Stub> cache_;
  const std::unique_ptr<memra::kv::v1::KvAdmin::Stub> admin_;

  std::atomic<bool> lease_alive_{false};

  mutable absl::Mutex mu_;
  memra::kv::v1::EngineRef engine_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_timeout_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<grpc::ClientContext> attach_context_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<
      grpc::ClientReaderWriter<memra::kv::v1::AttachRequest, memra::kv::v1::AttachResponse>>
      attach_stream_ ABSL_GUARDED_BY(mu_);
  std::thread lease_thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_CLIENT_CLIENT_H_
