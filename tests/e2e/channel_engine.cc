// An engine process for the step channel's end-to-end test (tests/e2e/step_channel_e2e_test.cc)
// that misuses its own channel (docs/step-channel.md) the ways a buggy or hostile engine could:
//   --mode=inflight  attach, create --sessions sessions, begin a step on each, then fill the
//                    submission ring with Advance records for its own slots twice over and never
//                    read a completion; touch --ready and hold until killed (a full ring in
//                    flight, waiting for completion room)
//   --mode=fuzz      for --seconds, attach (again each time its channel is closed), create a
//                    session and write random bytes into its rings and header counters,
//                    ringing the daemon; touch --ready after the first burst; exit 0
// Exit status 0 = every call it expected to work worked.

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/internal.h"
#include "client/step_channel_client.h"
#include "common/step_channel.h"
#include "core/status_macros.h"
#include "tests/engine_exit.h"
#include "tests/seeded_random.h"
#include "tests/service/test_plans.h"

ABSL_FLAG(std::string, socket, "", "memra-kvd's Unix socket path");
ABSL_FLAG(std::string, name, "channel-engine", "engine name shown by the daemon");
ABSL_FLAG(std::string, mode, "inflight", "inflight or fuzz");
ABSL_FLAG(std::string, ready, "", "touched once the misuse is under way");
ABSL_FLAG(int, sessions, 8, "sessions of --mode=inflight");
ABSL_FLAG(int, seconds, 3, "how long --mode=fuzz runs");
ABSL_FLAG(uint64_t, seed, 0xf22, "--mode=fuzz's random seed");

namespace memra::testing {
namespace {

using step_channel::kSlots;
using step_channel::kSubmissionSideBytes;
using step_channel::SubmissionRecord;

absl::Status Touch(const std::string& path) {
  std::ofstream file(path);
  file << "ready\n";
  return file ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot write ", path));
}

absl::StatusOr<std::unique_ptr<KvClient>> Attached(const std::string& name) {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                   KvClient::Connect(absl::GetFlag(FLAGS_socket)));
  RETURN_IF_ERROR(client->Attach(name));
  if (!client->step_channel_active()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no step channel: ", client->step_channel_status().ToString()));
  }
  return client;
}

absl::StatusOr<std::unique_ptr<Session>> NewSession(KvClient& client,
                                                    const PlanFingerprint& plan) {
  SessionOptions options;
  options.capacity = 256;
  return client.CreateSession(plan, options);
}

absl::Status RunInflight() {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, Attached(absl::GetFlag(FLAGS_name)));
  ASSIGN_OR_RETURN(PlanFingerprint plan, client->RegisterPlan(HybridTestPlan()));
  std::vector<std::unique_ptr<Session>> sessions;
  StepBatch batch(StepAddressing::kSlot);
  for (int i = 0; i < absl::GetFlag(FLAGS_sessions); ++i) {
    ASSIGN_OR_RETURN(std::unique_ptr<Session> session, NewSession(*client, plan));
    batch.Advance(*session, 0, 0, 1);
    sessions.push_back(std::move(session));
  }
  std::vector<StepOutcome> outcomes;
  RETURN_IF_ERROR(client->Step(batch, outcomes));  // over the channel
  for (const StepOutcome& outcome : outcomes) RETURN_IF_ERROR(outcome.status);
  // The whole ring twice: each session's next Advance, then the same again (refused: stale),
  // and no completion is ever read. The daemon serves the first ring-full, filling the
  // completion ring; the second waits for room that never comes (the daemon must sleep).
  std::shared_ptr<StepChannelClient> channel = ClientInternals::StepChannel(*client);
  const step_channel::Layout layout = step_channel::LayoutFor(kSlots);
  uint32_t tail = channel->header().sq_tail.load();
  for (int pass = 0; pass < 2; ++pass) {
    for (uint32_t i = 0; i < kSlots; ++i) {
      const size_t which = i % sessions.size();
      SubmissionRecord record;
      record.op = static_cast<uint8_t>(step_channel::Op::kAdvance);
      record.slot = sessions[which]->slot();
      record.generation = outcomes[which].begun.generation;
      record.rows = 1;
      record.next_rows = 1;
      std::memcpy(channel->region() + layout.submissions_offset +
                      uint64_t{tail % kSlots} * sizeof(SubmissionRecord),
                  &record, sizeof(record));
      ++tail;
    }
    channel->header().sq_tail.store(tail);
    channel->RingDoorbell();
    // The daemon took them all before the next pass reuses their ring slots.
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (pass == 0 && channel->header().sq_head.load() != tail) {
      if (absl::Now() > give_up) return absl::DeadlineExceededError("the daemon took no records");
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  RETURN_IF_ERROR(Touch(absl::GetFlag(FLAGS_ready)));
  while (true) absl::SleepFor(absl::Seconds(1));  // until killed
}

absl::Status RunFuzz() {
  SeededRandom random(absl::GetFlag(FLAGS_seed));
  const absl::Time end = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_seconds));
  const step_channel::Layout layout = step_channel::LayoutFor(kSlots);
  bool touched = false;
  for (int attach = 0; absl::Now() < end; ++attach) {
    ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                     Attached(absl::StrCat(absl::GetFlag(FLAGS_name), "-", attach)));
    ASSIGN_OR_RETURN(PlanFingerprint plan, client->RegisterPlan(HybridTestPlan()));
    ASSIGN_OR_RETURN(std::unique_ptr<Session> session, NewSession(*client, plan));
    std::shared_ptr<StepChannelClient> channel = ClientInternals::StepChannel(*client);
    while (absl::Now() < end && channel->header().closed.load() == 0) {
      for (int i = 0; i < 256; ++i) {
        // Any byte of the rings and side areas, and now and then a plausible record.
        const uint64_t at =
            layout.submissions_offset + random.Below(layout.region_bytes - layout.submissions_offset);
        channel->region()[at] = static_cast<uint8_t>(random.Below(256));
        if (random.Below(8) == 0) {
          SubmissionRecord record;
          record.op = static_cast<uint8_t>(1 + random.Below(6));
          record.slot = static_cast<uint32_t>(random.Below(16));  // its own and others' slots
          record.generation = random.Below(8);
          record.rows = random.Below(4);
          record.next_rows = random.Below(3);
          record.side_offset = random.Below(uint64_t{kSlots} * kSubmissionSideBytes + 64);
          record.side_length = static_cast<uint32_t>(random.Below(6) * 4);
          std::memcpy(channel->region() + layout.submissions_offset +
                          random.Below(kSlots) * sizeof(SubmissionRecord),
                      &record, sizeof(record));
        }
      }
      const uint32_t head = channel->header().sq_head.load();
      channel->header().sq_tail.store(random.Below(16) == 0
                                          ? static_cast<uint32_t>(random.Below(uint64_t{1} << 32))
                                          : head + static_cast<uint32_t>(random.Below(64)));
      channel->header().cq_head.store(random.Below(16) == 0
                                          ? static_cast<uint32_t>(random.Below(uint64_t{1} << 32))
                                          : channel->header().cq_tail.load());
      channel->RingDoorbell();
      if (!touched) {
        RETURN_IF_ERROR(Touch(absl::GetFlag(FLAGS_ready)));
        touched = true;
      }
      absl::SleepFor(absl::Microseconds(200));
    }
    (void)session->Release();
    client->Detach();
  }
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "inflight") return RunInflight();
  if (mode == "fuzz") return RunFuzz();
  return absl::InvalidArgumentError(absl::StrCat("--mode=", mode, ": inflight or fuzz"));
}

}  // namespace
}  // namespace memra::testing

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return memra::testing::EngineExit("channel_engine", absl::GetFlag(FLAGS_name),
                                     memra::testing::Run());
}
