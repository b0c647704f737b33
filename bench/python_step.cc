// Section 6: the Python client's decode step against the C++ client's, in the same run. The
// same one-Step-RPC decode step as the hot path (per session Begin, PrepareAppend(1 row),
// PublishAppend, Commit(1 row); Llama-3-8B's 32 K/V layers) at N = 1 and N = 256 sessions, by
// this process through client/ and by a Python engine process through python/memra_kv
// (bench/python_step.py), against one memra-kvd. The two alternate round by round (the Python
// process waits for a go file, writes its step times to a done file), so both meet the same
// daemon state and the same neighbours; the ratio python/C++ is the result.

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

  Table table({"N", "C++ p50", "p99", "Python p50", "p99", "Python/C++ p50", "p99"});
  Json rows = Json::array();
  for (const size_t n : kShapes) {
    std::vector<Session*> batch;
    for (size_t i = 0; i < n; ++i) batch.push_back(sessions[i].get());
    ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> stepper,
                     DecodeStepper::Create(*client, batch, /*accepted_rows=*/1));
    Samples cpp, py;
    for (int round = 0; round <= rounds; ++round) {
      const bool record = round > 0;  // round 0 warms up
      RETURN_IF_ERROR(stepper->ResetAll());
      for (int k = 0; k < steps; ++k) {
        const int64_t start = NowNs();
        RETURN_IF_ERROR(stepper->Step());
        if (record) cpp.Add(static_cast<double>(NowNs() - start));
      }
      const std::string name = absl::StrCat(n, "-", round);
      RETURN_IF_ERROR(Touch(dir.File("go-" + name)));
      RETURN_IF_ERROR(WaitForPath(dir.File("done-" + name), python, absl::Minutes(5)));
      ASSIGN_OR_RETURN(Samples round_samples, ReadSamples(dir.File("done-" + name), steps));
      if (record) py.Append(round_samples);
    }
    rows.push_back(Json{{"sessions", n},
                        {"cpp_step", cpp.ToJson()},
                        {"python_step", py.ToJson()},
                        {"ratio_python_cpp_p50", py.P50() / cpp.P50()},
                        {"ratio_python_cpp_p99", py.P99() / cpp.P99()}});
    table.Add({absl::StrCat(n), Us(cpp.P50()), Us(cpp.P99()), Us(py.P50()),
               Us(py.P99()), Ratio(py.P50() / cpp.P50()), Ratio(py.P99() / cpp.P99())});
  }
  // It releases its sessions and detaches, then says so.
  RETURN_IF_ERROR(WaitForPath(dir.File("finished"), python, absl::Minutes(1)));
  python.Stop();
  sessions.clear();
  client.reset();
  table.Print("6. decode step, Python client (python/memra_kv) vs C++ client (client/), one Step "
              "RPC for N sessions, same daemon, alternating rounds");
  Json json;
  json["model"] = "llama-3-8b (32 K/V layers)";
  json["operations_per_session"] = "Begin, PrepareAppend(1 row), PublishAppend, Commit(1 row)";
  json["steps_per_round"] = steps;
  json["by_sessions"] = std::move(rows);
  return json;
}

}  // namespace memra::bench
