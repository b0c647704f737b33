#ifndef MEMRA_TESTS_ENGINE_EXIT_H_
#define MEMRA_TESTS_ENGINE_EXIT_H_

// The exit status of a test engine process, for its main(): 0 when `status` is OK, otherwise 1
// after "<program> <label>: <status>" on stderr (the spawning test prints the engine's stderr
// when it fails, so the label says which engine of several it was).

#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace memra::testing {

inline int EngineExit(absl::string_view program, absl::string_view label,
                      const absl::Status& status) {
  if (status.ok()) return 0;
  std::fprintf(stderr, "%s %s: %s\n", std::string(program).c_str(), std::string(label).c_str(),
               status.ToString().c_str());
  return 1;
}

}  // namespace memra::testing

#endif  // MEMRA_TESTS_ENGINE_EXIT_H_
