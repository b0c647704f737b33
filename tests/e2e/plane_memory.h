#ifndef MEMRA_TESTS_E2E_PLANE_MEMORY_H_
#define MEMRA_TESTS_E2E_PLANE_MEMORY_H_

// How a test engine process reaches the bytes of a plane it mapped. Host planes are ordinary
// memory; cuda planes are device memory that only CUDA copies reach. The end-to-end scripts
// (engine_script, prefix_engine) do every plane access through this one interface, so the same
// script runs against either backend.
//
// Thread-compatible: one engine thread uses an instance. Every range is checked against its
// plane (overflow-checked) before any byte moves; a refused call moves nothing.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/client.h"

namespace memra::testing {

class PlaneMemory {
 public:
  virtual ~PlaneMemory() = default;

  // `offset`, `to`, `from` are byte offsets into `plane`. OUT_OF_RANGE past the plane's end.
  absl::Status Write(const PlaneView& plane, uint64_t offset, absl::Span<const uint8_t> data);
  // Complete on return: `out` holds the bytes, after this memory's own earlier writes.
  absl::Status Read(const PlaneView& plane, uint64_t offset, absl::Span<uint8_t> out);
  // memmove semantics: the ranges may overlap.
  absl::Status Move(const PlaneView& plane, uint64_t to, uint64_t from, uint64_t bytes);
  absl::Status Fill(const PlaneView& plane, uint64_t offset, uint8_t value, uint64_t bytes);

  // The interprocess event (cudaIpcGetEventHandle) recorded after every write this memory
  // enqueued: pass it to Session::SetWaitEvent (and to prefix requests' ordering) and the daemon
  // waits for those writes before it touches the planes. Empty where writes are complete on
  // return (host).
  virtual const std::string& WaitEvent() const = 0;

 protected:
  // The primitives see only ranges already checked against one plane.
  virtual absl::Status DoWrite(uint8_t* to, absl::Span<const uint8_t> data) = 0;
  virtual absl::Status DoRead(const uint8_t* from, absl::Span<uint8_t> out) = 0;
  virtual absl::Status DoMove(uint8_t* to, const uint8_t* from, uint64_t bytes) = 0;
  virtual absl::Status DoFill(uint8_t* at, uint8_t value, uint64_t bytes) = 0;
};

// Host planes: memcpy / memmove / memset; nothing to wait for.
class HostPlaneMemory final : public PlaneMemory {
 public:
  const std::string& WaitEvent() const override { return no_event_; }

 private:
  absl::Status DoWrite(uint8_t* to, absl::Span<const uint8_t> data) override;
  absl::Status DoRead(const uint8_t* from, absl::Span<uint8_t> out) override;
  absl::Status DoMove(uint8_t* to, const uint8_t* from, uint64_t bytes) override;
  absl::Status DoFill(uint8_t* at, uint8_t value, uint64_t bytes) override;

  const std::string no_event_;
};

}  // namespace memra::testing

#endif  // MEMRA_TESTS_E2E_PLANE_MEMORY_H_
