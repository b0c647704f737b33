// Section 9: hostile engines (issue 31). Two honest engine processes step their sessions the
// whole run; the run is phases of equal length: quiet, with one hostile engine process per
// resource a client can make the daemon hold (bench/load_engine.cc, tests/hostile_engines.h),
// quiet again, each hostile engine alone, and two CPU burners instead. The honest engines' step
// latency per phase is the result: the two quiet phases give the spread, the burners what plain
// CPU contention on this machine costs, the others what the hostile engines cost the honest ones.

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/sections.h"
#include "core/status_macros.h"

namespace memra::bench {
namespace {

// Each hostile behaviour and the resource it goes after (docs/security-model.md#resources).
struct Hostile {
  const char* behaviour;
  const char* resource;
};
constexpr Hostile kHostiles[] = {
    {"unread_descriptors", "descriptors in flight (arena answers never read)"},
    {"config_bombs", "config.json size and depth (1 MiB / 100 KB of '[', 2 threads)"},
    {"idle_connections", "gRPC connections (idle, as uid 65534 when run as root)"},
    {"event_streams", "SubscribeEvents streams"},
    {"grow", "the handoff thread vs a Grow (128 -> 2048 rows) + Attach churn"},
    {"offer_hog", "block store offers"},
    {"kept_mappings", "host memory kept mapped after release (29 MiB arenas)"},
    {"cpu_hog", "the daemon's time (4 threads creating and releasing 29 MiB sessions)"},
};
constexpr int kHonestEngines = 2;
constexpr char kEventStreamsPerEngine[] = "4";

struct Engine {
  std::string name;
  ChildProcess process;
  std::string ready_file;
  std::string samples_file;
};

// What the daemon process holds at one moment.
struct DaemonLoad {
  uint64_t threads = 0;
  uint64_t fds = 0;
  uint64_t rss = 0;
  double loadavg = 0;  // the machine's 1-minute load average
  Json ToJson() const {
    return Json{{"threads", threads}, {"fds", fds}, {"rss_bytes", rss}, {"loadavg_1m", loadavg}};
  }
};

absl::StatusOr<DaemonLoad> ReadDaemonLoad(pid_t pid) {
  DaemonLoad load;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, "Threads:")) load.threads = std::stoull(std::string(rest));
  }
  std::error_code error;
  for (const auto& entry :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), error)) {
    (void)entry;
    ++load.fds;
  }
  ASSIGN_OR_RETURN(ProcMemory memory, ReadProcMemory(pid));
  load.rss = memory.rss;
  std::ifstream loadavg("/proc/loadavg");
  loadavg >> load.loadavg;
  return load;
}

absl::StatusOr<std::string> ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return absl::InternalError("cannot read " + path);
  return line;
}

// The honest engine's samples ("<end ns> <latency ns>" lines) split by phase: phase p is
// [marks[2p], marks[2p + 1]).
absl::StatusOr<std::vector<Samples>> SamplesByPhase(const std::string& path,
                                                    const std::vector<int64_t>& marks) {
  std::ifstream in(path);
  if (!in) return absl::InternalError("cannot read " + path);
  std::vector<Samples> phases(marks.size() / 2);
  int64_t end = 0;
  int64_t latency = 0;
  while (in >> end >> latency) {
    for (size_t phase = 0; phase < phases.size(); ++phase) {
      if (end >= marks[2 * phase] && end < marks[2 * phase + 1]) {
        phases[phase].Add(static_cast<double>(latency));
      }
    }
  }
  return phases;
}

}  // namespace

absl::StatusOr<Json> RunHostileLoad(const BenchOptions& options) {
  if (options.load_engine_binary.empty()) {
    return absl::FailedPreconditionError("the hostile section needs --load_engine");
  }
  const absl::Duration phase = options.quick ? absl::Seconds(1) : absl::Seconds(15);
  ASSIGN_OR_RETURN(std::unique_ptr<Kvd> kvd,
                   Kvd::Start(options, uint64_t{2} << 30,
                              {"--prefix_cache_budget_bytes=64MiB", "--socket_mode=0666",
                               // Every release frees (none pooled): the kept mappings' worst case.
                               "--arena_pool_engine_bytes=0",
                               absl::StrCat("--max_engine_event_streams=",
                                            kEventStreamsPerEngine)}));
  // The connection flood connects as another uid when it can: let it reach the socket.
  const std::string kvd_dir = std::filesystem::path(kvd->socket_path()).parent_path();
  if (chmod(kvd_dir.c_str(), 0711) != 0) return absl::InternalError("chmod " + kvd_dir);
  ASSIGN_OR_RETURN(TempDir work, TempDir::Create("memra-hostile"));
  // ... and write its ready file and log (sticky, as /tmp).
  if (chmod(work.path().c_str(), 01777) != 0) return absl::InternalError("chmod " + work.path());

  auto start = [&](const std::string& name, const std::string& behaviour,
                   std::vector<std::string> extra) -> absl::StatusOr<Engine> {
    Engine engine{name, ChildProcess(), work.File(name + ".ready"), work.File(name + ".samples")};
    std::vector<std::string> argv = {options.load_engine_binary,
                                     "--socket=" + kvd->socket_path(),
                                     "--behaviour=" + behaviour,
                                     "--ready_file=" + engine.ready_file,
                                     "--samples_file=" + engine.samples_file};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ASSIGN_OR_RETURN(engine.process, ChildProcess::Spawn(argv, work.File(name + ".log")));
    return engine;
  };
  auto await_ready = [&](Engine& engine) -> absl::StatusOr<std::string> {
    if (absl::Status ready = WaitForPath(engine.ready_file, engine.process, absl::Seconds(120));
        !ready.ok()) {
      std::ifstream log(work.File(engine.name + ".log"));
      const std::string said((std::istreambuf_iterator<char>(log)),
                             std::istreambuf_iterator<char>());
      return absl::UnavailableError(absl::StrCat(engine.name, " never got ready (",
                                                 ready.message(), "); it said: ", said));
    }
    return ReadLine(engine.ready_file);
  };

  std::vector<Engine> honest;
  for (int i = 0; i < kHonestEngines; ++i) {
    ASSIGN_OR_RETURN(Engine engine, start(absl::StrCat("honest-", i), "honest", {}));
    honest.push_back(std::move(engine));
  }
  for (Engine& engine : honest) RETURN_IF_ERROR(await_ready(engine).status());
  absl::SleepFor(options.quick ? absl::Milliseconds(200) : absl::Seconds(2));  // warm up

  std::vector<int64_t> marks;
  std::vector<uint64_t> daemon_cpu;
  std::vector<DaemonLoad> loads;
  auto mark = [&]() -> absl::Status {
    marks.push_back(NowNs());
    ASSIGN_OR_RETURN(uint64_t cpu, ProcessCpuNs(kvd->pid()));
    daemon_cpu.push_back(cpu);
    ASSIGN_OR_RETURN(DaemonLoad load, ReadDaemonLoad(kvd->pid()));
    loads.push_back(load);
    return absl::OkStatus();
  };

  // Each phase: the engines it runs beside the honest ones (none: quiet).
  struct Phase {
    std::string name;
    std::vector<std::string> behaviours;
  };
  std::vector<std::string> all_hostile;
  for (const Hostile& hostile : kHostiles) all_hostile.push_back(hostile.behaviour);
  std::vector<Phase> phases = {{"quiet", {}},
                               {absl::StrCat("all ", all_hostile.size(), " hostile"), all_hostile},
                               {"quiet again", {}}};
  for (const Hostile& hostile : kHostiles) {
    phases.push_back({absl::StrCat("only ", hostile.behaviour), {hostile.behaviour}});
  }
  phases.push_back({"2 CPU burners", {"burn", "burn"}});

  std::vector<std::string> answers;  // the all-hostile phase's, in kHostiles' order
  std::vector<int> hostile_exits;
  for (size_t p = 0; p < phases.size(); ++p) {
    std::vector<Engine> beside;
    for (size_t i = 0; i < phases[p].behaviours.size(); ++i) {
      const std::string& behaviour = phases[p].behaviours[i];
      std::vector<std::string> extra = {absl::StrCat("--event_streams=", kEventStreamsPerEngine)};
      if (behaviour == "idle_connections") extra.push_back("--as_uid=65534");
      ASSIGN_OR_RETURN(Engine engine,
                       start(absl::StrCat("phase", p, "-", behaviour, "-", i), behaviour, extra));
      beside.push_back(std::move(engine));
    }
    for (Engine& engine : beside) {
      ASSIGN_OR_RETURN(std::string answer, await_ready(engine));
      if (p == 1) answers.push_back(answer);
    }
    RETURN_IF_ERROR(mark());
    absl::SleepFor(phase);
    RETURN_IF_ERROR(mark());
    for (Engine& engine : beside) {
      const int exit = engine.process.Stop(absl::Seconds(5));
      if (p == 1) hostile_exits.push_back(exit);
    }
  }
  for (Engine& engine : honest) {
    if (const int exit = engine.process.Stop(absl::Seconds(30)); exit != 0) {
      return absl::InternalError(absl::StrCat(engine.name, " exited ", exit, "; see its log in ",
                                              work.path()));
    }
  }
  // Marks: each phase's start (every engine beside the honest ones met its bound) and end.
  const size_t phase_count = phases.size();
  std::vector<Samples> all_honest(phase_count);
  Json engines = Json::array();
  Table table({"phase", "steps", "p50", "p99", "daemon CPU", "threads", "fds", "load avg"});
  for (const Engine& engine : honest) {
    ASSIGN_OR_RETURN(std::vector<Samples> by_phase, SamplesByPhase(engine.samples_file, marks));
    Json phase_json;
    for (size_t p = 0; p < phase_count; ++p) {
      all_honest[p].Append(by_phase[p]);
      phase_json[phases[p].name] = by_phase[p].ToJson();
    }
    engines.push_back(Json{{"engine", engine.name}, {"by_phase", phase_json}});
  }
  Json phases_json = Json::array();
  for (size_t p = 0; p < phase_count; ++p) {
    const double seconds = static_cast<double>(marks[2 * p + 1] - marks[2 * p]) / 1e9;
    const double cpu = static_cast<double>(daemon_cpu[2 * p + 1] - daemon_cpu[2 * p]) / 1e9;
    const DaemonLoad& end = loads[2 * p + 1];
    table.Add({phases[p].name, std::to_string(all_honest[p].count()), Us(all_honest[p].P50()),
               Us(all_honest[p].P99()), absl::StrCat(Fixed(100 * cpu / seconds, 0), "%"),
               std::to_string(end.threads), std::to_string(end.fds), Fixed(end.loadavg, 2)});
    phases_json.push_back(Json{{"phase", phases[p].name},
                               {"seconds", seconds},
                               {"honest_steps", all_honest[p].ToJson()},
                               {"daemon_cpu_seconds", cpu},
                               {"daemon_at_end", end.ToJson()}});
  }
  table.Print(absl::StrCat("9. Hostile engines: two honest engines' decode step (8 sessions of "
                           "Llama-3-8B each, one Step RPC; both engines' steps together) beside "
                           "hostile engines, ",
                           absl::FormatDuration(phase), " a phase"));
  Table hostiles({"hostile engine", "goes after", "what the daemon answered", "exit"});
  Json hostile_json = Json::array();
  for (size_t i = 0; i < answers.size(); ++i) {
    hostiles.Add({kHostiles[i].behaviour, kHostiles[i].resource, answers[i],
                  std::to_string(hostile_exits[i])});
    hostile_json.push_back(Json{{"behaviour", kHostiles[i].behaviour},
                                {"resource", kHostiles[i].resource},
                                {"daemon_answered", answers[i]},
                                {"exit", hostile_exits[i]}});
  }
  hostiles.Print("9. The hostile engines, once each met its bound");
  return Json{{"phase_seconds", absl::ToDoubleSeconds(phase)},
              {"phases", phases_json},
              {"honest_engines", engines},
              {"hostile_engines", hostile_json}};
}

}  // namespace memra::bench
