// memra-kvctl without the daemon: argument parsing (every refusal's exit code and message),
// --context suffixes, byte formatting, the human output of canned answers as golden text, the
// JSON output, and RunKvctl against a fake KvAdmin service on a real Unix socket (exit codes 3,
// 4 and 5, the AdmissionRefusal numbers, and the requests the flags turn into).

#include "tools/kvctl.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "proto/memra/kv/v1/group.pb.h"
#include "tests/status_matchers.h"
#include "tools/text_format.h"

namespace memra::kvctl {
namespace {

namespace pb = ::memra::kv::v1;
using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A fingerprint with recognizable bytes 0x00..0x1f.
std::string TestFingerprint() {
  std::string bytes;
  for (int i = 0; i < 32; ++i) bytes.push_back(static_cast<char>(i));
  return bytes;
}
constexpr char kTestFingerprintHex[] =
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

struct Outcome {
  int exit_code;
  std::string out;
  std::string err;
};

Outcome RunCli(const std::vector<std::string>& args) {
  std::ostringstream out;
  std::ostringstream err;
  const int code = RunKvctl(args, out, err);
  return {code, out.str(), err.str()};
}

// ---- --context and bytes ------------------------------------------------------------------

TEST(ParseContextTest, DecimalAndBinarySuffixes) {
  EXPECT_THAT(ParseContext("1"), IsOkAndHolds(1u));
  EXPECT_THAT(ParseContext("32768"), IsOkAndHolds(32768u));
  EXPECT_THAT(ParseContext("32k"), IsOkAndHolds(32768u));
  EXPECT_THAT(ParseContext("32K"), IsOkAndHolds(32768u));
  EXPECT_THAT(ParseContext("1m"), IsOkAndHolds(1048576u));
  EXPECT_THAT(ParseContext("1M"), IsOkAndHolds(1048576u));
  EXPECT_THAT(ParseContext("2047m"), IsOkAndHolds(uint64_t{2047} << 20));
  EXPECT_THAT(ParseContext("2147483647"), IsOkAndHolds(kMaxContextTokens));
}

TEST(ParseContextTest, RefusesMalformedText) {
  for (const char* text : {"", "k", "1.5k", "-1", " 1", "+1", "32kb", "1g", "0x10", "32 k"}) {
    EXPECT_THAT(ParseContext(text),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstrs(absl::StrCat("--context=", text, ": want tokens"),
                                    "k (x1024) or m (x1048576)")))
        << text;
  }
}

TEST(ParseContextTest, RefusesZeroAndMoreThanASessionHolds) {
  // 2^31, 2048m = 2^31, 2^21 k = 2^31, a k count whose product overflows 64 bits, and a number
  // that overflows 64 bits by itself.
  for (const char* text : {"0", "0k", "2147483648", "2048m", "2097152k", "18014398509481984k",
                           "99999999999999999999"}) {
    EXPECT_THAT(
        ParseContext(text),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 absl::StrCat("--context=", text, ": a session holds 1..2147483647 tokens")))
        << text;
  }
}

TEST(FormatBytesTest, ExactBelowOneKibibyteThenTwoDecimalsAndTheExactCount) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.00 KiB (1024 B)");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB (1536 B)");
  EXPECT_EQ(FormatBytes(1610612736), "1.50 GiB (1610612736 B)");
  // 1048575 B is 1023.999 KiB: it must not print as "1024.00 KiB".
  EXPECT_EQ(FormatBytes(1048575), "1.00 MiB (1048575 B)");
  EXPECT_EQ(FormatBytes(uint64_t{5} << 40), "5.00 TiB (5497558138880 B)");
  EXPECT_EQ(FormatBytes(UINT64_MAX), "16.00 EiB (18446744073709551615 B)");
}

TEST(TextTableTest, AlignsColumnsWithoutTrailingSpaces) {
  TextTable table({{"NAME"}, {"BYTES", TextTable::Align::kRight}, {"NOTE"}});
  table.AddRow({"a", "1", ""});
  table.AddRow({"longer", "12345", "x"});
  EXPECT_EQ(table.Render(),
            "NAME    BYTES  NOTE\n"
            "a           1\n"
            "longer  12345  x\n");
  FieldList fields;
  fields.Add("one", "1").Add("three", "3");
  EXPECT_EQ(fields.Render(), "one    1\nthree  3\n");
}

// ---- parsing ------------------------------------------------------------------------------

TEST(ParseArgsTest, DefaultsAndFlagsOnEitherSideOfTheCommand) {
  absl::StatusOr<Invocation> status = ParseArgs({"status"});
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->command, "status");
  EXPECT_EQ(status->socket_path, "/run/memra-kv/gpu0.admin.sock");
  EXPECT_EQ(status->timeout, absl::Seconds(10));
  EXPECT_FALSE(status->json);

  absl::StatusOr<Invocation> fit =
      ParseArgs({"--gpu=3", "--json", "fit", "--hf-config=/m/config.json", "--context=32k",
                 "--layers=4:12", "--tp=2", "--spec-snapshot", "--timeout=0.5"});
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_EQ(fit->command, "fit");
  EXPECT_EQ(fit->socket_path, "/run/memra-kv/gpu3.admin.sock");
  EXPECT_TRUE(fit->json);
  EXPECT_EQ(fit->hf_config_path, "/m/config.json");
  EXPECT_EQ(fit->context, 32768u);
  EXPECT_EQ(fit->layer_lo, 4u);
  EXPECT_EQ(fit->layer_hi, 12u);
  EXPECT_EQ(fit->tp_ranks, 2u);
  EXPECT_TRUE(fit->spec_snapshot);
  EXPECT_EQ(fit->timeout, absl::Milliseconds(500));
}

TEST(ParseArgsTest, ModelFingerprintAsHexOrBase64AndOpenEndedLayers) {
  absl::StatusOr<Invocation> hex =
      ParseArgs({"max-context", absl::StrCat("--model=", kTestFingerprintHex),
                 "--layers=8:", "--socket=/tmp/x.sock"});
  ASSERT_TRUE(hex.ok()) << hex.status();
  EXPECT_EQ(hex->model_fingerprint, TestFingerprint());
  EXPECT_EQ(hex->layer_lo, 8u);
  EXPECT_FALSE(hex->layer_hi.has_value());
  EXPECT_EQ(hex->socket_path, "/tmp/x.sock");

  absl::StatusOr<Invocation> base64 = ParseArgs(
      {"cost", absl::StrCat("--model=", absl::Base64Escape(TestFingerprint())), "--context=7"});
  ASSERT_TRUE(base64.ok()) << base64.status();
  EXPECT_EQ(base64->model_fingerprint, TestFingerprint());
}

TEST(ParseArgsTest, ImportModelAndSessionsFlags) {
  absl::StatusOr<Invocation> import =
      ParseArgs({"import-model", "--hf-config=c.json", "--name=mine", "--index-pool=4",
                 "--index-ring-rows=0", "--swa-ring", "--kv-dtype=q8_0/q5_1", "--register"});
  ASSERT_TRUE(import.ok()) << import.status();
  EXPECT_EQ(import->kv_dtype, "q8_0/q5_1");
  EXPECT_EQ(import->name, "mine");
  EXPECT_EQ(import->index_pool, 4u);
  EXPECT_EQ(import->index_ring_rows, 0u);
  EXPECT_TRUE(import->swa_ring);
  EXPECT_TRUE(import->register_plan);

  absl::StatusOr<Invocation> sessions = ParseArgs({"sessions", "--engine=17"});
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  EXPECT_EQ(sessions->engine_id, 17u);
}

// Every usage refusal: exit 2, the message, then the command's usage (or the command list).
struct Refusal {
  std::vector<std::string> args;
  std::string message;
  std::string usage;  // the first line of what follows the message
};

TEST(UsageErrorTest, EveryRefusalSaysWhatAndPrintsTheUsage) {
  const std::string kCostUsage = "Usage: memra-kvctl cost (--model=FINGERPRINT";
  const std::string kList = "Usage: memra-kvctl COMMAND [FLAGS]";
  const std::vector<Refusal> refusals = {
      {{}, "no command given", kList},
      {{"--json"}, "no command given", kList},
      {{"frob"}, "unknown command 'frob'", kList},
      {{"status", "--frob"},
       "unknown flag --frob",
       "Usage: memra-kvctl status [--group=FILE] [common flags]"},
      {{"status", "--context=1"}, "status does not take --context", "Usage: memra-kvctl status"},
      {{"max-context", "--hf-config=c", "--context=1k"},
       "max-context does not take --context",
       "Usage: memra-kvctl max-context"},
      {{"status", "--json=yes"},
       "--json is a switch and takes no value (got '--json=yes')",
       "Usage: memra-kvctl status"},
      {{"cost", "--context", "32k"}, "--context needs a value: --context=TOKENS", kCostUsage},
      {{"status", "extra"},
       "unexpected argument 'extra' (flags take values as --flag=VALUE)",
       "Usage: memra-kvctl status"},
      {{"status", "--json", "--json"}, "--json given twice", "Usage: memra-kvctl status"},
      {{"evict"}, "evict needs --entry=ID", "Usage: memra-kvctl evict --entry=ID"},
      {{"evict", "--entry=0"}, "--entry", "Usage: memra-kvctl evict --entry=ID"},
      {{"prefixes", "--entry=3"}, "prefixes does not take --entry", "Usage: memra-kvctl prefixes"},
      {{"status", "--socket=/a", "--gpu=1"},
       "give --socket=PATH or --gpu=N, not both",
       "Usage: memra-kvctl status"},
      {{"status", "--socket="}, "--socket= needs a path", "Usage: memra-kvctl status"},
      {{"status", "--gpu=x"},
       "--gpu=x: want a whole number in 0..1023",
       "Usage: memra-kvctl status"},
      {{"status", "--gpu=1024"},
       "--gpu=1024: want a whole number in 0..1023",
       "Usage: memra-kvctl status"},
      {{"status", "--timeout=0"},
       "--timeout=0: want seconds above 0 and at most 3600",
       "Usage: memra-kvctl status"},
      {{"status", "--timeout=abc"},
       "--timeout=abc: want seconds above 0 and at most 3600",
       "Usage: memra-kvctl status"},
      {{"status", "--timeout=3601"},
       "--timeout=3601: want seconds above 0 and at most 3600",
       "Usage: memra-kvctl status"},
      {{"status", "--timeout=inf"},
       "--timeout=inf: want seconds above 0 and at most 3600",
       "Usage: memra-kvctl status"},
      {{"cost", "--context=32k"},
       "cost needs exactly one model: --model=FINGERPRINT, --hf-config=PATH or --plan=PATH (got 0)",
       kCostUsage},
      {{"fit", "--hf-config=a", "--plan=b", "--context=1"},
       "fit needs exactly one model: --model=FINGERPRINT, --hf-config=PATH or --plan=PATH (got 2)",
       "Usage: memra-kvctl fit"},
      {{"cost", "--hf-config=a"}, "cost needs --context=TOKENS (e.g. --context=32k)", kCostUsage},
      {{"cost", "--hf-config=", "--context=1"}, "--hf-config= needs a path", kCostUsage},
      {{"cost", "--model=abc", "--context=1"},
       "--model=abc: want a plan fingerprint, 64 hex digits (or the base64 of its 32 bytes), got 3 "
       "characters",
       kCostUsage},
      {{"cost", "--hf-config=a", "--context=1", "--layers=3"},
       "--layers=3: want LO:HI (layers LO..HI-1) or LO: (LO to the end)",
       kCostUsage},
      {{"cost", "--hf-config=a", "--context=1", "--layers=4:4"},
       "--layers=4:4: HI (4) must be above LO (4): the layers are LO..HI-1",
       kCostUsage},
      {{"cost", "--hf-config=a", "--context=1", "--layers=a:4"},
       "--layers LO=a: want a whole number in 0..4294967295",
       kCostUsage},
      {{"cost", "--hf-config=a", "--context=1", "--layers=0:4294967296"},
       "--layers HI=4294967296: want a whole number in 0..4294967295",
       kCostUsage},
      {{"cost", "--hf-config=a", "--context=1", "--tp=0"},
       "--tp=0: want a whole number in 1..",
       kCostUsage},
      {{"cost", "--hf-config=a", "--context=2048m"},
       "--context=2048m: a session holds 1..2147483647 tokens",
       kCostUsage},
      {{"sessions", "--engine=0"},
       "--engine=0: want a whole number in 1..",
       "Usage: memra-kvctl sessions [--engine=ID]"},
      {{"import-model"},
       "import-model needs --hf-config=PATH (the model's config.json)",
       "Usage: memra-kvctl import-model --hf-config=PATH"},
      {{"import-model", "--hf-config=a", "--index-pool=0"},
       "--index-pool=0: want a whole number in 1..4294967295",
       "Usage: memra-kvctl import-model"},
      {{"import-model", "--hf-config=a", "--index-ring-rows=-1"},
       "--index-ring-rows=-1: want a whole number in 0..4294967295",
       "Usage: memra-kvctl import-model"},
      {{"import-model", "--hf-config=a", "--name="},
       "--name= needs a name (omit it for the config's own)",
       "Usage: memra-kvctl import-model"},
      {{"help", "cost", "fit"}, "help takes one command name, not 'fit'", kList},
      {{"help", "--json"}, "help takes one command name, not '--json'", kList},
      {{"help", "frob"}, "no command 'frob'", kList},
  };
  for (const Refusal& refusal : refusals) {
    const Outcome outcome = RunCli(refusal.args);
    const std::string args = absl::StrJoin(refusal.args, " ");
    EXPECT_EQ(outcome.exit_code, kExitUsage) << args;
    EXPECT_THAT(outcome.err, StartsWith(absl::StrCat("memra-kvctl: ", refusal.message))) << args;
    EXPECT_THAT(outcome.err, HasSubstr(absl::StrCat("\n\n", refusal.usage))) << args;
    EXPECT_EQ(outcome.out, "") << args;
  }
}

TEST(UsageErrorTest, UnreadableOrMalformedInputFilesAreUsageErrors) {
  const Outcome missing = RunCli({"cost", "--hf-config=/nonexistent/config.json", "--context=1"});
  EXPECT_EQ(missing.exit_code, kExitUsage);
  EXPECT_THAT(missing.err,
              StartsWith("memra-kvctl: --hf-config=/nonexistent/config.json: No such file or "
                         "directory (errno 2)\n"));

  const std::string plan_path = absl::StrCat(getenv("TEST_TMPDIR"), "/bad-plan.json");
  FILE* file = fopen(plan_path.c_str(), "w");
  ASSERT_NE(file, nullptr);
  fputs("{\"layers\": [{\"kind\": \"NOT_A_KIND\"}]}", file);
  fclose(file);
  const Outcome malformed = RunCli({"fit", "--plan=" + plan_path, "--context=1"});
  EXPECT_EQ(malformed.exit_code, kExitUsage);
  EXPECT_THAT(malformed.err, StartsWith(absl::StrCat("memra-kvctl: --plan=", plan_path,
                                                     ": not a ModelPlan in protobuf JSON: ")));
  EXPECT_THAT(malformed.err, HasSubstr("Usage: memra-kvctl fit"));

  const Outcome import_missing = RunCli({"import-model", "--hf-config=/nonexistent.json"});
  EXPECT_EQ(import_missing.exit_code, kExitUsage);
  EXPECT_THAT(import_missing.err,
              StartsWith("memra-kvctl: --hf-config=/nonexistent.json: No such file"));
}

TEST(HelpTest, OverviewAndEveryCommandTeach) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"help"}, {"--help"}, {"-h"}}) {
    const Outcome overview = RunCli(args);
    EXPECT_EQ(overview.exit_code, kExitOk);
    EXPECT_THAT(overview.out, HasSubstrs("Commands:", "Exit codes:", "3  daemon unreachable",
                                         "5  fit / max-context: nothing fits now"));
    EXPECT_EQ(overview.err, "");
  }
  for (const char* command : {"status", "sessions", "engines", "cost", "fit", "max-context",
                              "import-model", "drain", "undrain"}) {
    const Outcome help = RunCli({"help", command});
    EXPECT_EQ(help.exit_code, kExitOk) << command;
    EXPECT_THAT(help.out, HasSubstrs(absl::StrCat("memra-kvctl ", command, ": "),
                                     absl::StrCat("Usage: memra-kvctl ", command), "Example:\n",
                                     "Output:\n", "Exit codes:"))
        << command;
    // `CMD --help` is the same text, even with the command's required flags missing.
    EXPECT_EQ(RunCli({command, "--help"}).out, help.out) << command;
    for (absl::string_view line : absl::StrSplit(help.out, '\n')) {
      EXPECT_LE(line.size(), 100u) << command << ": " << line;
    }
  }
  EXPECT_THAT(RunCli({"help", "fit"}).out, HasSubstr("5 nothing fits now"));
  EXPECT_THAT(RunCli({"help", "cost"}).out,
              HasSubstrs("--context=TOKENS", "k = 1024", "32k = 32768", "--spec-snapshot"));
}

// ---- rendering ----------------------------------------------------------------------------

pb::EngineStatus Engine(uint64_t id, const std::string& name, bool live) {
  pb::EngineStatus engine;
  engine.set_engine_id(id);
  engine.set_engine_name(name);
  engine.set_pid(4000 + id);
  engine.set_uid(1000 + id);
  engine.set_gid(1000);
  engine.set_cache_scope(live ? absl::StrCat("uid:", 1000 + id) : "team-a");
  engine.set_lease_live(live);
  engine.set_sessions(id);
  engine.set_allocated_bytes(id << 30);
  engine.set_reserved_bytes(live ? 512 : 0);
  engine.set_reservations(live ? 1 : 0);
  engine.set_last_heartbeat_age_ms(live ? 250 : 61000);
  return engine;
}

pb::GetStatusResponse CannedStatus() {
  pb::GetStatusResponse status;
  status.set_backend("host");
  status.set_device_name("host shared memory");
  status.set_uptime_ms(3723456);
  status.set_epoch(0xabcdef);
  status.set_allocated_bytes(uint64_t{3} << 30);
  status.set_arena_count(3);
  status.set_sessions(3);
  status.set_engines(2);
  status.set_plans(1);
  *status.add_engine_status() = Engine(1, "vllm-0", true);
  *status.add_engine_status() = Engine(2, "sglang", false);
  pb::AdmissionStatus& admission = *status.mutable_admission();
  admission.set_budget_bytes(uint64_t{8} << 30);
  admission.set_reserved_bytes(512);
  admission.set_allocated_bytes(uint64_t{3} << 30);
  admission.set_free_bytes((uint64_t{5} << 30) - 512);
  admission.set_evictable_bytes(uint64_t{1} << 20);
  admission.set_reservations(1);
  admission.set_budget_rule("host: budget_bytes");
  admission.set_granularity_bytes(4096);
  return status;
}

TEST(RenderTest, Status) {
  EXPECT_EQ(
      RenderStatus(CannedStatus()),
      "backend        host\n"
      "device         host shared memory\n"
      "uptime         1h2m3s (epoch 0000000000abcdef)\n"
      "state          serving\n"
      "sessions       3 in 3 arenas of 3.00 GiB (3221225472 B)\n"
      "engines        2\n"
      "plans          1 registered\n"
      "admission      host: budget_bytes\n"
      "  budget       8.00 GiB (8589934592 B)\n"
      "  allocated    3.00 GiB (3221225472 B)\n"
      "  reserved     512 B in 1 reservation\n"
      "  free         5.00 GiB (5368708608 B)\n"
      "  evictable    1.00 MiB (1048576 B)\n"
      "  granularity  4.00 KiB (4096 B)\n"
      "\n"
      "ENGINE  NAME     PID   UID  SCOPE     LEASE  SESSIONS                ALLOCATED  RESERVED  "
      "RESV  HEARTBEAT\n"
      "     1  vllm-0  4001  1001  uid:1001  live          1  1.00 GiB (1073741824 B)     512 B  "
      "   1  250ms ago\n"
      "     2  sglang  4002  1002  team-a    ended         2  2.00 GiB (2147483648 B)       0 B  "
      "   0  1m1s ago\n");
}

// Issue 26: a daemon whose supervisor died serves on, and the status says its KV will not
// survive the next crash (not just "serving").
TEST(RenderTest, StatusSaysWhetherTheKvSurvivesADaemonCrash) {
  pb::GetStatusResponse status = CannedStatus();
  status.clear_engine_status();
  status.set_restart_survival(pb::RESTART_SURVIVAL_LOST);
  status.set_restart_survival_detail("the service manager stopped answering on NOTIFY_SOCKET");
  EXPECT_THAT(RenderStatus(status),
              HasSubstr("state          serving\n"
                        "restarts       SURVIVAL LOST: the service manager stopped answering on "
                        "NOTIFY_SOCKET\n"));
  status.set_restart_survival(pb::RESTART_SURVIVAL_ON);
  status.set_restart_survival_detail(
      "journal-4: 7 descriptors (journal, arenas, plans) in the service manager's fd store");
  EXPECT_THAT(RenderStatus(status),
              HasSubstr("restarts       KV survives a daemon crash (journal-4: 7 descriptors "
                        "(journal, arenas, plans) in the service manager's fd store)\n"));
  status.set_restart_survival(pb::RESTART_SURVIVAL_OFF);
  status.set_restart_survival_detail("keep_kv_across_restarts = false");
  EXPECT_THAT(RenderStatus(status), HasSubstr("restarts       KV does not survive a daemon crash "
                                              "(keep_kv_across_restarts = false)\n"));
}

TEST(RenderTest, StatusOnADeviceOverBudgetWhileDraining) {
  pb::GetStatusResponse status = CannedStatus();
  status.set_backend("cuda");
  status.set_device_uuid("GPU-1234");
  status.set_device_total_bytes(uint64_t{80} << 30);
  status.set_device_free_bytes(uint64_t{70} << 30);
  status.set_draining(true);
  status.clear_engine_status();
  status.mutable_admission()->set_free_bytes(0);
  status.mutable_admission()->set_over_budget_bytes(uint64_t{1} << 30);
  EXPECT_EQ(RenderStatus(status),
            "backend        cuda\n"
            "device         host shared memory (GPU-1234)\n"
            "device memory  80.00 GiB (85899345920 B) total, 70.00 GiB (75161927680 B) free\n"
            "uptime         1h2m3s (epoch 0000000000abcdef)\n"
            "state          DRAINING: new engines and sessions get UNAVAILABLE\n"
            "sessions       3 in 3 arenas of 3.00 GiB (3221225472 B)\n"
            "engines        2\n"
            "plans          1 registered\n"
            "admission      host: budget_bytes\n"
            "  budget       8.00 GiB (8589934592 B)\n"
            "  allocated    3.00 GiB (3221225472 B)\n"
            "  reserved     512 B in 1 reservation\n"
            "  free         0 B\n"
            "  evictable    1.00 MiB (1048576 B)\n"
            "  OVER BUDGET  1.00 GiB (1073741824 B)\n"
            "  granularity  4.00 KiB (4096 B)\n"
            "\n"
            "no engines attached\n");
}

TEST(RenderTest, EnginesAndSessions) {
  pb::ListEnginesResponse engines;
  EXPECT_EQ(RenderEngines(engines), "no engines attached\n");
  *engines.add_engines() = Engine(1, "vllm-0", true);
  *engines.add_engines() = Engine(12, "sglang", false);
  EXPECT_EQ(RenderEngines(engines),
            "ENGINE  NAME     PID   UID  SCOPE     LEASE  SESSIONS                  ALLOCATED  "
            "RESERVED  RESV  HEARTBEAT\n"
            "     1  vllm-0  4001  1001  uid:1001  live          1    1.00 GiB (1073741824 B)  "
            "   512 B     1  250ms ago\n"
            "    12  sglang  4012  1012  team-a    ended        12  12.00 GiB (12884901888 B)  "
            "     0 B     0  1m1s ago\n");

  pb::ListSessionsResponse sessions;
  EXPECT_EQ(RenderSessions(sessions), "no sessions\n");
  pb::SessionSummary& first = *sessions.add_sessions();
  first.set_session_id(7);
  first.set_engine_id(1);
  first.set_model_name("llama-3.1-8b");
  first.set_plan_fingerprint(TestFingerprint());
  first.set_capacity(32768);
  first.set_logical_len(1200);
  first.set_arena_bytes(uint64_t{4} << 30);
  first.set_layout_version(1);
  pb::SessionSummary& second = *sessions.add_sessions();
  second = first;
  second.set_session_id(8);
  second.set_capacity(8192);
  second.set_logical_len(0);
  second.set_arena_bytes(uint64_t{1} << 30);
  second.set_layout_version(2);
  second.set_in_transaction(true);
  second.set_tainted(true);
  EXPECT_EQ(RenderSessions(sessions),
            "SESSION  ENGINE  MODEL         CAPACITY  LENGTH                    ARENA  LAYOUT  "
            "STATE        FINGERPRINT\n"
            "      7       1  llama-3.1-8b     32768    1200  4.00 GiB (4294967296 B)       1  ok  "
            "         000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n"
            "      8       1  llama-3.1-8b      8192       0  1.00 GiB (1073741824 B)       2  "
            "txn,tainted  000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n"
            "2 sessions, 5.00 GiB (5368709120 B)\n");
}

pb::CostResponse CannedCost() {
  pb::CostResponse cost;
  cost.set_model_name("gemma-3-27b-it");
  cost.set_plan_fingerprint(TestFingerprint());
  cost.set_capacity(32768);
  cost.set_layers(62);
  cost.set_arena_bytes(1610612736);
  cost.set_granularity_bytes(2 << 20);
  pb::CostBreakdown& breakdown = *cost.mutable_breakdown();
  breakdown.set_bytes_per_token(20000);
  breakdown.set_kv_bytes_per_token(20000);
  breakdown.set_ring_bytes_per_token(25000);
  breakdown.set_latent_bytes_per_token(0);
  breakdown.set_ring_row_cap(1535);
  breakdown.set_fixed_bytes(123456);
  breakdown.set_total_plane_bytes(1609000000);
  return cost;
}

TEST(RenderTest, CostFitMaxContext) {
  EXPECT_EQ(
      RenderCost(CannedCost()),
      "model        gemma-3-27b-it\n"
      "fingerprint  000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n"
      "context      32768 tokens, 62 layers\n"
      "cost         1.50 GiB (1610612736 B)  (admission charges and the backend allocates this)\n"
      "per token    19.53 KiB (20000 B)  (what one more token adds at this context)\n"
      "full K/V     19.53 KiB (20000 B) a token\n"
      "sliding K/V  24.41 KiB (25000 B) a token, up to the ring's 1535 rows\n"
      "latent       0 B a token\n"
      "fixed        120.56 KiB (123456 B)\n"
      "planes       1.50 GiB (1609000000 B)\n"
      "granularity  2.00 MiB (2097152 B)\n");

  pb::CostResponse flat = CannedCost();
  flat.mutable_breakdown()->set_ring_row_cap(0);
  flat.mutable_breakdown()->set_ring_bytes_per_token(0);
  EXPECT_THAT(RenderCost(flat), HasSubstr("\nsliding K/V  0 B a token (no ring)\n"));

  pb::FitResponse fit;
  fit.set_session_bytes(1610612736);
  fit.set_sessions_now(3);
  fit.set_sessions_after_eviction(4);
  fit.set_sessions_when_empty(5);
  fit.set_total_tokens_now(110000);
  fit.set_total_tokens_when_empty(180000);
  fit.set_free_bytes(uint64_t{5} << 30);
  fit.set_evictable_bytes(uint64_t{1} << 30);
  fit.set_budget_bytes(uint64_t{8} << 30);
  EXPECT_EQ(RenderFit(fit, 32768),
            "session    1.50 GiB (1610612736 B) at 32768 tokens\n"
            "free       5.00 GiB (5368709120 B)\n"
            "evictable  1.00 GiB (1073741824 B)\n"
            "budget     8.00 GiB (8589934592 B)\n"
            "\n"
            "                 NOW  AFTER EVICTION  WHEN EMPTY\n"
            "sessions           3               4           5\n"
            "total tokens  110000               -      180000\n");

  pb::MaxContextResponse max;
  max.set_max_context_now(98304);
  max.set_max_context_after_eviction(120000);
  max.set_max_context_when_empty(196608);
  max.set_session_bytes_now(uint64_t{5} << 30);
  max.set_free_bytes(uint64_t{5} << 30);
  max.set_evictable_bytes(uint64_t{1} << 30);
  max.set_budget_bytes(uint64_t{8} << 30);
  EXPECT_EQ(RenderMaxContext(max),
            "session    5.00 GiB (5368709120 B) at the max context now\n"
            "free       5.00 GiB (5368709120 B)\n"
            "evictable  1.00 GiB (1073741824 B)\n"
            "budget     8.00 GiB (8589934592 B)\n"
            "\n"
            "               NOW  AFTER EVICTION  WHEN EMPTY\n"
            "max context  98304          120000      196608\n");
}

pb::ImportModelResponse CannedImport() {
  pb::ImportModelResponse imported;
  imported.set_architecture("Gemma3ForCausalLM");
  imported.set_plan_fingerprint(TestFingerprint());
  pb::ModelPlan& plan = *imported.mutable_plan();
  plan.set_name("gemma-3-27b-it");
  plan.set_swa_ring(true);
  for (uint32_t i = 0; i < 12; ++i) {
    pb::LayerPlan& layer = *plan.add_layers();
    layer.set_index(i);
    layer.set_kind((i + 1) % 6 == 0 ? pb::STATE_KIND_KV : pb::STATE_KIND_SLIDING_KV);
  }
  pb::LayerPlan& mtp = *plan.add_mtp_blocks();
  mtp.set_index(12);
  mtp.set_kind(pb::STATE_KIND_KV);
  imported.set_kv_dtype("bf16 from text_config.torch_dtype bfloat16");
  imported.set_kv_formats("K/V bf16/bf16");
  return imported;
}

TEST(RenderTest, ImportAndDrain) {
  EXPECT_EQ(RenderImport(CannedImport()),
            "architecture  Gemma3ForCausalLM\n"
            "name          gemma-3-27b-it\n"
            "fingerprint   000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n"
            "registered    no (--register keeps it in the daemon)\n"
            "layers        12 trunk + 1 MTP\n"
            "kv formats    K/V bf16/bf16 (bf16 from text_config.torch_dtype bfloat16)\n"
            "swa ring      on\n"
            "index ring    default working rows\n"
            "\n"
            "KIND        LAYERS  INDICES\n"
            "KV               3  5,11-12\n"
            "SLIDING_KV      10  0-4,6-10\n");
  pb::ImportModelResponse registered = CannedImport();
  registered.set_registered(true);
  registered.mutable_plan()->set_index_ring_rows(0);
  EXPECT_THAT(
      RenderImport(registered),
      HasSubstrs(absl::StrCat("registered    yes: --model=", kTestFingerprintHex, " names it\n"),
                 "index ring    0 rows\n"));

  pb::DrainResponse drained;
  drained.set_sessions_open(1);
  EXPECT_EQ(RenderDrain(drained),
            "draining: new engines and sessions get UNAVAILABLE; 1 session stays open until "
            "released\n");
  drained.set_sessions_open(3);
  EXPECT_THAT(RenderDrain(drained), HasSubstr("; 3 sessions stay open"));
}

TEST(RenderTest, PrefixesShowTheirCacheScope) {
  pb::ListPrefixesResponse prefixes;
  pb::PrefixEntry* entry = prefixes.add_entries();
  entry->set_entry_id(7);
  entry->set_cache_scope("uid:1001");
  entry->set_shape_fingerprint(std::string(32, '\x01'));
  entry->set_boundary_tokens(512);
  pb::PrefixEntry* shared = prefixes.add_entries();
  shared->set_entry_id(8);
  shared->set_cache_scope("team-a");
  pb::PrefixEntry* pooled = prefixes.add_entries();
  pooled->set_entry_id(9);
  pooled->set_cache_scope("team-a");
  pooled->set_from_engine_pool(true);
  pooled->set_engine_id(3);
  const std::string rendered = RenderPrefixes(prefixes);
  EXPECT_THAT(rendered, HasSubstrs("ENTRY  SCOPE     SHAPE", "    7  uid:1001  0101010101010101",
                                   "    8  team-a", "session\n", "engine 3 pool block\n",
                                   "3 entries"));
}

TEST(RenderTest, JsonPrintsEveryFieldWithProtoNames) {
  pb::FitResponse fit;
  fit.set_session_bytes(1610612736);
  fit.set_sessions_now(3);
  absl::StatusOr<std::string> json = RenderJson(fit);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(
      *json,
      "{\"session_bytes\":\"1610612736\",\"sessions_now\":\"3\",\"sessions_after_eviction\":\"0\","
      "\""
      "sessions_when_empty\":\"0\",\"total_tokens_now\":\"0\",\"total_tokens_when_empty\":\"0\",\"f"
      "ree_bytes\":\"0\",\"evictable_bytes\":\"0\",\"budget_bytes\":\"0\"}");
  // Bytes are base64, enums by name, and the ModelPlan reads back as --plan's input.
  json = RenderJson(CannedImport());
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json,
              HasSubstrs("{\"plan\":{\"name\":\"gemma-3-27b-it\",\"layers\":[{\"index\":0,",
                         "\"kind\":\"STATE_KIND_SLIDING_KV\"",
                         "\"plan_fingerprint\":\"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=\"",
                         "\"architecture\":\"Gemma3ForCausalLM\",\"registered\":false,",
                         "\"kv_formats\":\"K/V bf16/bf16\"}"));
}

// ---- RunKvctl against a fake daemon ---------------------------------------------------------

// What the fake answers and what it was asked. Every RPC answers `refusal` when it is not OK.
struct FakeState {
  grpc::Status refusal = grpc::Status::OK;
  pb::GetStatusResponse status;
  pb::ListEnginesResponse engines;
  pb::ListSessionsResponse sessions;
  pb::CostResponse cost;
  pb::FitResponse fit;
  pb::MaxContextResponse max_context;
  pb::ImportModelResponse imported;
  pb::DrainResponse drained;

  pb::ListSessionsRequest sessions_request;
  pb::CostRequest cost_request;
  pb::FitRequest fit_request;
  pb::MaxContextRequest max_context_request;
  pb::ImportModelRequest import_request;
  int drains = 0;
  int undrains = 0;
};

// Thread-safety: the state is guarded by mu_; handlers run on gRPC's threads.
class FakeAdmin final : public pb::KvAdmin::Service {
 public:
  template <typename Edit>
  void With(Edit edit) {
    absl::MutexLock lock(&mu_);
    edit(state_);
  }

  grpc::Status GetStatus(grpc::ServerContext*, const pb::GetStatusRequest*,
                         pb::GetStatusResponse* response) override {
    return Answer(&FakeState::status, response);
  }
  grpc::Status ListEngines(grpc::ServerContext*, const pb::ListEnginesRequest*,
                           pb::ListEnginesResponse* response) override {
    return Answer(&FakeState::engines, response);
  }
  grpc::Status ListSessions(grpc::ServerContext*, const pb::ListSessionsRequest* request,
                            pb::ListSessionsResponse* response) override {
    return Answer(&FakeState::sessions, response, &FakeState::sessions_request, request);
  }
  grpc::Status GetCost(grpc::ServerContext*, const pb::CostRequest* request,
                       pb::CostResponse* response) override {
    return Answer(&FakeState::cost, response, &FakeState::cost_request, request);
  }
  grpc::Status GetFit(grpc::ServerContext*, const pb::FitRequest* request,
                      pb::FitResponse* response) override {
    return Answer(&FakeState::fit, response, &FakeState::fit_request, request);
  }
  grpc::Status GetMaxContext(grpc::ServerContext*, const pb::MaxContextRequest* request,
                             pb::MaxContextResponse* response) override {
    return Answer(&FakeState::max_context, response, &FakeState::max_context_request, request);
  }
  grpc::Status ImportModel(grpc::ServerContext*, const pb::ImportModelRequest* request,
                           pb::ImportModelResponse* response) override {
    return Answer(&FakeState::imported, response, &FakeState::import_request, request);
  }
  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest*,
                     pb::DrainResponse* response) override {
    absl::MutexLock lock(&mu_);
    ++state_.drains;
    *response = state_.drained;
    return state_.refusal;
  }
  grpc::Status Undrain(grpc::ServerContext*, const pb::UndrainRequest*,
                       pb::UndrainResponse*) override {
    absl::MutexLock lock(&mu_);
    ++state_.undrains;
    return state_.refusal;
  }

 private:
  template <typename Response, typename Request = pb::GetStatusRequest>
  grpc::Status Answer(Response FakeState::*canned, Response* response,
                      Request FakeState::*last = nullptr, const Request* request = nullptr) {
    absl::MutexLock lock(&mu_);
    if (last != nullptr) state_.*last = *request;
    *response = state_.*canned;
    return state_.refusal;
  }

  absl::Mutex mu_;
  FakeState state_ ABSL_GUARDED_BY(mu_);
};

class FakeDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/memra-kvctl-XXXXXX";  // short: Unix socket paths are < 108 bytes
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/kvd.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }

  void TearDown() override {
    server_->Shutdown();
    for (const std::string& path : created_) unlink(path.c_str());
    unlink(socket_.c_str());
    rmdir(dir_.c_str());
  }

  // RunKvctl with --socket= this fake's socket after `args`.
  Outcome Kvctl(std::vector<std::string> args) {
    args.push_back("--socket=" + socket_);
    return RunCli(args);
  }

  std::string WriteFile(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    FILE* file = fopen(path.c_str(), "w");
    EXPECT_NE(file, nullptr) << path;
    if (file != nullptr) {
      fputs(text.c_str(), file);
      fclose(file);
    }
    created_.push_back(path);
    return path;
  }

  FakeState State() {
    FakeState copy;
    fake_.With([&](FakeState& state) { copy = state; });
    return copy;
  }

  std::string dir_;
  std::string socket_;
  std::vector<std::string> created_;
  FakeAdmin fake_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(FakeDaemonTest, EachCommandPrintsItsRenderedAnswerOrItsJson) {
  fake_.With([](FakeState& state) {
    state.status = CannedStatus();
    *state.engines.add_engines() = Engine(1, "vllm-0", true);
    state.cost = CannedCost();
    state.imported = CannedImport();
    state.drained.set_sessions_open(2);
  });
  const FakeState state = State();

  Outcome status = Kvctl({"status"});
  EXPECT_EQ(status.exit_code, kExitOk) << status.err;
  EXPECT_EQ(status.out, RenderStatus(state.status));
  EXPECT_EQ(status.err, "");
  status = Kvctl({"status", "--json"});
  EXPECT_EQ(status.exit_code, kExitOk) << status.err;
  EXPECT_EQ(status.out, *RenderJson(state.status) + "\n");

  EXPECT_EQ(Kvctl({"engines"}).out, RenderEngines(state.engines));
  EXPECT_EQ(Kvctl({"sessions"}).out, "no sessions\n");
  EXPECT_EQ(Kvctl({"cost", absl::StrCat("--model=", kTestFingerprintHex), "--context=32k"}).out,
            RenderCost(state.cost));
  const std::string config = WriteFile("config.json", "{}");
  EXPECT_EQ(Kvctl({"import-model", "--hf-config=" + config}).out, RenderImport(state.imported));

  const Outcome drain = Kvctl({"drain"});
  EXPECT_EQ(drain.exit_code, kExitOk);
  EXPECT_EQ(drain.out, RenderDrain(state.drained));
  const Outcome undrain = Kvctl({"undrain"});
  EXPECT_EQ(undrain.exit_code, kExitOk);
  EXPECT_EQ(undrain.out, "accepting new engines and sessions\n");
  EXPECT_EQ(State().drains, 1);
  EXPECT_EQ(State().undrains, 1);
}

TEST_F(FakeDaemonTest, FlagsBecomeTheRequest) {
  const std::string config_text = "{\"architectures\": [\"LlamaForCausalLM\"]}\n";
  const std::string config = WriteFile("config.json", config_text);
  ASSERT_EQ(Kvctl({"cost", "--hf-config=" + config, "--context=2k", "--layers=2:6", "--tp=4",
                   "--spec-snapshot"})
                .exit_code,
            kExitOk);
  const pb::CostRequest cost = State().cost_request;
  EXPECT_EQ(cost.model().hf_config_json(), config_text);
  EXPECT_EQ(cost.shape().capacity(), 2048u);
  EXPECT_EQ(cost.shape().layer_lo(), 2u);
  ASSERT_TRUE(cost.shape().has_layer_hi());
  EXPECT_EQ(cost.shape().layer_hi(), 6u);
  EXPECT_EQ(cost.shape().tp_ranks(), 4u);
  EXPECT_TRUE(cost.shape().spec_snapshot());

  const std::string plan =
      WriteFile("plan.json",
                "{\"name\": \"tiny\", \"layers\": [{\"index\": 0, \"kind\": \"STATE_KIND_KV\", "
                "\"head_dim_k\": 64, \"head_dim_v\": 64, \"n_head_kv\": 2}]}");
  fake_.With([](FakeState& state) { state.fit.set_sessions_now(1); });
  ASSERT_EQ(Kvctl({"fit", "--plan=" + plan, "--context=100"}).exit_code, kExitOk);
  const pb::FitRequest fit = State().fit_request;
  EXPECT_EQ(fit.model().plan().name(), "tiny");
  ASSERT_EQ(fit.model().plan().layers_size(), 1);
  EXPECT_EQ(fit.model().plan().layers(0).n_head_kv(), 2u);
  EXPECT_EQ(fit.shape().capacity(), 100u);
  EXPECT_FALSE(fit.shape().has_layer_hi());
  EXPECT_EQ(fit.shape().tp_ranks(), 0u);

  fake_.With([](FakeState& state) { state.max_context.set_max_context_now(1); });
  ASSERT_EQ(Kvctl({"max-context", absl::StrCat("--model=", kTestFingerprintHex)}).exit_code,
            kExitOk);
  EXPECT_EQ(State().max_context_request.model().plan_fingerprint(), TestFingerprint());
  EXPECT_EQ(State().max_context_request.shape().capacity(), 0u);

  ASSERT_EQ(Kvctl({"import-model", "--hf-config=" + config, "--name=mine", "--index-pool=8",
                   "--index-ring-rows=0", "--swa-ring", "--kv-dtype=fp8_e4m3", "--register"})
                .exit_code,
            kExitOk);
  const pb::ImportModelRequest import = State().import_request;
  EXPECT_EQ(import.hf_config_json(), config_text);
  EXPECT_EQ(import.name(), "mine");
  EXPECT_EQ(import.index_pool(), 8u);
  ASSERT_TRUE(import.has_index_ring_rows());
  EXPECT_EQ(import.index_ring_rows(), 0u);
  EXPECT_TRUE(import.swa_ring());
  EXPECT_EQ(import.kv_dtype(), "fp8_e4m3");
  EXPECT_TRUE(import.register_());

  ASSERT_EQ(Kvctl({"sessions", "--engine=5"}).exit_code, kExitOk);
  EXPECT_EQ(State().sessions_request.engine_id(), 5u);
}

TEST_F(FakeDaemonTest, NothingFitsNowExitsFiveAndStillPrintsTheAnswer) {
  fake_.With([](FakeState& state) {
    state.fit.set_sessions_now(0);
    state.fit.set_sessions_when_empty(2);
    state.max_context.set_max_context_now(0);
    state.max_context.set_max_context_when_empty(4096);
  });
  const FakeState state = State();
  const std::vector<std::string> model = {absl::StrCat("--model=", kTestFingerprintHex)};
  Outcome fit = Kvctl({"fit", model[0], "--context=8k"});
  EXPECT_EQ(fit.exit_code, kExitFitsNothing);
  EXPECT_EQ(fit.out, RenderFit(state.fit, 8192));
  fit = Kvctl({"fit", model[0], "--context=8k", "--json"});
  EXPECT_EQ(fit.exit_code, kExitFitsNothing);
  EXPECT_THAT(fit.out, HasSubstr("\"sessions_now\":\"0\""));
  const Outcome max = Kvctl({"max-context", model[0]});
  EXPECT_EQ(max.exit_code, kExitFitsNothing);
  EXPECT_EQ(max.out, RenderMaxContext(state.max_context));

  fake_.With([](FakeState& state) { state.fit.set_sessions_now(1); });
  EXPECT_EQ(Kvctl({"fit", model[0], "--context=8k"}).exit_code, kExitOk);
}

TEST_F(FakeDaemonTest, RefusalsExitFourWithCodeMessageAndAdmissionNumbers) {
  fake_.With([](FakeState& state) {
    state.refusal = grpc::Status(grpc::StatusCode::NOT_FOUND, "no registered plan 000102..");
  });
  Outcome refused = Kvctl({"cost", absl::StrCat("--model=", kTestFingerprintHex), "--context=1"});
  EXPECT_EQ(refused.exit_code, kExitRefused);
  EXPECT_EQ(refused.err,
            "memra-kvctl: memra-kvd refused GetCost: NOT_FOUND: no registered plan "
            "000102..\n");
  EXPECT_EQ(refused.out, "");

  pb::StatusDetails details;
  pb::AdmissionRefusal& numbers = *details.mutable_admission_refusal();
  numbers.set_needed_bytes(uint64_t{3} << 30);
  numbers.set_free_bytes(uint64_t{1} << 30);
  numbers.set_evictable_bytes(uint64_t{2} << 30);
  numbers.set_budget_bytes(uint64_t{8} << 30);
  numbers.set_bytes_to_evict(uint64_t{2} << 30);
  fake_.With([&](FakeState& state) {
    state.refusal = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "no room: needed 3 GiB",
                                 details.SerializeAsString());
  });
  refused = Kvctl({"status"});
  EXPECT_EQ(refused.exit_code, kExitRefused);
  EXPECT_EQ(refused.err,
            "memra-kvctl: memra-kvd refused GetStatus: RESOURCE_EXHAUSTED: no room: needed 3 GiB\n"
            "  needed     3.00 GiB (3221225472 B)\n"
            "  free       1.00 GiB (1073741824 B)\n"
            "  evictable  2.00 GiB (2147483648 B)\n"
            "  budget     8.00 GiB (8589934592 B)\n"
            "  to evict   2.00 GiB (2147483648 B)\n");

  numbers.set_bytes_to_evict(0);
  fake_.With([&](FakeState& state) {
    state.refusal =
        grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "no room", details.SerializeAsString());
  });
  EXPECT_THAT(
      Kvctl({"engines"}).err,
      HasSubstr("  to evict   0 B (it does not fit even after evicting the prefix cache)\n"));

  // Details that are not a StatusDetails are ignored, not misread.
  fake_.With([](FakeState& state) {
    state.refusal = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "odd", "\xff\xff");
  });
  EXPECT_EQ(Kvctl({"engines"}).err,
            "memra-kvctl: memra-kvd refused ListEngines: RESOURCE_EXHAUSTED: odd\n");
}

TEST_F(FakeDaemonTest, UnavailableAnswerIsUnreachable) {
  fake_.With([](FakeState& state) {
    state.refusal = grpc::Status(grpc::StatusCode::UNAVAILABLE, "shutting down");
  });
  const Outcome outcome = Kvctl({"status"});
  EXPECT_EQ(outcome.exit_code, kExitUnreachable);
  EXPECT_EQ(outcome.err,
            absl::StrCat("memra-kvctl: memra-kvd on ", socket_,
                         " did not answer GetStatus: UNAVAILABLE: shutting down\n"
                         "  is the daemon running? systemctl status memra-kvd@<gpu>\n"));
}

// A socket path with something at it that is not a daemon: fails fast (no waiting for the
// deadline) with the reason connect(2) gave.
TEST_F(FakeDaemonTest, UnreachableSocketsExitThreeNamingSocketAndUnit) {
  const std::string missing = dir_ + "/missing.sock";
  Outcome outcome = RunCli({"status", "--socket=" + missing});
  EXPECT_EQ(outcome.exit_code, kExitUnreachable);
  EXPECT_EQ(
      outcome.err,
      absl::StrCat("memra-kvctl: cannot reach memra-kvd at unix:", missing, ": connect ", missing,
                   ": No such file or directory (errno 2)\n"
                   "  is the daemon running? systemctl status memra-kvd@<gpu>\n"));
  EXPECT_EQ(outcome.out, "");

  // The default socket layout names the systemd unit of that GPU.
  outcome = RunCli({"engines", "--gpu=977"});
  EXPECT_EQ(outcome.exit_code, kExitUnreachable);
  EXPECT_THAT(outcome.err,
              HasSubstrs("unix:/run/memra-kv/gpu977.admin.sock", "systemctl status memra-kvd@977\n"));

  // A stale socket file: bound, nobody listening.
  const std::string stale = dir_ + "/stale.sock";
  created_.push_back(stale);
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  stale.copy(address.sun_path, stale.size());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  outcome = RunCli({"status", "--socket=" + stale});
  EXPECT_EQ(outcome.exit_code, kExitUnreachable);
  EXPECT_THAT(outcome.err,
              HasSubstr(absl::StrCat(": connect ", stale, ": Connection refused (errno 111)\n")));

  // Listening but never speaking gRPC: the --timeout deadline ends the wait.
  ASSERT_EQ(listen(fd, 1), 0);
  outcome = RunCli({"status", "--socket=" + stale, "--timeout=0.3"});
  EXPECT_EQ(outcome.exit_code, kExitUnreachable);
  EXPECT_THAT(outcome.err, HasSubstr(absl::StrCat("cannot reach memra-kvd at unix:", stale,
                                                  ": no gRPC connection within 300ms\n")));
  close(fd);
}

// ---- groups (docs/groups.md#memra-kvctl) ---------------------------------------------------

TEST(ParseArgsTest, SeveralSocketsOrAGroupFileMakeAGroup) {
  absl::StatusOr<Invocation> listed = ParseArgs({"fit", "--socket=/a,/b,/c,/d", "--tp=2", "--pp=2",
                                                 "--stage-layers=10,22", "--plan=/p.json",
                                                 "--context=1k"});
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->IsGroup());
  EXPECT_THAT(listed->group_sockets, ::testing::ElementsAre("/a", "/b", "/c", "/d"));
  EXPECT_EQ(listed->socket_path, "/a");
  EXPECT_EQ(listed->tp_ranks, 2u);
  EXPECT_EQ(listed->pp, 2u);
  EXPECT_THAT(listed->stage_layers, ::testing::ElementsAre(10, 22));

  absl::StatusOr<Invocation> one = ParseArgs({"status", "--socket=/a"});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_FALSE(one->IsGroup());

  absl::StatusOr<Invocation> filed = ParseArgs({"status", "--group=/etc/g.group"});
  ASSERT_TRUE(filed.ok()) << filed.status();
  EXPECT_TRUE(filed->IsGroup());
  EXPECT_EQ(filed->group_path, "/etc/g.group");
}

TEST(UsageErrorTest, GroupFlagsThatDoNotGoTogether) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> refusals = {
      {{"cost", "--socket=/a,/b", "--plan=p", "--context=1"},
       "cost answers for one daemon: several --socket paths are for status, fit and max-context"},
      {{"status", "--socket=/a,,/b"}, "--socket=/a,,/b: an empty path in the list"},
      {{"fit", "--socket=/a", "--pp=2", "--plan=p", "--context=1"},
       "--pp lays out a group: give --socket=A,B,... (or --group=FILE, which sets it)"},
      {{"fit", "--stage-layers=1,2", "--plan=p", "--context=1"},
       "--stage-layers lays out a group"},
      {{"fit", "--group=g", "--tp=2", "--plan=p", "--context=1"},
       "--group=g names every rank's daemon, tp, pp and stage layers: it does not take --tp"},
      {{"status", "--group=g", "--socket=/a"}, "--group=g names every rank's daemon"},
      {{"fit", "--socket=/a,/b", "--layers=0:4", "--plan=p", "--context=1"},
       "with a group the layout gives every rank its layers: --stage-layers=N,N,... instead of "
       "--layers"},
      {{"max-context", "--socket=/a,/b", "--model=" + std::string(kTestFingerprintHex)},
       "a group's layout needs the plan's layers, which --model leaves in the daemon: give "
       "--hf-config=PATH or --plan=PATH"},
      {{"fit", "--socket=/a,/b", "--pp=0", "--plan=p", "--context=1"},
       "--pp=0: want a whole number in 1..1024"},
      {{"fit", "--socket=/a,/b", "--stage-layers=3,x", "--plan=p", "--context=1"},
       "--stage-layers=x: want a whole number in 1..4294967295"},
      {{"status", "--group=/nonexistent/g.group"},
       "group file /nonexistent/g.group: No such file or directory"},
  };
  for (const auto& [args, message] : refusals) {
    const Outcome outcome = RunCli(args);
    const std::string joined = absl::StrJoin(args, " ");
    EXPECT_EQ(outcome.exit_code, kExitUsage) << joined << ": " << outcome.err;
    EXPECT_THAT(outcome.err, StartsWith(absl::StrCat("memra-kvctl: ", message))) << joined;
    EXPECT_EQ(outcome.out, "") << joined;
  }
  // Three sockets cannot be tp x pp 2: the list's own refusal, with the numbers.
  const Outcome odd = RunCli({"fit", "--socket=/a,/b,/c", "--pp=2", "--plan=p", "--context=1"});
  EXPECT_EQ(odd.exit_code, kExitUsage);
  EXPECT_THAT(odd.err, StartsWith("memra-kvctl: --socket: 3 sockets for tp 1 x pp 2 = 2 ranks"));
  const Outcome shared = RunCli({"status", "--socket=/a,/a"});
  EXPECT_EQ(shared.exit_code, kExitUsage);
  EXPECT_THAT(shared.err, HasSubstr("--socket entry 1: socket /a of rank 1 is rank 0's too"));
}

GroupView TwoByTwo(bool with_shard) {
  GroupView view{"g", 2, 2, {}};
  for (uint32_t rank = 0; rank < 4; ++rank) {
    GroupRankRow row;
    row.rank = rank;
    row.socket = absl::StrCat("/run/memra-kv/gpu", rank, ".sock");
    row.stage = rank / 2;
    row.tp_rank = rank % 2;
    row.has_shard = with_shard;
    row.layer_lo = row.stage * 16;
    row.layer_hi = row.layer_lo + 16;
    row.kv_shard = row.tp_rank;
    row.kv_shards = 2;
    view.ranks.push_back(row);
  }
  return view;
}

TEST(RenderTest, GroupStatusShowsEveryRankAndTheLeastFree) {
  std::vector<pb::GetStatusResponse> ranks(4);
  const uint64_t free[] = {400, 300, 100, 300};
  for (size_t i = 0; i < 4; ++i) {
    ranks[i].mutable_admission()->set_budget_bytes(1000);
    ranks[i].mutable_admission()->set_free_bytes(free[i]);
    ranks[i].mutable_admission()->set_allocated_bytes(1000 - free[i]);
    ranks[i].set_sessions(i);
  }
  ranks[3].set_draining(true);
  std::vector<std::optional<pb::ListGroupRanksResponse>> reservations(4);
  reservations[0].emplace();
  pb::GroupRankState* pending = reservations[0]->add_ranks();
  pending->set_phase(pb::GROUP_RANK_PHASE_PENDING);
  pending->set_bytes(100);
  pb::GroupRankState* confirmed = reservations[0]->add_ranks();
  confirmed->set_phase(pb::GROUP_RANK_PHASE_CONFIRMED);
  confirmed->set_bytes(200);
  reservations[1].emplace();  // listed, none held; ranks 2 and 3 not listed (engine socket)
  const std::string text = RenderGroupStatus(TwoByTwo(false), ranks, reservations);
  EXPECT_THAT(text, StartsWith("group g: tp 2 x pp 2 = 4 ranks\n\n"
                               "RANK  STAGE  TP  STATE     BUDGET  ALLOCATED  RESERVED  FREE  "
                               "EVICTABLE  SESSIONS  ENGINES  GROUP RESERVATIONS"));
  EXPECT_THAT(text, HasSubstr("   0      0   0  serving     1000        600         0   400  "
                              "        0         0        0  1 pending (100 B), 1 confirmed "
                              "(200 B)  /run/memra-kv/gpu0.sock\n"));
  EXPECT_THAT(text, HasSubstr("        0         1        0  none"));
  EXPECT_THAT(text, HasSubstr("   3      1   1  draining    1000        700         0   300"));
  EXPECT_THAT(text, ::testing::ContainsRegex("  -  +/run/memra-kv/gpu3.sock\n"));
  EXPECT_THAT(text, HasSubstr("least free       100 (rank 2) B: a group request fits only "
                              "where every rank's shard fits on its own daemon\n"));
  EXPECT_THAT(text, HasSubstr("state            DRAINING on 1 rank(s): the group admits nothing "
                              "new\n"));
}

TEST(RenderTest, GroupFitAndMaxContextNameTheRankThatDecides) {
  std::vector<pb::FitResponse> fits(4);
  const uint64_t now[] = {5, 3, 3, 9};
  for (size_t i = 0; i < 4; ++i) {
    fits[i].set_session_bytes(1000 + i);
    fits[i].set_free_bytes(5000);
    fits[i].set_sessions_now(now[i]);
    fits[i].set_sessions_after_eviction(10 - i);
    fits[i].set_sessions_when_empty(20);
    fits[i].set_total_tokens_now(now[i] * 1024);
    fits[i].set_total_tokens_when_empty(20 * 1024);
  }
  const std::string fit = RenderGroupFit(TwoByTwo(true), fits, 1024);
  EXPECT_THAT(fit, HasSubstr("session of 1024 tokens on every rank (bytes of each rank's "
                             "shard)\n\n"
                             "RANK  STAGE  TP  LAYERS  HEADS  SESSION  FREE  NOW  AFTER EVICTION  "
                             "WHEN EMPTY  SOCKET\n"
                             "   0      0   0  0-15    1/2       1000  5000    5              10  "
                             "        20  /run/memra-kv/gpu0.sock\n"));
  EXPECT_THAT(fit, HasSubstr("   3      1   1  16-31   2/2       1003  5000    9               7"));
  EXPECT_THAT(fit, HasSubstr("sessions         3 (rank 1)      7 (rank 3)     20 (rank 0)\n"
                             "total tokens  3072 (rank 1)               -  20480 (rank 0)\n"));

  std::vector<pb::MaxContextResponse> maxes(4);
  const uint64_t tokens[] = {8191, 10239, 4095, 14335};
  for (size_t i = 0; i < 4; ++i) {
    maxes[i].set_max_context_now(tokens[i]);
    maxes[i].set_max_context_after_eviction(tokens[i]);
    maxes[i].set_max_context_when_empty(tokens[i] + 1);
  }
  EXPECT_THAT(RenderGroupMaxContext(TwoByTwo(true), maxes),
              HasSubstr("max context  4095 (rank 2)   4095 (rank 2)  4096 (rank 2)\n"));
}

TEST(RenderTest, GroupJsonCarriesEveryRanksAnswer) {
  std::vector<pb::MaxContextResponse> maxes(4);
  std::vector<const google::protobuf::Message*> answers;
  for (size_t i = 0; i < 4; ++i) {
    maxes[i].set_max_context_now(100 + i);
    answers.push_back(&maxes[i]);
  }
  GroupView view = TwoByTwo(true);
  view.ranks[1].socket = "/odd \"path\"";
  absl::StatusOr<std::string> json = RenderGroupJson(view, answers);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_THAT(*json, StartsWith("{\"group\":\"g\",\"tp\":2,\"pp\":2,\"ranks\":[{\"rank\":0,"
                                "\"socket\":\"/run/memra-kv/gpu0.sock\",\"stage\":0,\"tp_rank\":0,"
                                "\"layer_lo\":0,\"layer_hi\":16,\"kv_shard\":0,\"kv_shards\":2,"
                                "\"answer\":{\"max_context_now\":\"100\""));
  EXPECT_THAT(*json, HasSubstr("\"socket\":\"/odd \\\"path\\\"\""));
  EXPECT_THAT(*json, HasSubstr("\"max_context_now\":\"103\""));
}


}  // namespace
}  // namespace memra::kvctl
