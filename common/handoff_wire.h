#ifndef MEMRA_COMMON_HANDOFF_WIRE_H_
#define MEMRA_COMMON_HANDOFF_WIRE_H_

// The handoff socket's protocol (docs/handoff.md; cache.proto "Arena" describes where it fits):
// the one side channel gRPC cannot be, because it carries file descriptors (SCM_RIGHTS). The
// daemon (server/edge/arena_handoff.h) and both clients (client/handoff_channel.h, the Python
// package's handoff.py) speak it.
//
// Every frame:  u32 length (little-endian; the bytes that follow, 2..kMaxFrameBytes)
//               u8  version (kVersion)
//               u8  kind
//               body (kind-specific, integers little-endian)
//
//   kTicket        daemon -> engine, once, right after connect:
//                  ticket[32] = u64 daemon instance (its epoch) | u64 connection number |
//                  16 random bytes. Opaque to engines: a ticket is valid for the daemon
//                  instance that issued it while its connection stays open.
//   kArenaRequest  engine -> daemon: u64 session_id | u8 token_len | token | u16 handle_len |
//                  handle (token <= 64 bytes, handle 1..256 bytes)
//   kArena         daemon -> engine, the answer to one request, with exactly one descriptor
//                  attached (SCM_RIGHTS): u64 arena bytes
//   kRefusal       daemon -> engine, the answer to one request (or the last frame before the
//                  daemon closes): u32 code (absl / gRPC status code numbering) | u16 len |
//                  message (UTF-8, the daemon's words with the numbers)
//   kStepChannelRequest  engine -> daemon: empty body (docs/step-channel.md; only when Attached
//                  offered the channel: an older daemon refuses the kind and closes)
//   kStepChannel   daemon -> engine, the answer to a step channel request, with exactly two
//                  descriptors attached (the region's sealed memfd, then the eventfd that wakes
//                  the daemon): u64 region bytes
//   kBufferOffer   engine -> daemon, with exactly one descriptor attached (SCM_RIGHTS): u64
//                  bytes. The block store's "buffer offer" (docs/block-store.md): a memfd of
//                  the engine's own KV pool, sealed with F_SEAL_SHRINK, at least `bytes` long.
//   kBufferId      daemon -> engine, the answer to one offer: u64 buffer id (single use, for
//                  RegisterEngineBuffers while this connection stays open)
// Kinds 7..15 are free; the block store's start at 16.
//
// Requests are answered one at a time, in order. A frame the daemon cannot parse (length out of
// range, another version, an unknown kind, a malformed body) is refused (INVALID_ARGUMENT) and
// the connection closed; so is a frame not complete within the daemon's per-request deadline.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/mapped_region.h"

namespace memra::handoff {

inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kLengthBytes = 4;
// Bounds every frame a reader accepts (version + kind + body), so a reader's buffer is bounded.
inline constexpr uint32_t kMaxFrameBytes = 1024;
inline constexpr size_t kTicketBytes = 32;
inline constexpr size_t kMaxTokenBytes = 64;
inline constexpr size_t kMaxHandleBytes = 256;
inline constexpr size_t kMaxMessageBytes = 900;  // longer refusal messages are cut

enum class Kind : uint8_t {
  kTicket = 1,
  kArenaRequest = 2,
  kArena = 3,
  kRefusal = 4,
  kStepChannelRequest = 5,
  kStepChannel = 6,
  kBufferOffer = 16,
  kBufferId = 17,
};
// Whether `kind` is one this side knows (1 to 6, 16 and 17).
bool KnownKind(uint8_t kind);
// Descriptors one frame carries at most (kStepChannel's two).
inline constexpr size_t kMaxDescriptors = 2;

struct ArenaRequest {
  uint64_t session_id = 0;
  std::string session_token;
  std::string handle;
};

// An engine asked for its step channel (kind 5; the body is empty).
struct StepChannelRequest {};

// What a kStepChannel answer carries: the region (its memfd and bytes) and the eventfd that
// wakes the daemon.
struct StepChannelFds {
  ArenaFd region;
  ScopedFd wake;
};

struct Frame {
  Kind kind = Kind::kTicket;
  std::string body;
};

// Whole frames, length prefix included.
std::string EncodeTicket(absl::string_view ticket);
// INVALID_ARGUMENT when the token or the handle is longer than the protocol allows.
absl::StatusOr<std::string> EncodeArenaRequest(const ArenaRequest& request);
std::string EncodeArena(uint64_t bytes);
// INVALID_ARGUMENT for 0 bytes.
absl::StatusOr<std::string> EncodeBufferOffer(uint64_t bytes);
std::string EncodeBufferId(uint64_t buffer_id);
std::string EncodeStepChannelRequest();
std::string EncodeStepChannel(uint64_t region_bytes);
// REQUIRES: !refusal.ok(). The message is cut at kMaxMessageBytes.
std::string EncodeRefusal(const absl::Status& refusal);

// Removes the first complete frame from the front of `buffer`: nullopt while it is incomplete;
// INVALID_ARGUMENT (with the numbers) for a length out of range, another version or an unknown
// kind, whatever follows in `buffer`.
absl::StatusOr<std::optional<Frame>> TakeFrame(std::string& buffer);

// Bodies. INVALID_ARGUMENT naming the field and the sizes for a malformed one.
absl::StatusOr<std::string> DecodeTicket(absl::string_view body);
absl::StatusOr<ArenaRequest> DecodeArenaRequest(absl::string_view body);
absl::StatusOr<uint64_t> DecodeArena(absl::string_view body);
// INVALID_ARGUMENT for 0 bytes too.
absl::StatusOr<uint64_t> DecodeBufferOffer(absl::string_view body);
absl::StatusOr<uint64_t> DecodeBufferId(absl::string_view body);
absl::StatusOr<StepChannelRequest> DecodeStepChannelRequest(absl::string_view body);
absl::StatusOr<uint64_t> DecodeStepChannel(absl::string_view body);  // region bytes
// The refusal as the status it carries; never OK (a code of 0 or out of range is UNKNOWN, a
// malformed body INVALID_ARGUMENT saying so).
absl::Status DecodeRefusal(absl::string_view body);

// Sends one whole frame on the Unix stream socket `socket`, with `pass_fds` attached (SCM_RIGHTS;
// at most kMaxDescriptors). Never raises SIGPIPE. UNAVAILABLE when the peer is gone or the frame
// could not go in one call (a non-blocking socket whose peer does not read: the daemon then
// closes it).
absl::Status SendFrame(int socket, absl::string_view frame, absl::Span<const int> pass_fds = {});

// Receives up to buffer.size() bytes from the Unix stream socket `socket` (one recvmsg, retried
// on EINTR); descriptors that came with them (SCM_RIGHTS) are appended to `*received`, O_CLOEXEC,
// up to kMaxDescriptors in all (extra descriptors are closed). 0 when the peer closed;
// UNAVAILABLE naming the errno, which is left in `errno` (a non-blocking reader tells EAGAIN by
// it).
absl::StatusOr<size_t> ReceiveBytes(int socket, absl::Span<char> buffer,
                                    std::vector<ScopedFd>* received);

}  // namespace memra::handoff

#endif  // MEMRA_COMMON_HANDOFF_WIRE_H_
