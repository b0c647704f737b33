#ifndef MEMRA_SERVER_BLOCK_STORE_SERVICE_H_
#define MEMRA_SERVER_BLOCK_STORE_SERVICE_H_

// memra.kv.v1 KvBlockStore over gRPC: authenticates the engine, decodes, calls BlockStore,
// encodes. No rules here (server/store/block_store.h and core/block_layout.h have them;
// block_store.proto documents the contract). Served on the engine socket only.
//
// Thread-safety: thread-safe (BlockStore and the scope finder are).

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"
#include "proto/memra/kv/v1/block_store.grpc.pb.h"
#include "proto/memra/kv/v1/block_store.pb.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "server/device/backend.h"
#include "server/store/block_store.h"

namespace memra {

class BlockStoreService final : public memra::kv::v1::KvBlockStore::Service {
 public:
  // The cache scope of the attached engine a ref names (EngineLeases::CacheScope: NOT_FOUND,
  // PERMISSION_DENIED wrong token, FAILED_PRECONDITION lease ended).
  using ScopeFinder =
      std::function<absl::StatusOr<std::string>(const memra::kv::v1::EngineRef&)>;

  // `store` and `backend` (engines' events are waited on through it) outlive the service.
  BlockStoreService(BlockStore* store, DeviceBackend* backend, ScopeFinder find_scope)
      : store_(store), backend_(backend), find_scope_(std::move(find_scope)) {}

  grpc::Status RegisterEngineBuffers(
      grpc::ServerContext*, const memra::kv::v1::RegisterEngineBuffersRequest* request,
      memra::kv::v1::RegisterEngineBuffersResponse* response) override;
  grpc::Status UnregisterEngineBuffers(
      grpc::ServerContext*, const memra::kv::v1::UnregisterEngineBuffersRequest* request,
      memra::kv::v1::UnregisterEngineBuffersResponse* response) override;
  grpc::Status LookupBlocks(grpc::ServerContext*,
                            const memra::kv::v1::LookupBlocksRequest* request,
                            memra::kv::v1::LookupBlocksResponse* response) override;
  grpc::Status StoreBlocks(grpc::ServerContext*, const memra::kv::v1::StoreBlocksRequest* request,
                           memra::kv::v1::TransferBlocksResponse* response) override;
  grpc::Status LoadBlocks(grpc::ServerContext*, const memra::kv::v1::LoadBlocksRequest* request,
                          memra::kv::v1::TransferBlocksResponse* response) override;
  grpc::Status UnpinBlocks(grpc::ServerContext*, const memra::kv::v1::UnpinBlocksRequest* request,
                           memra::kv::v1::UnpinBlocksResponse* response) override;

 private:
  BlockStore* const store_;
  DeviceBackend* const backend_;
  const ScopeFinder find_scope_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_BLOCK_STORE_SERVICE_H_
