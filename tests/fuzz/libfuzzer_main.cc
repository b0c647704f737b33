// libFuzzer entry point over one of the targets in fuzz_targets.h, chosen at compile time
// (-DMEMRA_FUZZ_TARGET=FuzzRequestDecoding or FuzzSessionOps). Built with clang by
// run_libfuzzer.sh, outside Bazel (which builds with GCC); a broken invariant aborts, which
// libFuzzer reports as a crash and saves the input. Replays in the suite: fuzz_test.cc.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Status status =
      memra::fuzz::MEMRA_FUZZ_TARGET(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", std::string(status.ToString()).c_str());
    std::abort();
  }
  return 0;
}
