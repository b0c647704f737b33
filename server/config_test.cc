#include "server/config.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kMiB = uint64_t{1} << 20;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Parses one line of config text as gpu0.conf.
absl::StatusOr<DaemonConfig> ParseLine(const std::string& line) {
  return ParseConfig(line + "\n", "gpu0.conf");
}

TEST(ConfigTest, KeyListIsTheDocumentedOne) {
  std::vector<std::string> names, reloadable;
  for (const ConfigKeyInfo& key : ConfigKeys()) {
    names.emplace_back(key.name);
    if (key.reloadable) reloadable.emplace_back(key.name);
  }
  EXPECT_THAT(names,
              ElementsAre("backend", "device", "socket_path", "socket_mode", "socket_group",
                          "budget_bytes", "cuda_memory_fraction",
                          "cuda_reserve_bytes", "cuda_export", "lease_timeout_ms", "lease_grace_ms",
                          "reservation_ttl_ms", "log_level", "metrics_address", "rpc_metrics",
                          "drain_grace_ms",
                          "prefix_cache_budget_bytes", "prefix_block_tokens",
                          "prefix_capture_on_engine_death", "prefix_verify_checksums",
                          "prefix_copy_threads", "prefix_slab_bytes",
                          "prefix_remote_redis_nodes", "prefix_remote_redis_user",
                          "prefix_remote_redis_password_file", "prefix_remote_redis_tls",
                          "prefix_remote_redis_connect_timeout_ms",
                          "prefix_remote_redis_timeout_ms", "prefix_remote_queue_bytes",
                          "prefix_remote_lookup_timeout_ms", "prefix_remote_fetch_timeout_ms",
                          "prefix_remote_ttl_s", "prefix_disk_dir", "prefix_disk_bytes",
                          "prefix_host_tier_bytes", "prefix_host_tier_memory",
                          "watchdog", "keep_kv_across_restarts", "step_channel",
                          "max_plan_layers",
                          "max_engine_sessions", "max_engine_plans", "max_engine_budget_share",
                          "max_attached_engines", "max_engine_event_streams", "max_event_streams",
                          "max_connections", "max_connections_per_uid", "connection_idle_timeout_ms",
                          "arena_pool_engine_bytes", "block_store_engine_bytes",
                          "block_store_max_registrations", "block_store_max_pins",
                          "block_store_max_offers", "block_store_max_mapped_buffers", "max_arenas",
                          "max_engine_arenas", "max_engine_cpu_percent",
                          "admin_socket_path", "admin_socket_mode", "admin_socket_group",
                          "handoff_socket_path", "cache_scope_allow"));
  EXPECT_THAT(reloadable, ElementsAre("budget_bytes", "cuda_memory_fraction", "cuda_reserve_bytes",
                                      "lease_timeout_ms", "reservation_ttl_ms", "log_level",
                                      "drain_grace_ms"));
}

TEST(ConfigTest, CudaExportModes) {
  EXPECT_EQ(DaemonConfig().cuda_export, CudaExport::kIpc);
  absl::StatusOr<DaemonConfig> vmm = ParseLine("cuda_export = \"vmm\"");
  ASSERT_TRUE(vmm.ok()) << vmm.status();
  EXPECT_EQ(vmm->cuda_export, CudaExport::kVmm);
  EXPECT_EQ(CudaExportName(CudaExport::kVmm), "vmm");
}

TEST(ConfigTest, Defaults) {
  DaemonConfig config;
  EXPECT_EQ(config.backend, Backend::kHost);
  EXPECT_EQ(config.device, 0u);
  EXPECT_EQ(config.SocketPath(), "/run/memra-kv/gpu0.sock");
  EXPECT_EQ(config.sockets.socket_mode, 0660u);
  EXPECT_EQ(config.admission.budget_bytes, 8 * kGiB);
  EXPECT_EQ(config.admission.cuda_memory_fraction, 0.9);
  EXPECT_EQ(config.admission.cuda_reserve_bytes, kGiB);
  EXPECT_EQ(config.leases.timeout, absl::Milliseconds(10000));
  EXPECT_EQ(config.leases.grace, absl::Milliseconds(2000));
  EXPECT_EQ(config.leases.reservation_ttl, absl::Milliseconds(30000));
  EXPECT_EQ(config.log_level, LogLevel::kInfo);
  EXPECT_EQ(config.metrics.metrics_address, "127.0.0.1:9464");
  EXPECT_FALSE(config.metrics.rpc_metrics);
  EXPECT_EQ(config.drain_grace_ms, 30000u);
  EXPECT_EQ(config.prefix.budget_bytes, 0u);
  EXPECT_EQ(config.prefix.block_tokens, 256u);
  EXPECT_TRUE(config.sessions.prefix_capture_on_engine_death);
  EXPECT_TRUE(config.prefix.verify_checksums);
  EXPECT_EQ(config.prefix.copy_threads, 4u);
  EXPECT_EQ(config.prefix.slab_bytes, uint64_t{128} << 20);
  EXPECT_TRUE(config.prefix_remote.cluster.seed_nodes.empty());
  EXPECT_EQ(config.prefix_remote.cluster.user, "");
  EXPECT_EQ(config.prefix_remote.cluster.password_file, "");
  EXPECT_FALSE(config.prefix_remote.cluster.tls);
  EXPECT_EQ(config.prefix_remote.cluster.connect_timeout, absl::Milliseconds(200));
  EXPECT_EQ(config.prefix_remote.cluster.command_timeout, absl::Milliseconds(500));
  EXPECT_EQ(config.prefix_remote.queue_bytes, uint64_t{256} << 20);
  EXPECT_EQ(config.prefix.remote_lookup_timeout, absl::Milliseconds(20));
  EXPECT_EQ(config.prefix.remote_fetch_timeout, absl::Milliseconds(2000));
  EXPECT_EQ(config.prefix_remote.ttl, absl::Seconds(0));
  EXPECT_EQ(config.prefix.disk_dir, "");
  EXPECT_EQ(config.prefix.disk_bytes, 0u);
  EXPECT_EQ(config.prefix.host_tier_bytes, 0u);
  EXPECT_EQ(config.prefix_host_tier_memory, PrefixHostMemory::kPinned);
  EXPECT_TRUE(config.watchdog);
  EXPECT_EQ(config.sessions.max_plan_layers, 4096u);
  EXPECT_EQ(config.sessions.max_engine_sessions, 4096u);
  EXPECT_EQ(config.sessions.max_engine_plans, 64u);
  EXPECT_EQ(config.admission.max_engine_budget_share, 100u);
  EXPECT_EQ(config.leases.max_engines, 256u);
  EXPECT_EQ(config.sockets.max_engine_event_streams, 4u);
  EXPECT_EQ(config.sockets.max_event_streams, 64u);
  EXPECT_EQ(config.connections.max_connections, 512u);
  EXPECT_EQ(config.connections.max_connections_per_uid, 256u);
  EXPECT_EQ(config.sockets.connection_idle_timeout_ms, 300'000u);
  EXPECT_EQ(config.admission.max_arenas, 0u);
  EXPECT_EQ(config.admission.max_engine_arenas, 0u);
  EXPECT_EQ(config.admission.max_engine_cpu_percent, 100u);
  EXPECT_EQ(config.AdminSocketPath(), "/run/memra-kv/gpu0.admin.sock");
  EXPECT_EQ(config.sockets.admin_socket_mode, 0600u);
  EXPECT_EQ(config.sockets.admin_socket_group, "");
  EXPECT_EQ(config.HandoffSocketPath(), "/run/memra-kv/gpu0.handoff.sock");
  EXPECT_THAT(ValidateConfig(config), IsOk());
}

TEST(ConfigTest, AdminSocketIsBesideTheEngineSocketUnlessGiven) {
  DaemonConfig config;
  config.device = 3;
  config.sockets.socket_path = "/tmp/kvd.sock";
  EXPECT_EQ(config.AdminSocketPath(), "/tmp/kvd.admin.sock");
  config.sockets.socket_path = "/tmp/engines-{device}";  // no ".sock" to replace: appended
  EXPECT_EQ(config.AdminSocketPath(), "/tmp/engines-3.admin.sock");
  config.sockets.admin_socket_path = "/run/ops/gpu{device}.sock";
  EXPECT_EQ(config.AdminSocketPath(), "/run/ops/gpu3.sock");
}

TEST(ConfigTest, HandoffSocketIsBesideTheEngineSocketUnlessGiven) {
  DaemonConfig config;
  config.device = 3;
  config.sockets.socket_path = "/tmp/kvd.sock";
  EXPECT_EQ(config.HandoffSocketPath(), "/tmp/kvd.handoff.sock");
  config.sockets.handoff_socket_path = "/run/fds/gpu{device}.sock";
  EXPECT_EQ(config.HandoffSocketPath(), "/run/fds/gpu3.sock");
}

TEST(ConfigTest, ValidateRefusesHandoffSocketThatIsAnotherSocketOrTooLong) {
  DaemonConfig config;
  config.sockets.handoff_socket_path = "/run/memra-kv/gpu{device}.sock";
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("handoff_socket_path and socket_path are both",
                                  "/run/memra-kv/gpu0.sock", "separate sockets")));
  config.sockets.handoff_socket_path = "/run/memra-kv/gpu{device}.admin.sock";
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("admin_socket_path and handoff_socket_path are both",
                                  "/run/memra-kv/gpu0.admin.sock")));
  config.sockets.handoff_socket_path = "/run/" + std::string(103, 'x');  // 108 bytes
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("the handoff socket", "is 108 bytes", "at most 107")));
}

TEST(ConfigTest, ValidateRefusesAdminSocketThatIsTheEngineSocketOrTooLong) {
  DaemonConfig config;
  config.sockets.admin_socket_path = "/run/memra-kv/gpu{device}.sock";
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("admin_socket_path and socket_path are both",
                                  "/run/memra-kv/gpu0.sock", "separate sockets")));
  config.sockets.admin_socket_path = "/run/" + std::string(103, 'x');  // 108 bytes
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("the admin socket", "is 108 bytes", "at most 107")));
  EXPECT_THAT(ParseConfig("admin_socket_path = \"relative.sock\"\n", "gpu0.conf"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("admin_socket_path", "not an absolute path")));
}

TEST(ConfigTest, EmptyTextGivesDefaults) {
  absl::StatusOr<DaemonConfig> config = ParseConfig("", "gpu0.conf");
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(*config, DaemonConfig{});
}

TEST(ConfigTest, RenderedDefaultsParseBackToDefaults) {
  absl::StatusOr<DaemonConfig> config = ParseConfig(RenderConfig(DaemonConfig{}), "rendered");
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(*config, DaemonConfig{});
}

TEST(ConfigTest, RenderedNonDefaultsParseBack) {
  DaemonConfig changed;
  changed.backend = Backend::kCuda;
  changed.device = 7;
  changed.sockets.socket_path = "/run/x \"quoted\\\" {device}.sock";
  changed.sockets.socket_mode = 0;
  changed.sockets.socket_group = "engines";
  changed.admission.budget_bytes = 3 * kMiB + 1;  // not a whole unit: rendered as plain bytes
  changed.admission.cuda_memory_fraction = 0.1 + 0.2;
  changed.admission.cuda_reserve_bytes = 0;
  changed.leases.timeout = absl::Milliseconds(100);
  changed.leases.grace = absl::Milliseconds(0);
  changed.leases.reservation_ttl = absl::Milliseconds(86'400'000);
  changed.log_level = LogLevel::kOff;
  changed.metrics.metrics_address = "";
  changed.drain_grace_ms = 0;
  changed.prefix.budget_bytes = 512 * kMiB;
  changed.prefix.block_tokens = 1;
  changed.sessions.prefix_capture_on_engine_death = false;
  changed.prefix.verify_checksums = false;
  changed.prefix_remote.cluster.seed_nodes = {{"10.0.0.1", 7000}, {"::1", 7001}};
  changed.prefix_remote.cluster.user = "memra-tier";
  changed.prefix_remote.cluster.password_file = "/etc/memra-kv/redis.pass";
  changed.prefix_remote.cluster.tls = true;
  changed.prefix_remote.cluster.connect_timeout = absl::Milliseconds(1);
  changed.prefix_remote.cluster.command_timeout = absl::Milliseconds(60'000);
  changed.prefix_remote.queue_bytes = 64 * kMiB;
  changed.prefix.remote_lookup_timeout = absl::Milliseconds(50);
  changed.prefix.remote_fetch_timeout = absl::Milliseconds(10'000);
  changed.prefix_remote.ttl = absl::Seconds(86'400);
  changed.prefix.disk_dir = "/var/cache/memra-kv/gpu7";
  changed.prefix.disk_bytes = 64 * kGiB;
  changed.prefix.host_tier_bytes = 96 * kGiB;
  changed.prefix_host_tier_memory = PrefixHostMemory::kPlain;
  changed.watchdog = false;
  changed.sockets.admin_socket_path = "/run/ops/{device}.sock";
  changed.sockets.admin_socket_mode = 0660;
  changed.sockets.admin_socket_group = "operators";
  changed.sockets.handoff_socket_path = "/run/fds/{device}.sock";
  changed.cache_scope_allow = "team:1001,@ml; drafts:@inference";
  absl::StatusOr<DaemonConfig> config = ParseConfig(RenderConfig(changed), "rendered");
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(*config, changed);
}

// deploy/memra-kv.conf.example must be exactly the rendered defaults, so it never drifts from the
// code. Regenerate: bazel run //deploy:render_config_example > deploy/memra-kv.conf.example
TEST(ConfigTest, ExampleFileIsRenderedDefaults) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  ASSERT_NE(srcdir, nullptr);
  std::string example = ReadFile(absl::StrCat(srcdir, "/memra_kv/deploy/memra-kv.conf.example"));
  EXPECT_EQ(example, RenderConfig(DaemonConfig{}))
      << "regenerate: bazel run //deploy:render_config_example > deploy/memra-kv.conf.example";
}

TEST(ConfigTest, ParsesEveryKindOfValue) {
  absl::StatusOr<DaemonConfig> config = ParseConfig(
      R"(backend = "cuda"
device = 3
socket_path = "/run/memra-kv/custom.sock"
socket_mode = "0600"
socket_group = "inference"
budget_bytes = "64GiB"
cuda_reserve_bytes = "512 MiB"
prefix_cache_budget_bytes = 1048576
cuda_memory_fraction = 1
log_level = "debug"
metrics_address = "[::1]:9100"
lease_timeout_ms = "20000"
watchdog = false
)",
      "gpu3.conf");
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->backend, Backend::kCuda);
  EXPECT_EQ(config->device, 3u);
  EXPECT_EQ(config->SocketPath(), "/run/memra-kv/custom.sock");
  EXPECT_EQ(config->sockets.socket_mode, 0600u);
  EXPECT_EQ(config->sockets.socket_group, "inference");
  EXPECT_EQ(config->admission.budget_bytes, 64 * kGiB);
  EXPECT_EQ(config->admission.cuda_reserve_bytes, 512 * kMiB);
  EXPECT_EQ(config->prefix.budget_bytes, kMiB);
  EXPECT_EQ(config->admission.cuda_memory_fraction, 1.0);
  EXPECT_EQ(config->log_level, LogLevel::kDebug);
  EXPECT_EQ(config->metrics.metrics_address, "[::1]:9100");
  EXPECT_EQ(config->leases.timeout, absl::Milliseconds(20000));
  EXPECT_FALSE(config->watchdog);
}

TEST(ConfigTest, UnknownKeyNamesKeyAndLineAndSuggests) {
  EXPECT_THAT(ParseConfig("device = 1\nbudget_byte = 1\n", "gpu0.conf"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("gpu0.conf:2", "unknown key \"budget_byte\"",
                                  "did you mean \"budget_bytes\"")));
}

TEST(ConfigTest, TablesAreUnknownKeys) {
  EXPECT_THAT(ParseConfig("[cuda]\nreserve = 1\n", "gpu0.conf"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("unknown key \"cuda\"")));
}

TEST(ConfigTest, SyntaxErrorNamesTheSource) {
  EXPECT_THAT(ParseConfig("device = \n", "gpu0.conf"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("cannot parse gpu0.conf", "gpu0.conf")));
  EXPECT_THAT(ParseConfig("device = 1\ndevice = 2\n", "gpu0.conf"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("already exists")));
}

// Each refusal names the file and line, the key, the value as written and what is accepted.
struct BadValueCase {
  std::string line;
  std::vector<std::string> expected;  // substrings of the message
};

class BadValueTest : public ::testing::TestWithParam<BadValueCase> {};

TEST_P(BadValueTest, RefusedWithKeyValueAndRange) {
  absl::StatusOr<DaemonConfig> config = ParseLine(GetParam().line);
  ASSERT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
  std::string message(config.status().message());
  EXPECT_THAT(message, ::testing::StartsWith("gpu0.conf:1: "));
  for (const std::string& part : GetParam().expected) {
    EXPECT_THAT(message, ::testing::HasSubstr(part));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Values, BadValueTest,
    ::testing::Values(
        BadValueCase{"lease_timeout_ms = 5",
                     {"lease_timeout_ms = 5", "out of range", "from 100 to 3600000"}},
        BadValueCase{"lease_timeout_ms = -1",
                     {"lease_timeout_ms = -1", "not a valid value", "from 100 to 3600000"}},
        BadValueCase{"lease_timeout_ms = \"10s\"",
                     {"lease_timeout_ms = \"10s\"", "not a valid value"}},
        BadValueCase{"device = 1024", {"device = 1024", "out of range", "from 0 to 1023"}},
        BadValueCase{"device = 1.5", {"device = 1.5", "not a valid value", "integer"}},
        BadValueCase{
            "budget_bytes = \"64GB\"",
            {"budget_bytes = \"64GB\"", "not a valid value", "from 1MiB to 1PiB", "KiB|MiB|GiB"}},
        BadValueCase{"budget_bytes = 1000", {"budget_bytes = 1000", "out of range", "1MiB"}},
        BadValueCase{"budget_bytes = \"99999999999PiB\"",
                     {"budget_bytes = \"99999999999PiB\"", "not a valid value"}},
        BadValueCase{"cuda_reserve_bytes = \"2TiB\"",
                     {"cuda_reserve_bytes = \"2TiB\"", "out of range", "from 0 to 1TiB"}},
        BadValueCase{
            "cuda_memory_fraction = 1.5",
            {"cuda_memory_fraction = 1.5", "out of range", "greater than 0 and at most 1"}},
        BadValueCase{"cuda_memory_fraction = 0",
                     {"cuda_memory_fraction = 0", "out of range", "greater than 0"}},
        BadValueCase{"cuda_memory_fraction = \"most\"",
                     {"cuda_memory_fraction = \"most\"", "not a number"}},
        BadValueCase{"cuda_memory_fraction = nan", {"cuda_memory_fraction = nan", "not a number"}},
        BadValueCase{"socket_mode = 0o660",
                     {"socket_mode = 432", "not a string", "\"0000\" to \"0777\""}},
        BadValueCase{"socket_mode = \"0668\"", {"socket_mode = \"0668\"", "not a valid mode"}},
        BadValueCase{"admin_socket_mode = \"1777\"",
                     {"admin_socket_mode = \"1777\"", "not a valid mode"}},
        BadValueCase{"watchdog = \"yes\"",
                     {"watchdog = \"yes\"", "not a boolean", "true or false"}},
        BadValueCase{"log_level = \"verbose\"",
                     {"log_level = \"verbose\"", "not a known value",
                      "one of trace, debug, info, warn, error, critical, off"}},
        BadValueCase{"backend = \"rocm\"",
                     {"backend = \"rocm\"", "not a known value", "one of host, cuda"}},
        BadValueCase{"backend = 1", {"backend = 1", "one of host, cuda"}},
        BadValueCase{"cuda_export = \"nvlink\"",
                     {"cuda_export = \"nvlink\"", "not a known value", "one of ipc, vmm"}},
        BadValueCase{"socket_path = \"memra.sock\"",
                     {"socket_path = \"memra.sock\"", "not an absolute path"}},
        BadValueCase{"socket_group = \"my group\"",
                     {"socket_group = \"my group\"", "contains ' '", "group name or gid"}},
        BadValueCase{"cache_scope_allow = \"team 1001\"",
                     {"cache_scope_allow = \"team 1001\"", "has no ':'", "uid or @group"}},
        BadValueCase{"admin_socket_group = \"-x\"",
                     {"admin_socket_group = \"-x\"", "starts with '-'"}},
        BadValueCase{"metrics_address = \"localhost\"",
                     {"metrics_address = \"localhost\"", "no \":port\"", "host:port"}},
        BadValueCase{"metrics_address = \"::1:9464\"",
                     {"metrics_address = \"::1:9464\"", "IPv6 host must be in brackets"}},
        BadValueCase{"metrics_address = \"127.0.0.1:70000\"",
                     {"metrics_address = \"127.0.0.1:70000\"", "port \"70000\" is not 1 to 65535"}},
        BadValueCase{"prefix_block_tokens = 0",
                     {"prefix_block_tokens = 0", "out of range", "from 1 to 65536"}},
        BadValueCase{"prefix_copy_threads = 0",
                     {"prefix_copy_threads = 0", "out of range", "from 1 to 256"}},
        BadValueCase{"prefix_slab_bytes = \"4KiB\"",
                     {"prefix_slab_bytes = \"4KiB\"", "out of range", "from 64KiB to 1TiB"}},
        BadValueCase{"prefix_remote_redis_nodes = \"redis-a\"",
                     {"prefix_remote_redis_nodes = \"redis-a\"", "'redis-a' has no port",
                      "host:port,..."}},
        BadValueCase{"prefix_remote_redis_nodes = \"a:1,b:0\"",
                     {"prefix_remote_redis_nodes = \"a:1,b:0\"", "'b:0'", "1..65535"}},
        BadValueCase{"prefix_remote_redis_user = \"two words\"",
                     {"prefix_remote_redis_user = \"two words\"", "contains a space"}},
        BadValueCase{"prefix_remote_redis_password_file = \"redis.pass\"",
                     {"prefix_remote_redis_password_file = \"redis.pass\"",
                      "not an absolute path"}},
        BadValueCase{"prefix_remote_redis_timeout_ms = 0",
                     {"prefix_remote_redis_timeout_ms = 0", "out of range", "from 1 to 60000"}},
        BadValueCase{"prefix_remote_redis_connect_timeout_ms = 60001",
                     {"prefix_remote_redis_connect_timeout_ms = 60001", "from 1 to 60000"}},
        BadValueCase{"prefix_disk_dir = \"cache\"",
                     {"prefix_disk_dir = \"cache\"", "not an absolute path"}},
        BadValueCase{"prefix_disk_bytes = \"65TiB\"",
                     {"prefix_disk_bytes = \"65TiB\"", "out of range", "from 0 to 64TiB"}},
        BadValueCase{"prefix_host_tier_bytes = \"65TiB\"",
                     {"prefix_host_tier_bytes = \"65TiB\"", "out of range", "from 0 to 64TiB"}},
        BadValueCase{"prefix_host_tier_memory = \"cuda\"",
                     {"prefix_host_tier_memory = \"cuda\"", "one of pinned, plain"}},
        BadValueCase{"rpc_metrics = 1", {"rpc_metrics = 1", "true or false"}},
        BadValueCase{"max_plan_layers = 16385",
                     {"max_plan_layers = 16385", "out of range", "from 1 to 16384"}},
        BadValueCase{"max_engine_sessions = 0",
                     {"max_engine_sessions = 0", "out of range", "from 1 to 10000000"}},
        BadValueCase{"max_engine_plans = 1025",
                     {"max_engine_plans = 1025", "out of range", "from 1 to 1024"}},
        BadValueCase{"max_engine_budget_share = 101",
                     {"max_engine_budget_share = 101", "out of range", "from 1 to 100"}},
        BadValueCase{"max_attached_engines = 0",
                     {"max_attached_engines = 0", "out of range", "from 1 to 65536"}},
        BadValueCase{"max_arenas = -1", {"max_arenas = -1", "from 0 to 100000000"}},
        BadValueCase{"max_engine_arenas = -1",
                     {"max_engine_arenas = -1", "from 0 to 100000000"}},
        BadValueCase{"max_engine_cpu_percent = 6401",
                     {"max_engine_cpu_percent = 6401", "from 0 to 6400"}},
        BadValueCase{"drain_grace_ms = [1, 2]",
                     {"drain_grace_ms is a TOML array", "from 0 to 3600000"}}));

TEST(ConfigTest, ReportsEveryErrorInLineOrder) {
  absl::Status status =
      ParseConfig("zzz = 1\ndevice = 5000\nlog_level = \"loud\"\n", "gpu0.conf").status();
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::string> lines = absl::StrSplit(std::string(status.message()), '\n');
  ASSERT_EQ(lines.size(), 3u) << status;
  EXPECT_THAT(lines[0], HasSubstrs("gpu0.conf:1", "unknown key \"zzz\""));
  EXPECT_THAT(lines[1], HasSubstrs("gpu0.conf:2", "device = 5000"));
  EXPECT_THAT(lines[2], HasSubstrs("gpu0.conf:3", "log_level = \"loud\""));
}

TEST(ConfigTest, OverridesUseTheSameKeysAndRules) {
  DaemonConfig config;
  EXPECT_THAT(ApplyOverride(config, "budget_bytes", "64GiB"), IsOk());
  EXPECT_THAT(ApplyOverride(config, "cuda_memory_fraction", "0.5"), IsOk());
  EXPECT_THAT(ApplyOverride(config, "socket_mode", "0640"), IsOk());
  EXPECT_THAT(ApplyOverride(config, "watchdog", "false"), IsOk());
  EXPECT_THAT(ApplyOverride(config, "log_level", "warn"), IsOk());
  EXPECT_THAT(ApplyOverride(config, "metrics_address", ""), IsOk());
  EXPECT_EQ(config.admission.budget_bytes, 64 * kGiB);
  EXPECT_EQ(config.admission.cuda_memory_fraction, 0.5);
  EXPECT_EQ(config.sockets.socket_mode, 0640u);
  EXPECT_FALSE(config.watchdog);
  EXPECT_EQ(config.log_level, LogLevel::kWarn);
  EXPECT_EQ(config.metrics.metrics_address, "");

  DaemonConfig before = config;
  EXPECT_THAT(ApplyOverride(config, "lease_timeout_ms", "5"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("--lease_timeout_ms=5", "out of range", "from 100 to 3600000")));
  EXPECT_THAT(ApplyOverride(config, "watchdog", "1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("--watchdog=1", "not a boolean", "true or false")));
  EXPECT_THAT(ApplyOverride(config, "lease_timout_ms", "500"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("--lease_timout_ms=500", "unknown key \"lease_timout_ms\"",
                                  "did you mean \"lease_timeout_ms\"")));
  EXPECT_EQ(config, before) << "a refused override changes nothing";
}

// Every key of the file is also an override with the same syntax: feeding each rendered
// `key = value` line (quotes removed, as a shell would) to ApplyOverride rebuilds the config.
TEST(ConfigTest, EveryRenderedKeyIsAnOverride) {
  DaemonConfig source;
  source.backend = Backend::kCuda;
  source.device = 2;
  source.admission.budget_bytes = 12 * kGiB;
  source.admission.cuda_memory_fraction = 0.75;
  source.log_level = LogLevel::kError;
  source.sockets.socket_mode = 0600;
  source.prefix.verify_checksums = false;
  DaemonConfig rebuilt = DaemonConfig{};
  rebuilt.watchdog = false;  // differs from `source`: proves the override wrote it
  int applied = 0;
  for (absl::string_view line : absl::StrSplit(RenderConfig(source), '\n')) {
    if (line.empty() || line[0] == '#') continue;
    std::pair<std::string, std::string> kv = absl::StrSplit(line, " = ");
    std::string value(absl::StripSuffix(absl::StripPrefix(kv.second, "\""), "\""));
    ASSERT_THAT(ApplyOverride(rebuilt, kv.first, value), IsOk()) << line;
    ++applied;
  }
  EXPECT_EQ(applied, static_cast<int>(ConfigKeys().size()));
  EXPECT_EQ(rebuilt, source);
}

TEST(ConfigTest, SplitConfigFlagsTakesKeysAndLeavesTheRest) {
  const char* argv[] = {"memra-kvd",  "--config=/etc/memra-kv/gpu1.conf",
                        "--device=1", "--budget_bytes",
                        "64GiB",      "-log_level=debug",
                        "--watchdog", "--help",
                        "--",         "--device=9"};
  absl::StatusOr<SplitFlags> split = SplitConfigFlags(std::size(argv), argv);
  ASSERT_THAT(split, IsOk());
  std::vector<std::string> overrides;
  for (const ConfigOverride& o : split->overrides) overrides.push_back(o.key + "=" + o.value);
  EXPECT_THAT(overrides,
              ElementsAre("device=1", "budget_bytes=64GiB", "log_level=debug", "watchdog=true"));
  EXPECT_THAT(split->rest, ElementsAre("memra-kvd", "--config=/etc/memra-kv/gpu1.conf", "--help",
                                       "--", "--device=9"));

  const char* missing[] = {"memra-kvd", "--drain_grace_ms"};
  EXPECT_THAT(SplitConfigFlags(std::size(missing), missing),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("--drain_grace_ms: no value", "from 0 to 3600000")));
}

TEST(ConfigTest, ValidateRefusesSocketPathTooLongForItsDevice) {
  DaemonConfig config;
  // 107 bytes for device 0.
  config.sockets.socket_path = "/run/" + std::string(95, 'x') + "/{device}.sock";
  config.sockets.admin_socket_path = "/run/admin.sock";
  config.sockets.handoff_socket_path = "/run/handoff.sock";
  EXPECT_THAT(ValidateConfig(config), IsOk());
  config.device = 100;
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("socket_path", "device = 100", "(109 bytes)", "at most 107")));
}

TEST(ConfigTest, ValidateRefusesPrefixBudgetAboveHostBudget) {
  DaemonConfig config;
  config.admission.budget_bytes = kGiB;
  config.prefix.budget_bytes = 2 * kGiB;
  EXPECT_THAT(ValidateConfig(config), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstrs("prefix_cache_budget_bytes = 2147483648",
                                                          "budget_bytes = 1073741824")));
  config.backend = Backend::kCuda;  // the CUDA budget is only known at start-up
  EXPECT_THAT(ValidateConfig(config), IsOk());
}

TEST(ConfigTest, ValidateRefusesRedisTlsAndAUserWithoutPassword) {
  DaemonConfig config;
  config.prefix_remote.cluster.tls = true;
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_remote_redis_tls = true", "hiredis 0.14", "no TLS",
                                  "hiredis_ssl", "hiredis 1.0")));
  config.prefix_remote.cluster.tls = false;
  config.prefix_remote.cluster.user = "memra-tier";
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_remote_redis_user = \"memra-tier\"",
                                  "needs prefix_remote_redis_password_file")));
  config.prefix_remote.cluster.password_file = "/etc/memra-kv/redis.pass";
  EXPECT_THAT(ValidateConfig(config), IsOk());
}

// The remote tier is a tier of the prefix cache: refused, not ignored, without one.
TEST(ConfigTest, ValidateRefusesRedisNodesWithoutAPrefixCache) {
  DaemonConfig config;
  config.prefix_remote.cluster.seed_nodes = {{"10.0.0.1", 7000}};
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_remote_redis_nodes = \"10.0.0.1:7000\"",
                                  "needs a prefix cache", "prefix_cache_budget_bytes is 0")));
  config.prefix.budget_bytes = 64 * kMiB;
  EXPECT_THAT(ValidateConfig(config), IsOk());
}

TEST(ConfigTest, ValidateRefusesAHalfConfiguredDiskTier) {
  DaemonConfig config;
  config.prefix.budget_bytes = kGiB;
  config.prefix.disk_dir = "/var/cache/memra-kv";
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_disk_dir = \"/var/cache/memra-kv\"",
                                  "prefix_disk_bytes = 0", "needs a directory, a byte budget")));
  config.prefix.disk_dir = "";
  config.prefix.disk_bytes = kGiB;
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_disk_dir = \"\"", "prefix_disk_bytes = 1073741824")));
  config.prefix.disk_dir = "/var/cache/memra-kv";
  config.prefix.budget_bytes = 0;
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_cache_budget_bytes = 0", "and a prefix cache")));
  config.prefix.budget_bytes = kGiB;
  EXPECT_THAT(ValidateConfig(config), IsOk());
}

// The host tier needs a prefix cache, and its pinned memory the cuda backend (the host
// backend's device tier already is host memory; "plain" runs the tier there on request).
TEST(ConfigTest, ValidateRefusesAHostTierItCannotServe) {
  DaemonConfig config;
  config.prefix.host_tier_bytes = 8 * kGiB;
  config.prefix_host_tier_memory = PrefixHostMemory::kPlain;
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_host_tier_bytes = 8589934592",
                                  "prefix_cache_budget_bytes is 0")));
  config.prefix.budget_bytes = kGiB;
  EXPECT_THAT(ValidateConfig(config), IsOk());
  config.prefix_host_tier_memory = PrefixHostMemory::kPinned;
  EXPECT_THAT(ValidateConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_host_tier_bytes = 8589934592",
                                  "prefix_host_tier_memory = pinned needs backend = cuda",
                                  "prefix_host_tier_memory = plain")));
  config.prefix.host_tier_bytes = 0;
  EXPECT_THAT(ValidateConfig(config), IsOk());
}

class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string templ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/config-XXXXXX");
    ASSERT_NE(mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  std::string dir_;
};

TEST_F(ConfigFileTest, FlagsOverrideTheFileAndValidateRunsLast) {
  std::string path = Write("gpu0.conf",
                           "device = 0\nbudget_bytes = \"1GiB\"\n"
                           "prefix_cache_budget_bytes = \"2GiB\"\n");
  // The file alone is inconsistent; the flag fixes it, so validation must come after flags.
  absl::StatusOr<DaemonConfig> config =
      LoadDaemonConfig(path, {{"device", "3"}, {"budget_bytes", "4GiB"}});
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->device, 3u);
  EXPECT_EQ(config->SocketPath(), "/run/memra-kv/gpu3.sock");
  EXPECT_EQ(config->admission.budget_bytes, 4 * kGiB);

  EXPECT_THAT(LoadDaemonConfig(path, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("prefix_cache_budget_bytes", "budget_bytes")));
  EXPECT_THAT(LoadDaemonConfig(path, {{"device", "x"}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("--device=x")));
}

TEST_F(ConfigFileTest, FileErrorsNameThePathAndLine) {
  std::string path = Write("gpu1.conf", "# comment\nwatchdog = 3\n");
  EXPECT_THAT(LoadConfigFile(path),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(path + ":2", "watchdog = 3", "true or false")));
}

TEST_F(ConfigFileTest, MissingFileIsNotFound) {
  std::string path = dir_ + "/absent.conf";
  EXPECT_THAT(LoadConfigFile(path),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("open config file", path)));
  EXPECT_THAT(LoadDaemonConfig("", {}), IsOk()) << "no file: defaults";
}

TEST_F(ConfigFileTest, ArenaLimitIsSetOrThreeQuartersOfMaxMapCount) {
  DaemonConfig config;
  EXPECT_EQ(EffectiveMaxArenas(config, Write("max_map_count", "262144\n")), 196'608u);
  EXPECT_EQ(EffectiveMaxArenas(config, dir_ + "/absent"), kDefaultMaxMapCount / 4 * 3);
  EXPECT_EQ(EffectiveMaxArenas(config, Write("garbage", "many\n")), kDefaultMaxMapCount / 4 * 3);
  config.admission.max_arenas = 10;
  EXPECT_EQ(EffectiveMaxArenas(config, Write("max_map_count", "262144\n")), 10u);
}

TEST(ConfigTest, EngineArenaLimitIsSetOrHalfTheArenaLimit) {
  DaemonConfig config;
  EXPECT_EQ(EffectiveMaxEngineArenas(config, 49'146), 24'573u);
  EXPECT_EQ(EffectiveMaxEngineArenas(config, 1), 1u);  // never 0: an engine gets an arena
  config.admission.max_engine_arenas = 10'000;
  EXPECT_EQ(EffectiveMaxEngineArenas(config, 49'146), 10'000u);
}

TEST(ConfigTest, PlanReloadAppliesLiveKeysAndListsTheRest) {
  DaemonConfig running;
  DaemonConfig reread = running;
  reread.log_level = LogLevel::kDebug;
  reread.admission.budget_bytes = 16 * kGiB;
  reread.drain_grace_ms = 5000;
  reread.sockets.socket_path = "/run/memra-kv/other.sock";
  reread.backend = Backend::kCuda;
  reread.prefix.block_tokens = 128;
  // The prefix cache's budget is fixed at start (its tiers are sized from it): a SIGHUP says so
  // rather than claiming to apply it.
  reread.prefix.budget_bytes = 64 * kMiB;

  ReloadOutcome outcome = PlanReload(running, reread);
  EXPECT_THAT(outcome.applied_keys, ElementsAre("budget_bytes", "log_level", "drain_grace_ms"));
  EXPECT_THAT(outcome.not_reloadable_keys,
              ElementsAre("backend", "socket_path", "prefix_cache_budget_bytes",
                          "prefix_block_tokens"));
  EXPECT_EQ(outcome.applied.prefix.budget_bytes, running.prefix.budget_bytes);
  EXPECT_EQ(outcome.applied.log_level, LogLevel::kDebug);
  EXPECT_EQ(outcome.applied.admission.budget_bytes, 16 * kGiB);
  EXPECT_EQ(outcome.applied.drain_grace_ms, 5000u);
  EXPECT_EQ(outcome.applied.sockets.socket_path, running.sockets.socket_path);
  EXPECT_EQ(outcome.applied.backend, Backend::kHost);
  EXPECT_EQ(outcome.applied.prefix.block_tokens, 256u);

  ReloadOutcome unchanged = PlanReload(running, running);
  EXPECT_THAT(unchanged.applied_keys, IsEmpty());
  EXPECT_THAT(unchanged.not_reloadable_keys, IsEmpty());
  EXPECT_EQ(unchanged.applied, running);
}

// The unit's RestartPreventExitStatus= must name the code the daemon exits with on a bad config.
TEST(ConfigTest, ConfigErrorExitCodeMatchesTheUnit) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  ASSERT_NE(srcdir, nullptr);
  std::string unit = ReadFile(absl::StrCat(srcdir, "/memra_kv/deploy/memra-kvd@.service"));
  EXPECT_THAT(unit, ::testing::HasSubstr(
                        absl::StrCat("\nRestartPreventExitStatus=", kConfigErrorExitCode, "\n")));
}

TEST(ConfigTest, Names) {
  EXPECT_EQ(BackendName(Backend::kCuda), "cuda");
  EXPECT_EQ(LogLevelName(LogLevel::kCritical), "critical");
}

}  // namespace
}  // namespace memra
