#ifndef MEMRA_CLIENT_STEP_CHANNEL_CLIENT_H_
#define MEMRA_CLIENT_STEP_CHANNEL_CLIENT_H_

// The engine's end of its step channel (docs/step-channel.md; layout common/step_channel.h):
// runs a slot-addressed Step as records in the shared submission ring and reads the results
// from the completion ring, waking the daemon through its eventfd only when it sleeps, and
// waiting for completions with a short spin (small steps only), then FUTEX_WAIT on cq_tail.
// KvClient::Step uses it for batches it can carry (Carries); everything else goes over gRPC.
//
// Thread-safe: one Run at a time (a mutex); a Run that failed (the daemon closed the channel,
// no answer within the deadline, the client abandoned it) breaks the channel for good, since
// records may still be in flight: the client then steps over gRPC.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/handoff_wire.h"
#include "common/mapped_region.h"
#include "common/step_channel.h"
#include "core/transaction.h"
#include "proto/memra/kv/v1/cache.pb.h"

namespace memra {

class StepChannelClient {
 public:
  // Maps the region the daemon handed over and checks its header (CheckHeader's refusals).
  static absl::StatusOr<std::unique_ptr<StepChannelClient>> Map(handoff::StepChannelFds fds);

  // Whether `request` can go over the channel: no wait event, at most kMaxStepEntries entries,
  // every entry addressed by slot and naming an operation, token ids within a record's side
  // span. (The layer limit,
  // step_channel::kMaxKvLayers, is the caller's: it knows the sessions.)
  static bool Carries(const memra::kv::v1::StepRequest& request);

  // Runs `request`'s entries in order; one result per entry into `response` (as the Step RPC
  // answers). UNAVAILABLE when the daemon closed the channel (saying why), answered nothing
  // within `deadline` or the channel was abandoned meanwhile; INTERNAL when its completions
  // break the protocol. After any error the channel is broken (broken()). nullopt, with nothing
  // submitted and `response` untouched, when it was broken before this Run could start (by
  // another thread's Run it waited for, or Abandon): the caller steps over gRPC instead.
  std::optional<absl::Status> Run(const memra::kv::v1::StepRequest& request,
                                  memra::kv::v1::StepResponse* response, absl::Duration deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Lock-free: callers holding their own locks (KvClient's) never wait for a Run.
  bool broken() const { return broken_.load(std::memory_order_acquire); }

  // The client's lease stream to the daemon broke (the daemon died or restarted) or the client
  // detached: the daemon will answer no more. Breaks the channel and wakes a Run waiting for
  // completions, which fails at once (UNAVAILABLE) instead of at its deadline.
  void Abandon();

  // For bad-input tests that write the rings themselves (the channel is theirs afterwards: Run
  // no longer knows the counters): the region, its header, and the daemon's doorbell (a write
  // of its eventfd, which Run makes only while the daemon sleeps).
  step_channel::StepChannelHeader& header() const { return *header_; }
  uint8_t* region() const { return region_.data(); }
  void RingDoorbell() const;

 private:
  StepChannelClient(MappedRegion region, ScopedFd wake);

  // Writes entry `index` of `request` as the record at sq_tail_.
  void Submit(const memra::kv::v1::StepEntry& entry, uint64_t index)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The completion at cq_head_ as entry `index`'s result.
  absl::Status Complete(memra::kv::v1::StepResponse* response, int entries)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until the daemon wrote a completion past cq_head_: its tail, or UNAVAILABLE.
  absl::StatusOr<uint32_t> AwaitCompletions(absl::Time give_up) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const MappedRegion region_;
  const ScopedFd wake_;
  step_channel::StepChannelHeader* const header_;
  const step_channel::Layout layout_;

  mutable absl::Mutex mu_;
  // This side's own counters (never read back from the region).
  uint32_t sq_tail_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t cq_head_ ABSL_GUARDED_BY(mu_) = 0;
  // Complete's working storage for a plan's layers, reused (contents meaningless outside it).
  std::vector<LayerAppend> layers_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> broken_{false};
  std::atomic<bool> abandoned_{false};
};

}  // namespace memra

#endif  // MEMRA_CLIENT_STEP_CHANNEL_CLIENT_H_
