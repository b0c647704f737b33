// Section 6: the Python client's decode step against the C++ client's, in the same run. One
// Advance entry per session per step (commit the previous step's row, prepare the next one's;
// Llama-3-8B's 32 K/V layers) at N = 1 and N = 256 sessions, over the engine's step channel (a
// batch by slot) and over the Step RPC (a batch by session id and token), by this process
// through client/ and by a Python engine process through python/memra_kv
// (bench/python_step.py), against one memra-kvd. The two alternate round by round (the Python
// process waits for a go file, writes its step times to done files), so both meet the same
// daemon state and the same neighbours; the ratio python/C++ per path is the result.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/sections.h"
#include "core/admission.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"

namespace memra::bench {
namespace {

constexpr uint64_t kCapacity = 128;  // as python_step.py's and the hot path's
constexpr int kStepsPerRound = 100;
constexpr int kRounds = 5;  // timed rounds per N; one warm-up round more runs first
constexpr size_t kShapes[] = {1, 256};  // sessions per step

absl::Status Touch(const std::string& path) {
  std::ofstream out(path);
  if (!out) return absl::InternalError("cannot write " + path);
  return absl::OkStatus();
}

// The step times python_step.py wrote for one round.
absl::StatusOr<Samples> ReadSamples(const std::string& path, int steps) {
  std::ifstream in(path);
  Samples samples;
  double ns;
  while (in >> ns) samples.Add(ns);
  if (static_cast<int>(samples.count()) != steps) {
    return absl::InternalError(
        absl::StrCat(path, " holds ", samples.count(), " step times, not ", steps));
  }
  return samples;
}

}  // namespace

absl::StatusOr<Json> RunPythonStep(const BenchOptions& options) {
  if (options.python_stepper.empty()) {
    return absl::InvalidArgumentError(
        "python_step needs --python_stepper=bench/python_step.py and --python_path (run.sh)");
  }
  const ModelPlan model = test_plans::Llama3_8B();
  SessionShape request;
  request.capacity = kCapacity;
  ASSIGN_OR_RETURN(uint64_t session_bytes,
                   SessionArenaBytes(model, FormatDefaults(), request,
                                     {.granularity = static_cast<uint64_t>(getpagesize())}));
  const size_t most = *std::max_element(std::begin(kShapes), std::end(kShapes));
  // Room for both engines' sessions.
  ASSIGN_OR_RETURN(std::unique_ptr<Kvd> kvd,
                   Kvd::Start(options, 2 * most * session_bytes + (64 << 20)));
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, kvd->Attach("bench-cpp-step"));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, client->RegisterPlan(model));
  SessionOptions session_options;
  session_options.capacity = kCapacity;
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Session>> sessions,
                   CreateSessions(*client, fingerprint, session_options, most));

  const int steps = options.quick ? 3 : kStepsPerRound;
  const int rounds = options.quick ? 1 : kRounds;
  ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("memra-pystep"));
  ASSIGN_OR_RETURN(
      ChildProcess python,
      ChildProcess::Spawn({options.python, options.python_stepper, "--socket=" + kvd->socket_path(),
                           "--dir=" + dir.path(), "--python_path=" + options.python_path,
                           "--shapes=" + absl::StrJoin(kShapes, ","), absl::StrCat("--rounds=", rounds),
                           absl::StrCat("--steps=", steps)},
                          dir.File("python.log")));

  if (!client->step_channel_active()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the daemon offered no step channel: ", client->step_channel_status().ToString()));
  }
  Table table({"N", "channel: C++ p50", "Python p50", "Python/C++ p50", "p99", "gRPC: C++ p50",
               "Python p50", "Python/C++ p50", "p99"});
  Json rows = Json::array();
  double channel_ratio_at_most = 0;
  for (const size_t n : kShapes) {
    std::vector<Session*> batch;
    for (size_t i = 0; i < n; ++i) batch.push_back(sessions[i].get());
    // The same sessions on both paths: each stepper resets them before its steps.
    ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> over_channel,
                     DecodeStepper::Create(*client, batch, /*accepted_rows=*/1,
                                           StepForm::kAdvance, StepAddressing::kSlot));
    ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> over_grpc,
                     DecodeStepper::Create(*client, batch, /*accepted_rows=*/1,
                                           StepForm::kAdvance, StepAddressing::kSessionToken));
    Samples cpp_channel, cpp_grpc, py_channel, py_grpc;
    for (int round = 0; round <= rounds; ++round) {
      const bool record = round > 0;  // round 0 warms up
      for (auto [stepper, samples] : {std::pair{over_channel.get(), &cpp_channel},
                                      std::pair{over_grpc.get(), &cpp_grpc}}) {
        RETURN_IF_ERROR(stepper->ResetAll());
        for (int k = 0; k < steps; ++k) {
          const int64_t start = NowNs();
          RETURN_IF_ERROR(stepper->Step());
          if (record) samples->Add(static_cast<double>(NowNs() - start));
        }
      }
      const std::string name = absl::StrCat(n, "-", round);
      RETURN_IF_ERROR(Touch(dir.File("go-" + name)));
      RETURN_IF_ERROR(WaitForPath(dir.File("done-" + name), python, absl::Minutes(5)));
      ASSIGN_OR_RETURN(Samples channel_round,
                       ReadSamples(dir.File("done-" + name + ".channel"), steps));
      ASSIGN_OR_RETURN(Samples grpc_round, ReadSamples(dir.File("done-" + name + ".grpc"), steps));
      if (record) {
        py_channel.Append(channel_round);
        py_grpc.Append(grpc_round);
      }
    }
    RETURN_IF_ERROR(over_channel->ResetAll());  // the next N's steppers start with none open
    if (!client->step_channel_active()) {
      return absl::InternalError(absl::StrCat("the C++ client's step channel broke: ",
                                              client->step_channel_status().ToString()));
    }
    channel_ratio_at_most = py_channel.P50() / cpp_channel.P50();
    rows.push_back(Json{{"sessions", n},
                        {"cpp_channel_step", cpp_channel.ToJson()},
                        {"python_channel_step", py_channel.ToJson()},
                        {"cpp_grpc_step", cpp_grpc.ToJson()},
                        {"python_grpc_step", py_grpc.ToJson()},
                        {"ratio_python_cpp_channel_p50", py_channel.P50() / cpp_channel.P50()},
                        {"ratio_python_cpp_channel_p99", py_channel.P99() / cpp_channel.P99()},
                        {"ratio_python_cpp_grpc_p50", py_grpc.P50() / cpp_grpc.P50()},
                        {"ratio_python_cpp_grpc_p99", py_grpc.P99() / cpp_grpc.P99()}});
    table.Add({absl::StrCat(n), Us(cpp_channel.P50()), Us(py_channel.P50()),
               Ratio(py_channel.P50() / cpp_channel.P50()),
               Ratio(py_channel.P99() / cpp_channel.P99()), Us(cpp_grpc.P50()),
               Us(py_grpc.P50()), Ratio(py_grpc.P50() / cpp_grpc.P50()),
               Ratio(py_grpc.P99() / cpp_grpc.P99())});
  }
  // It releases its sessions and detaches, then says so.
  RETURN_IF_ERROR(WaitForPath(dir.File("finished"), python, absl::Minutes(1)));
  python.Stop();
  sessions.clear();
  client.reset();
  table.Print("6. decode step, Python client (python/memra_kv) vs C++ client (client/), one "
              "Advance per session, over the step channel and over the Step RPC, same daemon, "
              "alternating rounds");
  std::printf("target: Python/C++ over the channel at N=%zu <= 2x: %s (%s)\n", kShapes[1],
              channel_ratio_at_most <= 2.0 ? "MET" : "MISSED",
              Ratio(channel_ratio_at_most).c_str());
  Json json;
  json["model"] = "llama-3-8b (32 K/V layers)";
  json["step"] = "one Advance entry per session (commit 1 row, prepare 1 row)";
  json["steps_per_round"] = steps;
  json["by_sessions"] = std::move(rows);
  return json;
}

// Section 6b: restore throughput from Python. bench/python_restore.py (beside python_step.py)
// restores a prefix into a recycled and a fresh session and loads blocks from the block store
// through python/memra_kv, each paired with a numpy copy of the same bytes in its own process,
// against a daemon that verifies restored pieces (its default) and one that does not.
absl::StatusOr<Json> RunPythonRestore(const BenchOptions& options) {
  if (options.python_stepper.empty()) {
    return absl::InvalidArgumentError(
        "python_restore needs --python_stepper=bench/python_step.py (its directory holds "
        "python_restore.py) and --python_path (run.sh)");
  }
  const std::string script =
      options.python_stepper.substr(0, options.python_stepper.rfind('/') + 1) +
      "python_restore.py";
  const int tokens = options.quick ? 512 : 2048;  // 64 MiB: the 58 MB restore
  const int repetitions = options.quick ? 2 : 20;
  const int load_blocks = options.quick ? 8 : 256;  // 64 MiB
  Table table({"verify", "restore MB", "recycled ms", "memcpy ms", "restore/memcpy",
               "fresh ms", "first-touch memcpy ms", "fresh/first-touch",
               "Python build + RPC floor ms", "block load MB", "load ms", "memcpy ms",
               "load/memcpy"});
  Json runs = Json::array();
  double recycled_ratio_verified = 0;
  for (const bool verify : {true, false}) {
    const std::string verify_flag =
        absl::StrCat("--prefix_verify_checksums=", verify ? "true" : "false");
    ASSIGN_OR_RETURN(std::unique_ptr<Kvd> kvd,
                     Kvd::Start(options, uint64_t{3} << 30,
                                {"--prefix_cache_budget_bytes=1GiB", "--prefix_block_tokens=256",
                                 verify_flag}));
    ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("memra-pyrestore"));
    const std::string out = dir.File("figures.json");
    ASSIGN_OR_RETURN(ChildProcess python,
                     ChildProcess::Spawn({options.python, script,
                                          "--socket=" + kvd->socket_path(),
                                          "--python_path=" + options.python_path,
                                          "--out=" + out, absl::StrCat("--tokens=", tokens),
                                          absl::StrCat("--load_blocks=", load_blocks),
                                          absl::StrCat("--repetitions=", repetitions)},
                                         dir.File("python.log")));
    RETURN_IF_ERROR(WaitForPath(out, python, absl::Minutes(10)));
    python.Stop();
    std::ifstream in(out);
    const Json figures = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (figures.is_discarded() || !figures.contains("restore") ||
        !figures.contains("block_load")) {
      return absl::InternalError(absl::StrCat(out, " is not the script's figures"));
    }
    const Json& restore = figures["restore"];
    const Json& load = figures["block_load"];
    // Paired: the p50 of each repetition's memcpy time over its call's.
    const double ratio = restore["ratio_recycled_memcpy"].get<double>();
    if (verify) recycled_ratio_verified = ratio;
    const double load_ratio = load["ratio_load_memcpy"].get<double>();
    runs.push_back(Json{{"verify_checksums", verify}, {"restore", restore}, {"block_load", load}});
    const auto ms = [](const Json& value) {
      return absl::StrFormat("%.1f", value.get<double>());
    };
    const auto megabytes = [](const Json& value) {
      return absl::StrFormat("%.1f", value.get<double>() / 1e6);
    };
    table.Add({verify ? "yes" : "no", megabytes(restore["bytes"]),
               ms(restore["recycled_ms"]), ms(restore["memcpy_warm_ms"]), Ratio(ratio),
               ms(restore["fresh_ms"]), ms(restore["memcpy_first_touch_ms"]),
               Ratio(restore["ratio_fresh_first_touch_memcpy"].get<double>()),
               absl::StrFormat("%.2f + %.2f", restore["request_build_ms"].get<double>(),
                               restore["rpc_floor_ms"].get<double>()),
               megabytes(load["bytes"]), ms(load["load_ms"]),
               ms(load["memcpy_warm_ms"]), Ratio(load_ratio)});
  }
  table.Print("6b. restore and block-store load from Python (python/memra_kv) vs a numpy copy of "
              "the same bytes, paired, same process; with and without the daemon's checksum "
              "verification");
  std::printf("target: a verified restore from Python >= 0.7x memcpy: %s (%s)\n",
              recycled_ratio_verified >= 0.7 ? "MET" : "MISSED",
              Ratio(recycled_ratio_verified).c_str());
  Json json;
  json["model"] = "llama-3.2-1b K/V geometry (16 layers, 8 heads of 64, bf16), 256-token blocks";
  json["restore_tokens"] = tokens;
  json["runs"] = std::move(runs);
  return json;
}

}  // namespace memra::bench
