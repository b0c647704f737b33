#include "client/step_channel_client.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "core/status_macros.h"

namespace memra {

namespace pb = ::memra::kv::v1;
using step_channel::CloseReason;
using step_channel::CompletionRecord;
using step_channel::CompletionSide;
using step_channel::kCompletionSideBytes;
using step_channel::kSlots;
using step_channel::kSubmissionSideBytes;
using step_channel::LayerAppendRecord;
using step_channel::Op;
using step_channel::SubmissionRecord;

namespace {

// How long cq_tail is polled before FUTEX_WAIT: a small step's answer usually comes within a
// few microseconds while the daemon spins, cheaper to catch than a futex round trip (~10-20 us
// here). With more records outstanding the answer takes longer than a wake-up, and a spinning
// client would take CPU from the daemon on a machine with few cores: it sleeps at once.
constexpr std::chrono::microseconds kSpin{50};
constexpr uint32_t kMaxRecordsToSpinFor = 16;
// One FUTEX_WAIT at most this long: the deadline and `closed` are re-checked between waits.
constexpr absl::Duration kMaxFutexWait = absl::Milliseconds(100);

const char* CloseReasonName(uint32_t reason) {
  switch (static_cast<CloseReason>(reason)) {
    case CloseReason::kOpen:
      return "open";
    case CloseReason::kEngineReclaimed:
      return "the engine was reclaimed";
    case CloseReason::kReplaced:
      return "the engine opened another channel";
    case CloseReason::kCorrupt:
      return "the engine broke the ring protocol";
    case CloseReason::kShutdown:
      return "the daemon is shutting down";
  }
  return "an unknown reason";
}

int TokenCount(const pb::StepEntry& entry) {
  if (entry.has_commit()) return entry.commit().token_ids_size();
  if (entry.has_advance()) return entry.advance().token_ids_size();
  return 0;
}

}  // namespace

StepChannelClient::StepChannelClient(MappedRegion region, ScopedFd wake)
    : region_(std::move(region)),
      wake_(std::move(wake)),
      header_(reinterpret_cast<step_channel::StepChannelHeader*>(region_.data())),
      layout_(step_channel::LayoutFor(kSlots)) {}

absl::StatusOr<std::unique_ptr<StepChannelClient>> StepChannelClient::Map(
    handoff::StepChannelFds fds) {
  if (fds.region.bytes < sizeof(step_channel::StepChannelHeader)) {
    return absl::InvalidArgumentError(absl::StrCat("step channel region of ", fds.region.bytes,
                                                   " bytes: smaller than its header"));
  }
  ASSIGN_OR_RETURN(MappedRegion region, MappedRegion::MapShared(fds.region.fd.get(),
                                                                fds.region.bytes,
                                                                "step channel memfd"));
  RETURN_IF_ERROR(step_channel::CheckHeader(
      *reinterpret_cast<const step_channel::StepChannelHeader*>(region.data()), fds.region.bytes));
  return std::unique_ptr<StepChannelClient>(
      new StepChannelClient(std::move(region), std::move(fds.wake)));
}

bool StepChannelClient::Carries(const pb::StepRequest& request) {
  if (!request.ordering().wait_event().empty()) return false;
  // Over the limit: the Step RPC's refusal, the same on both paths.
  if (request.entries_size() > step_channel::kMaxStepEntries) return false;
  for (const pb::StepEntry& entry : request.entries()) {
    if (!entry.has_slot() || entry.op_case() == pb::StepEntry::OP_NOT_SET) return false;
    if (static_cast<uint64_t>(TokenCount(entry)) * sizeof(int32_t) > kSubmissionSideBytes) {
      return false;
    }
  }
  return true;
}

void StepChannelClient::RingDoorbell() const {
  const uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));
}

void StepChannelClient::Abandon() {
  abandoned_.store(true, std::memory_order_seq_cst);
  broken_.store(true, std::memory_order_release);
  // A Run in FUTEX_WAIT on cq_tail wakes and sees abandoned_.
  step_channel::FutexWakeAll(header_->cq_tail);
}

void StepChannelClient::Submit(const pb::StepEntry& entry, uint64_t index) {
  const uint32_t sq_index = sq_tail_ % kSlots;
  SubmissionRecord record;
  record.user_data = index;
  record.slot = entry.slot();
  const google::protobuf::RepeatedField<int32_t>* token_ids = nullptr;
  switch (entry.op_case()) {
    case pb::StepEntry::kBegin:
      record.op = static_cast<uint8_t>(Op::kBegin);
      break;
    case pb::StepEntry::kPrepare:
      record.op = static_cast<uint8_t>(Op::kPrepare);
      record.generation = entry.prepare().generation();
      record.rows = entry.prepare().rows();
      break;
    case pb::StepEntry::kPublish:
      record.op = static_cast<uint8_t>(Op::kPublish);
      record.generation = entry.publish().generation();
      break;
    case pb::StepEntry::kCommit:
      record.op = static_cast<uint8_t>(Op::kCommit);
      record.generation = entry.commit().generation();
      record.rows = entry.commit().accepted_rows();
      token_ids = &entry.commit().token_ids();
      break;
    case pb::StepEntry::kAbort:
      record.op = static_cast<uint8_t>(Op::kAbort);
      record.generation = entry.abort().generation();
      break;
    case pb::StepEntry::kAdvance:
      record.op = static_cast<uint8_t>(Op::kAdvance);
      record.generation = entry.advance().generation();
      record.rows = entry.advance().accepted_rows();
      record.next_rows = entry.advance().next_rows();
      token_ids = &entry.advance().token_ids();
      break;
    case pb::StepEntry::OP_NOT_SET:
      break;  // Carries() keeps these off the channel
  }
  if (token_ids != nullptr && !token_ids->empty()) {
    record.side_offset = uint64_t{sq_index} * kSubmissionSideBytes;
    record.side_length = static_cast<uint32_t>(token_ids->size() * sizeof(int32_t));
    std::memcpy(region_.data() + layout_.submission_side_offset + record.side_offset,
                token_ids->data(), record.side_length);
  }
  std::memcpy(region_.data() + layout_.submissions_offset +
                  uint64_t{sq_index} * sizeof(SubmissionRecord),
              &record, sizeof(record));
  ++sq_tail_;
}

absl::StatusOr<uint32_t> StepChannelClient::AwaitCompletions(absl::Time give_up) {
  const auto spin_until = std::chrono::steady_clock::now() +
                          (sq_tail_ - cq_head_ <= kMaxRecordsToSpinFor
                               ? kSpin
                               : std::chrono::microseconds::zero());
  while (true) {
    const uint32_t tail = header_->cq_tail.load(std::memory_order_acquire);
    if (tail != cq_head_) return tail;
    if (abandoned_.load(std::memory_order_seq_cst)) {
      return absl::UnavailableError(absl::StrCat(
          "this engine's step channel was abandoned: its lease stream to the daemon broke (the "
          "daemon died or restarted) or it detached; records in flight (", sq_tail_ - cq_head_,
          ") may or may not have run: check the sessions' state"));
    }
    if (const uint32_t closed = header_->closed.load(std::memory_order_acquire); closed != 0) {
      return absl::UnavailableError(
          absl::StrCat("the daemon closed this engine's step channel (", CloseReasonName(closed),
                       "); records in flight may or may not have run: check the sessions' "
                       "state"));
    }
    if (std::chrono::steady_clock::now() < spin_until) continue;
    const absl::Duration left = give_up - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::UnavailableError(absl::StrCat(
          "the daemon answered no step channel record within the deadline (", cq_head_,
          " completions read, ", sq_tail_, " records written)"));
    }
    // Announce the wait, then look again before sleeping: the daemon publishes cq_tail before
    // reading engine_waiting.
    header_->engine_waiting.store(1, std::memory_order_seq_cst);
    if (header_->cq_tail.load(std::memory_order_seq_cst) == cq_head_ &&
        !abandoned_.load(std::memory_order_seq_cst)) {
      step_channel::FutexWait(header_->cq_tail, cq_head_, std::min(left, kMaxFutexWait));
    }
    header_->engine_waiting.store(0, std::memory_order_relaxed);
  }
}

absl::Status StepChannelClient::Complete(pb::StepResponse* response, int entries) {
  const uint32_t cq_index = cq_head_ % kSlots;
  CompletionRecord completion;
  std::memcpy(&completion,
              region_.data() + layout_.completions_offset +
                  uint64_t{cq_index} * sizeof(CompletionRecord),
              sizeof(completion));
  ++cq_head_;
  if (completion.user_data >= static_cast<uint64_t>(entries)) {
    return absl::InternalError(absl::StrCat("step channel completion for entry ",
                                            completion.user_data, " of a step of ", entries));
  }
  pb::StepResult* result = response->mutable_results(static_cast<int>(completion.user_data));
  const uint64_t own = uint64_t{cq_index} * kCompletionSideBytes;
  const bool side_in_span =
      completion.side_offset == own && completion.side_length <= kCompletionSideBytes;
  const absl::string_view side(
      reinterpret_cast<const char*>(region_.data() + layout_.completion_side_offset + own),
      side_in_span ? completion.side_length : 0);
  result->set_code(completion.code);
  if (completion.code != 0) {
    result->set_message(std::string(side));
    if (completion.restart_epoch != 0) {
      result->mutable_daemon_restart()->set_previous_epoch(completion.restart_previous_epoch);
      result->mutable_daemon_restart()->set_epoch(completion.restart_epoch);
    }
    return absl::OkStatus();
  }
  pb::PrepareAppendResponse* prepared = nullptr;
  switch (static_cast<Op>(completion.op)) {
    case Op::kBegin:
      result->mutable_begin()->set_generation(completion.generation);
      result->mutable_begin()->set_base_len(completion.base_len);
      break;
    case Op::kPrepare:
      prepared = result->mutable_prepare();
      break;
    case Op::kPublish:
      result->mutable_publish()->set_staged_len(completion.staged_len);
      break;
    case Op::kCommit:
      result->mutable_commit()->set_committed_len(completion.committed_len);
      break;
    case Op::kAbort:
      result->mutable_abort()->set_committed_len(completion.committed_len);
      break;
    case Op::kAdvance:
      result->mutable_advance()->set_committed_len(completion.committed_len);
      result->mutable_advance()->set_published(completion.published != 0);
      if (completion.has_prepared != 0) prepared = result->mutable_advance()->mutable_prepared();
      break;
    default:
      return absl::InternalError(absl::StrCat("step channel completion for entry ",
                                              completion.user_data, ": operation ",
                                              completion.op, " is not one of 1 to ",
                                              step_channel::kMaxOp));
  }
  if (prepared == nullptr) return absl::OkStatus();
  const auto kind = static_cast<CompletionSide>(completion.side_kind);
  if (kind == CompletionSide::kLayersTooLarge) {
    result->clear_payload();
    result->set_code(static_cast<int32_t>(absl::StatusCode::kDataLoss));
    result->set_message(absl::StrCat(
        "the append was prepared (generation ", completion.generation, ", target ",
        completion.target, ") but its plan of ", completion.side_length,
        " bytes does not fit the step channel; step sessions of more than ",
        step_channel::kMaxKvLayers, " K/V layers over gRPC"));
    return absl::OkStatus();
  }
  if (kind != CompletionSide::kLayers || !side_in_span ||
      side.size() % sizeof(LayerAppendRecord) != 0) {
    return absl::InternalError(absl::StrCat(
        "step channel completion for entry ", completion.user_data,
        ": its prepared plan is not in its side span (kind ", completion.side_kind, ", offset ",
        completion.side_offset, ", ", completion.side_length, " bytes)"));
  }
  prepared->set_generation(completion.generation);
  prepared->set_target(completion.target);
  layers_.clear();
  for (size_t offset = 0; offset < side.size(); offset += sizeof(LayerAppendRecord)) {
    LayerAppendRecord record;
    std::memcpy(&record, side.data() + offset, sizeof(record));
    layers_.push_back(step_channel::FromRecord(record));
  }
  // The client's Step outcomes read the Step RPC's message (KvClient decodes it once).
  LayerAppendsToProto(layers_, prepared->mutable_layers());
  return absl::OkStatus();
}

std::optional<absl::Status> StepChannelClient::Run(const pb::StepRequest& request,
                                                   pb::StepResponse* response,
                                                   absl::Duration deadline) {
  absl::MutexLock lock(&mu_);
  if (broken_.load(std::memory_order_acquire)) return std::nullopt;
  const int entries = request.entries_size();
  response->mutable_results()->Reserve(entries);
  for (int i = response->results_size(); i < entries; ++i) response->add_results();
  const absl::Time give_up = absl::Now() + deadline;
  int submitted = 0;
  int completed = 0;
  absl::Status status;
  while (completed < entries) {
    if (submitted < entries && sq_tail_ - cq_head_ < kSlots) {
      while (submitted < entries && sq_tail_ - cq_head_ < kSlots) {
        Submit(request.entries(submitted), static_cast<uint64_t>(submitted));
        ++submitted;
      }
      header_->sq_tail.store(sq_tail_, std::memory_order_seq_cst);
      if (header_->daemon_sleeping.load(std::memory_order_seq_cst) != 0) RingDoorbell();
    }
    absl::StatusOr<uint32_t> tail = AwaitCompletions(give_up);
    if (!tail.ok()) {
      status = tail.status();
      break;
    }
    if (*tail - cq_head_ > sq_tail_ - cq_head_) {
      status = absl::InternalError(absl::StrCat("step channel: completion tail ", *tail,
                                                " is past the ", sq_tail_, " records written"));
      break;
    }
    while (cq_head_ != *tail && status.ok()) {
      status = Complete(response, entries);
      ++completed;
    }
    header_->cq_head.store(cq_head_, std::memory_order_release);
    if (!status.ok()) break;
  }
  if (!status.ok()) broken_.store(true, std::memory_order_release);
  return status;
}

}  // namespace memra
