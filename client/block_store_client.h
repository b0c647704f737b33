#ifndef MEMRA_CLIENT_BLOCK_STORE_CLIENT_H_
#define MEMRA_CLIENT_BLOCK_STORE_CLIENT_H_

// The block store (proto/memra/kv/v1/block_store.proto, docs/block-store.md) as an engine calls
// it: a view of a KvClient (KvClient::block_store()) over its one connection, lease and handoff
// connection. An engine with its own paged KV pool registers it (memory offered over the
// handoff socket, layout as core/block_layout.h's BlockPoolSpec) and stores and loads whole
// blocks by key:
//
//   memra::BlockStoreClient blocks = client->block_store();
//   ASSIGN_OR_RETURN(uint64_t buffer, blocks.OfferPoolBuffer(memfd, bytes));  // sealed memfd
//   ASSIGN_OR_RETURN(memra::RegisteredPool pool, blocks.RegisterPool(spec, {{buffer, bytes}}));
//   ASSIGN_OR_RETURN(memra::BlockStoreMatch match, blocks.Lookup(call));
//   ASSIGN_OR_RETURN(memra::BlockStoreTransfer loaded, blocks.Load(call));
//
// Refusals keep the daemon's codes and messages.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "core/block_layout.h"
#include "core/model_plan.h"
#include "core/prefix_index.h"

namespace memra {

class ClientConnection;

// One buffer of RegisterPool: an id OfferPoolBuffer answered (host) or, when
// `cuda_ipc_handle` is set, the cudaIpcMemHandle_t of a GPU allocation (cuda); `bytes` from
// offset_in_allocation of it.
struct PoolBufferRef {
  uint64_t handoff_buffer_id = 0;
  uint64_t bytes = 0;
  uint64_t offset_in_allocation = 0;
  std::string cuda_ipc_handle = {};
};
struct RegisteredPoolGroup {
  uint32_t kv_group = 0;
  PlanFingerprint layout_fingerprint{};
  uint64_t block_bytes = 0;
  uint64_t state_bytes = 0;
};
struct RegisteredPool {
  uint64_t registration_id = 0;
  std::vector<RegisteredPoolGroup> groups;  // ascending kv_group
};
// What a block store call names blocks by: the engine's own block hashes, or token ids from
// position 0 (whole blocks).
struct BlockStoreKeys {
  std::vector<std::string> hashes;
  std::vector<int32_t> token_ids;
};
// One Lookup / Store / Load call (block_store.proto's LookupBlocks / StoreBlocks / LoadBlocks
// document each field).
struct BlockStoreCall {
  uint64_t registration_id = 0;
  uint32_t kv_group = 0;
  BlockStoreKeys keys;
  std::vector<uint32_t> block_ids;  // store / load
  uint32_t skip_blocks = 0;         // store / load with token ids
  uint32_t pin_ttl_ms = 0;          // lookup
  uint64_t pin_id = 0;              // load: the lookup's pin it releases
  std::string parent_hash;          // store: routers' event fields
  std::vector<int32_t> event_token_ids;
  std::vector<std::string> event_block_hashes;  // store: routers' hashes (none: keys.hashes)
  // store / load on cuda: the engine's interprocess event the daemon waits on first.
  std::string wait_event;
};
struct BlockStoreMatch {
  uint64_t matched_blocks = 0;
  uint64_t pin_id = 0;
  StorageMedium medium = StorageMedium::kDevice;
};
struct BlockStoreOutcome {
  absl::Status status;  // OK, NOT_FOUND, DATA_LOSS... with the daemon's message
  bool already_present = false;
};
struct BlockStoreTransfer {
  std::vector<BlockStoreOutcome> blocks;  // one per block id
  uint64_t copied_bytes = 0;
  // cuda: cudaIpcEventHandle_t to wait on before using the blocks; empty on host.
  std::string completion_event;
};

// A view of a KvClient: cheap to copy (one weak reference to the client's connection), no
// channel, lease or handoff connection of its own. Valid while its KvClient lives: a call after
// the KvClient is destroyed changes nothing and is refused with FAILED_PRECONDITION ("... after
// its KvClient was destroyed"); a call in flight when it is destroyed completes. Every call
// REQUIRES the KvClient attached (FAILED_PRECONDITION otherwise). Thread-safe.
class BlockStoreClient {
 public:
  // Offers `fd` (a memfd sealed with F_SEAL_SHRINK, at least `bytes` long; the caller keeps
  // it) over this engine's handoff connection; the buffer id RegisterPool names it by (single
  // use, valid while the connection is).
  absl::StatusOr<uint64_t> OfferPoolBuffer(int fd, uint64_t bytes) const;
  // RegisterEngineBuffers: `spec` without its buffer_bytes (`buffers` give them).
  absl::StatusOr<RegisteredPool> RegisterPool(const BlockPoolSpec& spec,
                                              absl::Span<const PoolBufferRef> buffers) const;
  absl::Status UnregisterPool(uint64_t registration_id) const;
  absl::StatusOr<BlockStoreMatch> Lookup(const BlockStoreCall& call) const;
  // The host backend's copies are done when these return.
  absl::StatusOr<BlockStoreTransfer> Store(const BlockStoreCall& call) const;
  absl::StatusOr<BlockStoreTransfer> Load(const BlockStoreCall& call) const;
  absl::Status Unpin(uint64_t pin_id) const;

 private:
  friend class KvClient;
  explicit BlockStoreClient(std::weak_ptr<ClientConnection> connection)
      : connection_(std::move(connection)) {}

  std::weak_ptr<ClientConnection> connection_;
};

}  // namespace memra

#endif  // MEMRA_CLIENT_BLOCK_STORE_CLIENT_H_
