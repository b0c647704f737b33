#ifndef MEMRA_TESTS_HOSTILE_ENGINES_H_
#define MEMRA_TESTS_HOSTILE_ENGINES_H_

// What a hostile engine does to make the daemon hold something (issue 31,
// docs/security-model.md#resources), one call per behaviour. Shared by
// tests/service/resource_bounds_test.cc, which drives each past its bound beside an honest
// engine and asserts the refusal, and bench/hostile_engine.cc, which keeps each up beside honest
// engines' decode steps (bench/README.md "Hostile engines").
//
// Thread-safety: each call uses only what it is given; a KvClient is thread-safe itself.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/mapped_region.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/sync_stream.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"

namespace memra::testing {

// ---- Descriptors in flight (item 1) ----

// Sends `count` requests for `session`'s first arena over `client`'s handoff connection and
// reads none of the answers (each would carry a descriptor).
absl::Status SendUnreadArenaRequests(KvClient& client, const Session& session, int count);

// ---- Client-supplied config.json (item 2) ----

// kMaxModelConfigBytes + 1 bytes of '[': refused for its size.
std::string OversizeModelConfig();
// 100 KB of '[' (under the size bound): refused for its depth.
std::string OverdeepModelConfig();
// KvAdmin.GetCost (capacity 128) and KvAdmin.ImportModel with `config` as hf_config_json.
absl::Status GetCostOf(KvClient& client, const std::string& config);
absl::Status ImportModelOf(KvClient& client, const std::string& config);

// ---- gRPC connections (item 3) ----

// Connects to `path`, sends the HTTP/2 client preface and an empty SETTINGS frame, and reads:
// 'S' (served: the server's SETTINGS came back) or 'C' (closed at the door: EOF), 'E' on a local
// error. The connection stays open in `*fd` (-1 when none was made). Stack only, system calls
// only: safe in a forked child of a multi-threaded process.
char TryConnection(const char* path, int* fd);

// ---- Event streams (item 5) ----

struct EventStream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<memra::kv::v1::PrefixEvent>> reader;
};
// A SubscribeEvents stream of `client`'s engine (deadline `deadline` from now), once the daemon
// answered it: open (the daemon sent its headers) or ended (EndOf tells why).
std::unique_ptr<EventStream> SubscribeEvents(KvClient& client,
                                             absl::Duration deadline = absl::Seconds(60));
// Reads `stream` to its end and returns how it ended.
absl::Status EndOf(EventStream& stream);

// ---- Host memory kept mapped after release (item 8) ----

// An engine's own mapping and descriptor of one arena, kept past the arena's release (the
// mapping is removed with this object). Move-only.
class KeptArena {
 public:
  // Fetches `session`'s first arena's descriptor over `client`'s handoff connection, maps it
  // and writes `fill` over every byte (the engine's KV).
  static absl::StatusOr<KeptArena> Keep(KvClient& client, const Session& session, uint8_t fill);
  KeptArena(KeptArena&& other) noexcept;
  KeptArena& operator=(KeptArena&& other) noexcept;
  ~KeptArena();

  uint64_t bytes() const { return bytes_; }
  const uint8_t* data() const { return data_; }
  // Bytes of memory the descriptor holds now (fstat st_blocks x 512): the daemon's pages while
  // they are not punched out; 0 for a freed arena the engine did not touch again.
  absl::StatusOr<uint64_t> AllocatedBytes() const;

 private:
  KeptArena(ScopedFd fd, uint8_t* data, uint64_t bytes)
      : fd_(std::move(fd)), data_(data), bytes_(bytes) {}

  ScopedFd fd_;
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace memra::testing

#endif  // MEMRA_TESTS_HOSTILE_ENGINES_H_
