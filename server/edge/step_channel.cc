#include "server/edge/step_channel.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "core/status_macros.h"
#include "common/daemon_restart.h"
#include "spdlog/spdlog.h"

namespace memra {

using step_channel::CloseReason;
using step_channel::CompletionRecord;
using step_channel::CompletionSide;
using step_channel::kCompletionSideBytes;
using step_channel::kSlots;
using step_channel::kSubmissionSideBytes;
using step_channel::LayerAppendRecord;
using step_channel::Op;
using step_channel::StepChannelHeader;
using step_channel::SubmissionRecord;

namespace {

constexpr int kMaxEvents = 64;
// Refusals logged per channel and second (the rest are counted, then logged as a count): a
// misbehaving engine cannot flood the log from the thread that serves every engine.
constexpr uint32_t kRefusalsLoggedPerSecond = 10;
// Channels one engine lease may open: each pins a region the engine may keep mapped, so an
// engine that re-opens (a re-attach that resumed its lease) may, a few times, and no more.
constexpr uint32_t kMaxOpensPerEngine = 4;
// How often a channel whose record waits for a busy session is tried again while idle.
constexpr int kParkedRetryMilliseconds = 1;
constexpr uint64_t kWakeEvent = 0;  // epoll data of wake_; a channel's is its engine id (>= 1)

bool AllZero(const uint8_t* bytes, size_t size) {
  return std::all_of(bytes, bytes + size, [](uint8_t b) { return b == 0; });
}

// Writes `bytes` into the completion side span at `offset` of `side` and says where.
void PutSide(uint8_t* side, uint32_t cq_index, absl::string_view bytes, CompletionSide kind,
             CompletionRecord& completion) {
  const uint64_t offset = uint64_t{cq_index} * kCompletionSideBytes;
  const size_t length = std::min<size_t>(bytes.size(), kCompletionSideBytes);
  std::memcpy(side + offset, bytes.data(), length);
  completion.side_kind = static_cast<uint8_t>(kind);
  completion.side_offset = offset;
  completion.side_length = static_cast<uint32_t>(length);
}

}  // namespace

struct StepChannels::Channel {
  Channel(EngineId engine_in, MappedRegion region_in, ScopedFd wake_in)
      : engine(engine_in), region(std::move(region_in)), wake(std::move(wake_in)) {
    const step_channel::Layout layout = step_channel::LayoutFor(kSlots);
    header = reinterpret_cast<StepChannelHeader*>(region.data());
    submissions = region.data() + layout.submissions_offset;
    completions = region.data() + layout.completions_offset;
    submission_side = region.data() + layout.submission_side_offset;
    completion_side = region.data() + layout.completion_side_offset;
  }

  // Constant after construction.
  const EngineId engine;
  const MappedRegion region;
  const ScopedFd wake;  // the eventfd the engine writes (the daemon never reads nor writes it)
  StepChannelHeader* header;
  uint8_t* submissions;
  uint8_t* completions;
  uint8_t* submission_side;
  uint8_t* completion_side;

  std::atomic<bool> closed{false};
  // Serving thread only: the daemon's own ring counters (never read back from the region).
  uint32_t sq_head = 0;
  uint32_t cq_tail = 0;
  // The last round stopped at a record whose session was busy (a long operation): the
  // thread retries it every kParkedRetryMilliseconds instead of sleeping until a doorbell.
  bool parked = false;
  RefusalLog refusal_log;
  // Serving thread only, reused every round (no allocation in steady state): the round's
  // records as copied out of the ring, their slots, the sessions those name, and the token ids
  // of the record being run.
  std::vector<SubmissionRecord> records;
  std::vector<uint32_t> slots;
  std::vector<std::shared_ptr<DaemonSession>> sessions;
  std::vector<int32_t> token_ids;
  std::vector<LayerAppendRecord> plan_records;  // WriteResult's, for the record being answered
};

StepChannels::StepChannels(SessionRegistry* sessions, const EngineLeases* leases, Options options)
    : sessions_(sessions), leases_(leases), options_(options) {}

StepChannels::~StepChannels() { Stop(); }

absl::Status StepChannels::Start() {
  absl::MutexLock lock(&mu_);
  if (started_) return absl::FailedPreconditionError("the step channels were already started");
  ScopedFd epoll(epoll_create1(EPOLL_CLOEXEC));
  if (epoll.get() < 0) return PosixError("epoll_create1 for the step channels", errno);
  ScopedFd wake(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake.get() < 0) return PosixError("eventfd for the step channels", errno);
  epoll_event event{.events = EPOLLIN | EPOLLET, .data = {.u64 = kWakeEvent}};
  if (epoll_ctl(epoll.get(), EPOLL_CTL_ADD, wake.get(), &event) != 0) {
    return PosixError("epoll_ctl ADD for the step channels", errno);
  }
  epoll_ = std::move(epoll);
  wake_ = std::move(wake);
  started_ = true;
  thread_ = std::thread([this] { Serve(); });
  return absl::OkStatus();
}

void StepChannels::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (!started_ || stopping_) return;
    stopping_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  Wake();
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  for (auto& [engine, channel] : channels_) MarkClosed(*channel, CloseReason::kShutdown);
  channels_.clear();
}

void StepChannels::Wake() {
  const uint64_t one = 1;
  if (wake_.get() >= 0) (void)!write(wake_.get(), &one, sizeof(one));
}

void StepChannels::MarkClosed(Channel& channel, CloseReason reason) {
  if (channel.closed.exchange(true)) return;
  channel.header->closed.store(static_cast<uint32_t>(reason), std::memory_order_seq_cst);
  // The engine waits on cq_tail: woken, it re-reads `closed`.
  step_channel::FutexWakeAll(channel.header->cq_tail);
}

absl::Status StepChannels::CheckMayOpenLocked(EngineId engine) const {
  auto it = opens_.find(engine.value);
  if (it != opens_.end() && it->second >= kMaxOpensPerEngine) {
    return absl::FailedPreconditionError(absl::StrCat(
        "engine ", engine.value, " opened a step channel ", it->second,
        " times, the most one engine lease may (each pins ",
        step_channel::LayoutFor(kSlots).region_bytes, " bytes of shared memory): step over gRPC"));
  }
  // One channel per engine: replacing its own adds none; a new one needs room daemon-wide.
  if (!channels_.contains(engine.value) && channels_.size() >= options_.max_channels) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine ", engine.value, ": the daemon serves ", channels_.size(),
        " step channels and the limit is ", options_.max_channels, " (",
        options_.max_channels_source, "): step over gRPC"));
  }
  return absl::OkStatus();
}

absl::StatusOr<handoff::StepChannelFds> StepChannels::Open(EngineId engine) {
  RETURN_IF_ERROR(leases_->CheckBound(engine));
  {
    // Before the region is created: a refused request costs the daemon nothing.
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckMayOpenLocked(engine));
  }
  const uint64_t bytes = step_channel::LayoutFor(kSlots).region_bytes;
  ASSIGN_OR_RETURN(ScopedFd memfd, CreateSealedMemfd("memra-kv-step-channel", bytes));
  ASSIGN_OR_RETURN(MappedRegion region,
                   MappedRegion::MapShared(memfd.get(), bytes, "step channel memfd"));
  step_channel::InitializeHeader(region.data());
  ScopedFd wake(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake.get() < 0) return PosixError("eventfd for a step channel", errno);
  ScopedFd engine_wake(fcntl(wake.get(), F_DUPFD_CLOEXEC, 0));
  if (engine_wake.get() < 0) return PosixError("duplicating a step channel's eventfd", errno);
  auto channel = std::make_shared<Channel>(engine, std::move(region), std::move(wake));
  {
    absl::MutexLock lock(&mu_);
    if (!started_ || stopping_) {
      return absl::UnavailableError("the daemon's step channels are not serving (stopping)");
    }
    // Again: requests of one engine may have raced past the first check.
    RETURN_IF_ERROR(CheckMayOpenLocked(engine));
    auto it = channels_.find(engine.value);
    if (it != channels_.end()) {
      MarkClosed(*it->second, CloseReason::kReplaced);
      (void)epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second->wake.get(), nullptr);
    }
    // Edge-triggered: every engine write wakes the thread, which never reads the eventfd (the
    // engine shares its file status flags and could make a read block).
    epoll_event event{.events = EPOLLIN | EPOLLET, .data = {.u64 = engine.value}};
    if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, channel->wake.get(), &event) != 0) {
      if (it != channels_.end()) channels_.erase(it);
      generation_.fetch_add(1, std::memory_order_release);
      return PosixError("epoll_ctl ADD for a step channel", errno);
    }
    ++opens_[engine.value];
    channels_[engine.value] = channel;
    generation_.fetch_add(1, std::memory_order_release);
  }
  Wake();
  // A reclaim that ran before the channel was filed found nothing to close: check again now
  // that it is filed (a reclaim after this point closes it).
  if (absl::Status live = leases_->CheckBound(engine); !live.ok()) {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(engine.value);
    if (it != channels_.end() && it->second == channel) {
      MarkClosed(*channel, CloseReason::kEngineReclaimed);
      (void)epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, channel->wake.get(), nullptr);
      channels_.erase(it);
      generation_.fetch_add(1, std::memory_order_release);
    }
    return live;
  }
  spdlog::info("engine {}: step channel opened ({} bytes, {} slots)", engine.value, bytes,
               kSlots);
  return handoff::StepChannelFds{.region = ArenaFd{.fd = std::move(memfd), .bytes = bytes},
                                 .wake = std::move(engine_wake)};
}

void StepChannels::Close(EngineId engine) {
  {
    absl::MutexLock lock(&mu_);
    opens_.erase(engine.value);  // the lease is over: the count is done with
    auto it = channels_.find(engine.value);
    if (it == channels_.end()) return;
    MarkClosed(*it->second, CloseReason::kEngineReclaimed);
    (void)epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second->wake.get(), nullptr);
    channels_.erase(it);
    generation_.fetch_add(1, std::memory_order_release);
  }
  Wake();
}

StepChannelStats StepChannels::stats() const {
  absl::MutexLock lock(&mu_);
  return StepChannelStats{.open = channels_.size(),
                          .records = records_.load(std::memory_order_relaxed),
                          .corrupt_closed = corrupt_closed_.load(std::memory_order_relaxed),
                          .sleeps = sleeps_.load(std::memory_order_relaxed)};
}

void StepChannels::Serve() {
  using SteadyClock = std::chrono::steady_clock;
  const auto spin = absl::ToChronoNanoseconds(options_.spin);
  std::vector<std::shared_ptr<Channel>> serving;
  uint64_t seen = ~uint64_t{0};
  SteadyClock::time_point last_work = SteadyClock::now();
  epoll_event events[kMaxEvents];
  while (true) {
    if (const uint64_t now_generation = generation_.load(std::memory_order_acquire);
        now_generation != seen) {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      seen = generation_.load(std::memory_order_acquire);
      serving.clear();
      for (const auto& [engine, channel] : channels_) serving.push_back(channel);
    }
    bool worked = false;
    bool parked = false;
    for (const std::shared_ptr<Channel>& channel : serving) {
      worked |= ServeRound(*channel);
      parked |= channel->parked;
    }
    const SteadyClock::time_point now = SteadyClock::now();
    // Spins only after a round that did work: doorbells that bring none (an engine may ring
    // as often as it likes) put the thread straight back to sleep.
    if (worked) {
      last_work = now;
      continue;
    }
    if (now - last_work < spin) continue;
    // Idle: announce the sleep, then look once more (an engine that published before reading
    // daemon_sleeping wrote no eventfd; one that published after will), then sleep.
    for (const std::shared_ptr<Channel>& channel : serving) {
      channel->header->daemon_sleeping.store(1, std::memory_order_seq_cst);
    }
    bool pending = false;
    for (const std::shared_ptr<Channel>& channel : serving) {
      // A parked channel is servable but waits for its session, not for the thread.
      if (!channel->closed.load(std::memory_order_relaxed) && !channel->parked &&
          Servable(*channel)) {
        pending = true;
      }
    }
    if (!pending && generation_.load(std::memory_order_acquire) == seen) {
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      const int ready = epoll_wait(epoll_.get(), events, kMaxEvents,
                                   parked ? kParkedRetryMilliseconds : -1);
      if (ready < 0 && errno != EINTR) spdlog::error("step channels: epoll_wait: {}", strerror(errno));
    }
    for (const std::shared_ptr<Channel>& channel : serving) {
      channel->header->daemon_sleeping.store(0, std::memory_order_relaxed);
    }
  }
}

bool StepChannels::Servable(const Channel& channel) {
  const StepChannelHeader& header = *channel.header;
  const uint32_t submitted = header.sq_tail.load(std::memory_order_seq_cst) - channel.sq_head;
  const uint32_t unread = channel.cq_tail - header.cq_head.load(std::memory_order_seq_cst);
  // Absurd counters count as work: the round that finds them closes the channel.
  return submitted != 0 && (submitted > kSlots || unread != kSlots);
}

bool StepChannels::ServeRound(Channel& channel) {
  channel.parked = false;
  if (channel.closed.load(std::memory_order_relaxed)) return false;
  StepChannelHeader& header = *channel.header;
  // The engine's counters, read once; free-running, so differences are what count.
  const uint32_t sq_tail = header.sq_tail.load(std::memory_order_acquire);
  const uint32_t submitted = sq_tail - channel.sq_head;
  if (submitted == 0) return false;
  const uint32_t cq_head = header.cq_head.load(std::memory_order_acquire);
  const uint32_t unread = channel.cq_tail - cq_head;
  if (submitted > kSlots || unread > kSlots) {
    const std::string why =
        submitted > kSlots
            ? absl::StrCat("submission tail ", sq_tail, " claims ", submitted,
                           " records past head ", channel.sq_head, "; the ring holds ", kSlots)
            : absl::StrCat("completion head ", cq_head, " leaves ", unread,
                           " completions unread behind tail ", channel.cq_tail,
                           "; the ring holds ", kSlots);
    spdlog::warn("engine {}: step channel closed: {}", channel.engine.value, why);
    corrupt_closed_.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(channel.engine.value);
    MarkClosed(channel, CloseReason::kCorrupt);
    if (it != channels_.end() && it->second.get() == &channel) {
      (void)epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, channel.wake.get(), nullptr);
      channels_.erase(it);
      generation_.fetch_add(1, std::memory_order_release);
    }
    return false;
  }
  const uint32_t count =
      std::min({submitted, kSlots - unread, options_.max_records_per_round});
  if (count == 0) return false;  // the engine has not read its completions yet
  // Authenticated once per round, as the Step RPC does once per call.
  const absl::Status engine_check = leases_->CheckBound(channel.engine);
  // The one read of each record: everything below uses these copies.
  channel.records.resize(count);
  channel.slots.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t sq_index = (channel.sq_head + i) % kSlots;
    std::memcpy(&channel.records[i],
                channel.submissions + uint64_t{sq_index} * sizeof(SubmissionRecord),
                sizeof(SubmissionRecord));
    channel.slots[i] = channel.records[i].slot;
  }
  // Every record's session, under one acquisition of the registry's lock (not one per record).
  // Valid for the whole round: no channel operation changes which session a slot names (an
  // operation kind that does, a release, must end the batch there).
  channel.sessions.assign(count, nullptr);
  if (engine_check.ok()) {
    sessions_->FindSlots(channel.engine, channel.slots, absl::MakeSpan(channel.sessions));
  }
  // The engine's share of the daemon's time, admitted and charged once per round (two clock
  // reads and two lock round trips per record were a tenth of a record's cost). An engine in
  // debt gets each record admitted on its own instead: refused, except what ends its own work.
  const bool round_admitted = engine_check.ok() && sessions_->AdmitWork(channel.engine).ok();
  std::optional<TimeCharge> round_charge;
  if (round_admitted) round_charge.emplace(sessions_->time_shares(), channel.engine);
  uint32_t served = 0;
  for (; served < count; ++served) {
    const uint32_t sq_index = channel.sq_head % kSlots;
    CompletionRecord completion;
    if (!RunRecord(channel, channel.records[served], channel.sessions[served].get(), sq_index,
                   engine_check, round_admitted, completion)) {
      // Its session is busy in a long operation: the record stays unconsumed (read again,
      // as the engine left it, next time) and the others' channels are served meanwhile.
      channel.parked = true;
      break;
    }
    std::memcpy(channel.completions +
                    uint64_t{channel.cq_tail % kSlots} * sizeof(CompletionRecord),
                &completion, sizeof(completion));
    ++channel.sq_head;
    ++channel.cq_tail;
  }
  channel.sessions.clear();  // no session outlives its round here (capacity kept)
  if (served == 0) return false;
  // Counted before the engine can see the completions (stats() is exact once it does).
  records_.fetch_add(served, std::memory_order_relaxed);
  header.sq_head.store(channel.sq_head, std::memory_order_release);
  header.cq_tail.store(channel.cq_tail, std::memory_order_seq_cst);
  if (header.engine_waiting.load(std::memory_order_seq_cst) != 0) {
    step_channel::FutexWakeAll(header.cq_tail);
  }
  return true;
}

void StepChannels::LogRefusal(Channel& channel, absl::string_view message) {
  const absl::Time now = absl::Now();
  RefusalLog& log = channel.refusal_log;
  if (now - log.window_start >= absl::Seconds(1)) {
    if (log.suppressed != 0) {
      spdlog::info("engine {}: {} more step channel refusals not logged", channel.engine.value,
                   log.suppressed);
    }
    log = RefusalLog{.window_start = now};
  }
  if (log.logged >= kRefusalsLoggedPerSecond) {
    ++log.suppressed;
    return;
  }
  ++log.logged;
  spdlog::info("engine {}: {}", channel.engine.value, std::string(message));
}

absl::StatusOr<SessionOp> StepChannels::DecodeRecord(Channel& channel,
                                                     const SubmissionRecord& record,
                                                     uint32_t sq_index) {
  // Built only for a refusal: a valid record formats nothing.
  const auto which = [&] {
    return absl::StrCat("step channel record ", channel.sq_head, " (ring slot ", sq_index, ")");
  };
  if (record.version != step_channel::kVersion) {
    if (record.version == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          which(), ": a step channel version ", step_channel::kPreviousVersion,
          " record (no version byte); this daemon speaks version ", step_channel::kVersion,
          ": update the engine library"));
    }
    return absl::InvalidArgumentError(absl::StrCat(which(), ": record version ", record.version,
                                                   "; this daemon speaks version ",
                                                   step_channel::kVersion));
  }
  if (record.op < 1 || record.op > step_channel::kMaxOp) {
    return absl::InvalidArgumentError(absl::StrCat(which(), ": operation ", record.op,
                                                   " is not one of 1 to ", step_channel::kMaxOp));
  }
  if (!AllZero(record.reserved, sizeof(record.reserved)) || record.reserved2 != 0 ||
      record.reserved3 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(which(), ": reserved fields are not zero"));
  }
  const Op op = static_cast<Op>(record.op);
  channel.token_ids.clear();
  if (record.side_length != 0) {
    if (op != Op::kCommit && op != Op::kAdvance) {
      return absl::InvalidArgumentError(absl::StrCat(which(), ": operation ", record.op,
                                                     " carries no token ids, but side_length is ",
                                                     record.side_length));
    }
    if (record.side_length % sizeof(int32_t) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          which(), ": side_length ", record.side_length, " is not a multiple of 4 (int32 ids)"));
    }
    const uint64_t area = uint64_t{kSlots} * kSubmissionSideBytes;
    if (record.side_offset > area || record.side_length > area - record.side_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          which(), ": side span at offset ", record.side_offset, " of ", record.side_length,
          " bytes lies beyond the submission side area of ", area, " bytes"));
    }
    const uint64_t own = uint64_t{sq_index} * kSubmissionSideBytes;
    if (record.side_offset < own ||
        record.side_offset + record.side_length > own + kSubmissionSideBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          which(), ": side span [", record.side_offset, ", ",
          record.side_offset + record.side_length, ") is outside its ring slot's span [", own,
          ", ", own + kSubmissionSideBytes, ")"));
    }
    // Copied once out of shared memory, after the bounds checks above.
    channel.token_ids.resize(record.side_length / sizeof(int32_t));
    std::memcpy(channel.token_ids.data(), channel.submission_side + record.side_offset,
                record.side_length);
  }
  const absl::Span<const int32_t> token_ids = channel.token_ids;
  switch (op) {
    case Op::kBegin:
      return BeginOp{};
    case Op::kPrepare:
      return PrepareAppendOp{.generation = record.generation, .rows = record.rows};
    case Op::kPublish:
      return PublishAppendOp{.generation = record.generation};
    case Op::kCommit:
      return CommitOp{.generation = record.generation,
                      .accepted_rows = record.rows,
                      .token_ids = token_ids};
    case Op::kAbort:
      return AbortOp{.generation = record.generation};
    case Op::kAdvance:
      return AdvanceOp{.request = {.generation = record.generation,
                                   .accepted_rows = record.rows,
                                   .next_rows = record.next_rows},
                       .token_ids = token_ids};
  }
  return absl::InternalError(absl::StrCat(which(), ": operation ", record.op, " has no decoding"));
}

void StepChannels::WriteResult(Channel& channel, uint32_t cq_index, const SessionResult& result,
                               CompletionRecord& completion) {
  const AppendPlan* prepared = nullptr;
  if (const auto* begun = std::get_if<TransactionId>(&result)) {
    completion.generation = begun->generation;
    completion.base_len = begun->base_len;
  } else if (const auto* plan = std::get_if<AppendPlan>(&result)) {
    prepared = plan;
  } else if (const auto* published = std::get_if<PublishedAppend>(&result)) {
    completion.staged_len = published->staged_len;
  } else if (const auto* committed = std::get_if<CommittedLength>(&result)) {
    completion.committed_len = committed->committed_len;
  } else if (const auto* advanced = std::get_if<SessionAdvanced>(&result)) {
    completion.committed_len = advanced->committed_len;
    completion.published = advanced->step.published ? 1 : 0;
    if (advanced->step.prepared.has_value()) prepared = &*advanced->step.prepared;
  }
  if (prepared == nullptr) return;
  completion.has_prepared = 1;
  completion.generation = prepared->transaction.generation;
  completion.target = prepared->target;
  step_channel::PlanToRecords(prepared->layers, channel.plan_records);
  const uint64_t bytes = uint64_t{channel.plan_records.size()} * sizeof(LayerAppendRecord);
  if (bytes > kCompletionSideBytes) {
    // Applied, but the plan does not fit: only an engine that ignored the channel's layer
    // limit (docs/step-channel.md) gets here, and it alone loses the plan.
    completion.side_kind = static_cast<uint8_t>(CompletionSide::kLayersTooLarge);
    completion.side_length = static_cast<uint32_t>(bytes);
    return;
  }
  const uint64_t offset = uint64_t{cq_index} * kCompletionSideBytes;
  std::memcpy(channel.completion_side + offset, channel.plan_records.data(), bytes);
  completion.side_kind = static_cast<uint8_t>(CompletionSide::kLayers);
  completion.side_offset = offset;
  completion.side_length = static_cast<uint32_t>(bytes);
}

bool StepChannels::RunRecord(Channel& channel, const SubmissionRecord& record,
                             DaemonSession* session, uint32_t sq_index,
                             const absl::Status& engine_check, bool round_admitted,
                             CompletionRecord& completion) {
  const uint32_t cq_index = channel.cq_tail % kSlots;
  completion.user_data = record.user_data;
  // The record, bounds-checked, straight into its session operation.
  absl::StatusOr<SessionOp> op = DecodeRecord(channel, record, sq_index);
  if (!op.ok()) {
    completion.code = static_cast<int32_t>(op.status().code());
    PutSide(channel.completion_side, cq_index, op.status().message(), CompletionSide::kMessage,
            completion);
    LogRefusal(channel, op.status().message());
    return true;
  }
  // The Step RPC's refusals in its order: the engine, then the slot, then the operation.
  std::optional<absl::StatusOr<SessionResult>> outcome;
  if (!engine_check.ok()) {
    outcome = engine_check;
  } else if (session == nullptr) {
    outcome = SessionRegistry::SlotRefusal(SessionSlot{channel.engine, record.slot});
  } else {
    outcome = sessions_->TryApply(*session, *op, /*charged_by_caller=*/round_admitted);
    if (!outcome.has_value()) return false;  // busy in a long operation: nothing ran
  }
  if (outcome->ok()) {
    completion.op = record.op;
    WriteResult(channel, cq_index, **outcome, completion);
    return true;
  }
  const absl::Status& status = outcome->status();
  completion.code = static_cast<int32_t>(status.code());
  LogRefusal(channel, absl::StrCat("step channel record for slot ", record.slot, " refused: ",
                                   absl::StatusCodeToString(status.code()), " ",
                                   status.message()));
  PutSide(channel.completion_side, cq_index, status.message(), CompletionSide::kMessage,
          completion);
  if (std::optional<DaemonRestart> restart = GetDaemonRestart(status); restart.has_value()) {
    completion.restart_previous_epoch = restart->previous_epoch;
    completion.restart_epoch = restart->epoch;
  }
  return true;
}

}  // namespace memra
