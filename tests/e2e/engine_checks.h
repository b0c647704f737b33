#ifndef MEMRA_TESTS_E2E_ENGINE_CHECKS_H_
#define MEMRA_TESTS_E2E_ENGINE_CHECKS_H_

// What the end-to-end tests (host: tests/e2e/e2e_test.cc, cuda: tests/cuda/cuda_e2e_test.cc)
// check of a test_engine from outside it, as a third process. GoogleTest assertions.

#include <cstdint>
#include <map>
#include <string>

#include "client/client.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "tests/e2e/engine_device.h"

namespace memra::testing {

using Facts = std::map<std::string, std::string>;

inline constexpr uint64_t kE2eRingRows = 4671;  // SwaRingRows(32, kE2eCapacity)

// A number of an engine's facts file (a test failure, and 0, when missing or malformed).
uint64_t Number(const Facts& facts, const std::string& key);

// The engine named `name` in the daemon's status, or null.
const memra::kv::v1::EngineStatus* FindEngine(const memra::kv::v1::GetStatusResponse& status,
                                              const std::string& name);

// The engine whose facts these are ran the script (tests/e2e/engine_script.h) with --spec: it
// wrapped the SWA ring, rewound, committed partially and rolled speculation back. Then, as this
// process sees it: the daemon's lengths and ring bases; on cuda every byte and mirror of the
// session read through this process's own mapping of its arenas with `device` (unmapped again
// before returning, so the daemon alone decides when the memory goes); on host, that the daemon
// refuses this process the arenas' descriptors (`checker` attaches as another engine for that,
// if it is not attached).
void ExpectScriptedSession(KvClient& checker, const Facts& facts, EngineDevice& device);

}  // namespace memra::testing

#endif  // MEMRA_TESTS_E2E_ENGINE_CHECKS_H_
