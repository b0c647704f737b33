#include "server/edge/block_store_service.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/edge/prefix_service.h"
#include "server/edge/rpc_reply.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

BlockKeyRequest KeysOf(const pb::BlockKeys& keys) {
  BlockKeyRequest out;
  out.hashes.assign(keys.hashes().begin(), keys.hashes().end());
  out.token_ids.assign(keys.token_ids().begin(), keys.token_ids().end());
  return out;
}

// The fields StoreBlocksRequest and LoadBlocksRequest share.
template <typename Request>
BlockTransfer TransferOf(const Request& request) {
  BlockTransfer transfer;
  transfer.registration_id = request.registration_id();
  transfer.kv_group = request.kv_group();
  transfer.keys = KeysOf(request.keys());
  transfer.block_ids.assign(request.block_ids().begin(), request.block_ids().end());
  transfer.skip_blocks = request.skip_blocks();
  return transfer;
}

void EncodeTransfer(const BlockTransferResult& result, pb::TransferBlocksResponse* response) {
  for (const PoolBlockResult& block : result.blocks) {
    pb::BlockResult* out = response->add_blocks();
    out->set_code(static_cast<uint32_t>(block.status.code()));
    out->set_message(std::string(block.status.message()));
    out->set_already_present(block.already_present);
  }
  response->set_copied_bytes(result.copied_bytes);
}

// A transfer's reply: its results and, on cuda, the event the engine waits on before touching
// the blocks.
absl::Status ReplyTransfer(DeviceBackend* backend, const BlockTransferResult& result,
                           pb::TransferBlocksResponse* response) {
  ASSIGN_OR_RETURN(std::string completion_event, backend->RecordCompletionEvent());
  EncodeTransfer(result, response);
  response->set_completion_event(std::move(completion_event));
  return absl::OkStatus();
}

}  // namespace

grpc::Status BlockStoreService::RegisterEngineBuffers(
    grpc::ServerContext*, const pb::RegisterEngineBuffersRequest* request,
    pb::RegisterEngineBuffersResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::string scope, find_scope_(request->engine()));
    std::vector<EngineBufferRequest> buffers;
    for (int i = 0; i < request->buffers_size(); ++i) {
      const pb::EngineBufferRef& buffer = request->buffers(i);
      if (buffer.memory_case() == pb::EngineBufferRef::MEMORY_NOT_SET) {
        return absl::InvalidArgumentError(absl::StrCat(
            "buffer ", i, ": names no memory (handoff_buffer_id on the host backend, "
            "cuda_ipc_handle on cuda)"));
      }
      buffers.push_back({.handoff_buffer_id = buffer.handoff_buffer_id(),
                         .cuda_ipc_handle = buffer.cuda_ipc_handle(),
                         .bytes = buffer.bytes(),
                         .offset_in_allocation = buffer.offset_in_allocation()});
    }
    BlockPoolSpec spec;
    spec.num_blocks = request->num_blocks();
    spec.tokens_per_block = request->tokens_per_block();
    spec.element = static_cast<uint32_t>(request->element_type());
    spec.order = static_cast<uint32_t>(request->order());
    spec.num_kv_heads = request->num_kv_heads();
    spec.head_dim = request->head_dim();
    spec.tp_rank = request->tp_rank();
    spec.tp_size = request->tp_size();
    spec.model = request->model();
    for (const pb::BlockTensor& tensor : request->tensors()) {
      spec.tensors.push_back({.layer = tensor.layer(),
                              .role = static_cast<uint32_t>(tensor.kind()),
                              .kv_group = tensor.kv_group(),
                              .buffer = tensor.buffer(),
                              .offset = tensor.offset(),
                              .block_stride = tensor.block_stride(),
                              .block_bytes = tensor.block_bytes()});
    }
    ASSIGN_OR_RETURN(BlockStoreRegistration registered,
                     store_->Register(request->engine().engine_id(), scope, std::move(spec),
                                      buffers));
    response->set_registration_id(registered.registration_id);
    for (const BlockGroupLayout& group : registered.groups) {
      pb::KvGroupLayout* out = response->add_groups();
      out->set_kv_group(group.kv_group);
      out->set_layout_fingerprint(std::string(group.fingerprint.begin(), group.fingerprint.end()));
      out->set_block_bytes(group.block_bytes);
      out->set_state_bytes(group.state_bytes);
    }
    return absl::OkStatus();
  }();
  return Reply("RegisterEngineBuffers", status);
}

grpc::Status BlockStoreService::UnregisterEngineBuffers(
    grpc::ServerContext*, const pb::UnregisterEngineBuffersRequest* request,
    pb::UnregisterEngineBuffersResponse*) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(find_scope_(request->engine()).status());
    return store_->Unregister(request->engine().engine_id(), request->registration_id());
  }();
  return Reply("UnregisterEngineBuffers", status);
}

grpc::Status BlockStoreService::LookupBlocks(grpc::ServerContext*,
                                             const pb::LookupBlocksRequest* request,
                                             pb::LookupBlocksResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(find_scope_(request->engine()).status());
    ASSIGN_OR_RETURN(BlockLookup found,
                     store_->Lookup(request->engine().engine_id(), request->registration_id(),
                                    request->kv_group(), KeysOf(request->keys()),
                                    absl::Milliseconds(request->pin_ttl_ms())));
    response->set_matched_blocks(found.matched_blocks);
    response->set_pin_id(found.pin_id);
    response->set_medium(MediumToProto(found.medium));
    return absl::OkStatus();
  }();
  return Reply("LookupBlocks", status);
}

grpc::Status BlockStoreService::StoreBlocks(grpc::ServerContext*,
                                            const pb::StoreBlocksRequest* request,
                                            pb::TransferBlocksResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(find_scope_(request->engine()).status());
    // Authenticated first: nobody makes the daemon wait on an event for a pool not theirs.
    RETURN_IF_ERROR(backend_->WaitForEngineEvent(request->ordering().wait_event()));
    BlockTransfer transfer = TransferOf(*request);
    transfer.parent_hash = request->parent_hash();
    transfer.event_token_ids.assign(request->event_token_ids().begin(),
                                    request->event_token_ids().end());
    transfer.event_block_hashes.assign(request->event_block_hashes().begin(),
                                       request->event_block_hashes().end());
    ASSIGN_OR_RETURN(BlockTransferResult result,
                     store_->Store(request->engine().engine_id(), transfer));
    return ReplyTransfer(backend_, result, response);
  }();
  return Reply("StoreBlocks", status);
}

grpc::Status BlockStoreService::LoadBlocks(grpc::ServerContext*,
                                           const pb::LoadBlocksRequest* request,
                                           pb::TransferBlocksResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(find_scope_(request->engine()).status());
    RETURN_IF_ERROR(backend_->WaitForEngineEvent(request->ordering().wait_event()));
    BlockTransfer transfer = TransferOf(*request);
    transfer.pin_id = request->pin_id();
    ASSIGN_OR_RETURN(BlockTransferResult result,
                     store_->Load(request->engine().engine_id(), transfer));
    return ReplyTransfer(backend_, result, response);
  }();
  return Reply("LoadBlocks", status);
}

grpc::Status BlockStoreService::UnpinBlocks(grpc::ServerContext*,
                                            const pb::UnpinBlocksRequest* request,
                                            pb::UnpinBlocksResponse*) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(find_scope_(request->engine()).status());
    return store_->Unpin(request->engine().engine_id(), request->pin_id());
  }();
  return Reply("UnpinBlocks", status);
}

}  // namespace memra
