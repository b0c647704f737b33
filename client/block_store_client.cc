#include "client/block_store_client.h"

#include <utility>

#include "client/connection.h"
#include "client/internal.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"

namespace memra {

namespace pb = ::memra::kv::v1;

namespace {

void SetBlockKeys(const BlockStoreKeys& keys, pb::BlockKeys& out) {
  for (const std::string& hash : keys.hashes) out.add_hashes(hash);
  out.mutable_token_ids()->Add(keys.token_ids.begin(), keys.token_ids.end());
}

// The fields StoreBlocksRequest and LoadBlocksRequest share (the engine is ViewCall's).
template <typename Request>
void SetTransfer(const BlockStoreCall& call, Request& request) {
  request.set_registration_id(call.registration_id);
  request.set_kv_group(call.kv_group);
  SetBlockKeys(call.keys, *request.mutable_keys());
  request.mutable_block_ids()->Add(call.block_ids.begin(), call.block_ids.end());
  request.set_skip_blocks(call.skip_blocks);
  if (!call.wait_event.empty()) request.mutable_ordering()->set_wait_event(call.wait_event);
}

BlockStoreTransfer TransferFromProto(const pb::TransferBlocksResponse& response) {
  BlockStoreTransfer out;
  for (const pb::BlockResult& block : response.blocks()) {
    const bool known = block.code() <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated);
    out.blocks.push_back(
        {.status = absl::Status(known ? static_cast<absl::StatusCode>(block.code())
                                      : absl::StatusCode::kUnknown,
                                block.message()),
         .already_present = block.already_present()});
  }
  out.copied_bytes = response.copied_bytes();
  out.completion_event = response.completion_event();
  return out;
}

}  // namespace

absl::StatusOr<uint64_t> BlockStoreClient::OfferPoolBuffer(int fd, uint64_t bytes) const {
  ASSIGN_OR_RETURN(std::shared_ptr<ClientConnection> connection,
                   ClientConnection::Lock(connection_, "BlockStoreClient::OfferPoolBuffer"));
  std::shared_ptr<HandoffChannel> handoff = connection->handoff();
  if (handoff == nullptr) {
    return absl::FailedPreconditionError(
        "offering a pool buffer before Attach: it goes over the engine's handoff connection");
  }
  return handoff->OfferBuffer(fd, bytes);
}

absl::StatusOr<RegisteredPool> BlockStoreClient::RegisterPool(
    const BlockPoolSpec& spec, absl::Span<const PoolBufferRef> buffers) const {
  pb::RegisterEngineBuffersRequest request;
  for (const PoolBufferRef& buffer : buffers) {
    pb::EngineBufferRef* out = request.add_buffers();
    if (buffer.cuda_ipc_handle.empty()) {
      out->set_handoff_buffer_id(buffer.handoff_buffer_id);
    } else {
      out->set_cuda_ipc_handle(buffer.cuda_ipc_handle);
    }
    out->set_bytes(buffer.bytes);
    out->set_offset_in_allocation(buffer.offset_in_allocation);
  }
  request.set_num_blocks(spec.num_blocks);
  request.set_tokens_per_block(spec.tokens_per_block);
  request.set_element_type(static_cast<pb::BlockElementType>(spec.element));
  request.set_order(static_cast<pb::BlockOrder>(spec.order));
  request.set_num_kv_heads(spec.num_kv_heads);
  request.set_head_dim(spec.head_dim);
  request.set_tp_rank(spec.tp_rank);
  request.set_tp_size(spec.tp_size);
  request.set_model(spec.model);
  for (const BlockTensorSpec& tensor : spec.tensors) {
    pb::BlockTensor* out = request.add_tensors();
    out->set_layer(tensor.layer);
    out->set_kind(static_cast<pb::BlockTensorKind>(tensor.role));
    out->set_kv_group(tensor.kv_group);
    out->set_buffer(tensor.buffer);
    out->set_offset(tensor.offset);
    out->set_block_stride(tensor.block_stride);
    out->set_block_bytes(tensor.block_bytes);
  }
  pb::RegisterEngineBuffersResponse response;
  RETURN_IF_ERROR(ClientConnection::ViewCall(connection_, "BlockStoreClient::RegisterPool",
                                             "RegisterPool",
                                             &pb::KvBlockStore::Stub::RegisterEngineBuffers,
                                             request, response));
  RegisteredPool pool;
  pool.registration_id = response.registration_id();
  for (const pb::KvGroupLayout& group : response.groups()) {
    RegisteredPoolGroup out;
    out.kv_group = group.kv_group();
    ASSIGN_OR_RETURN(out.layout_fingerprint, FingerprintFromBytes(group.layout_fingerprint()));
    out.block_bytes = group.block_bytes();
    out.state_bytes = group.state_bytes();
    pool.groups.push_back(out);
  }
  return pool;
}

absl::Status BlockStoreClient::UnregisterPool(uint64_t registration_id) const {
  pb::UnregisterEngineBuffersRequest request;
  request.set_registration_id(registration_id);
  pb::UnregisterEngineBuffersResponse response;
  return ClientConnection::ViewCall(connection_, "BlockStoreClient::UnregisterPool",
                                    "UnregisterPool",
                                    &pb::KvBlockStore::Stub::UnregisterEngineBuffers, request,
                                    response);
}

absl::StatusOr<BlockStoreMatch> BlockStoreClient::Lookup(const BlockStoreCall& call) const {
  pb::LookupBlocksRequest request;
  request.set_registration_id(call.registration_id);
  request.set_kv_group(call.kv_group);
  SetBlockKeys(call.keys, *request.mutable_keys());
  request.set_pin_ttl_ms(call.pin_ttl_ms);
  pb::LookupBlocksResponse response;
  RETURN_IF_ERROR(ClientConnection::ViewCall(connection_, "BlockStoreClient::Lookup",
                                             "LookupBlocks", &pb::KvBlockStore::Stub::LookupBlocks,
                                             request, response));
  return BlockStoreMatch{.matched_blocks = response.matched_blocks(),
                         .pin_id = response.pin_id(),
                         .medium = MediumFromProto(response.medium())};
}

absl::StatusOr<BlockStoreTransfer> BlockStoreClient::Store(const BlockStoreCall& call) const {
  pb::StoreBlocksRequest request;
  SetTransfer(call, request);
  request.set_parent_hash(call.parent_hash);
  request.mutable_event_token_ids()->Add(call.event_token_ids.begin(),
                                         call.event_token_ids.end());
  request.mutable_event_block_hashes()->Add(call.event_block_hashes.begin(),
                                            call.event_block_hashes.end());
  pb::TransferBlocksResponse response;
  RETURN_IF_ERROR(ClientConnection::ViewCall(connection_, "BlockStoreClient::Store",
                                             "StoreBlocks", &pb::KvBlockStore::Stub::StoreBlocks,
                                             request, response));
  return TransferFromProto(response);
}

absl::StatusOr<BlockStoreTransfer> BlockStoreClient::Load(const BlockStoreCall& call) const {
  pb::LoadBlocksRequest request;
  SetTransfer(call, request);
  request.set_pin_id(call.pin_id);
  pb::TransferBlocksResponse response;
  RETURN_IF_ERROR(ClientConnection::ViewCall(connection_, "BlockStoreClient::Load", "LoadBlocks",
                                             &pb::KvBlockStore::Stub::LoadBlocks, request,
                                             response));
  return TransferFromProto(response);
}

absl::Status BlockStoreClient::Unpin(uint64_t pin_id) const {
  pb::UnpinBlocksRequest request;
  request.set_pin_id(pin_id);
  pb::UnpinBlocksResponse response;
  return ClientConnection::ViewCall(connection_, "BlockStoreClient::Unpin", "UnpinBlocks",
                                    &pb::KvBlockStore::Stub::UnpinBlocks, request, response);
}

}  // namespace memra
