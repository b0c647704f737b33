#ifndef MEMRA_CLIENT_HANDOFF_CHANNEL_H_
#define MEMRA_CLIENT_HANDOFF_CHANNEL_H_

// The engine's end of the daemon's handoff socket (common/handoff_wire.h, docs/handoff.md):
// connect before Attach and attach with ticket(); afterwards trade a session's arena handles for
// descriptors of the arenas' memory. KvClient keeps one per engine; tests use it directly.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/handoff_wire.h"
#include "common/mapped_region.h"

namespace memra {

// Thread-safe: requests are serialised (one answer per request, in order).
class HandoffChannel {
 public:
  // Connects to `path` and reads the ticket, waiting up to `deadline` for it. UNAVAILABLE when
  // nothing answers there; the daemon's refusal (e.g. RESOURCE_EXHAUSTED: too many connections)
  // when it sends one instead of a ticket.
  static absl::StatusOr<std::unique_ptr<HandoffChannel>> Connect(const std::string& path,
                                                                 absl::Duration deadline);

  // The 24 bytes Attach carries (Hello.handoff_ticket).
  const std::string& ticket() const { return ticket_; }

  // The descriptor of arena `request.handle` of session `request.session_id`. The daemon's
  // refusal as it sent it (code and message); UNAVAILABLE when the connection broke or no
  // answer came within the deadline; DATA_LOSS when an answer came without a descriptor.
  absl::StatusOr<ArenaFd> FetchArena(const handoff::ArenaRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The block store's buffer offer (docs/block-store.md): sends a descriptor of the engine's own
  // pool memory (`fd`, kept open by the caller; a memfd sealed with F_SEAL_SHRINK, at least
  // `bytes` long) and returns the buffer id RegisterEngineBuffers names it by. The daemon's
  // refusal as it sent it; UNAVAILABLE as FetchArena.
  absl::StatusOr<uint64_t> OfferBuffer(int fd, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // The engine's step channel (docs/step-channel.md): the region's memfd and its bytes, and the
  // eventfd that wakes the daemon. The daemon's refusal as it sent it; UNAVAILABLE as
  // FetchArena's; DATA_LOSS when the answer came without both descriptors. Only after Attach
  // offered the channel (Attached.step_channel): an older daemon closes the connection.
  absl::StatusOr<handoff::StepChannelFds> OpenStepChannel() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class ClientInternals;  // the socket, for the tests' raw frames
  HandoffChannel(ScopedFd socket, std::string path, absl::Duration deadline)
      : socket_(std::move(socket)), path_(std::move(path)), deadline_(deadline) {}

  // The next frame (and the descriptors that came with it, if any), waiting up to deadline_.
  absl::StatusOr<handoff::Frame> ReadFrame(std::vector<ScopedFd>* received)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends `frame` (with `pass_fds` attached) and reads the answer: a refusal becomes its status,
  // another kind than `expected` INTERNAL.
  absl::StatusOr<handoff::Frame> Exchange(absl::string_view frame, handoff::Kind expected,
                                          std::vector<ScopedFd>* received,
                                          absl::Span<const int> pass_fds = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ScopedFd socket_;
  const std::string path_;
  const absl::Duration deadline_;
  std::string ticket_;  // set once by Connect

  absl::Mutex mu_;
  std::string input_ ABSL_GUARDED_BY(mu_);  // bytes of a frame not yet complete
};

}  // namespace memra

#endif  // MEMRA_CLIENT_HANDOFF_CHANNEL_H_
