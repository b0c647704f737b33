#ifndef MEMRA_BENCH_HARNESS_H_
#define MEMRA_BENCH_HARNESS_H_

// The small harness every benchmark section uses: a monotonic clock, latency samples with
// percentiles, child processes (memra-kvd, the echo floor, redis-server) that die with the
// benchmark, /proc memory readings, the machine's description and the output (a text table on
// stdout, JSON for machines).
//
// Thread-safety: none of these are shared between threads.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace memra::bench {

using Json = nlohmann::ordered_json;

// Monotonic nanoseconds.
int64_t NowNs();

// CPU time of the calling thread, nanoseconds.
int64_t ThreadCpuNs();

// Keeps `value` alive for the optimizer (a loop whose result is unused is not deleted).
template <typename T>
inline void KeepAlive(const T& value) {
  asm volatile("" : : "r,m"(value) : "memory");
}

// Latency samples in nanoseconds.
class Samples {
 public:
  void Add(double ns) { values_.push_back(ns); }
  void Append(const Samples& other);
  size_t count() const { return values_.size(); }
  bool empty() const { return values_.empty(); }
  // Nearest-rank percentile, p in [0, 100]; 0 for no samples.
  double Percentile(double p) const;
  double P50() const { return Percentile(50); }
  double P99() const { return Percentile(99); }
  double Mean() const;
  // {"n", "p50_us", "p99_us", "mean_us"} (divided by `per`, e.g. sessions per step).
  Json ToJson(double per = 1) const;

 private:
  std::vector<double> values_;
};

// Bytes per second -> GB/s (10^9 bytes).
inline double GBps(uint64_t bytes, double ns) { return ns > 0 ? bytes / ns : 0; }

// A child process started by the benchmark. It is sent SIGKILL when the benchmark dies
// (PR_SET_PDEATHSIG), and SIGTERM (then SIGKILL after a grace) when this object goes away, so
// no daemon or redis-server outlives a failed run. Move-only.
class ChildProcess {
 public:
  // Starts argv[0] (a path) with stdout and stderr appended to `log_path`.
  static absl::StatusOr<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                            const std::string& log_path);
  ChildProcess() = default;
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0; }
  // False once the process has exited (reaps it).
  bool Alive();
  // SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit status (128 + signal when
  // killed); -1 when nothing was running.
  int Stop(absl::Duration grace = absl::Seconds(10));

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
};

// Waits until `path` exists; UNAVAILABLE when `child` exits first or `timeout` passes.
absl::Status WaitForPath(const std::string& path, ChildProcess& child, absl::Duration timeout);

// A fresh private directory under /tmp (short: Unix socket paths are < 108 bytes), removed
// with its files (not subdirectories) on destruction.
class TempDir {
 public:
  static absl::StatusOr<TempDir> Create(const std::string& prefix);
  TempDir() = default;
  TempDir(TempDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  TempDir& operator=(TempDir&&) = delete;
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Memory of a process from /proc/<pid>/status, in bytes.
struct ProcMemory {
  uint64_t rss = 0;        // VmRSS
  uint64_t rss_anon = 0;   // RssAnon: heap and stacks, the process's own bookkeeping
  uint64_t rss_shmem = 0;  // RssShmem: shared-memory pages it has touched (arenas)
};
absl::StatusOr<ProcMemory> ReadProcMemory(pid_t pid);

// CPU time (user + system) all threads of `pid`, exited ones included, have run, in nanoseconds
// (/proc/<pid>/stat; the kernel reports it in clock ticks, so compare long intervals).
absl::StatusOr<uint64_t> ProcessCpuNs(pid_t pid);

// The machine and the date: CPU model, logical CPUs, memory, kernel, UTC time.
Json DescribeMachine();

// A loopback TCP port nothing listens on right now (bind to port 0, read it back).
absl::StatusOr<int> FreeTcpPort();

// Fixed-width text tables for stdout.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void Print(const std::string& title) const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// Number formatting for tables: microseconds with 2 significant decimals, ratios "1.23x".
std::string Us(double ns);
std::string Ratio(double value);
std::string Fixed(double value, int decimals);

}  // namespace memra::bench

#endif  // MEMRA_BENCH_HARNESS_H_
