#include "bench/harness.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <numeric>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/errors.h"

namespace memra::bench {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t ThreadCpuNs() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return int64_t{now.tv_sec} * 1000000000 + now.tv_nsec;
}

// ---- Samples --------------------------------------------------------------------------------

void Samples::Append(const Samples& other) {
  values_.insert(values_.end(), other.values_.begin(), other.values_.end());
}

double Samples::Percentile(double p) const {
  if (values_.empty()) return 0;
  std::vector<double> sorted = values_;
  std::sort(sorted.begin(), sorted.end());
  const double rank = std::ceil(p / 100.0 * sorted.size());
  const size_t index = rank < 1 ? 0 : static_cast<size_t>(rank) - 1;
  return sorted[std::min(index, sorted.size() - 1)];
}

double Samples::Mean() const {
  if (values_.empty()) return 0;
  return std::accumulate(values_.begin(), values_.end(), 0.0) / values_.size();
}

Json Samples::ToJson(double per) const {
  return Json{{"n", count()},
              {"p50_us", P50() / per / 1e3},
              {"p99_us", P99() / per / 1e3},
              {"mean_us", Mean() / per / 1e3}};
}

// ---- ChildProcess ---------------------------------------------------------------------------

absl::StatusOr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                                 const std::string& log_path) {
  if (argv.empty()) return absl::InvalidArgumentError("Spawn: empty argv");
  if (access(argv[0].c_str(), X_OK) != 0) {
    return PosixError(absl::StrCat("cannot execute ", argv[0]), errno);
  }
  // Everything the child touches is prepared before fork: after it, only async-signal-safe
  // calls (the benchmark has gRPC threads).
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return PosixError(absl::StrCat("fork for ", argv[0]), errno);
  if (pid == 0) {
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(126);
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (log < 0 || dup2(log, STDOUT_FILENO) < 0 || dup2(log, STDERR_FILENO) < 0) _exit(126);
    execv(args[0], args.data());
    _exit(127);
  }
  return ChildProcess(pid);
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    Stop();
    pid_ = std::exchange(other.pid_, -1);
  }
  return *this;
}

ChildProcess::~ChildProcess() { Stop(); }

bool ChildProcess::Alive() {
  if (pid_ <= 0) return false;
  if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
    pid_ = -1;
    return false;
  }
  return true;
}

int ChildProcess::Stop(absl::Duration grace) {
  if (pid_ <= 0) return -1;
  const pid_t pid = std::exchange(pid_, -1);
  kill(pid, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (absl::Now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

absl::Status WaitForPath(const std::string& path, ChildProcess& child, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (access(path.c_str(), F_OK) != 0) {
    if (!child.Alive()) {
      return absl::UnavailableError(absl::StrCat("the process exited before ", path, " appeared"));
    }
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat(path, " did not appear within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return absl::OkStatus();
}

// ---- TempDir --------------------------------------------------------------------------------

absl::StatusOr<TempDir> TempDir::Create(const std::string& prefix) {
  std::string pattern = absl::StrCat("/tmp/", prefix, "-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return PosixError("mkdtemp " + pattern, errno);
  return TempDir(pattern);
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  if (DIR* dir = opendir(path_.c_str()); dir != nullptr) {
    while (const dirent* entry = readdir(dir)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") unlink(File(name).c_str());
    }
    closedir(dir);
  }
  rmdir(path_.c_str());
}

// ---- /proc ----------------------------------------------------------------------------------

absl::StatusOr<ProcMemory> ReadProcMemory(pid_t pid) {
  const std::string path = absl::StrCat("/proc/", pid, "/status");
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  ProcMemory memory;
  std::string line;
  int found = 0;
  while (std::getline(in, line)) {
    for (auto [key, field] : {std::pair{"VmRSS:", &memory.rss},
                              std::pair{"RssAnon:", &memory.rss_anon},
                              std::pair{"RssShmem:", &memory.rss_shmem}}) {
      absl::string_view rest = line;
      if (!absl::ConsumePrefix(&rest, key)) continue;
      rest = absl::StripAsciiWhitespace(rest);
      absl::ConsumeSuffix(&rest, " kB");
      uint64_t kib = 0;
      if (!absl::SimpleAtoi(rest, &kib)) {
        return absl::InternalError(absl::StrCat("unparsable line in ", path, ": ", line));
      }
      *field = kib * 1024;
      ++found;
    }
  }
  if (found != 3) return absl::InternalError(absl::StrCat(path, " lacks VmRSS/RssAnon/RssShmem"));
  return memory;
}

absl::StatusOr<uint64_t> ProcessCpuNs(pid_t pid) {
  const std::string path = absl::StrCat("/proc/", pid, "/stat");
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start at field 3; utime and stime
  // are fields 14 and 15.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(text).substr(close + 2), ' ');
  uint64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return absl::InternalError(absl::StrCat("unparsable ", path));
  }
  return (utime + stime) * (1000000000 / static_cast<uint64_t>(sysconf(_SC_CLK_TCK)));
}

Json DescribeMachine() {
  std::string cpu = "unknown";
  {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
      absl::string_view rest = line;
      if (absl::ConsumePrefix(&rest, "model name")) {
        const size_t colon = rest.find(':');
        if (colon != absl::string_view::npos) {
          cpu = std::string(absl::StripAsciiWhitespace(rest.substr(colon + 1)));
        }
        break;
      }
    }
  }
  uint64_t mem_total = 0;
  {
    std::ifstream in("/proc/meminfo");
    std::string line;
    while (std::getline(in, line)) {
      absl::string_view rest = line;
      if (absl::ConsumePrefix(&rest, "MemTotal:")) {
        rest = absl::StripAsciiWhitespace(rest);
        absl::ConsumeSuffix(&rest, " kB");
        if (absl::SimpleAtoi(rest, &mem_total)) mem_total *= 1024;
        break;
      }
    }
  }
  utsname names{};
  uname(&names);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return Json{{"cpu_model", cpu},
              {"logical_cpus", sysconf(_SC_NPROCESSORS_ONLN)},
              {"memory_bytes", mem_total},
              {"kernel", absl::StrCat(names.sysname, " ", names.release)},
              {"hostname", host},
              {"date_utc", absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone())}};
}

absl::StatusOr<int> FreeTcpPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return PosixError("socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    close(fd);
    return PosixError("bind 127.0.0.1:0", err);
  }
  close(fd);
  return ntohs(addr.sin_port);
}

// ---- output ---------------------------------------------------------------------------------

void Table::Print(const std::string& title) const {
  std::vector<size_t> widths;
  for (const auto& row : rows_) {
    if (widths.size() < row.size()) widths.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  std::printf("\n== %s\n", title.c_str());
  for (size_t r = 0; r < rows_.size(); ++r) {
    std::string line;
    for (size_t i = 0; i < rows_[r].size(); ++i) {
      // First column left-aligned (names), the rest right-aligned (numbers).
      line += i == 0 ? absl::StrFormat("%-*s", widths[i], rows_[r][i])
                     : absl::StrFormat("  %*s", widths[i], rows_[r][i]);
    }
    std::printf("%s\n", line.c_str());
    if (r == 0) {
      size_t total = 0;
      for (size_t w : widths) total += w + 2;
      std::printf("%s\n", std::string(total - 2, '-').c_str());
    }
  }
  std::fflush(stdout);
}

std::string Us(double ns) { return absl::StrFormat("%.2f", ns / 1e3); }
std::string Ratio(double value) { return absl::StrFormat("%.2fx", value); }
std::string Fixed(double value, int decimals) { return absl::StrFormat("%.*f", decimals, value); }

}  // namespace memra::bench
