#include "server/restart/readopt.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/daemon_restart.h"
#include "server/base/sd_notify.h"
#include "spdlog/spdlog.h"

namespace memra {

Readopted Readopt(PreviousDaemon previous, const ReadoptParts& parts) {
  Readopted readopted;
  const absl::Time start = absl::Now();
  const DaemonRestart restart{previous.epoch, parts.epoch};
  for (const std::string& problem : previous.problems) {
    spdlog::warn("restart: {}", problem);
  }
  if (parts.restart_state != nullptr) {
    parts.restart_state->CarrySessionSlotLimit(previous.session_slot_limit);
  }
  // Plans, by the fingerprint the previous daemon recorded.
  absl::flat_hash_map<std::string, std::shared_ptr<const ModelPlan>> plans;
  absl::flat_hash_map<std::string, std::string> plan_names;
  for (auto& [name, plan] : previous.plans) {
    absl::StatusOr<PlanFingerprint> fingerprint = parts.plans->Register(plan);
    if (!fingerprint.ok()) {
      spdlog::warn("restart: kept plan {} not registered: {}", name,
                   fingerprint.status().ToString());
      continue;
    }
    absl::StatusOr<std::shared_ptr<const ModelPlan>> found = parts.plans->Find(*fingerprint);
    if (!found.ok()) continue;
    const std::string bytes = FingerprintToBytes(*fingerprint);
    plans[bytes] = *found;
    plan_names[bytes] = name;
  }
  absl::flat_hash_map<uint64_t, std::string> engines;  // id -> its cache scope
  for (const auto& engine : previous.engines) {
    parts.leases->Readopt(EngineId{engine.id()}, engine.token(),
                    EngineIdentity{.name = engine.name(),
                                   .peer = PeerCredentials{.uid = engine.uid(),
                                                           .gid = engine.gid(),
                                                           .pid = static_cast<pid_t>(engine.pid())},
                                   .cache_scope = engine.cache_scope()});
    engines.emplace(engine.id(), engine.cache_scope());
  }
  parts.leases->RaiseNextEngineId(previous.next_engine_id);
  parts.sessions->RaiseNextSessionId(previous.next_session_id);
  absl::flat_hash_map<uint64_t, std::string> not_readopted;
  for (const auto& record : previous.sessions) {
    auto plan = plans.find(record.plan_fingerprint());
    auto arena_fd = previous.arenas.find(record.arena_fd_name());
    std::string reason;
    if (!record.not_recoverable().empty()) {
      reason = record.not_recoverable();
    } else if (!engines.contains(record.owner())) {
      reason = absl::StrCat("its engine ", record.owner(), " was not in the journal");
    } else if (plan == plans.end()) {
      reason = "its model plan was not kept (or its fingerprint changed with the configuration)";
    } else if (arena_fd == previous.arenas.end()) {
      reason = absl::StrCat("its arena's memory (", record.arena_fd_name(), ") was not kept");
    }
    if (reason.empty()) {
      absl::StatusOr<ArenaId> arena = parts.backend->AdoptArenaFd(
          arena_fd->second.release(), record.arena_bytes(), record.arena_handle());
      previous.arenas.erase(arena_fd);
      if (!arena.ok()) {
        reason = absl::StrCat("its arena could not be mapped again: ", arena.status().message());
      } else {
        DaemonSession::Params params = parts.sessions->BaseParams();
        params.id = SessionId{record.id()};
        params.owner = EngineId{record.owner()};
        params.slot = record.slot();
        params.cache_scope = engines[record.owner()];
        params.token = record.token();
        params.model = plan->second;
        params.fingerprint = record.plan_fingerprint();
        params.shape.capacity = record.capacity();
        params.shape.layer_lo = record.layer_lo();
        if (record.has_layer_hi()) params.shape.layer_hi = record.layer_hi();
        params.shape.tp_ranks = record.tp_ranks();
        params.shape.spec_snapshot = record.spec_snapshot();
        const CommittedRecord committed{
            .committed_len = record.committed_len(),
            .next_generation = record.next_generation(),
            .ring_bases = {record.ring_bases().begin(), record.ring_bases().end()},
            .tainted = record.tainted()};
        if (parts.restart_state != nullptr) {
          parts.restart_state->NameAdoptedArena(*arena, record.arena_fd_name());
          parts.restart_state->NameAdoptedPlan(record.plan_fingerprint(), plan_names[plan->first]);
        }
        absl::StatusOr<std::unique_ptr<DaemonSession>> session =
            DaemonSession::Adopt(std::move(params), parts.backend, parts.budget, *arena,
                                 record.arena_bytes(), record.layout_version(), committed);
        absl::Status filed =
            session.ok() ? parts.sessions->Readopt(*std::move(session), previous.session_slot_limit)
                         : session.status();
        if (!filed.ok()) {
          reason = std::string(filed.message());
          if (parts.restart_state != nullptr) parts.restart_state->ArenaFreed(*arena);
          (void)parts.backend->FreeArena(*arena);
        } else {
          // Counts for its engine again.
          (void)parts.plans->Register(*plan->second, record.owner());
          ++readopted.sessions;
          readopted.bytes += record.arena_bytes();
          continue;
        }
      }
    }
    spdlog::warn("restart: session {} of engine {} not re-adopted: {}", record.id(),
                 record.owner(), reason);
    not_readopted[record.id()] = std::move(reason);
  }
  const size_t lost_now = not_readopted.size();
  // Why sessions were not re-adopted outlives this daemon: the next one tells their engines too
  // (issue 26), until the engine is reclaimed. Earlier restarts' reasons come along, naming the
  // restart they were lost in.
  for (const auto& lost : previous.lost_sessions) {
    if (!engines.contains(lost.owner()) || not_readopted.contains(lost.id())) continue;
    not_readopted[lost.id()] =
        absl::StrCat(lost.reason(), " (at the restart from epoch ", lost.lost_from_epoch(),
                     " to ", lost.lost_at_epoch(), ")");
    if (parts.restart_state != nullptr) parts.restart_state->SessionLost(lost);
  }
  if (parts.restart_state != nullptr) {
    for (const auto& record : previous.sessions) {
      auto lost = not_readopted.find(record.id());
      if (lost == not_readopted.end() || !engines.contains(record.owner())) continue;
      memra::kvd::journal::LostSessionRecord journaled;
      journaled.set_id(record.id());
      journaled.set_owner(record.owner());
      journaled.set_reason(lost->second);
      journaled.set_lost_from_epoch(previous.epoch);
      journaled.set_lost_at_epoch(parts.epoch);
      parts.restart_state->SessionLost(journaled);
    }
  }
  readopted.previous_epoch = previous.epoch;
  readopted.engines = engines.size();
  readopted.not_readopted = lost_now;
  readopted.torn_records = previous.torn_records;
  if (previous.unreadable_records > 0) {
    spdlog::warn("restart: {} journal records could not be read; sessions below id {} that are "
                 "not re-adopted answer the restart error",
                 previous.unreadable_records, previous.next_session_id);
  }
  parts.sessions->SetRestart(restart, std::move(not_readopted), previous.unreadable_records,
                       previous.next_session_id);
  parts.leases->SetRestart(restart, {});
  if (parts.restart_state != nullptr) {
    // This daemon's journal first, then the previous daemon's leftovers go: a crash in between
    // leaves two journals and the next start takes the newer.
    if (absl::Status published = parts.restart_state->Publish(); !published.ok()) {
      spdlog::error("restart journal not kept: {}", published.ToString());
    }
    parts.restart_state->ForgetUnusedPlans();
    parts.restart_state->Forget(previous.journal_name);
    for (const auto& [name, fd] : previous.arenas) parts.restart_state->Forget(name);
    for (const std::string& name : previous.leftovers) parts.restart_state->Forget(name);
  }
  readopted.took = absl::Now() - start;
  spdlog::info(
      "restart: epoch {} -> {} (generation {}): re-adopted {} engines and {} sessions ({} bytes) "
      "in {} ms; {} sessions not re-adopted, {} torn journal records, {} unused arenas freed",
      previous.epoch, parts.epoch, previous.generation + 1, readopted.engines, readopted.sessions,
      readopted.bytes, absl::ToDoubleMilliseconds(readopted.took), readopted.not_readopted,
      readopted.torn_records, previous.arenas.size());
  return readopted;
}

RestartKeeping KeepForRestart(const RestartKeepingOptions& options,
                              std::optional<PreviousDaemon>& previous, DeviceBackend* backend) {
  RestartKeeping keeping;
  if (!options.keep) {
    keeping.off = "keep_kv_across_restarts = false";
  } else if (!UnderServiceManager()) {
    keeping.off = "no service manager ($NOTIFY_SOCKET unset): run under systemd or "
                  "memra-kv-supervise";
  } else if (!options.memory_dies.empty()) {
    spdlog::warn("KV does not survive a restart on the {} backend: {}", backend->Name(),
                 options.memory_dies);
    keeping.off = options.memory_dies;
  } else {
    absl::StatusOr<std::unique_ptr<RestartState>> created =
        RestartState::Create(options.slots, options.epoch,
                             previous.has_value() ? previous->generation + 1 : 1, backend);
    if (created.ok()) {
      keeping.state = *std::move(created);
    } else {
      spdlog::error("KV will not survive a restart: {}", created.status().ToString());
      keeping.off =
          absl::StrCat("the restart journal could not be made: ", created.status().message());
    }
  }
  if (previous.has_value() && keeping.state == nullptr) {
    DropPreviousDaemon(*std::move(previous));
    previous.reset();
  }
  return keeping;
}

void DropPreviousDaemon(PreviousDaemon previous) {
  spdlog::warn("restart: the previous daemon's {} sessions are not re-adopted: this daemon "
               "keeps no restart journal (keep_kv_across_restarts, or the journal failed)",
               previous.sessions.size());
  std::vector<std::string> names = previous.leftovers;
  names.push_back(previous.journal_name);
  for (const auto& [name, fd] : previous.arenas) names.push_back(name);
  for (const auto& [name, plan] : previous.plans) names.push_back(name);
  for (const std::string& name : names) {
    if (!name.empty()) (void)SdNotify(absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name));
  }
}

}  // namespace memra
