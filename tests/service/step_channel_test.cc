// The step channel (docs/step-channel.md) against the in-process daemon: slot-addressed
// batches go over it with the Step RPC's outcomes, its refusals are the RPC's word for word,
// corrupt records and absurd counters are refused or close only the offending engine's
// channel, random bytes in one engine's rings leave another engine's sessions exact, and a
// reclaim closes the channel.

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/internal.h"
#include "client/step_channel_client.h"
#include "common/grpc_status.h"
#include "common/step_channel.h"
#include "gtest/gtest.h"
#include "tests/seeded_random.h"
#include "tests/service/test_daemon.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;
using step_channel::CloseReason;
using step_channel::CompletionRecord;
using step_channel::kSlots;
using step_channel::kSubmissionSideBytes;
using step_channel::Layout;
using step_channel::SubmissionRecord;
using ::testing::HasSubstr;

constexpr uint64_t kCapacity = 256;

SessionSnapshot StateOf(Session& session) {
  absl::StatusOr<SessionSnapshot> state = session.State();
  EXPECT_THAT(state, IsOk());
  return state.ok() ? *state : SessionSnapshot();
}

// A channel driven by hand: records written straight into the ring, completions read back.
class RawRing {
 public:
  explicit RawRing(std::shared_ptr<StepChannelClient> channel)
      : channel_(std::move(channel)), layout_(step_channel::LayoutFor(kSlots)) {
    tail_ = channel_->header().sq_tail.load();
  }

  uint32_t next_index() const { return tail_ % kSlots; }
  uint8_t* submission_side(uint64_t offset) const {
    return channel_->region() + layout_.submission_side_offset + offset;
  }

  // Writes `record` at the tail, publishes it and rings.
  void Publish(const SubmissionRecord& record) {
    std::memcpy(channel_->region() + layout_.submissions_offset +
                    uint64_t{next_index()} * sizeof(SubmissionRecord),
                &record, sizeof(record));
    ++tail_;
    channel_->header().sq_tail.store(tail_);
    channel_->RingDoorbell();
  }

  // Publish, then waits for its completion.
  absl::StatusOr<CompletionRecord> Run(const SubmissionRecord& record) {
    Publish(record);
    for (int i = 0; i < 5000; ++i) {
      if (channel_->header().cq_tail.load() == tail_) {
        CompletionRecord completion;
        std::memcpy(&completion,
                    channel_->region() + layout_.completions_offset +
                        uint64_t{(tail_ - 1) % kSlots} * sizeof(CompletionRecord),
                    sizeof(completion));
        channel_->header().cq_head.store(tail_);
        return completion;
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    return absl::DeadlineExceededError(absl::StrCat("no completion for record ", tail_ - 1));
  }

  std::string Message(const CompletionRecord& completion) const {
    return std::string(reinterpret_cast<const char*>(channel_->region() +
                                                     layout_.completion_side_offset +
                                                     completion.side_offset),
                       completion.side_length);
  }

  StepChannelClient& channel() { return *channel_; }

 private:
  std::shared_ptr<StepChannelClient> channel_;
  const Layout layout_;
  uint32_t tail_ = 0;
};

SubmissionRecord Record(step_channel::Op op, uint32_t slot) {
  SubmissionRecord record;
  record.op = static_cast<uint8_t>(op);
  record.slot = slot;
  return record;
}

// Begin, prepare 1 row, publish, commit it, each a unary gRPC call; the committed length.
uint64_t AppendAndCommitOverRpc(Session& session) {
  absl::StatusOr<Transaction> tx = session.Begin();
  EXPECT_THAT(tx, IsOk());
  if (!tx.ok()) return 0;
  EXPECT_THAT(session.PrepareAppend(tx->generation, 1), IsOk());
  EXPECT_THAT(session.PublishAppend(tx->generation), IsOk());
  absl::StatusOr<uint64_t> committed = session.Commit(tx->generation, 1);
  EXPECT_THAT(committed, IsOk());
  return committed.ok() ? *committed : 0;
}

bool WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 5000; ++i) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return done();
}

class StepChannelTest : public DaemonTest {
 protected:
  // The batch's outcomes over the channel and over the Step RPC (the same request, with this
  // client's engine), as "code message" per entry.
  std::vector<std::string> OverBoth(KvClient& client, StepBatch& batch, bool* same) {
    absl::StatusOr<std::vector<StepOutcome>> channel = client.Step(batch);
    EXPECT_THAT(channel, IsOk());
    pb::StepRequest request = ClientInternals::Request(batch);
    absl::StatusOr<pb::EngineRef> engine = ClientInternals::Engine(client);
    EXPECT_THAT(engine, IsOk());
    *request.mutable_engine() = *engine;
    pb::StepResponse rpc;
    EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(client).Step(
                    ClientInternals::NewContext(client).get(), request, &rpc)),
                IsOk());
    std::vector<std::string> outcomes;
    *same = channel.ok() && rpc.results_size() == static_cast<int>(channel->size());
    for (int i = 0; *same && i < rpc.results_size(); ++i) {
      const absl::Status& status = (*channel)[i].status;
      const std::string over_channel =
          absl::StrCat(static_cast<int>(status.code()), " ", status.message());
      const std::string over_rpc = absl::StrCat(rpc.results(i).code(), " ", rpc.results(i).message());
      EXPECT_EQ(over_channel, over_rpc) << "entry " << i;
      *same = *same && over_channel == over_rpc;
      outcomes.push_back(over_channel);
    }
    return outcomes;
  }
};

TEST_F(StepChannelTest, SlotBatchesGoOverTheChannel) {
  ASSERT_TRUE(client_->step_channel_active()) << client_->step_channel_status();
  EXPECT_EQ(daemon_->step_channel_stats().open, 1u);
  std::unique_ptr<Session> first = NewSession(*client_, kCapacity);
  std::unique_ptr<Session> second = NewSession(*client_, kCapacity);
  ASSERT_NE(second, nullptr);
  const uint64_t records_before = daemon_->step_channel_stats().records;
  StepBatch batch(StepAddressing::kSlot);
  ASSERT_TRUE(batch.ChannelEligible());
  batch.Advance(*first, 0, 0, 2);
  batch.Advance(*second, 0, 0, 3);
  std::vector<StepOutcome> outcomes;
  ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
  ASSERT_THAT(outcomes[0].status, IsOk());
  ASSERT_THAT(outcomes[1].status, IsOk());
  ASSERT_TRUE(outcomes[1].prepared.has_value());
  EXPECT_EQ(outcomes[1].prepared->target, 3u);
  EXPECT_FALSE(outcomes[1].prepared->layers.empty());
  const std::vector<int32_t> tokens = {11, 12};
  batch.Clear();
  batch.Advance(*first, outcomes[0].begun.generation, 2, 1, tokens);
  batch.Publish(*second, outcomes[1].begun.generation);
  batch.Commit(*second, outcomes[1].begun.generation, 3);
  ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
  ASSERT_THAT(outcomes[0].status, IsOk());
  ASSERT_THAT(outcomes[1].status, IsOk());
  ASSERT_THAT(outcomes[2].status, IsOk());
  EXPECT_EQ(outcomes[0].committed_len, 2u);
  EXPECT_TRUE(outcomes[0].published);
  EXPECT_EQ(outcomes[1].staged_len, 3u);
  EXPECT_EQ(outcomes[2].committed_len, 3u);
  EXPECT_EQ(daemon_->step_channel_stats().records, records_before + 5);
  EXPECT_EQ(StateOf(*first).committed_len, 2u);
  EXPECT_EQ(StateOf(*second).committed_len, 3u);
  // Token-addressed batches and batches with a wait event stay on gRPC.
  StepBatch by_token;
  by_token.Begin(*second);
  EXPECT_FALSE(by_token.ChannelEligible());
  ASSERT_THAT(client_->Step(by_token), IsOk());
  EXPECT_EQ(daemon_->step_channel_stats().records, records_before + 5);
}

TEST_F(StepChannelTest, RefusalsAreTheStepRpcsWordForWord) {
  std::unique_ptr<Session> mine = NewSession(*client_, kCapacity);
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  std::unique_ptr<Session> theirs = NewSession(*other, kCapacity);
  ASSERT_NE(theirs, nullptr);
  ASSERT_TRUE(client_->step_channel_active());
  absl::StatusOr<StepOutcome> opened = mine->Advance(0, 0, 2);
  ASSERT_THAT(opened, IsOk());
  const uint64_t generation = opened->begun.generation;
  const std::string before = absl::StrCat(StateOf(*mine).committed_len, " ",
                                          StateOf(*mine).staged_len, " ",
                                          StateOf(*theirs).committed_len);

  StepBatch batch(StepAddressing::kSlot);
  batch.Commit(*mine, generation, 5);                   // beyond the 2 prepared rows
  batch.Commit(*mine, generation + 7, 1);               // no such transaction
  batch.Commit(*mine, generation, 2, {1, 2, 3});        // 3 token ids for 2 rows
  batch.Advance(*theirs, 0, 0, 1);                      // another engine's slot
  batch.Publish(*mine, generation + 3);                 // not the active transaction
  batch.Abort(*theirs, 1);                              // another engine's slot again
  bool same = false;
  std::vector<std::string> outcomes = OverBoth(*client_, batch, &same);
  EXPECT_TRUE(same);
  ASSERT_EQ(outcomes.size(), 6u);
  for (const std::string& outcome : outcomes) EXPECT_NE(outcome.substr(0, 2), "0 ") << outcome;
  EXPECT_THAT(outcomes[3], HasSubstr(absl::StrCat(static_cast<int>(
                                                      absl::StatusCode::kNotFound),
                                                  " ")));
  EXPECT_THAT(outcomes[3], HasSubstr(absl::StrCat("slot ", theirs->slot())));
  EXPECT_EQ(absl::StrCat(StateOf(*mine).committed_len, " ", StateOf(*mine).staged_len, " ",
                         StateOf(*theirs).committed_len),
            before);
}

TEST_F(StepChannelTest, CorruptRecordsAreRefusedWithTheirNumbersAndChangeNothing) {
  std::unique_ptr<KvClient> raw_client = NewClient("engine-raw");
  ASSERT_NE(raw_client, nullptr);
  std::unique_ptr<Session> session = NewSession(*raw_client, kCapacity);
  ASSERT_NE(session, nullptr);
  const SessionSnapshot before = StateOf(*session);
  RawRing ring(ClientInternals::StepChannel(*raw_client));

  SubmissionRecord bad_op = Record(step_channel::Op::kBegin, session->slot());
  bad_op.op = 9;
  absl::StatusOr<CompletionRecord> done = ring.Run(bad_op);
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ring.Message(*done), HasSubstr("step channel record 0 (ring slot 0): operation 9 "
                                             "is not one of 1 to 6"));

  SubmissionRecord reserved = Record(step_channel::Op::kBegin, session->slot());
  reserved.reserved3 = 1;
  done = ring.Run(reserved);
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ring.Message(*done), HasSubstr("record 1 (ring slot 1): reserved fields"));

  // A record of another version: version 1's had no version byte (it reads as 0), and both
  // versions are named; any other version is named against this daemon's.
  SubmissionRecord version_one = Record(step_channel::Op::kBegin, session->slot());
  version_one.version = 0;
  done = ring.Run(version_one);
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(done->op, 0u);
  EXPECT_THAT(ring.Message(*done),
              HasSubstr("record 2 (ring slot 2): a step channel version 1 record (no version "
                        "byte); this daemon speaks version 2"));
  SubmissionRecord version_three = Record(step_channel::Op::kBegin, session->slot());
  version_three.version = 3;
  done = ring.Run(version_three);
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ring.Message(*done), HasSubstr("record 3 (ring slot 3): record version 3; this "
                                             "daemon speaks version 2"));

  // Token ids on an operation that has none.
  SubmissionRecord begin_with_ids = Record(step_channel::Op::kBegin, session->slot());
  begin_with_ids.side_offset = uint64_t{ring.next_index()} * kSubmissionSideBytes;
  begin_with_ids.side_length = 8;
  done = ring.Run(begin_with_ids);
  ASSERT_THAT(done, IsOk());
  EXPECT_THAT(ring.Message(*done), HasSubstr("operation 1 carries no token ids, but "
                                             "side_length is 8"));

  // A side span in another ring slot's span, one beyond the side area, one of odd length.
  SubmissionRecord commit = Record(step_channel::Op::kCommit, session->slot());
  commit.generation = 1;
  commit.rows = 1;
  commit.side_offset = uint64_t{ring.next_index() + 1} * kSubmissionSideBytes;
  commit.side_length = 4;
  const uint64_t own = uint64_t{ring.next_index()} * kSubmissionSideBytes;
  done = ring.Run(commit);
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ring.Message(*done),
              HasSubstr(absl::StrCat("side span [", own + kSubmissionSideBytes, ", ",
                                     own + kSubmissionSideBytes + 4,
                                     ") is outside its ring slot's span [", own, ", ",
                                     own + kSubmissionSideBytes, ")")));
  commit.side_offset = uint64_t{kSlots} * kSubmissionSideBytes - 4;
  commit.side_length = 8;
  done = ring.Run(commit);
  ASSERT_THAT(done, IsOk());
  EXPECT_THAT(ring.Message(*done),
              HasSubstr(absl::StrCat("side span at offset ", commit.side_offset,
                                     " of 8 bytes lies beyond the submission side area of ",
                                     uint64_t{kSlots} * kSubmissionSideBytes, " bytes")));
  commit.side_offset = uint64_t{ring.next_index()} * kSubmissionSideBytes;
  commit.side_length = 6;
  done = ring.Run(commit);
  ASSERT_THAT(done, IsOk());
  EXPECT_THAT(ring.Message(*done), HasSubstr("side_length 6 is not a multiple of 4"));

  // A record naming another engine's slot: the Step RPC's NOT_FOUND (as for an empty slot).
  std::unique_ptr<Session> foreign = NewSession(*client_, kCapacity);
  ASSERT_NE(foreign, nullptr);
  const SessionSnapshot foreign_before = StateOf(*foreign);
  done = ring.Run(Record(step_channel::Op::kBegin, foreign->slot()));
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->code, static_cast<int32_t>(absl::StatusCode::kNotFound));
  EXPECT_THAT(ring.Message(*done), HasSubstr(absl::StrCat("slot ", foreign->slot())));
  EXPECT_EQ(StateOf(*foreign), foreign_before);

  // Nothing changed, and the channel still serves well-formed records.
  EXPECT_EQ(StateOf(*session), before);
  done = ring.Run(Record(step_channel::Op::kBegin, session->slot()));
  ASSERT_THAT(done, IsOk());
  EXPECT_EQ(done->code, 0);
  EXPECT_EQ(done->op, static_cast<uint8_t>(step_channel::Op::kBegin));
  EXPECT_EQ(done->base_len, 0u);
  EXPECT_EQ(StateOf(*session).active_generation, done->generation);
}

TEST_F(StepChannelTest, AnAbsurdCounterClosesOnlyThatEnginesChannel) {
  std::unique_ptr<KvClient> raw_client = NewClient("engine-raw");
  ASSERT_NE(raw_client, nullptr);
  std::shared_ptr<StepChannelClient> raw = ClientInternals::StepChannel(*raw_client);
  ASSERT_NE(raw, nullptr);
  std::unique_ptr<Session> victim = NewSession(*client_, kCapacity);
  ASSERT_NE(victim, nullptr);
  // More records claimed than the ring holds.
  raw->header().sq_tail.store(kSlots + 1);
  raw->RingDoorbell();
  ASSERT_TRUE(WaitFor([&] { return raw->header().closed.load() != 0; }));
  EXPECT_EQ(raw->header().closed.load(), static_cast<uint32_t>(CloseReason::kCorrupt));
  EXPECT_EQ(daemon_->step_channel_stats().corrupt_closed, 1u);
  EXPECT_EQ(raw->header().cq_tail.load(), 0u) << "no record of the absurd batch ran";
  // The other engine's channel goes on.
  ASSERT_TRUE(client_->step_channel_active());
  absl::StatusOr<StepOutcome> stepped = victim->Advance(0, 0, 1);
  ASSERT_THAT(stepped, IsOk());
  StepBatch batch(StepAddressing::kSlot);
  batch.Advance(*victim, stepped->begun.generation, 1, 0);
  ASSERT_THAT(client_->Step(batch), IsOk());
  EXPECT_EQ(StateOf(*victim).committed_len, 1u);
  EXPECT_EQ(daemon_->step_channel_stats().open, 1u);
  // The closed engine's own Step over its channel: UNAVAILABLE saying why; its client falls
  // back to gRPC afterwards.
  std::unique_ptr<Session> own = NewSession(*raw_client, kCapacity);
  ASSERT_NE(own, nullptr);
  StepBatch own_batch(StepAddressing::kSlot);
  own_batch.Begin(*own);
  EXPECT_THAT(raw_client->Step(own_batch).status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("the engine broke the ring protocol")));
  EXPECT_FALSE(raw_client->step_channel_active());
  absl::StatusOr<std::vector<StepOutcome>> over_rpc = raw_client->Step(own_batch);
  ASSERT_THAT(over_rpc, IsOk());
  EXPECT_THAT((*over_rpc)[0].status, IsOk());
}

TEST_F(StepChannelTest, RandomBytesInOneEnginesRingsLeaveAnotherEnginesSessionsExact) {
  std::unique_ptr<Session> victim = NewSession(*client_, kCapacity);
  std::unique_ptr<Session> victim_rpc = NewSession(*client_, kCapacity);
  ASSERT_NE(victim_rpc, nullptr);
  SeededRandom random(0x5eed5);
  uint64_t victim_len = 0;
  uint64_t victim_generation = 0;
  uint64_t rpc_len = 0;
  StepBatch batch(StepAddressing::kSlot);
  std::vector<StepOutcome> outcomes;
  for (int round = 0; round < 12; ++round) {
    std::unique_ptr<KvClient> fuzzer = NewClient(absl::StrCat("fuzzer-", round));
    ASSERT_NE(fuzzer, nullptr);
    std::unique_ptr<Session> fuzzed = NewSession(*fuzzer, kCapacity);
    ASSERT_NE(fuzzed, nullptr);
    std::shared_ptr<StepChannelClient> channel = ClientInternals::StepChannel(*fuzzer);
    ASSERT_NE(channel, nullptr);
    const Layout layout = step_channel::LayoutFor(kSlots);
    for (int burst = 0; burst < 20 && channel->header().closed.load() == 0; ++burst) {
      // Random bytes over random records and side spans, then a random (often absurd) tail.
      for (int i = 0; i < 64; ++i) {
        const uint64_t at = layout.submissions_offset + random.Below(layout.completions_offset -
                                                                     layout.submissions_offset);
        channel->region()[at] = static_cast<uint8_t>(random.Below(256));
        // Now and then a plausible record: a small op and the fuzzer's own slot.
        if (random.Below(4) == 0) {
          SubmissionRecord record;
          record.op = static_cast<uint8_t>(random.Below(8));
          record.slot = random.Below(2) == 0 ? fuzzed->slot() : victim->slot();
          record.generation = random.Below(4);
          record.rows = random.Below(3);
          record.side_offset = random.Below(uint64_t{kSlots} * kSubmissionSideBytes);
          record.side_length = static_cast<uint32_t>(random.Below(4) * 4);
          std::memcpy(channel->region() + layout.submissions_offset +
                          random.Below(kSlots) * sizeof(SubmissionRecord),
                      &record, sizeof(record));
        }
      }
      const uint32_t head = channel->header().sq_head.load();
      const uint32_t tail = random.Below(3) == 0 ? static_cast<uint32_t>(random.Below(1u << 31))
                                                 : head + static_cast<uint32_t>(random.Below(40));
      channel->header().sq_tail.store(tail);
      channel->header().cq_head.store(random.Below(5) == 0
                                          ? static_cast<uint32_t>(random.Below(1u << 31))
                                          : channel->header().cq_tail.load());
      if (random.Below(3) == 0) channel->header().daemon_sleeping.store(0);
      channel->RingDoorbell();

      // The victim steps over its channel and over gRPC meanwhile, with exact results.
      batch.Clear();
      batch.Advance(*victim, victim_generation, victim_generation == 0 ? 0 : 1, 1);
      ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
      ASSERT_THAT(outcomes[0].status, IsOk()) << "round " << round << " burst " << burst;
      if (victim_generation != 0) ++victim_len;
      EXPECT_EQ(outcomes[0].committed_len, victim_len);
      victim_generation = outcomes[0].begun.generation;
      EXPECT_EQ(AppendAndCommitOverRpc(*victim_rpc), ++rpc_len);
    }
    ASSERT_TRUE(client_->step_channel_active());
    KillEngine(*fuzzer);
    fuzzed.reset();
  }
  EXPECT_EQ(StateOf(*victim).committed_len, victim_len);
  EXPECT_EQ(StateOf(*victim_rpc).committed_len, rpc_len);
  EXPECT_EQ(daemon_->step_channel_stats().open, 1u);
  EXPECT_EQ(daemon_->GetStatus().sessions(), 2u);
}

// The one serving thread never waits for a session: while a Grow holds engine-raw's session
// (its arena allocation held in the backend), engine-raw's record for that session waits in
// its ring and every other engine's channel steps go on; the record runs once the Grow ends.
TEST_F(StepChannelTest, ASessionBusyInAGrowStallsOnlyItsOwnEnginesRecords) {
  std::unique_ptr<KvClient> raw_client = NewClient("engine-raw");
  ASSERT_NE(raw_client, nullptr);
  std::unique_ptr<Session> growing = NewSession(*raw_client, kCapacity);
  ASSERT_NE(growing, nullptr);
  std::unique_ptr<Session> other = NewSession(*client_, kCapacity);
  ASSERT_NE(other, nullptr);
  RawRing ring(ClientInternals::StepChannel(*raw_client));

  faults_->Hold(BackendOp::kCreateArena);
  absl::StatusOr<SessionSnapshot> grown;
  std::thread grow([&] { grown = growing->Grow(kCapacity * 2); });
  ASSERT_TRUE(WaitFor([&] { return faults_->HeldCalls(BackendOp::kCreateArena) == 1; }));
  absl::StatusOr<CompletionRecord> begun;
  std::thread begin([&] { begun = ring.Run(Record(step_channel::Op::kBegin, growing->slot())); });
  ASSERT_TRUE(WaitFor([&] { return ring.channel().header().sq_tail.load() == 1; }));

  const uint64_t records_before = daemon_->step_channel_stats().records;
  const absl::Time start = absl::Now();
  uint64_t generation = 0;
  for (uint64_t step = 0; step < 5; ++step) {
    StepBatch batch(StepAddressing::kSlot);
    batch.Advance(*other, generation, generation == 0 ? 0 : 1, 1);
    absl::StatusOr<std::vector<StepOutcome>> outcomes = client_->Step(batch);
    ASSERT_THAT(outcomes, IsOk());
    ASSERT_THAT((*outcomes)[0].status, IsOk());
    generation = (*outcomes)[0].begun.generation;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_TRUE(client_->step_channel_active());
  EXPECT_EQ(daemon_->step_channel_stats().records, records_before + 5);
  EXPECT_EQ(StateOf(*other).committed_len, 4u);
  EXPECT_EQ(ring.channel().header().cq_tail.load(), 0u) << "the busy session's record waits";
  EXPECT_EQ(ring.channel().header().sq_head.load(), 0u);

  faults_->Unhold(BackendOp::kCreateArena);
  grow.join();
  begin.join();
  ASSERT_THAT(grown, IsOk());
  EXPECT_EQ(grown->capacity, kCapacity * 2);
  ASSERT_THAT(begun, IsOk());
  EXPECT_EQ(begun->code, 0) << ring.Message(*begun);
  EXPECT_EQ(begun->op, static_cast<uint8_t>(step_channel::Op::kBegin));
}

TEST_F(StepChannelTest, ReclaimClosesTheChannelAndNoRecordReachesTheSessionsAfter) {
  std::unique_ptr<KvClient> doomed = NewClient("doomed");
  ASSERT_NE(doomed, nullptr);
  std::unique_ptr<Session> session = NewSession(*doomed, kCapacity);
  ASSERT_NE(session, nullptr);
  std::shared_ptr<StepChannelClient> channel = ClientInternals::StepChannel(*doomed);
  ASSERT_NE(channel, nullptr);
  EXPECT_EQ(daemon_->step_channel_stats().open, 2u);
  KillEngine(*doomed);
  EXPECT_EQ(channel->header().closed.load(), static_cast<uint32_t>(CloseReason::kEngineReclaimed));
  EXPECT_EQ(daemon_->step_channel_stats().open, 1u);
  // The client abandoned the channel at its detach: a Run submits nothing.
  pb::StepRequest request;
  request.add_entries()->set_slot(session->slot());
  request.mutable_entries(0)->mutable_begin();
  pb::StepResponse response;
  EXPECT_FALSE(channel->Run(request, &response, absl::Seconds(2)).has_value());
  // A record written into the ring anyway is never taken.
  RawRing ring(channel);
  ring.Publish(Record(step_channel::Op::kBegin, session->slot()));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(channel->header().sq_head.load(), 0u);
  EXPECT_EQ(channel->header().cq_tail.load(), 0u);
  session.reset();
}

TEST_F(StepChannelTest, AnEngineLeaseOpensAtMostFourChannels) {
  ASSERT_TRUE(client_->step_channel_active());  // its first
  std::vector<handoff::StepChannelFds> replacements;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<handoff::StepChannelFds> opened =
        ClientInternals::OpenAnotherStepChannel(*client_);
    ASSERT_THAT(opened, IsOk()) << i;
    replacements.push_back(*std::move(opened));
  }
  for (int i = 0; i < 3; ++i) {
    EXPECT_THAT(ClientInternals::OpenAnotherStepChannel(*client_).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr(absl::StrCat("engine ", client_->engine_id(),
                                                " opened a step channel 4 times"))));
  }
  EXPECT_EQ(daemon_->step_channel_stats().open, 1u);
  // The client's own channel was replaced: its Step says so, and the next goes over gRPC.
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  StepBatch batch(StepAddressing::kSlot);
  batch.Advance(*session, 0, 0, 1);
  EXPECT_THAT(client_->Step(batch).status(),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("the engine opened another channel")));
  absl::StatusOr<std::vector<StepOutcome>> outcomes = client_->Step(batch);
  ASSERT_THAT(outcomes, IsOk());
  EXPECT_THAT((*outcomes)[0].status, IsOk());
  // Another engine opens its own as before.
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  EXPECT_TRUE(other->step_channel_active()) << other->step_channel_status();
}

// A Run waiting for completions the daemon will never write (here: a record parked behind a
// held Grow) fails at once when the client abandons the channel, not at its deadline.
TEST_F(StepChannelTest, AbandonWakesAWaitingRunAtOnce) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  std::shared_ptr<StepChannelClient> channel = ClientInternals::StepChannel(*client_);
  ASSERT_NE(channel, nullptr);
  faults_->Hold(BackendOp::kCreateArena);
  absl::StatusOr<SessionSnapshot> grown;
  std::thread grow([&] { grown = session->Grow(kCapacity * 2); });
  ASSERT_TRUE(WaitFor([&] { return faults_->HeldCalls(BackendOp::kCreateArena) == 1; }));
  pb::StepRequest request;
  request.add_entries()->set_slot(session->slot());
  request.mutable_entries(0)->mutable_begin();
  pb::StepResponse response;
  std::optional<absl::Status> ran;
  absl::Duration took;
  std::thread run([&] {
    const absl::Time start = absl::Now();
    ran = channel->Run(request, &response, absl::Seconds(30));
    took = absl::Now() - start;
  });
  ASSERT_TRUE(WaitFor([&] { return channel->header().sq_tail.load() == 1; }));
  absl::SleepFor(absl::Milliseconds(20));
  channel->Abandon();
  run.join();
  faults_->Unhold(BackendOp::kCreateArena);
  grow.join();
  EXPECT_THAT(grown, IsOk());
  ASSERT_TRUE(ran.has_value());
  EXPECT_THAT(*ran, StatusIs(absl::StatusCode::kUnavailable,
                             HasSubstr("step channel was abandoned")));
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_TRUE(channel->broken());
  EXPECT_FALSE(channel->Run(request, &response, absl::Seconds(1)).has_value());
}

TEST_F(StepChannelTest, AStepOverTheEntryLimitGetsTheStepRpcsRefusal) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  StepBatch batch(StepAddressing::kSlot);
  for (int i = 0; i <= step_channel::kMaxStepEntries; ++i) batch.Begin(*session);
  EXPECT_FALSE(batch.ChannelEligible());
  const uint64_t records = daemon_->step_channel_stats().records;
  EXPECT_THAT(client_->Step(batch).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("Step carries ", step_channel::kMaxStepEntries + 1,
                                              " entries; the limit is ",
                                              step_channel::kMaxStepEntries))));
  EXPECT_EQ(daemon_->step_channel_stats().records, records);
  EXPECT_EQ(StateOf(*session).active_generation, 0u);
  EXPECT_TRUE(client_->step_channel_active());
}

TEST_F(StepChannelTest, ForceGrpcStepOpensNoChannel) {
  ClientOptions options;
  options.force_grpc_step = true;
  absl::StatusOr<std::unique_ptr<KvClient>> client =
      KvClient::Connect(daemon_->socket_path(), options);
  ASSERT_THAT(client, IsOk());
  ASSERT_THAT((*client)->Attach("grpc-only"), IsOk());
  EXPECT_FALSE((*client)->step_channel_active());
  EXPECT_THAT((*client)->step_channel_status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("force_grpc_step")));
  std::unique_ptr<Session> session = NewSession(**client, kCapacity);
  ASSERT_NE(session, nullptr);
  const uint64_t records = daemon_->step_channel_stats().records;
  StepBatch batch(StepAddressing::kSlot);
  batch.Advance(*session, 0, 0, 1);
  absl::StatusOr<std::vector<StepOutcome>> outcomes = (*client)->Step(batch);
  ASSERT_THAT(outcomes, IsOk());
  EXPECT_THAT((*outcomes)[0].status, IsOk());
  EXPECT_EQ(daemon_->step_channel_stats().records, records);
  EXPECT_EQ(daemon_->step_channel_stats().open, 1u);  // client_'s only
}

class NoStepChannelTest : public StepChannelTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override { config.step_channel = false; }
};

TEST_F(NoStepChannelTest, ADaemonWithoutTheChannelOffersNoneAndStepsOverGrpc) {
  EXPECT_FALSE(client_->step_channel_active());
  EXPECT_THAT(client_->step_channel_status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("offers no step channel")));
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  StepBatch batch(StepAddressing::kSlot);
  batch.Advance(*session, 0, 0, 1);
  absl::StatusOr<std::vector<StepOutcome>> outcomes = client_->Step(batch);
  ASSERT_THAT(outcomes, IsOk());
  EXPECT_THAT((*outcomes)[0].status, IsOk());
  EXPECT_EQ(daemon_->step_channel_stats().records, 0u);
  EXPECT_EQ(daemon_->step_channel_stats().open, 0u);
}

}  // namespace
}  // namespace memra::testing
