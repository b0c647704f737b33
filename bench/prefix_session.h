#ifndef MEMRA_BENCH_PREFIX_SESSION_H_
#define MEMRA_BENCH_PREFIX_SESSION_H_

// What the prefix sections (prefix_redis.cc: 3, prefix_tiers.cc: 7) share: the dense model they
// store, the token ids they key entries by, how a source session is filled, and the deadline of
// their prefix calls.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "core/model_plan.h"
#include "grpcpp/client_context.h"

namespace memra::bench {

inline constexpr absl::Duration kPrefixDeadline = absl::Seconds(300);

// A dense model small enough that a 128k-token entry, its copy in Redis and the buffers on
// this side fit this machine: Llama-3.2-1B's geometry (16 layers, 8 KV heads of 64).
ModelPlan DenseModel();

// n token ids, distinct per salt.
std::vector<int32_t> TokenIds(uint64_t n, uint64_t salt);

// A client context with kPrefixDeadline (operator calls through the raw stubs).
std::unique_ptr<grpc::ClientContext> PrefixContext();

// Commits `tokens.size()` rows in chunks, each commit carrying its token ids, and writes a
// non-zero byte pattern into every plane (rows' contents are irrelevant to the copy).
absl::Status FillSession(Session& session, const std::vector<int32_t>& tokens);

}  // namespace memra::bench

#endif  // MEMRA_BENCH_PREFIX_SESSION_H_
