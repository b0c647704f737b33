#include "server/edge/prefix_service.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/codec.h"
#include "core/status_macros.h"
#include "server/edge/rpc_reply.h"
#include "server/edge/session_wire.h"
#include "server/session/session_prefix.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

// How often an idle event stream looks for cancellation.
constexpr absl::Duration kEventPoll = absl::Milliseconds(200);

std::string KeyBytes(const BlockKey& key) {
  return std::string(reinterpret_cast<const char*>(key.data()), key.size());
}

}  // namespace

pb::PrefixMedium MediumToProto(StorageMedium medium) {
  switch (medium) {
    case StorageMedium::kDevice:
      return pb::PREFIX_MEDIUM_DEVICE;
    case StorageMedium::kPinnedHost:
      return pb::PREFIX_MEDIUM_PINNED_HOST;
    case StorageMedium::kDisk:
      return pb::PREFIX_MEDIUM_DISK;
    case StorageMedium::kRemote:
      return pb::PREFIX_MEDIUM_REMOTE;
  }
  return pb::PREFIX_MEDIUM_DEVICE;
}

namespace {

void FillEntry(const ScopedEntry& entry, StorageMedium medium, bool with_keys,
               pb::PrefixEntry* out) {
  const EntryView& view = entry.view;
  out->set_cache_scope(entry.cache_scope);
  out->set_entry_id(view.id.value);
  out->set_shape_fingerprint(FingerprintToBytes(view.fingerprint));
  out->set_boundary_tokens(view.boundary_tokens);
  out->set_blocks(view.blocks.size());
  uint64_t block_bytes = 0;
  for (const LookupBlock& block : view.blocks) {
    block_bytes += block.bytes;
    if (with_keys) out->add_block_keys(KeyBytes(block.key));
  }
  out->set_block_bytes(block_bytes);
  out->set_boundary_bytes(view.boundary_bytes);
  out->set_epoch(view.epoch);
  out->set_last_use_tick(view.last_use_tick);
  out->set_pins(view.pins);
  out->set_medium(MediumToProto(medium));
  out->set_from_engine_pool(entry.from_engine_pool);
  out->set_engine_id(view.origin.engine_id);
}

pb::PrefixEvent EventToProto(const ScopedPrefixEvent& scoped) {
  const PrefixEvent& event = scoped.event;
  pb::PrefixEvent out;
  out.set_cache_scope(scoped.cache_scope);
  out.set_sequence(event.sequence);
  out.set_epoch(event.epoch);
  switch (event.kind) {
    case PrefixEventKind::kStored:
      out.set_kind(pb::PrefixEvent::STORED);
      break;
    case PrefixEventKind::kEvicted:
      out.set_kind(pb::PrefixEvent::EVICTED);
      break;
    case PrefixEventKind::kDropped:
      out.set_kind(pb::PrefixEvent::DROPPED);
      break;
    case PrefixEventKind::kMoved:
      out.set_kind(pb::PrefixEvent::MOVED);
      break;
  }
  out.set_medium(MediumToProto(event.medium));
  out.set_shape_fingerprint(FingerprintToBytes(event.fingerprint));
  for (const BlockKey& key : event.block_keys) out.add_block_keys(KeyBytes(key));
  if (event.boundary_key.has_value()) out.set_boundary_key(KeyBytes(*event.boundary_key));
  out.set_reason(event.reason);
  // What routers index (fields 20-25): an engine pool's own hashes, else the keys themselves.
  const PrefixEventOrigin& origin = event.origin;
  if (!origin.block_hashes.empty()) {
    for (const std::string& hash : origin.block_hashes) out.add_block_hashes(hash);
  } else {
    for (const BlockKey& key : event.block_keys) out.add_block_hashes(KeyBytes(key));
  }
  out.set_parent_block_hash(origin.parent_block_hash);
  out.mutable_token_ids()->Add(origin.token_ids.begin(), origin.token_ids.end());
  out.set_block_tokens(origin.block_tokens);
  out.set_engine_id(origin.engine_id);
  out.set_from_engine_pool(origin.from_engine_pool);
  return out;
}

pb::PrefixEvent GapEvent(uint64_t epoch, uint64_t last_sequence) {
  pb::PrefixEvent gap;
  gap.set_kind(pb::PrefixEvent::GAP);
  gap.set_epoch(epoch);
  gap.set_sequence(last_sequence);
  return gap;
}

}  // namespace

pb::PrefixCacheStats PrefixStatsToProto(const PrefixCacheStats& stats) {
  pb::PrefixCacheStats out;
  out.set_entries(stats.entries);
  out.set_blocks(stats.blocks);
  out.set_stored_bytes(stats.stored_bytes);
  out.set_evictable_bytes(stats.evictable_bytes);
  out.set_pinned_bytes(stats.pinned_bytes);
  out.set_budget_bytes(stats.budget_bytes);
  out.set_lookup_hits(stats.lookup_hits);
  out.set_lookup_partials(stats.lookup_partials);
  out.set_lookup_misses(stats.lookup_misses);
  out.set_captures(stats.captures);
  out.set_restores(stats.restores);
  out.set_tokens_restored(stats.tokens_restored);
  out.set_evicted_entries(stats.evicted_entries);
  out.set_dropped_entries(stats.dropped_entries);
  out.set_death_captures(stats.death_captures);
  out.set_epoch(stats.epoch);
  out.set_last_sequence(stats.last_sequence);
  out.set_block_tokens(stats.block_tokens);
  out.set_slabs(stats.slabs.slabs);
  out.set_slab_bytes(stats.slabs.slab_bytes);
  out.set_slab_free_bytes(stats.slabs.free_bytes);
  out.set_slab_empty_bytes(stats.slabs.empty_bytes);
  out.set_slab_fragmentation_ppm(stats.slabs.fragmentation_ppm);
  for (const PrefixTierStats& tier : stats.tiers) {
    pb::PrefixTierStats* t = out.add_tiers();
    t->set_medium(MediumToProto(tier.medium));
    t->set_stored_bytes(tier.stored_bytes);
    t->set_budget_bytes(tier.budget_bytes);
    t->set_hits(tier.hits);
    t->set_promotions(tier.promotions);
    t->set_demotions(tier.demotions);
  }
  if (stats.remote.has_value()) {
    const RemoteTierStats& r = *stats.remote;
    pb::PrefixRemoteStats* remote = out.mutable_remote();
    remote->set_up(r.up);
    remote->set_queued_bytes(r.queued_bytes);
    remote->set_queued_writes(r.queued_writes);
    remote->set_writes(r.writes);
    remote->set_written_bytes(r.written_bytes);
    remote->set_dropped_writes(r.dropped_writes);
    remote->set_write_errors(r.write_errors);
    remote->set_reads(r.reads);
    remote->set_read_errors(r.read_errors);
    remote->set_partial_lookups(r.partial_lookups);
    remote->set_read_timeouts(r.read_timeouts);
    remote->set_read_refusals(r.read_refusals);
    remote->set_breaker_opens(r.breaker_opens);
    remote->set_hits(r.hits);
    remote->set_pulled_pieces(r.pulled_pieces);
    remote->set_pulled_bytes(r.pulled_bytes);
    remote->set_corrupt(r.corrupt);
    remote->set_shape_mismatches(r.shape_mismatches);
  }
  return out;
}

PrefixService::PrefixService(PrefixCache* cache, DeviceBackend* backend,
                             SessionFinder find_session, ScopeFinder find_scope,
                             ServedSocket socket, ConcurrencyLimit::Limits event_streams)
    : cache_(cache),
      backend_(backend),
      find_session_(std::move(find_session)),
      find_scope_(std::move(find_scope)),
      socket_(std::move(socket)),
      event_streams_("SubscribeEvents streams", std::move(event_streams)) {}

absl::StatusOr<std::optional<std::string>> PrefixService::ReaderScope(
    const pb::EngineRef& engine, const std::string& requested) const {
  if (socket_.for_operators()) {
    if (requested.empty()) return std::nullopt;
    return requested;
  }
  ASSIGN_OR_RETURN(std::string own, find_scope_(engine));
  if (!requested.empty() && requested != own) {
    return absl::PermissionDeniedError(
        absl::StrCat("engine ", engine.engine_id(), " reads only its own cache scope ", own,
                     ", not \"", requested, "\" (operators read any scope on the admin socket ",
                     socket_.admin_socket_path, ")"));
  }
  return own;
}

absl::Status PrefixService::Enabled() const {
  if (cache_ == nullptr) {
    return absl::FailedPreconditionError(
        "the prefix cache is disabled on this daemon (prefix_cache_budget_bytes = 0)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<DaemonSession>> PrefixService::OrderedSession(
    const pb::SessionRef& ref, const pb::DeviceOrdering& ordering) {
  ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session, find_session_(ref));
  RETURN_IF_ERROR(backend_->WaitForEngineEvent(ordering.wait_event()));
  return session;
}

grpc::Status PrefixService::Capture(grpc::ServerContext*, const pb::CapturePrefixRequest* request,
                                    pb::CapturePrefixResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(Enabled());
    ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session,
                     OrderedSession(request->session(), request->ordering()));
    // The backend's copies are complete when they return (DeviceBackend invariant (4)).
    ASSIGN_OR_RETURN(PrefixCaptureResult captured,
                     CaptureSessionPrefix(*cache_, *session, SpanOf(request->token_ids()),
                                          request->boundary_tokens()));
    response->set_entry_id(captured.entry.value);
    response->set_boundary_tokens(captured.boundary_tokens);
    response->set_already_present(captured.already_present);
    response->set_added_bytes(captured.added_bytes);
    response->set_stored_bytes(captured.stored_bytes);
    response->set_shape_fingerprint(FingerprintToBytes(captured.shape));
    return absl::OkStatus();
  }();
  return Reply("prefix Capture", status);
}

grpc::Status PrefixService::Lookup(grpc::ServerContext*, const pb::LookupPrefixRequest* request,
                                   pb::LookupPrefixResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(Enabled());
    ASSIGN_OR_RETURN(std::optional<std::string> scope,
                     ReaderScope(request->engine(), request->cache_scope()));
    if (!scope.has_value()) {
      return absl::InvalidArgumentError(
          "a Lookup on the admin socket names the cache scope to look in (cache_scope)");
    }
    ASSIGN_OR_RETURN(PlanFingerprint model,
                     FingerprintFromBytes(request->shape().plan_fingerprint()));
    const PrefixLookupResult found = cache_->Lookup(
        *scope, PrefixShapeFingerprint(model, SessionShapeFromProto(request->shape())),
        SpanOf(request->token_ids()));
    switch (found.outcome) {
      case LookupOutcome::kMiss:
        response->set_outcome(pb::LOOKUP_OUTCOME_MISS);
        break;
      case LookupOutcome::kPartial:
        response->set_outcome(pb::LOOKUP_OUTCOME_PARTIAL);
        break;
      case LookupOutcome::kHit:
        response->set_outcome(pb::LOOKUP_OUTCOME_HIT);
        break;
    }
    response->set_entry_id(found.entry.has_value() ? found.entry->value : 0);
    response->set_matched_tokens(found.matched_tokens);
    response->set_block_tokens(cache_->block_tokens());
    response->set_medium(MediumToProto(found.medium));
    return absl::OkStatus();
  }();
  return Reply("prefix Lookup", status);
}

grpc::Status PrefixService::Restore(grpc::ServerContext*, const pb::RestorePrefixRequest* request,
                                    pb::RestorePrefixResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(Enabled());
    ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session,
                     OrderedSession(request->session(), request->ordering()));
    std::optional<EntryId> entry;
    if (request->entry_id() != 0) entry = EntryId{request->entry_id()};
    ASSIGN_OR_RETURN(PrefixRestoreResult restored,
                     RestoreSessionPrefix(*cache_, *session, entry, SpanOf(request->token_ids())));
    response->set_entry_id(restored.entry.value);
    response->set_restored_tokens(restored.restored_tokens);
    ASSIGN_OR_RETURN(SessionReport report, session->GetState());
    SessionStatusToProto(report.state, response->mutable_state());
    return absl::OkStatus();
  }();
  return Reply("prefix Restore", status);
}

grpc::Status PrefixService::SubscribeEvents(grpc::ServerContext* context,
                                            const pb::SubscribePrefixEventsRequest* request,
                                            grpc::ServerWriter<pb::PrefixEvent>* writer) {
  if (absl::Status enabled = Enabled(); !enabled.ok()) return Reply("SubscribeEvents", enabled);
  absl::StatusOr<std::optional<std::string>> scope =
      ReaderScope(request->engine(), request->cache_scope());
  if (!scope.ok()) return Reply("SubscribeEvents", scope.status());
  // A stream holds one of the synchronous server's threads until it ends: bounded per engine
  // (authenticated above) and per socket.
  std::optional<uint64_t> engine;
  if (!socket_.for_operators()) engine = request->engine().engine_id();
  absl::StatusOr<std::unique_ptr<ConcurrencyLimit::Permit>> open = event_streams_.TryAcquire(engine);
  if (!open.ok()) return Reply("SubscribeEvents", open.status());
  // Tells the subscriber the stream is open (it holds its permit) before any event comes.
  writer->SendInitialMetadata();
  uint64_t epoch = request->epoch();
  uint64_t last = request->last_sequence();
  while (!context->IsCancelled() && !stopping_.load()) {
    // The stream lives no longer than the lease that opened it.
    if (engine.has_value()) {
      if (absl::StatusOr<std::string> still = find_scope_(request->engine()); !still.ok()) {
        return Reply("SubscribeEvents", still.status());
      }
    }
    const ScopedEventReplay replay = cache_->EventsSince(epoch, last, *scope);
    if (replay.gap) {
      // Resync from here on: the subscriber lists the entries, then follows live events.
      if (!writer->Write(GapEvent(cache_->epoch(), replay.last_sequence))) break;
    }
    for (const ScopedPrefixEvent& event : replay.events) {
      if (!writer->Write(EventToProto(event))) return grpc::Status::OK;
    }
    epoch = cache_->epoch();
    last = replay.last_sequence;
    cache_->AwaitEvent(last, kEventPoll);
  }
  return grpc::Status::OK;
}

grpc::Status PrefixService::ListPrefixes(grpc::ServerContext*, const pb::ListPrefixesRequest*,
                                         pb::ListPrefixesResponse* response) {
  if (absl::Status allowed = socket_.AllowOperatorCall("KvPrefixCache.ListPrefixes");
      !allowed.ok()) {
    return Reply("ListPrefixes", allowed);
  }
  if (absl::Status enabled = Enabled(); !enabled.ok()) return Reply("ListPrefixes", enabled);
  for (const ScopedEntry& entry : cache_->ListEntries()) {
    FillEntry(entry, cache_->MediumOf(entry.view), /*with_keys=*/false, response->add_entries());
  }
  *response->mutable_stats() = PrefixStatsToProto(cache_->Stats());
  return grpc::Status::OK;
}

grpc::Status PrefixService::InspectPrefix(grpc::ServerContext*,
                                          const pb::InspectPrefixRequest* request,
                                          pb::PrefixEntry* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(socket_.AllowOperatorCall("KvPrefixCache.InspectPrefix"));
    RETURN_IF_ERROR(Enabled());
    ASSIGN_OR_RETURN(ScopedEntry entry, cache_->Inspect(EntryId{request->entry_id()}));
    FillEntry(entry, cache_->MediumOf(entry.view), /*with_keys=*/true, response);
    return absl::OkStatus();
  }();
  return Reply("InspectPrefix", status);
}

grpc::Status PrefixService::EvictPrefix(grpc::ServerContext*,
                                        const pb::EvictPrefixRequest* request,
                                        pb::EvictPrefixResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(socket_.AllowOperatorCall("KvPrefixCache.EvictPrefix"));
    RETURN_IF_ERROR(Enabled());
    ASSIGN_OR_RETURN(uint64_t freed, cache_->EvictEntry(EntryId{request->entry_id()}));
    response->set_freed_bytes(freed);
    *response->mutable_stats() = PrefixStatsToProto(cache_->Stats());
    return absl::OkStatus();
  }();
  return Reply("EvictPrefix", status);
}

}  // namespace memra
