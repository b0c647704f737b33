#include "server/restart/restart_state.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/errors.h"
#include "core/status_macros.h"
#include "proto/memra/kv/v1/model_plan.pb.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

namespace jr = ::memra::kvd::journal;

constexpr char kJournalPrefix[] = "journal-";
constexpr char kArenaPrefix[] = "arena-";
constexpr char kPlanPrefix[] = "plan-";

uint64_t EngineKey(uint64_t id) { return id << 1; }
uint64_t SessionKey(uint64_t id) { return (id << 1) | 1; }

// The whole content of a memfd (a kept plan).
absl::StatusOr<std::string> ReadAll(int fd) {
  std::string content;
  char buffer[65536];
  for (off_t at = 0;;) {
    const ssize_t n = pread(fd, buffer, sizeof(buffer), at);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("reading a kept plan", errno);
    }
    if (n == 0) return content;
    content.append(buffer, static_cast<size_t>(n));
    at += n;
  }
}

}  // namespace

std::optional<PreviousDaemon> ReadPreviousDaemon(std::vector<ListenedFd> passed) {
  PreviousDaemon previous;
  // The newest journal; every other passed name is an arena, a plan or a leftover.
  std::unique_ptr<RestartJournal> journal;
  std::vector<std::pair<std::string, ScopedFd>> plans;
  for (ListenedFd& listened : passed) {
    ScopedFd fd(listened.fd);
    if (absl::StartsWith(listened.name, kJournalPrefix)) {
      absl::StatusOr<std::unique_ptr<RestartJournal>> opened = RestartJournal::Open(std::move(fd));
      if (!opened.ok()) {
        previous.problems.push_back(
            absl::StrCat(listened.name, ": ", opened.status().message()));
        previous.leftovers.push_back(listened.name);
      } else if (journal == nullptr || (*opened)->generation() > journal->generation()) {
        if (journal != nullptr) previous.leftovers.push_back(previous.journal_name);
        journal = *std::move(opened);
        previous.journal_name = listened.name;
      } else {
        previous.leftovers.push_back(listened.name);
      }
    } else if (absl::StartsWith(listened.name, kArenaPrefix)) {
      previous.arenas.emplace(listened.name, std::move(fd));
    } else if (absl::StartsWith(listened.name, kPlanPrefix)) {
      plans.emplace_back(listened.name, std::move(fd));
    } else {
      previous.leftovers.push_back(listened.name);
    }
  }
  if (journal == nullptr) {
    for (auto& [name, fd] : previous.arenas) previous.leftovers.push_back(name);
    for (auto& [name, fd] : plans) previous.leftovers.push_back(name);
    if (!previous.leftovers.empty()) {
      spdlog::warn("{} descriptors were passed but no restart journal that opens: nothing is "
                   "re-adopted, and they leave the fd store", previous.leftovers.size());
    }
    for (const std::string& problem : previous.problems) spdlog::warn("restart: {}", problem);
    for (const std::string& name : previous.leftovers) {
      if (!name.empty()) (void)SdNotify(absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name));
    }
    return std::nullopt;
  }
  previous.epoch = journal->epoch();
  previous.generation = journal->generation();
  previous.next_engine_id = journal->next_engine_id();
  previous.next_session_id = journal->next_session_id();
  previous.session_slot_limit = journal->session_slot_limit();
  for (uint64_t slot = 0; slot < journal->slots(); ++slot) {
    RestartJournal::SlotContent content = journal->Read(slot);
    if (content.torn) ++previous.torn_records;
    if (!content.payload.has_value()) {
      if (content.newest_damaged) {
        ++previous.unreadable_records;
        spdlog::warn("restart: journal slot {}: every copy of its record is damaged; the "
                     "session or engine it held is lost and cannot be named",
                     slot);
      }
      continue;
    }
    jr::Record record;
    if (!record.ParseFromString(*content.payload)) {
      ++previous.unreadable_records;
      spdlog::warn("restart: journal slot {} does not parse; the session or engine it held is "
                   "lost and cannot be named",
                   slot);
      continue;
    }
    if (record.has_session() && content.newest_damaged) {
      // The whole copy may be older than what the engine was told (a session would come back
      // at length 10 after its engine was told 30): not re-adopted, and its engine told why.
      spdlog::warn("restart: session {} of engine {}: its newest journal record is damaged; the "
                   "older one (committed length {}) may be older than what its engine was told, "
                   "so it is not re-adopted",
                   record.session().id(), record.session().owner(),
                   record.session().committed_len());
      record.mutable_session()->set_not_recoverable(
          "its newest restart journal record was damaged (it fails its checksum), so the state "
          "it was last acknowledged at is not known");
    } else if (content.torn) {
      spdlog::info("restart: journal slot {}: a write was torn by the crash; the record before "
                   "it is used (a change in flight comes back undone)",
                   slot);
    }
    if (record.has_engine()) previous.engines.push_back(record.engine());
    if (record.has_session()) previous.sessions.push_back(record.session());
    if (record.has_lost_session()) previous.lost_sessions.push_back(record.lost_session());
  }
  for (auto& [name, fd] : plans) {
    absl::StatusOr<std::string> bytes = ReadAll(fd.get());
    memra::kv::v1::ModelPlan proto;
    absl::StatusOr<ModelPlan> plan =
        !bytes.ok() ? absl::StatusOr<ModelPlan>(bytes.status())
        : proto.ParseFromString(*bytes)
            ? ModelPlanFromProto(proto)
            : absl::StatusOr<ModelPlan>(absl::InvalidArgumentError("does not parse"));
    if (!plan.ok()) {
      previous.problems.push_back(absl::StrCat(name, ": ", plan.status().message()));
      previous.leftovers.push_back(name);
      continue;
    }
    previous.plans.emplace(name, *std::move(plan));
  }
  return previous;
}

absl::StatusOr<std::unique_ptr<RestartState>> RestartState::Create(uint64_t slots, uint64_t epoch,
                                                                   uint64_t generation,
                                                                   DeviceBackend* backend,
                                                                   FdStoreSender send) {
  ASSIGN_OR_RETURN(std::unique_ptr<RestartJournal> journal,
                   RestartJournal::Create(slots, epoch, generation));
  if (!send) send = &SdNotifyWithFds;
  return std::unique_ptr<RestartState>(
      new RestartState(std::move(journal), backend, std::move(send)));
}

RestartState::RestartState(std::unique_ptr<RestartJournal> journal, DeviceBackend* backend,
                           FdStoreSender send)
    : journal_(std::move(journal)), backend_(backend), send_(std::move(send)) {}

void RestartState::FailLocked(std::string what) {
  ++failures_;
  spdlog::error("restart survival: {}", what);
}

std::optional<uint64_t> RestartState::TakeSlotLocked(uint64_t key) {
  if (auto it = slots_.find(key); it != slots_.end()) return it->second;
  uint64_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else if (next_unused_slot_ < journal_->slots()) {
    slot = next_unused_slot_++;
  } else {
    return std::nullopt;
  }
  slots_[key] = slot;
  return slot;
}

void RestartState::FreeSlotLocked(uint64_t key) {
  auto it = slots_.find(key);
  if (it == slots_.end()) return;
  (void)journal_->Clear(it->second);
  free_slots_.push_back(it->second);
  slots_.erase(it);
}

absl::Status RestartState::StoreLocked(const std::string& name, int fd) {
  return send_(absl::StrCat("FDSTORE=1\nFDNAME=", name), {fd});
}

void RestartState::RemoveLocked(const std::string& name) {
  if (absl::Status removed = send_(absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name), {});
      !removed.ok()) {
    FailLocked(absl::StrCat("removing ", name, " from the fd store: ", removed.message()));
  }
}

void RestartState::EngineAttached(uint64_t id, absl::string_view token, absl::string_view name,
                                  const PeerCredentials& peer, absl::string_view cache_scope) {
  jr::Record record;
  jr::EngineRecord* engine = record.mutable_engine();
  engine->set_id(id);
  engine->set_token(std::string(token));
  engine->set_name(std::string(name.substr(0, 128)));
  engine->set_pid(peer.pid);
  engine->set_uid(peer.uid);
  engine->set_gid(peer.gid);
  engine->set_cache_scope(std::string(cache_scope));
  journal_->RaiseNextEngineId(id + 1);
  absl::MutexLock lock(&mu_);
  std::optional<uint64_t> slot = TakeSlotLocked(EngineKey(id));
  if (!slot.has_value()) {
    FailLocked(absl::StrCat("journal full (", journal_->slots(), " slots): engine ", id,
                            " will not survive a restart"));
    return;
  }
  if (absl::Status written = journal_->Write(*slot, record.SerializeAsString()); !written.ok()) {
    FailLocked(absl::StrCat("engine ", id, ": ", written.message()));
  }
}

void RestartState::EngineForgotten(uint64_t id) {
  absl::MutexLock lock(&mu_);
  FreeSlotLocked(EngineKey(id));
  if (auto lost = lost_by_owner_.find(id); lost != lost_by_owner_.end()) {
    for (uint64_t session : lost->second) FreeSlotLocked(SessionKey(session));
    lost_by_owner_.erase(lost);
  }
}

void RestartState::SessionLost(const jr::LostSessionRecord& lost) {
  jr::Record record;
  *record.mutable_lost_session() = lost;
  std::string payload = record.SerializeAsString();
  if (payload.size() > RestartJournal::kMaxPayloadBytes) {  // a long reason: cut, still valid
    const size_t over = payload.size() - RestartJournal::kMaxPayloadBytes;
    record.mutable_lost_session()->mutable_reason()->resize(
        lost.reason().size() > over + 3 ? lost.reason().size() - over - 3 : 0);
    payload = record.SerializeAsString();
  }
  absl::MutexLock lock(&mu_);
  std::optional<uint64_t> slot = TakeSlotLocked(SessionKey(lost.id()));
  if (!slot.has_value()) {
    FailLocked(absl::StrCat("journal full (", journal_->slots(), " slots): why session ",
                            lost.id(), " was not re-adopted will not be told after a restart"));
    return;
  }
  if (absl::Status written = journal_->Write(*slot, payload); !written.ok()) {
    FailLocked(absl::StrCat("lost session ", lost.id(), ": ", written.message()));
    return;
  }
  lost_by_owner_[lost.owner()].push_back(lost.id());
}

void RestartState::ArenaCreated(ArenaId arena) {
  absl::StatusOr<int> fd = backend_->DuplicateArenaFd(arena);
  absl::MutexLock lock(&mu_);
  if (!fd.ok()) {
    FailLocked(absl::StrCat("arena ", arena.value, " not kept: ", fd.status().message()));
    return;
  }
  ScopedFd owned(*fd);  // the store holds its own copy once sent
  const std::string name = absl::StrCat(kArenaPrefix, journal_->generation(), "-", arena.value);
  if (absl::Status stored = StoreLocked(name, owned.get()); !stored.ok()) {
    FailLocked(absl::StrCat("arena ", arena.value, " not kept: ", stored.message()));
    return;
  }
  arena_names_[arena.value] = name;
}

void RestartState::ArenaFreed(ArenaId arena) {
  absl::MutexLock lock(&mu_);
  auto it = arena_names_.find(arena.value);
  if (it == arena_names_.end()) return;
  RemoveLocked(it->second);
  arena_names_.erase(it);
}

void RestartState::RefPlanLocked(const JournaledSession& session) {
  const std::string fingerprint(session.fingerprint);
  session_plans_[session.id] = fingerprint;
  StoredPlan& plan = plans_[fingerprint];
  ++plan.sessions;
  if (!plan.fd_name.empty() || session.model == nullptr) return;
  const std::string bytes = ModelPlanToProto(*session.model).SerializeAsString();
  const int raw = memfd_create("memra-kv-plan", MFD_CLOEXEC);
  if (raw < 0) {
    FailLocked(absl::StrCat("memfd_create for a plan: errno ", errno));
    return;
  }
  ScopedFd fd(raw);
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      FailLocked(absl::StrCat("writing a plan's memfd: errno ", errno));
      return;
    }
    done += static_cast<size_t>(n);
  }
  const std::string name =
      absl::StrCat(kPlanPrefix, absl::BytesToHexString(fingerprint));
  if (absl::Status stored = StoreLocked(name, fd.get()); !stored.ok()) {
    FailLocked(absl::StrCat(name, " not kept: ", stored.message()));
    return;
  }
  plan.fd_name = name;
}

void RestartState::UnrefPlanLocked(const std::string& fingerprint) {
  auto it = plans_.find(fingerprint);
  if (it == plans_.end()) return;
  if (--it->second.sessions > 0) return;
  if (!it->second.fd_name.empty()) RemoveLocked(it->second.fd_name);
  plans_.erase(it);
}

void RestartState::SessionChanged(const JournaledSession& session) {
  jr::Record record;
  jr::SessionRecord* out = record.mutable_session();
  std::optional<uint64_t> slot;
  {
    absl::MutexLock lock(&mu_);
    slot = TakeSlotLocked(SessionKey(session.id));
    if (!slot.has_value()) {
      FailLocked(absl::StrCat("journal full (", journal_->slots(), " slots): session ",
                              session.id, " will not survive a restart"));
      return;
    }
    if (!session_plans_.contains(session.id)) RefPlanLocked(session);
    auto arena = arena_names_.find(session.arena.value);
    if (arena != arena_names_.end()) {
      out->set_arena_fd_name(arena->second);
    } else {
      out->set_not_recoverable("its arena's memory was not kept in the fd store");
    }
  }
  journal_->RaiseNextSessionId(session.id + 1);
  out->set_id(session.id);
  out->set_token(std::string(session.token));
  out->set_owner(session.owner);
  out->set_slot(session.slot);
  out->set_plan_fingerprint(std::string(session.fingerprint));
  out->set_layer_lo(session.shape.layer_lo);
  if (session.shape.layer_hi.has_value()) out->set_layer_hi(*session.shape.layer_hi);
  out->set_tp_ranks(session.shape.tp_ranks);
  out->set_spec_snapshot(session.shape.spec_snapshot);
  out->set_capacity(session.shape.capacity);
  out->set_layout_version(session.layout_version);
  out->set_arena_handle(std::string(session.arena_handle));
  out->set_arena_bytes(session.arena_bytes);
  out->set_committed_len(session.committed.committed_len);
  out->set_next_generation(session.committed.next_generation);
  for (uint64_t base : session.committed.ring_bases) out->add_ring_bases(base);
  out->set_tainted(session.committed.tainted);
  if (!session.not_recoverable.empty()) out->set_not_recoverable(session.not_recoverable);
  std::string payload = record.SerializeAsString();
  if (payload.size() > RestartJournal::kMaxPayloadBytes) {
    // Too many ring layers to describe: the engine gets told why instead.
    const size_t bytes = payload.size();
    out->clear_ring_bases();
    out->set_not_recoverable(absl::StrCat("its journal record of ", bytes,
                                          " bytes exceeds a slot's ",
                                          RestartJournal::kMaxPayloadBytes));
    payload = record.SerializeAsString();
  }
  if (absl::Status written = journal_->Write(*slot, payload); !written.ok()) {
    absl::MutexLock lock(&mu_);
    FailLocked(absl::StrCat("session ", session.id, ": ", written.message()));
  }
}

void RestartState::SessionReleased(uint64_t id) {
  absl::MutexLock lock(&mu_);
  FreeSlotLocked(SessionKey(id));
  if (auto it = session_plans_.find(id); it != session_plans_.end()) {
    UnrefPlanLocked(it->second);
    session_plans_.erase(it);
  }
}

void RestartState::NameAdoptedArena(ArenaId arena, std::string fd_name) {
  absl::MutexLock lock(&mu_);
  arena_names_[arena.value] = std::move(fd_name);
}

void RestartState::NameAdoptedPlan(std::string fingerprint, std::string fd_name) {
  absl::MutexLock lock(&mu_);
  plans_[std::move(fingerprint)].fd_name = std::move(fd_name);
}

void RestartState::ForgetUnusedPlans() {
  absl::MutexLock lock(&mu_);
  for (auto it = plans_.begin(); it != plans_.end();) {
    if (it->second.sessions == 0) {
      if (!it->second.fd_name.empty()) RemoveLocked(it->second.fd_name);
      plans_.erase(it++);
      continue;
    }
    ++it;
  }
}

absl::Status RestartState::Publish() {
  absl::MutexLock lock(&mu_);
  if (published_) return absl::OkStatus();
  RETURN_IF_ERROR(
      StoreLocked(absl::StrCat(kJournalPrefix, journal_->generation()), journal_->fd()));
  published_ = true;
  return absl::OkStatus();
}

void RestartState::Forget(const std::string& fd_name) {
  absl::MutexLock lock(&mu_);
  RemoveLocked(fd_name);
}

void RestartState::ProbeStore() {
  absl::MutexLock lock(&mu_);
  if (store_lost_.has_value()) return;
  // Unknown assignments are ignored by systemd and memra-kv-supervise alike.
  const absl::Status answered = send_("MEMRA_KV_PROBE=1", {});
  if (answered.ok()) return;
  store_lost_ = absl::StrCat("the service manager stopped answering on NOTIFY_SOCKET (",
                             answered.message(),
                             "): what its fd store kept is gone, and KV will not survive the "
                             "next restart of this daemon");
  spdlog::error("restart survival is off: {}", *store_lost_);
}

std::optional<std::string> RestartState::store_lost() const {
  absl::MutexLock lock(&mu_);
  return store_lost_;
}

uint64_t RestartState::failures() const {
  absl::MutexLock lock(&mu_);
  return failures_;
}

size_t RestartState::stored_fds() const {
  absl::MutexLock lock(&mu_);
  size_t plans = 0;
  for (const auto& [fingerprint, plan] : plans_) plans += plan.fd_name.empty() ? 0 : 1;
  return arena_names_.size() + plans + (published_ ? 1 : 0);
}

}  // namespace memra
