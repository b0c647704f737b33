#include "client/prefix_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/connection.h"
#include "client/internal.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

absl::StatusOr<BlockKey> BlockKeyFromBytes(const std::string& bytes, absl::string_view field) {
  BlockKey key;
  if (bytes.size() != key.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", bytes.size(), " bytes, not ", key.size()));
  }
  std::copy(bytes.begin(), bytes.end(), key.begin());
  return key;
}

}  // namespace

absl::StatusOr<PrefixCaptured> PrefixClient::Capture(const Session& session,
                                                     absl::Span<const int32_t> token_ids,
                                                     uint64_t boundary_tokens) const {
  pb::CapturePrefixRequest request = ForSession<pb::CapturePrefixRequest>(session);
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  request.set_boundary_tokens(boundary_tokens);
  pb::CapturePrefixResponse response;
  RETURN_IF_ERROR(ClientConnection::ViewCall(connection_, "PrefixClient::Capture", std::nullopt,
                                             &pb::KvPrefixCache::Stub::Capture, request,
                                             response));
  PrefixCaptured captured{response.entry_id(),        response.boundary_tokens(),
                          response.already_present(), response.added_bytes(),
                          response.stored_bytes(),    {}};
  ASSIGN_OR_RETURN(captured.shape_fingerprint, FingerprintFromBytes(response.shape_fingerprint()));
  return captured;
}

absl::StatusOr<PrefixMatch> PrefixClient::Lookup(const PlanFingerprint& plan,
                                                 const SessionOptions& shape,
                                                 absl::Span<const int32_t> token_ids) const {
  pb::LookupPrefixRequest request;
  SetSessionShape(plan, shape, *request.mutable_shape());
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  pb::LookupPrefixResponse response;
  // As the engine: its cache scope is read.
  RETURN_IF_ERROR(ClientConnection::ViewCall(connection_, "PrefixClient::Lookup", "LookupPrefix",
                                             &pb::KvPrefixCache::Stub::Lookup, request,
                                             response));
  PrefixMatch match;
  switch (response.outcome()) {
    case pb::LOOKUP_OUTCOME_HIT:
      match.outcome = LookupOutcome::kHit;
      break;
    case pb::LOOKUP_OUTCOME_PARTIAL:
      match.outcome = LookupOutcome::kPartial;
      break;
    default:
      match.outcome = LookupOutcome::kMiss;
      break;
  }
  match.entry_id = response.entry_id();
  match.matched_tokens = response.matched_tokens();
  match.block_tokens = response.block_tokens();
  match.medium = MediumFromProto(response.medium());
  return match;
}

absl::StatusOr<PrefixRestored> PrefixClient::Restore(const Session& session,
                                                     absl::Span<const int32_t> token_ids,
                                                     uint64_t entry_id) const {
  pb::RestorePrefixRequest request = ForSession<pb::RestorePrefixRequest>(session);
  request.set_entry_id(entry_id);
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  pb::RestorePrefixResponse response;
  RETURN_IF_ERROR(ClientConnection::ViewCall(connection_, "PrefixClient::Restore", std::nullopt,
                                             &pb::KvPrefixCache::Stub::Restore, request,
                                             response));
  return PrefixRestored{response.entry_id(), response.restored_tokens(),
                        SessionSnapshotFromProto(response.state())};
}

// ---- PrefixEventStream ----

struct PrefixEventStream::Call {
  // Keeps the channel the reader is on (null when the subscription was refused).
  std::shared_ptr<ClientConnection> connection;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<pb::PrefixEvent>> reader;
  // Why there is no reader: what the first Next() returns.
  absl::Status refused;
  bool finished = false;  // Finish() was called (it may be called once), or there is no reader
};

PrefixEventStream::PrefixEventStream(std::unique_ptr<Call> call) : call_(std::move(call)) {}

PrefixEventStream::~PrefixEventStream() {
  Cancel();
  if (!call_->finished) (void)call_->reader->Finish();
}

void PrefixEventStream::Cancel() { call_->context.TryCancel(); }

absl::StatusOr<std::optional<PrefixCacheEvent>> PrefixEventStream::Next() {
  if (!call_->refused.ok()) return std::exchange(call_->refused, absl::OkStatus());
  if (call_->finished) return std::nullopt;
  pb::PrefixEvent event;
  if (!call_->reader->Read(&event)) {
    call_->finished = true;
    absl::Status ended = FromGrpcStatus(call_->reader->Finish());
    // Cancelling is how a subscriber ends the stream: not an error.
    if (ended.ok() || absl::IsCancelled(ended)) return std::nullopt;
    return ended;
  }
  PrefixCacheEvent out;
  out.gap = event.kind() == pb::PrefixEvent::GAP;
  out.sequence = event.sequence();
  out.epoch = event.epoch();
  if (out.gap) return out;
  switch (event.kind()) {
    case pb::PrefixEvent::EVICTED:
      out.kind = PrefixEventKind::kEvicted;
      break;
    case pb::PrefixEvent::DROPPED:
      out.kind = PrefixEventKind::kDropped;
      break;
    case pb::PrefixEvent::MOVED:
      out.kind = PrefixEventKind::kMoved;
      break;
    default:
      out.kind = PrefixEventKind::kStored;
      break;
  }
  ASSIGN_OR_RETURN(out.shape_fingerprint, FingerprintFromBytes(event.shape_fingerprint()));
  for (const std::string& key : event.block_keys()) {
    ASSIGN_OR_RETURN(out.block_keys.emplace_back(), BlockKeyFromBytes(key, "event block key"));
  }
  if (!event.boundary_key().empty()) {
    ASSIGN_OR_RETURN(out.boundary_key, BlockKeyFromBytes(event.boundary_key(), "boundary key"));
  }
  out.reason = event.reason();
  out.cache_scope = event.cache_scope();
  out.medium = MediumFromProto(event.medium());
  out.origin.block_hashes.assign(event.block_hashes().begin(), event.block_hashes().end());
  out.origin.parent_block_hash = event.parent_block_hash();
  out.origin.token_ids.assign(event.token_ids().begin(), event.token_ids().end());
  out.origin.block_tokens = event.block_tokens();
  out.origin.engine_id = event.engine_id();
  out.origin.from_engine_pool = event.from_engine_pool();
  return out;
}

std::unique_ptr<PrefixEventStream> PrefixClient::SubscribeEvents(uint64_t epoch,
                                                                 uint64_t last_sequence) const {
  auto call = std::make_unique<PrefixEventStream::Call>();
  absl::StatusOr<std::shared_ptr<ClientConnection>> connection =
      ClientConnection::Lock(connection_, "PrefixClient::SubscribeEvents");
  if (!connection.ok()) {
    call->refused = connection.status();
    call->finished = true;
    return std::unique_ptr<PrefixEventStream>(new PrefixEventStream(std::move(call)));
  }
  call->connection = *std::move(connection);
  pb::SubscribePrefixEventsRequest request;
  request.set_epoch(epoch);
  request.set_last_sequence(last_sequence);
  // The engine's scope's events (an unattached client is refused by the engine socket).
  std::optional<pb::EngineRef> engine = call->connection->EngineIfAttached();
  if (engine.has_value()) *request.mutable_engine() = *std::move(engine);
  call->reader = call->connection->prefix().SubscribeEvents(&call->context, request);
  return std::unique_ptr<PrefixEventStream>(new PrefixEventStream(std::move(call)));
}

}  // namespace memra
