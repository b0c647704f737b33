#ifndef MEMRA_BENCH_SECTIONS_H_
#define MEMRA_BENCH_SECTIONS_H_

// The benchmark's sections (bench/README.md explains each). Every section starts the processes
// it needs, prints its table, and returns its results as JSON; a failure is an error status
// (the other sections still run).

#include "absl/status/statusor.h"
#include "bench/harness.h"
#include "bench/kvd.h"

namespace memra::bench {

// 1. Decode step for N sessions: memra-kvd vs the bare gRPC floor vs core/ in process.
absl::StatusOr<Json> RunHotPath(const BenchOptions& options);
// 1c. The decode step (one Advance per session, by slot) over the step channel vs over gRPC
// and the bare gRPC floor; the daemon's CPU per session.
absl::StatusOr<Json> RunStepChannel(const BenchOptions& options);
// 2. SpecSnapshot + SpecRollback of a hybrid model's recurrent state vs memcpy.
absl::StatusOr<Json> RunSpecDecode(const BenchOptions& options);
// 3. Prefix restore/capture (pending) and the Redis peer: SET/GET vs memcpy.
absl::StatusOr<Json> RunPrefixAndRedis(const BenchOptions& options);
// 3c. A small (1k-token) entry's capture and restore vs paired memcpy, and where its time goes.
absl::StatusOr<Json> RunPrefixSmall(const BenchOptions& options);
// 4. Session create/release and admission queries.
absl::StatusOr<Json> RunAdmission(const BenchOptions& options);
// 5. Scale: many live sessions in the daemon; many blocks in core's PrefixIndex.
absl::StatusOr<Json> RunScale(const BenchOptions& options);
// Checks, before anything starts, that every stage of the scale section's population fits the
// limits its daemon will run with (FAILED_PRECONDITION naming the stage and the limit): a full
// run (--scale_sessions=10000) that a moved daemon default would break fails here, at once.
absl::Status CheckScaleLimits(const BenchOptions& options);
// 6. The Python client's decode step (python/memra_kv) vs the C++ client's, N = 1 and 256.
absl::StatusOr<Json> RunPythonStep(const BenchOptions& options);
// 6b. Restore and block-store load throughput from Python vs a numpy copy of the same bytes.
absl::StatusOr<Json> RunPythonRestore(const BenchOptions& options);
// 7. Prefix restore by tier (device, disk, a Redis Cluster) vs memcpy and plain GET; capture.
absl::StatusOr<Json> RunPrefixTiers(const BenchOptions& options);
// 8. The block store: an engine pool's blocks stored and loaded vs memcpy and Redis.
absl::StatusOr<Json> RunBlockStore(const BenchOptions& options);
// 9. Two honest engines' decode step with and without one hostile engine per resource.
absl::StatusOr<Json> RunHostileLoad(const BenchOptions& options);

}  // namespace memra::bench

#endif  // MEMRA_BENCH_SECTIONS_H_
