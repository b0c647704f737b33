#ifndef MEMRA_TESTS_E2E_FACTS_H_
#define MEMRA_TESTS_E2E_FACTS_H_

// The facts file an end-to-end engine process leaves for its test (key=value lines: session id
// and token, committed length, ...), and the test's reading of it.

#include <stdio.h>

#include <fstream>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memra::testing {

// Writes `facts` to `path` through a rename, so a test polling for the file never reads half of
// it. Empty `path`: nothing to write.
inline absl::Status WriteFacts(const std::string& path, const std::string& facts) {
  if (path.empty()) return absl::OkStatus();
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial);
    out << facts;
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", partial));
  }
  if (rename(partial.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", partial));
  }
  return absl::OkStatus();
}

// The key=value lines of `path` (empty when it cannot be read).
inline std::map<std::string, std::string> ReadFacts(const std::string& path) {
  std::map<std::string, std::string> facts;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) facts[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return facts;
}

}  // namespace memra::testing

#endif  // MEMRA_TESTS_E2E_FACTS_H_
