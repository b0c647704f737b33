#ifndef MEMRA_BENCH_KVD_H_
#define MEMRA_BENCH_KVD_H_

// What the benchmark sections share: their options, the real memra-kvd started as a child
// process on a private Unix socket (host backend), and the batched decode step an engine sends.
//
// Thread-safety: single-threaded use.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/harness.h"
#include "client/client.h"
#include "core/model_plan.h"
#include "server/config.h"

namespace memra::bench {

struct BenchOptions {
  std::string kvd_binary;    // //server:memra-kvd
  std::string echo_binary;   // //bench:echo_server
  std::string redis_binary;  // redis-server
  std::string load_engine_binary;  // //bench:load_engine (the hostile section's engines)
  // The python_step section: bench/python_step.py, the interpreter it runs on, and the directory
  // holding the memra_kv package (with its generated stubs: python/tools/gen_protos.py).
  std::string python_stepper;
  std::string python = "/usr/bin/python3";
  std::string python_path;
  // Tiny iteration counts and sizes: checks the harness end to end, measures nothing useful.
  bool quick = false;
  uint64_t scale_sessions = 10000;
  uint64_t prefix_blocks = 100000;
  uint64_t redis_max_tokens = 131072;
};

// The configuration a bench daemon started with `extra_flags` runs with: the daemon's defaults
// with those flags applied, exactly as its own command line applies them. INVALID_ARGUMENT for a
// flag that is not a config key.
absl::StatusOr<DaemonConfig> BenchDaemonConfig(const std::vector<std::string>& extra_flags);

// memra-kvd (host backend) on a socket in a private directory; its log is daemon.log there.
// `extra_flags` are appended to its command line (e.g. --prefix_cache_budget_bytes=N).
// Stop() (or the destructor) drains it with SIGTERM. REQUIRES: every client detached first,
// so the drain has no live session to wait for.
class Kvd {
 public:
  static absl::StatusOr<std::unique_ptr<Kvd>> Start(
      const BenchOptions& options, uint64_t budget_bytes,
      const std::vector<std::string>& extra_flags = {});
  ~Kvd() { Stop(); }

  const std::string& socket_path() const { return socket_path_; }
  // The operators' socket (eviction, inspection, the listings).
  const std::string& admin_socket_path() const { return admin_socket_path_; }
  pid_t pid() const { return process_.pid(); }
  absl::StatusOr<ProcMemory> Memory() const { return ReadProcMemory(process_.pid()); }
  // Connects and attaches as `engine_name`.
  absl::StatusOr<std::unique_ptr<KvClient>> Attach(const std::string& engine_name) const;
  // Exit status (0: a clean drain); -1 when already stopped.
  int Stop();

 private:
  Kvd(TempDir dir, std::string socket_path, std::string admin_socket_path, ChildProcess process)
      : dir_(std::move(dir)),
        socket_path_(std::move(socket_path)),
        admin_socket_path_(std::move(admin_socket_path)),
        process_(std::move(process)) {}

  TempDir dir_;
  std::string socket_path_;
  std::string admin_socket_path_;
  ChildProcess process_;
};

// Sessions of one plan created through the client.
absl::StatusOr<std::vector<std::unique_ptr<Session>>> CreateSessions(
    KvClient& client, const PlanFingerprint& plan, const SessionOptions& options, size_t count);

// One decode step of a batched engine for many sessions, as ONE Step RPC: per session Begin,
// PrepareAppend(1 row), PublishAppend, Commit(accepted_rows). The engine knows each session's
// next generation (generations go up by one per Begin, core/transaction.h), so all four
// operations travel together; every outcome is checked against what the step must produce.
//
// kAdvance sends the same step as ONE Advance entry per session instead: commit the previous
// step's transaction and prepare the next one's row (the first step only prepares).
enum class StepForm { kSeparateEntries, kAdvance };

class DecodeStepper {
 public:
  // Reads each session's next generation and committed length from the daemon.
  // REQUIRES: no transaction open on `sessions`; they outlive the stepper.
  // `addressing`: kSlot lets the client carry the step over its step channel
  // (docs/step-channel.md) when it has one.
  static absl::StatusOr<std::unique_ptr<DecodeStepper>> Create(
      KvClient& client, std::vector<Session*> sessions, uint64_t accepted_rows,
      StepForm form = StepForm::kSeparateEntries,
      StepAddressing addressing = StepAddressing::kSessionToken);

  // Builds, sends and checks one step. INTERNAL when an outcome is not the expected one.
  absl::Status Step();
  // The same step through the raw stub (gRPC), reporting the serialized request/response sizes.
  absl::Status StepMeasuringSizes(uint64_t* request_bytes, uint64_t* response_bytes);
  // Reset every session (ending any open transaction); generations keep counting.
  absl::Status ResetAll();

 private:
  DecodeStepper(KvClient& client, std::vector<Session*> sessions, uint64_t accepted_rows,
                StepForm form, StepAddressing addressing);
  void Build();
  absl::Status Check(const std::vector<StepOutcome>& outcomes);
  absl::Status CheckAdvance(const std::vector<StepOutcome>& outcomes);

  KvClient& client_;
  const std::vector<Session*> sessions_;
  const uint64_t accepted_rows_;
  const StepForm form_;
  std::vector<uint64_t> next_generation_;  // per session
  std::vector<uint64_t> open_generation_;  // per session, kAdvance: the open transaction (0: none)
  std::vector<uint64_t> committed_;        // per session, as the daemon reports it
  StepBatch batch_;
  std::vector<StepOutcome> outcomes_;  // reused step to step, as a decode loop would
};

}  // namespace memra::bench

#endif  // MEMRA_BENCH_KVD_H_
