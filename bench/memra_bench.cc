// memra-kv benchmarks: the daemon's cost as ratios against baselines measured in the same run
// (bench/README.md). Prints a table per section and writes every number as JSON.
//
//   memra_bench --kvd=bazel-bin/server/memra-kvd --echo_server=bazel-bin/bench/echo_server
//               --json_out=bench/results/latest.json       (bench/run.sh does this)
//
// Exit status 0 when every section ran; 1 when one failed (its error is in the JSON, the other
// sections still ran).

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/mutex.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/sections.h"

ABSL_FLAG(std::string, kvd, "", "path of the memra-kvd binary (//server:memra-kvd)");
ABSL_FLAG(std::string, echo_server, "", "path of //bench:echo_server");
ABSL_FLAG(std::string, load_engine, "", "path of //bench:load_engine (the hostile section)");
ABSL_FLAG(std::string, redis_server, "/usr/bin/redis-server", "path of redis-server");
ABSL_FLAG(std::string, json_out, "", "write the results as JSON here");
ABSL_FLAG(std::string, plot_data, "",
          "write the hot path's latency vs N here (whitespace-separated columns, for gnuplot)");
ABSL_FLAG(std::string, python_stepper, "", "bench/python_step.py (the python_step section)");
ABSL_FLAG(std::string, python, "/usr/bin/python3", "the interpreter python_step.py runs on");
ABSL_FLAG(std::string, python_path, "",
          "directory holding the memra_kv package with its generated stubs (python/)");
ABSL_FLAG(std::string, sections,
          "hot_path,step_channel,spec_decode,prefix_redis,admission,scale,python_step,"
          "python_restore,block_store,hostile",
          "comma-separated sections to run");
ABSL_FLAG(bool, quick, false, "tiny iteration counts: checks the harness, measures nothing");
ABSL_FLAG(bool, check_limits, false,
          "only check, for the options given, that each population fits its daemon's limits "
          "(exit 0 when it does), then exit: runs no section");
ABSL_FLAG(uint64_t, scale_sessions, 10000, "live sessions the scale section grows to");
ABSL_FLAG(uint64_t, prefix_blocks, 100000, "prefix-index blocks the scale section grows to");
ABSL_FLAG(uint64_t, redis_max_tokens, 131072, "largest entry (tokens) of the Redis comparison");

namespace memra::bench {
namespace {

absl::Status WritePlotData(const Json& hot_path, const std::string& path) {
  std::ofstream out(path);
  out << "# sessions daemon_p50_us daemon_p99_us floor_p50_us floor_p99_us core_p50_us\n";
  for (const Json& row : hot_path["by_sessions"]) {
    out << row["sessions"] << " " << row["daemon_step"]["p50_us"] << " "
        << row["daemon_step"]["p99_us"] << " " << row["floor_step"]["p50_us"] << " "
        << row["floor_step"]["p99_us"] << " " << row["core_step"]["p50_us"] << "\n";
  }
  if (!out) return absl::InternalError("cannot write " + path);
  return absl::OkStatus();
}

int Run() {
  BenchOptions options;
  options.kvd_binary = absl::GetFlag(FLAGS_kvd);
  options.echo_binary = absl::GetFlag(FLAGS_echo_server);
  options.load_engine_binary = absl::GetFlag(FLAGS_load_engine);
  options.redis_binary = absl::GetFlag(FLAGS_redis_server);
  options.quick = absl::GetFlag(FLAGS_quick);
  options.scale_sessions = absl::GetFlag(FLAGS_scale_sessions);
  options.prefix_blocks = absl::GetFlag(FLAGS_prefix_blocks);
  options.redis_max_tokens = absl::GetFlag(FLAGS_redis_max_tokens);
  options.python_stepper = absl::GetFlag(FLAGS_python_stepper);
  options.python = absl::GetFlag(FLAGS_python);
  options.python_path = absl::GetFlag(FLAGS_python_path);
  if (options.kvd_binary.empty() || options.echo_binary.empty()) {
    std::fprintf(stderr, "memra_bench: --kvd and --echo_server are required\n");
    return 2;
  }
  if (options.scale_sessions < 2 || options.prefix_blocks < 64) {
    std::fprintf(stderr, "memra_bench: --scale_sessions >= 2 and --prefix_blocks >= 64\n");
    return 2;
  }

  if (absl::GetFlag(FLAGS_check_limits)) {
    if (absl::Status fits = CheckScaleLimits(options); !fits.ok()) {
      std::fprintf(stderr, "memra_bench: %s\n", fits.ToString().c_str());
      return 1;
    }
    std::printf("memra_bench: every population fits its daemon's limits (scale: %llu sessions)\n",
                static_cast<unsigned long long>(options.scale_sessions));
    return 0;
  }

  Json report;
  report["benchmark"] = "memra-kv bench (bench/README.md)";
  report["machine"] = DescribeMachine();
  report["quick"] = options.quick;
  const Json& machine = report["machine"];
  std::printf("memra-kv bench on %s (%d logical CPUs), %s%s\n",
              machine["cpu_model"].get<std::string>().c_str(),
              machine["logical_cpus"].get<int>(), machine["date_utc"].get<std::string>().c_str(),
              options.quick ? " [--quick: numbers are meaningless]" : "");

  using Section = absl::StatusOr<Json> (*)(const BenchOptions&);
  const std::pair<const char*, Section> all[] = {{"hot_path", RunHotPath},
                                                 {"step_channel", RunStepChannel},
                                                 {"spec_decode", RunSpecDecode},
                                                 {"prefix_redis", RunPrefixAndRedis},
                                                 {"prefix_small", RunPrefixSmall},
                                                 {"admission", RunAdmission},
                                                 {"scale", RunScale},
                                                 {"python_step", RunPythonStep},
                                                 {"python_restore", RunPythonRestore},
                                                 {"prefix_tiers", RunPrefixTiers},
                                                 {"block_store", RunBlockStore},
                                                 {"hostile", RunHostileLoad}};
  const std::vector<std::string> wanted = absl::StrSplit(absl::GetFlag(FLAGS_sections), ',');
  bool failed = false;
  for (const auto& [name, run] : all) {
    if (std::find(wanted.begin(), wanted.end(), name) == wanted.end()) continue;
    absl::StatusOr<Json> result = run(options);
    if (result.ok()) {
      report[name] = *std::move(result);
    } else {
      failed = true;
      report[name] = Json{{"error", result.status().ToString()}};
      std::fprintf(stderr, "\nsection %s FAILED: %s\n", name, result.status().ToString().c_str());
    }
  }

  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    std::ofstream out(path);
    out << report.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "memra_bench: cannot write %s\n", path.c_str());
      return 1;
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_plot_data);
      !path.empty() && report.contains("hot_path") && report["hot_path"].contains("by_sessions")) {
    if (absl::Status written = WritePlotData(report["hot_path"], path); !written.ok()) {
      std::fprintf(stderr, "memra_bench: %s\n", written.ToString().c_str());
      return 1;
    }
  }
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace memra::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // This process is the engine: it does what client/client.h advises engines to do.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return memra::bench::Run();
}
