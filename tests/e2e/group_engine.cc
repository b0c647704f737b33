// A test engine spanning GPUs: one process over every rank's memra-kvd of a group file, through
// the group client (client/group.h). group_e2e_test runs it as separate processes. Modes:
//   admit      Admit the group (one yes or no); facts: ok, or the refusal's code, message and
//              AdmissionRefusal numbers.
//   reserve    Reserve every rank (PENDING), write the facts, then wait to be SIGKILLed.
//   capture    A group session: commit --tokens rows with rank-, layer- and row-specific bytes
//              in every K/V plane and their token ids, capture the group prefix, release.
//   capture0   The same, but the prefix is captured on rank 0 only (no group entry).
//   restore    A fresh group session: restore the group prefix on every rank, then check every
//              restored byte of every rank against what capture wrote. A group miss is a fact.
//   admit-hold Admit and create the group session, write the facts, then wait to be killed.
//   restart-reserve   (tests/restart) Reserve every rank, touch --ready, wait for --until,
//              then Confirm; facts: the confirm's outcome.
//   restart-session   (tests/restart) A group session with --tokens committed rows, touch
//              --ready, wait for --until, then commit --tokens more on every rank and check
//              every rank's bytes; facts: the lengths and whether the bytes are identical.
// The facts file (tests/e2e/facts.h) is written once, at the end (or before waiting).

#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "client/group.h"
#include "client/group_file.h"
#include "core/admission.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"
#include "tests/e2e/facts.h"
#include "tests/engine_exit.h"

ABSL_FLAG(std::string, group, "", "the group file");
ABSL_FLAG(std::string, mode, "admit", "admit | reserve | capture | capture0 | restore | admit-hold");
ABSL_FLAG(uint64_t, capacity, 4096, "tokens per session");
ABSL_FLAG(uint64_t, tokens, 64, "rows committed (capture) and looked up (restore)");
ABSL_FLAG(uint64_t, token_seed, 1, "token ids are seed * 100000 + position");
ABSL_FLAG(int64_t, deadline_ms, 10000, "admission deadline");
ABSL_FLAG(std::string, out, "", "the facts file");
ABSL_FLAG(std::string, ready, "", "restart modes: the file touched once set up");
ABSL_FLAG(std::string, until, "", "restart modes: the file whose existence says go on");

namespace memra::testing {
namespace {

// The plan every group test uses: 8 dense layers, 4 K/V heads of 64 (f16 by default), so TP=4
// holds one head per rank and PP=2 four layers per stage.
ModelPlan GroupTestModel() { return test_plans::DenseModel(8, 64, 4); }

std::vector<int32_t> TokenIds(uint64_t count) {
  std::vector<int32_t> ids(count);
  for (uint64_t i = 0; i < count; ++i) {
    ids[i] = static_cast<int32_t>(absl::GetFlag(FLAGS_token_seed) * 100000 + i);
  }
  return ids;
}

// The byte capture writes at `offset` of row `row` of plane `kind` of `layer` on `rank`: every
// rank's shard differs, so a restore from another rank's shard cannot pass.
uint8_t Pattern(uint32_t rank, uint32_t layer, PlaneKind kind, uint64_t row, uint64_t offset) {
  return static_cast<uint8_t>(rank * 71 + layer * 13 + static_cast<uint32_t>(kind) * 7 + row * 3 +
                              offset);
}

constexpr PlaneKind kKvPlanes[] = {PlaneKind::kKeys, PlaneKind::kValues};

// Calls visit(rank, layer, kind, row, byte offset, the byte) for every byte of rows [0, rows) of
// every K/V plane of every rank; stops at the first refusal.
template <typename Visit>
absl::Status ForEachRowByte(GroupSession& session, uint64_t rows, Visit visit) {
  for (uint32_t r = 0; r < session.ranks(); ++r) {
    for (const SessionLayer& layer : session.rank(r).layout().layers) {
      for (PlaneKind kind : kKvPlanes) {
        ASSIGN_OR_RETURN(PlaneView plane, session.rank(r).Plane(layer.layer, kind));
        for (uint64_t row = 0; row < rows; ++row) {
          for (uint64_t b = 0; b < plane.row_bytes; ++b) {
            RETURN_IF_ERROR(
                visit(r, layer.layer, kind, row, b, plane.data[row * plane.row_bytes + b]));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status WriteRows(GroupSession& session, uint64_t rows) {
  return ForEachRowByte(session, rows,
                        [](uint32_t r, uint32_t layer, PlaneKind kind, uint64_t row, uint64_t b,
                           uint8_t& byte) {
                          byte = Pattern(r, layer, kind, row, b);
                          return absl::OkStatus();
                        });
}

// The first byte of any rank's rows that is not what capture wrote, or OK.
absl::Status CheckRows(GroupSession& session, uint64_t rows) {
  return ForEachRowByte(
      session, rows,
      [](uint32_t r, uint32_t layer, PlaneKind kind, uint64_t row, uint64_t b, uint8_t& byte) {
        const uint8_t want = Pattern(r, layer, kind, row, b);
        if (byte == want) return absl::OkStatus();
        return absl::DataLossError(absl::StrCat("rank ", r, " layer ", layer, " plane ",
                                                static_cast<int>(kind), " row ", row, " byte ", b,
                                                ": ", byte, " != ", want));
      });
}

std::string RefusalFacts(const absl::Status& status) {
  std::string facts = absl::StrCat("ok=0\ncode=", absl::StatusCodeToString(status.code()),
                                   "\nmessage=", status.message(), "\n");
  if (std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(status)) {
    absl::StrAppend(&facts, "needed=", refusal->needed, "\nfree=", refusal->free,
                    "\nbudget=", refusal->budget, "\n");
  }
  return facts;
}

void WaitToBeKilled() {
  while (true) pause();
}

// Touches --ready, then waits until --until exists (the test creates it once the daemon it
// killed serves again and this engine re-attached): a state, polled, not a time.
absl::Status ReadyThenWait() {
  RETURN_IF_ERROR(WriteFacts(absl::GetFlag(FLAGS_ready), "ready=1\n"));
  const std::string until = absl::GetFlag(FLAGS_until);
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  while (access(until.c_str(), F_OK) != 0) {
    if (absl::Now() > give_up) return absl::DeadlineExceededError("no " + until + " in 2 min");
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::OkStatus();
}

// One transaction of `rows` rows on every rank, writing the pattern rows [base, base + rows).
absl::StatusOr<uint64_t> CommitRows(GroupSession& session, uint64_t base, uint64_t rows,
                                    absl::Span<const int32_t> ids) {
  ASSIGN_OR_RETURN(GroupTransaction transaction, session.Begin());
  if (transaction.base_len != base) {
    return absl::FailedPreconditionError(
        absl::StrCat("the group's base is ", transaction.base_len, ", expected ", base));
  }
  RETURN_IF_ERROR(session.PrepareAppend(transaction, rows));
  RETURN_IF_ERROR(WriteRows(session, base + rows));
  RETURN_IF_ERROR(session.PublishAppend(transaction));
  return session.Commit(transaction, rows, ids.subspan(base, rows));
}

absl::Status Run() {
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const std::string out = absl::GetFlag(FLAGS_out);
  const uint64_t capacity = absl::GetFlag(FLAGS_capacity);
  const uint64_t tokens = absl::GetFlag(FLAGS_tokens);
  ASSIGN_OR_RETURN(GroupFile file, ReadGroupFile(absl::GetFlag(FLAGS_group)));
  GroupClientOptions options;
  options.engine_name = absl::StrCat("group-engine ", mode);
  options.admission_deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  ASSIGN_OR_RETURN(std::unique_ptr<GroupClient> group,
                   GroupClient::Connect(file, std::move(options)));
  ASSIGN_OR_RETURN(GroupPlan plan, group->RegisterPlan(GroupTestModel()));

  if (mode == "admit") {
    absl::StatusOr<GroupAdmission> admitted = group->Admit(plan, capacity);
    if (!admitted.ok()) return WriteFacts(out, RefusalFacts(admitted.status()));
    std::string facts = absl::StrCat("ok=1\ngroup_id=", admitted->group_id, "\n");
    for (uint32_t r = 0; r < group->ranks(); ++r) {
      absl::StrAppend(&facts, "bytes", r, "=", admitted->bytes[r], "\n");
    }
    ASSIGN_OR_RETURN(uint64_t freed, group->Release(*admitted));
    absl::StrAppend(&facts, "released=", freed, "\n");
    return WriteFacts(out, facts);
  }
  if (mode == "reserve") {
    ASSIGN_OR_RETURN(GroupAdmission reserved, group->Reserve(plan, capacity));
    RETURN_IF_ERROR(WriteFacts(out, absl::StrCat("group_id=", reserved.group_id,
                                                 "\nbytes0=", reserved.bytes[0], "\n")));
    WaitToBeKilled();
  }
  if (mode == "admit-hold") {
    ASSIGN_OR_RETURN(std::unique_ptr<GroupSession> session,
                     group->CreateSession(plan, capacity));
    RETURN_IF_ERROR(WriteFacts(out, absl::StrCat("group_id=", session->group_id(), "\n")));
    WaitToBeKilled();
  }
  if (mode == "restart-reserve") {
    ASSIGN_OR_RETURN(GroupAdmission reserved, group->Reserve(plan, capacity));
    RETURN_IF_ERROR(ReadyThenWait());
    const absl::Status confirmed = group->Confirm(reserved);
    if (!confirmed.ok()) return WriteFacts(out, RefusalFacts(confirmed));
    RETURN_IF_ERROR(group->Release(reserved).status());
    return WriteFacts(out, "ok=1\n");
  }
  const std::vector<int32_t> ids = TokenIds(2 * tokens);
  if (mode == "restart-session") {
    ASSIGN_OR_RETURN(std::unique_ptr<GroupSession> session,
                     group->CreateSession(plan, capacity));
    RETURN_IF_ERROR(CommitRows(*session, 0, tokens, ids).status());
    RETURN_IF_ERROR(ReadyThenWait());
    ASSIGN_OR_RETURN(uint64_t committed, CommitRows(*session, tokens, tokens, ids));
    ASSIGN_OR_RETURN(std::vector<SessionSnapshot> states, session->State());
    std::string facts = absl::StrCat("ok=1\ncommitted=", committed, "\n");
    for (uint32_t r = 0; r < states.size(); ++r) {
      absl::StrAppend(&facts, "committed", r, "=", states[r].committed_len, "\n",
                      "reattaches", r, "=", group->rank(r).reattaches(), "\n");
    }
    const absl::Status identical = CheckRows(*session, committed);
    absl::StrAppend(&facts, "identical=", identical.ok() ? 1 : 0, "\nmismatch=",
                    identical.message(), "\n");
    RETURN_IF_ERROR(session->Release().status());
    return WriteFacts(out, facts);
  }
  if (mode == "capture" || mode == "capture0") {
    ASSIGN_OR_RETURN(std::unique_ptr<GroupSession> session,
                     group->CreateSession(plan, capacity));
    ASSIGN_OR_RETURN(uint64_t committed, CommitRows(*session, 0, tokens, ids));
    if (mode == "capture") {
      RETURN_IF_ERROR(
          group->CapturePrefix(*session, absl::MakeSpan(ids).subspan(0, tokens), tokens));
    } else {
      RETURN_IF_ERROR(group->rank(0)
                          .prefixes()
                          .Capture(session->rank(0), absl::MakeSpan(ids).subspan(0, tokens), tokens)
                          .status());
    }
    ASSIGN_OR_RETURN(uint64_t freed, session->Release());
    return WriteFacts(out, absl::StrCat("committed=", committed, "\nfreed=", freed, "\n"));
  }
  if (mode == "restore") {
    const absl::Span<const int32_t> asked = absl::MakeSpan(ids).subspan(0, tokens);
    ASSIGN_OR_RETURN(GroupPrefixMatch match, group->LookupPrefix(plan, capacity, asked));
    ASSIGN_OR_RETURN(std::unique_ptr<GroupSession> session,
                     group->CreateSession(plan, capacity));
    absl::StatusOr<uint64_t> restored = group->RestorePrefix(plan, *session, asked);
    if (!restored.ok()) {
      return WriteFacts(out, absl::StrCat("matched=", match.matched_tokens, "\n",
                                          RefusalFacts(restored.status())));
    }
    ASSIGN_OR_RETURN(std::vector<SessionSnapshot> states, session->State());
    std::string facts = absl::StrCat("ok=1\nmatched=", match.matched_tokens,
                                     "\nrestored=", *restored, "\n");
    for (uint32_t r = 0; r < states.size(); ++r) {
      absl::StrAppend(&facts, "committed", r, "=", states[r].committed_len, "\n");
    }
    const absl::Status identical = CheckRows(*session, *restored);
    absl::StrAppend(&facts, "identical=", identical.ok() ? 1 : 0, "\nmismatch=",
                    identical.message(), "\n");
    return WriteFacts(out, facts);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown --mode ", mode));
}

}  // namespace
}  // namespace memra::testing

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return memra::testing::EngineExit(argv[0], absl::GetFlag(FLAGS_mode), memra::testing::Run());
}
