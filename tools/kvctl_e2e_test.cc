// memra-kvctl end to end: the real memra-kvd binary (host backend) and the real memra-kvctl
// binary, each its own process; an engine (KvClient in this process) holds sessions where a
// listing needs them. Numbers are checked against what the daemon itself reports through
// --json, never against figures worked out here: cost == fit's session bytes == the arena a
// session of that shape really gets, max-context's answer is the largest context whose cost fits.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/codec.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/prefix.pb.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"
#include "tools/kvctl_process.h"
#include "tools/text_format.h"

namespace memra::kvctl {
namespace {

namespace pb = ::memra::kv::v1;
using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::Runfile;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr uint64_t kBudgetBytes = uint64_t{256} << 20;
constexpr char kLlamaConfig[] = "tests/data/hf_configs/llama-3.1-8b.json";

using Outcome = ::memra::testing::KvctlOutcome;

// The answer of `memra-kvctl ... --json`, parsed.
template <typename Response>
Response ParseJson(const Outcome& outcome) {
  Response response;
  const auto status = google::protobuf::util::JsonStringToMessage(outcome.out, &response);
  EXPECT_TRUE(status.ok()) << status.ToString() << " in: " << outcome.out << outcome.err;
  return response;
}

class KvctlE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start({absl::StrCat("--budget_bytes=", kBudgetBytes), "--backend=host",
                               "--prefix_cache_budget_bytes=16MiB"}));
  }

  void TearDown() override { engine_.reset(); }

  // Runs the real memra-kvctl with `args` and --socket=<this daemon's admin socket> (unless
  // `socket` says otherwise); stdout and stderr go through files.
  Outcome Kvctl(std::vector<std::string> args, const std::string& socket = "") {
    args.push_back("--socket=" + (socket.empty() ? admin_socket_ : socket));
    return ::memra::testing::RunKvctlBinary(std::move(args), dir_);
  }

  // Kvctl that must succeed (exit 0) with --json; the parsed answer.
  template <typename Response>
  Response KvctlJson(std::vector<std::string> args) {
    args.push_back("--json");
    const Outcome outcome = Kvctl(args);
    EXPECT_EQ(outcome.exit_code, 0) << absl::StrJoin(args, " ") << ": " << outcome.err;
    return ParseJson<Response>(outcome);
  }

  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  KvClient& Engine() {
    if (engine_ == nullptr) {
      absl::StatusOr<std::unique_ptr<KvClient>> client = KvClient::Connect(socket_);
      EXPECT_THAT(client, IsOk());
      engine_ = *std::move(client);
      EXPECT_THAT(engine_->Attach("kvctl-e2e-engine"), IsOk());
    }
    return *engine_;
  }

  testing::DaemonProcess daemon_{"kvctl-e2e"};  // stopped, its directory removed, after TearDown
  const std::string& dir_ = daemon_.dir();
  const std::string& socket_ = daemon_.socket();
  const std::string& admin_socket_ = daemon_.admin_socket();
  std::unique_ptr<KvClient> engine_;
};

TEST_F(KvctlE2eTest, StatusOfAnIdleDaemon) {
  const Outcome status = Kvctl({"status"});
  EXPECT_EQ(status.exit_code, 0) << status.err;
  EXPECT_THAT(status.out, HasSubstrs("backend        host\n", "state          serving\n",
                                     absl::StrCat("  budget       ", FormatBytes(kBudgetBytes)),
                                     "\nno engines attached\n"));
  const auto json = KvctlJson<pb::GetStatusResponse>({"status"});
  EXPECT_EQ(json.backend(), "host");
  EXPECT_EQ(json.admission().budget_bytes(), kBudgetBytes);
  EXPECT_EQ(json.admission().free_bytes(), kBudgetBytes);
  EXPECT_EQ(json.sessions(), 0u);
  EXPECT_FALSE(json.draining());

  EXPECT_EQ(Kvctl({"engines"}).out, "no engines attached\n");
  EXPECT_EQ(Kvctl({"sessions"}).out, "no sessions\n");
}

TEST_F(KvctlE2eTest, ImportModelRegistersAndTheCostOfItsSessionIsTheArenaItGets) {
  const Outcome imported = Kvctl({"import-model", "--hf-config=" + Runfile(kLlamaConfig)});
  EXPECT_EQ(imported.exit_code, 0) << imported.err;
  EXPECT_THAT(imported.out, HasSubstrs("architecture  LlamaForCausalLM\n",
                                       "registered    no (--register keeps it in the daemon)\n",
                                       "layers        32 trunk + 0 MTP\n", "KV        32  0-31\n"));
  const auto registered = KvctlJson<pb::ImportModelResponse>(
      {"import-model", "--hf-config=" + Runfile(kLlamaConfig), "--register"});
  EXPECT_TRUE(registered.registered());
  ASSERT_EQ(registered.plan_fingerprint().size(), 32u);
  const std::string hex = absl::BytesToHexString(registered.plan_fingerprint());
  EXPECT_THAT(imported.out, HasSubstr(absl::StrCat("fingerprint   ", hex, "\n")));
  EXPECT_EQ(KvctlJson<pb::GetStatusResponse>({"status"}).plans(), 1u);

  // The registered plan by fingerprint, the config itself, and the plan as JSON all cost the same.
  const auto cost = KvctlJson<pb::CostResponse>({"cost", "--model=" + hex, "--context=1k"});
  EXPECT_EQ(cost.capacity(), 1024u);
  EXPECT_EQ(cost.plan_fingerprint(), registered.plan_fingerprint());
  EXPECT_EQ(cost.layers(), 32u);
  EXPECT_GE(cost.arena_bytes(), cost.breakdown().total_plane_bytes());
  EXPECT_GT(cost.breakdown().kv_bytes_per_token(), 0u);
  const auto by_config = KvctlJson<pb::CostResponse>(
      {"cost", "--hf-config=" + Runfile(kLlamaConfig), "--context=1024"});
  EXPECT_EQ(by_config.arena_bytes(), cost.arena_bytes());
  EXPECT_EQ(by_config.plan_fingerprint(), cost.plan_fingerprint());
  std::string plan_json;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(registered.plan(), &plan_json).ok());
  const auto by_plan = KvctlJson<pb::CostResponse>(
      {"cost", "--plan=" + WriteFile("plan.json", plan_json), "--context=1k"});
  EXPECT_EQ(by_plan.arena_bytes(), cost.arena_bytes());
  EXPECT_EQ(by_plan.plan_fingerprint(), cost.plan_fingerprint());

  const Outcome human = Kvctl({"cost", "--model=" + hex, "--context=1k"});
  EXPECT_EQ(human.exit_code, 0) << human.err;
  EXPECT_THAT(
      human.out,
      HasSubstrs(absl::StrCat("cost         ", FormatBytes(cost.arena_bytes())),
                 "context      1024 tokens, 32 layers\n", absl::StrCat("fingerprint  ", hex, "\n"),
                 absl::StrCat("per token    ", FormatBytes(cost.breakdown().bytes_per_token()))));

  // A session of that shape: its arena is exactly the cost, and the listings show it.
  absl::StatusOr<PlanFingerprint> fingerprint = FingerprintFromBytes(registered.plan_fingerprint());
  ASSERT_THAT(fingerprint, IsOk());
  SessionOptions options;
  options.capacity = 1024;
  absl::StatusOr<std::unique_ptr<Session>> session = Engine().CreateSession(*fingerprint, options);
  ASSERT_THAT(session, IsOk());
  const auto sessions = KvctlJson<pb::ListSessionsResponse>({"sessions"});
  ASSERT_EQ(sessions.sessions_size(), 1);
  EXPECT_EQ(sessions.sessions(0).arena_bytes(), cost.arena_bytes());
  EXPECT_EQ(sessions.sessions(0).capacity(), 1024u);
  EXPECT_EQ(sessions.sessions(0).engine_id(), Engine().engine_id());
  const Outcome listed = Kvctl({"sessions", absl::StrCat("--engine=", Engine().engine_id())});
  EXPECT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_THAT(listed.out, HasSubstrs(FormatBytes(cost.arena_bytes()), hex, "1 session, "));
  EXPECT_EQ(KvctlJson<pb::ListSessionsResponse>(
                {"sessions", absl::StrCat("--engine=", Engine().engine_id() + 1)})
                .sessions_size(),
            0);

  const auto engines = KvctlJson<pb::ListEnginesResponse>({"engines"});
  ASSERT_EQ(engines.engines_size(), 1);
  EXPECT_EQ(engines.engines(0).engine_name(), "kvctl-e2e-engine");
  EXPECT_EQ(engines.engines(0).pid(), getpid());
  EXPECT_EQ(engines.engines(0).allocated_bytes(), cost.arena_bytes());
  EXPECT_TRUE(engines.engines(0).lease_live());
  EXPECT_THAT(Kvctl({"engines"}).out,
              HasSubstrs("kvctl-e2e-engine", absl::StrCat(getpid()), "live"));

  const auto status = KvctlJson<pb::GetStatusResponse>({"status"});
  EXPECT_EQ(status.admission().allocated_bytes(), cost.arena_bytes());
  EXPECT_EQ(status.admission().free_bytes(), kBudgetBytes - cost.arena_bytes());
}

TEST_F(KvctlE2eTest, FitAndMaxContextAgreeWithCost) {
  const std::string model = "--hf-config=" + Runfile(kLlamaConfig);
  const auto cost = KvctlJson<pb::CostResponse>({"cost", model, "--context=1k"});
  const auto fit = KvctlJson<pb::FitResponse>({"fit", model, "--context=1k"});
  EXPECT_EQ(fit.session_bytes(), cost.arena_bytes());
  EXPECT_EQ(fit.budget_bytes(), kBudgetBytes);
  // Whole sessions in the empty budget, and not one more.
  EXPECT_LE(fit.sessions_when_empty() * fit.session_bytes(), kBudgetBytes);
  EXPECT_GT((fit.sessions_when_empty() + 1) * fit.session_bytes(), kBudgetBytes);
  EXPECT_EQ(fit.sessions_now(), fit.sessions_when_empty());
  EXPECT_GE(fit.total_tokens_when_empty(), fit.sessions_when_empty() * 1024);

  const Outcome human = Kvctl({"fit", model, "--context=1k"});
  EXPECT_EQ(human.exit_code, 0) << human.err;
  EXPECT_THAT(human.out, HasSubstrs(absl::StrCat("session    ", FormatBytes(cost.arena_bytes()),
                                                 " at 1024 tokens\n"),
                                    "NOW  AFTER EVICTION  WHEN EMPTY\n",
                                    absl::StrCat("total tokens  ", fit.total_tokens_now())));

  // The largest context: it fits, one more token does not.
  const auto max = KvctlJson<pb::MaxContextResponse>({"max-context", model});
  ASSERT_GT(max.max_context_now(), 0u);
  const auto at_max = KvctlJson<pb::CostResponse>(
      {"cost", model, absl::StrCat("--context=", max.max_context_now())});
  EXPECT_EQ(at_max.arena_bytes(), max.session_bytes_now());
  EXPECT_LE(at_max.arena_bytes(), max.free_bytes());
  const auto past_max = KvctlJson<pb::CostResponse>(
      {"cost", model, absl::StrCat("--context=", max.max_context_now() + 1)});
  EXPECT_GT(past_max.arena_bytes(), max.free_bytes());
  EXPECT_THAT(Kvctl({"max-context", model}).out,
              HasSubstr(absl::StrCat("max context  ", max.max_context_now())));

  // A context no budget of this size holds: nothing fits, exit 5, the answer still printed.
  const Outcome too_big = Kvctl({"fit", model, "--context=1m"});
  EXPECT_EQ(too_big.exit_code, 5) << too_big.err;
  EXPECT_THAT(too_big.out, ContainsRegex("\nsessions +0 +0 +0\n"));
}

// Sessions at the largest context, one after another, until not even one token fits: each
// session's arena is what max-context said, and at the end max-context and fit exit 5.
TEST_F(KvctlE2eTest, FillingTheBudgetEndsInNothingFits) {
  const auto imported = KvctlJson<pb::ImportModelResponse>(
      {"import-model", "--hf-config=" + Runfile(kLlamaConfig), "--register"});
  const std::string model = "--model=" + absl::BytesToHexString(imported.plan_fingerprint());
  absl::StatusOr<PlanFingerprint> fingerprint = FingerprintFromBytes(imported.plan_fingerprint());
  ASSERT_THAT(fingerprint, IsOk());
  std::vector<std::unique_ptr<Session>> sessions;
  uint64_t held_bytes = 0;
  for (int round = 0; round < 16; ++round) {
    const Outcome answer = Kvctl({"max-context", model, "--json"});
    const auto max = ParseJson<pb::MaxContextResponse>(answer);
    EXPECT_EQ(max.free_bytes(), kBudgetBytes - held_bytes);
    if (max.max_context_now() == 0) {
      EXPECT_EQ(answer.exit_code, 5) << answer.err;
      break;
    }
    EXPECT_EQ(answer.exit_code, 0) << answer.err;
    SessionOptions options;
    options.capacity = max.max_context_now();
    absl::StatusOr<std::unique_ptr<Session>> session =
        Engine().CreateSession(*fingerprint, options);
    ASSERT_THAT(session, IsOk()) << "round " << round << " at " << options.capacity;
    sessions.push_back(*std::move(session));
    held_bytes += max.session_bytes_now();
    EXPECT_EQ(KvctlJson<pb::GetStatusResponse>({"status"}).admission().allocated_bytes(),
              held_bytes);
  }
  ASSERT_FALSE(sessions.empty());
  const Outcome max = Kvctl({"max-context", model});
  EXPECT_EQ(max.exit_code, 5) << max.out << max.err;
  EXPECT_THAT(max.out, ContainsRegex("\nmax context +0 +0 +[1-9][0-9]*\n"));
  const Outcome fit = Kvctl({"fit", model, "--context=1"});
  EXPECT_EQ(fit.exit_code, 5) << fit.out << fit.err;
  EXPECT_THAT(fit.out, ContainsRegex("\nsessions +0 +0 +[1-9][0-9]*\n"));
}

TEST_F(KvctlE2eTest, PrefixesAndEvict) {
  const Outcome listed = Kvctl({"prefixes"});
  EXPECT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_THAT(listed.out, HasSubstr("0 entries"));
  EXPECT_THAT(listed.out, HasSubstr("budget     16.00 MiB (16777216 B)"));
  EXPECT_THAT(listed.out, HasSubstr("lookups    0 hit, 0 partial, 0 miss"));
  EXPECT_THAT(listed.out,
              HasSubstr("slabs      0 (0 B; 0 B free in use, 0 B empty kept; 0.0% fragmented)"));
  EXPECT_THAT(listed.out, HasSubstr("tiers      device 0 B of 16.00 MiB (16777216 B) (0 hits)"));
  EXPECT_EQ(KvctlJson<pb::ListPrefixesResponse>({"prefixes"}).stats().budget_bytes(),
            uint64_t{16} << 20);
  const Outcome unknown = Kvctl({"evict", "--entry=99"});
  EXPECT_EQ(unknown.exit_code, 4);
  EXPECT_THAT(unknown.err, StartsWith("memra-kvctl: memra-kvd refused EvictPrefix: NOT_FOUND: "));
  EXPECT_THAT(unknown.err, HasSubstr("99"));
}

TEST_F(KvctlE2eTest, DrainAndUndrain) {
  Outcome drain = Kvctl({"drain"});
  EXPECT_EQ(drain.exit_code, 0) << drain.err;
  EXPECT_THAT(drain.out, StartsWith("draining: new engines and sessions get UNAVAILABLE; 0 "));
  EXPECT_TRUE(KvctlJson<pb::GetStatusResponse>({"status"}).draining());
  EXPECT_THAT(Kvctl({"status"}).out, HasSubstr("state          DRAINING"));
  // While draining, the admission queries still answer.
  EXPECT_EQ(Kvctl({"cost", "--hf-config=" + Runfile(kLlamaConfig), "--context=1k"}).exit_code, 0);
  EXPECT_EQ(Kvctl({"drain"}).exit_code, 0);  // idempotent

  const Outcome undrain = Kvctl({"undrain"});
  EXPECT_EQ(undrain.exit_code, 0) << undrain.err;
  EXPECT_EQ(undrain.out, "accepting new engines and sessions\n");
  EXPECT_FALSE(KvctlJson<pb::GetStatusResponse>({"status"}).draining());
  EXPECT_EQ(Kvctl({"undrain"}).exit_code, 0);
}

TEST_F(KvctlE2eTest, RefusalsExitFourWithTheDaemonsCodeAndMessage) {
  const std::string unknown(64, 'e');
  const Outcome not_found = Kvctl({"cost", "--model=" + unknown, "--context=1k"});
  EXPECT_EQ(not_found.exit_code, 4);
  EXPECT_THAT(not_found.err, StartsWith("memra-kvctl: memra-kvd refused GetCost: NOT_FOUND: "));
  EXPECT_EQ(not_found.out, "");

  const Outcome bad_layers =
      Kvctl({"fit", "--hf-config=" + Runfile(kLlamaConfig), "--context=1k", "--layers=0:99"});
  EXPECT_EQ(bad_layers.exit_code, 4);
  EXPECT_THAT(bad_layers.err,
              StartsWith("memra-kvctl: memra-kvd refused GetFit: INVALID_ARGUMENT: "));
  EXPECT_THAT(bad_layers.err, HasSubstr("99"));

  const std::string unsupported =
      WriteFile("unsupported.json", "{\"architectures\": [\"NoSuchForCausalLM\"]}");
  const Outcome import = Kvctl({"import-model", "--hf-config=" + unsupported});
  EXPECT_EQ(import.exit_code, 4);
  EXPECT_THAT(import.err,
              HasSubstrs("refused ImportModel: INVALID_ARGUMENT: ", "NoSuchForCausalLM"));
}

TEST_F(KvctlE2eTest, UnreachableDaemonExitsThree) {
  const std::string absent = dir_ + "/absent.sock";
  const Outcome missing = Kvctl({"status"}, absent);
  EXPECT_EQ(missing.exit_code, 3);
  EXPECT_EQ(
      missing.err,
      absl::StrCat("memra-kvctl: cannot reach memra-kvd at unix:", absent, ": connect ", absent,
                   ": No such file or directory (errno 2)\n"
                   "  is the daemon running? systemctl status memra-kvd@<gpu>\n"));

  // The daemon stops (SIGTERM drains and exits 0, removing its socket).
  ASSERT_TRUE(daemon_.Signal(SIGTERM));
  EXPECT_EQ(daemon_.WaitExit(), 0);
  const Outcome stopped = Kvctl({"status", "--timeout=2"});
  EXPECT_EQ(stopped.exit_code, 3) << stopped.out;
  EXPECT_THAT(stopped.err,
              HasSubstr(absl::StrCat("cannot reach memra-kvd at unix:", admin_socket_)));
}

// The engine socket answers the read-only status but refuses the operators' calls, naming the
// admin socket; nothing changes.
TEST_F(KvctlE2eTest, EngineSocketRefusesDrainNamingTheAdminSocket) {
  EXPECT_EQ(Kvctl({"status"}, socket_).exit_code, 0);
  const Outcome drain = Kvctl({"drain"}, socket_);
  EXPECT_EQ(drain.exit_code, 4);
  EXPECT_THAT(drain.err, HasSubstrs("refused Drain: PERMISSION_DENIED: KvAdmin.Drain",
                                    absl::StrCat("served only on the admin socket ",
                                                 admin_socket_)));
  const Outcome sessions = Kvctl({"sessions"}, socket_);
  EXPECT_EQ(sessions.exit_code, 4);
  EXPECT_THAT(sessions.err, HasSubstr("KvAdmin.ListSessions"));
  EXPECT_FALSE(KvctlJson<pb::GetStatusResponse>({"status"}).draining());
}

}  // namespace
}  // namespace memra::kvctl
