#include "server/edge/step_channel.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "core/status_macros.h"
#include "server/edge/step_entry.h"
#include "spdlog/spdlog.h"

namespace memra {

namespace pb = ::memra::kv::v1;
using step_channel::CloseReason;
using step_channel::CompletionRecord;
using step_channel::CompletionSide;
using step_channel::kCompletionSideBytes;
using step_channel::kSlots;
using step_channel::kSubmissionSideBytes;
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
  // Serving thread only: the daemon's own ring counters (never read back from the region) and
  // the entry / result every record is decoded into and answered from, reused.
  uint32_t sq_head = 0;
  uint32_t cq_tail = 0;
  // The last round stopped at a record whose session was busy (a long operation): the
  // thread retries it every kParkedRetryMilliseconds instead of sleeping until a doorbell.
  bool parked = false;
  RefusalLog refusal_log;
  pb::StepEntry entry;
  pb::StepResult result;
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
  uint32_t served = 0;
  for (; served < count; ++served) {
    const uint32_t sq_index = channel.sq_head % kSlots;
    // The one read of the record: everything below uses this copy.
    SubmissionRecord record;
    std::memcpy(&record, channel.submissions + uint64_t{sq_index} * sizeof(SubmissionRecord),
                sizeof(record));
    CompletionRecord completion;
    if (!RunRecord(channel, record, sq_index, engine_check, completion)) {
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

bool StepChannels::RunRecord(Channel& channel, const SubmissionRecord& record, uint32_t sq_index,
                             const absl::Status& engine_check, CompletionRecord& completion) {
  const uint32_t cq_index = channel.cq_tail % kSlots;
  completion.user_data = record.user_data;
  pb::StepEntry& entry = channel.entry;
  pb::StepResult& result = channel.result;
  // The record, bounds-checked, into the Step RPC's entry type.
  absl::Status decoded = [&]() -> absl::Status {
    const std::string which = absl::StrCat("step channel record ", channel.sq_head, " (ring slot ",
                                           sq_index, ")");
    if (record.op < 1 || record.op > step_channel::kMaxOp) {
      return absl::InvalidArgumentError(absl::StrCat(which, ": operation ", record.op,
                                                     " is not one of 1 to ",
                                                     step_channel::kMaxOp));
    }
    if (!AllZero(record.reserved, sizeof(record.reserved)) || record.reserved2 != 0 ||
        record.reserved3 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(which, ": reserved fields are not zero"));
    }
    const Op op = static_cast<Op>(record.op);
    if (record.side_length != 0) {
      if (op != Op::kCommit && op != Op::kAdvance) {
        return absl::InvalidArgumentError(absl::StrCat(
            which, ": operation ", record.op, " carries no token ids, but side_length is ",
            record.side_length));
      }
      if (record.side_length % sizeof(int32_t) != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            which, ": side_length ", record.side_length, " is not a multiple of 4 (int32 ids)"));
      }
      const uint64_t area = uint64_t{kSlots} * kSubmissionSideBytes;
      if (record.side_offset > area || record.side_length > area - record.side_offset) {
        return absl::InvalidArgumentError(absl::StrCat(
            which, ": side span at offset ", record.side_offset, " of ", record.side_length,
            " bytes lies beyond the submission side area of ", area, " bytes"));
      }
      const uint64_t own = uint64_t{sq_index} * kSubmissionSideBytes;
      if (record.side_offset < own ||
          record.side_offset + record.side_length > own + kSubmissionSideBytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            which, ": side span [", record.side_offset, ", ",
            record.side_offset + record.side_length, ") is outside its ring slot's span [", own,
            ", ", own + kSubmissionSideBytes, ")"));
      }
    }
    entry.Clear();
    entry.set_slot(record.slot);
    google::protobuf::RepeatedField<int32_t>* token_ids = nullptr;
    switch (op) {
      case Op::kBegin:
        entry.mutable_begin();
        break;
      case Op::kPrepare:
        entry.mutable_prepare()->set_generation(record.generation);
        entry.mutable_prepare()->set_rows(record.rows);
        break;
      case Op::kPublish:
        entry.mutable_publish()->set_generation(record.generation);
        break;
      case Op::kCommit:
        entry.mutable_commit()->set_generation(record.generation);
        entry.mutable_commit()->set_accepted_rows(record.rows);
        token_ids = entry.mutable_commit()->mutable_token_ids();
        break;
      case Op::kAbort:
        entry.mutable_abort()->set_generation(record.generation);
        break;
      case Op::kAdvance:
        entry.mutable_advance()->set_generation(record.generation);
        entry.mutable_advance()->set_accepted_rows(record.rows);
        entry.mutable_advance()->set_next_rows(record.next_rows);
        token_ids = entry.mutable_advance()->mutable_token_ids();
        break;
    }
    if (token_ids != nullptr && record.side_length != 0) {
      // Copied once out of shared memory, after the bounds checks above.
      const int count = static_cast<int>(record.side_length / sizeof(int32_t));
      token_ids->Resize(count, 0);
      std::memcpy(token_ids->mutable_data(), channel.submission_side + record.side_offset,
                  record.side_length);
    }
    return absl::OkStatus();
  }();
  if (!decoded.ok()) {
    completion.code = static_cast<int32_t>(decoded.code());
    PutSide(channel.completion_side, cq_index, decoded.message(), CompletionSide::kMessage,
            completion);
    LogRefusal(channel, decoded.message());
    return true;
  }
  result.Clear();
  if (!RunStepEntry(
          *sessions_, entry,
          [&]() -> absl::StatusOr<EngineId> {
            RETURN_IF_ERROR(engine_check);
            return channel.engine;
          },
          &result, {.busy = BusySession::kSkip, .log_refusal = false})) {
    return false;
  }
  completion.code = result.code();
  if (result.code() != 0) {
    LogRefusal(channel, absl::StrCat("step channel record for slot ", record.slot, " refused: ",
                                     absl::StatusCodeToString(
                                         static_cast<absl::StatusCode>(result.code())),
                                     " ", result.message()));
    PutSide(channel.completion_side, cq_index, result.message(), CompletionSide::kMessage,
            completion);
    if (result.has_daemon_restart()) {
      completion.restart_previous_epoch = result.daemon_restart().previous_epoch();
      completion.restart_epoch = result.daemon_restart().epoch();
    }
    return true;
  }
  completion.payload = static_cast<uint8_t>(result.payload_case());
  const pb::PrepareAppendResponse* prepared = nullptr;
  switch (result.payload_case()) {
    case pb::StepResult::kBegin:
      completion.generation = result.begin().generation();
      completion.base_len = result.begin().base_len();
      break;
    case pb::StepResult::kPrepare:
      prepared = &result.prepare();
      break;
    case pb::StepResult::kPublish:
      completion.staged_len = result.publish().staged_len();
      break;
    case pb::StepResult::kCommit:
      completion.committed_len = result.commit().committed_len();
      break;
    case pb::StepResult::kAbort:
      completion.committed_len = result.abort().committed_len();
      break;
    case pb::StepResult::kAdvance:
      completion.committed_len = result.advance().committed_len();
      completion.published = result.advance().published() ? 1 : 0;
      if (result.advance().has_prepared()) prepared = &result.advance().prepared();
      break;
    case pb::StepResult::PAYLOAD_NOT_SET:
      break;
  }
  if (prepared != nullptr) {
    completion.has_prepared = 1;
    completion.generation = prepared->generation();
    completion.target = prepared->target();
    const size_t bytes = prepared->ByteSizeLong();
    if (bytes > kCompletionSideBytes) {
      // Applied, but the plan does not fit: only an engine that ignored the channel's layer
      // limit (docs/step-channel.md) gets here, and it alone loses the plan.
      completion.side_kind = static_cast<uint8_t>(CompletionSide::kLayersTooLarge);
      completion.side_length = static_cast<uint32_t>(bytes);
      return true;
    }
    const uint64_t offset = uint64_t{cq_index} * kCompletionSideBytes;
    prepared->SerializeWithCachedSizesToArray(channel.completion_side + offset);
    completion.side_kind = static_cast<uint8_t>(CompletionSide::kLayers);
    completion.side_offset = offset;
    completion.side_length = static_cast<uint32_t>(bytes);
  }
  return true;
}

}  // namespace memra
