#ifndef MEMRA_TESTS_FUZZ_FUZZ_TARGETS_H_
#define MEMRA_TESTS_FUZZ_FUZZ_TARGETS_H_

// Fuzz targets over what an untrusted engine controls (issue 14, "Checks that stay"). Each takes
// arbitrary bytes and returns OK unless a rule of the code was broken: a refusal of bad input is
// the code working, so it is OK here; a non-OK status names the broken invariant. Crashes and
// undefined behaviour surface as such (run under --config=asan, or libFuzzer: docs/checking.md).
// The same functions are driven by the seeded mutation run in fuzz_test.cc (in the suite, GCC)
// and by libfuzzer_main.cc (clang's libFuzzer, long local runs).

#include <string_view>

#include "absl/status/status.h"

namespace memra::fuzz {

// Request decoding, as the daemon does it. First byte: 0 = the rest is a serialized
// memra.kv.v1.CostRequest (ModelSelector: fingerprint / inline plan / Hugging Face config.json,
// then plan validation, fingerprinting, PlanSession sizing and cost); 1 = a serialized
// PrepareAppendResponse (LayerAppendsFromProto, as the client decodes it). Checks: decode/encode
// round trips, a validated plan fingerprints, PlanSession's bytes equal its cost's.
absl::Status FuzzRequestDecoding(std::string_view input);

// The session state machine (core/session.h SessionState over KvTransactionCache). First byte:
// the model (dense, SWA ring, latent + indexer, recurrent, hybrid); second: capacity and spec
// buffers; then one op per byte group (Begin, PrepareAppend, PublishAppend, Commit, Abort,
// Rewind, SpecSnapshot, SpecRollback, Hydrate, Reset, Grow, taint). Checks after every op:
// committed <= staged <= capacity; no transaction => staged == committed; latent lengths ==
// staged and index_pools_ready <= len / pool; a refused op changed nothing; CanRewindTo agrees
// with Rewind; Grow never changes its source.
absl::Status FuzzSessionOps(std::string_view input);

}  // namespace memra::fuzz

#endif  // MEMRA_TESTS_FUZZ_FUZZ_TARGETS_H_
