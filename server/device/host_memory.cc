#include "server/device/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

class PlainHostMemory final : public HostMemoryProvider {
 public:
  std::string_view Name() const override { return "host"; }
  uint64_t Granularity() const override { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }
  absl::StatusOr<uint8_t*> Allocate(uint64_t bytes) override {
    void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) {
      const int err = errno;
      return absl::ResourceExhaustedError(absl::StrCat("host tier: mmap of ", bytes,
                                                       " bytes failed: ", std::strerror(err)));
    }
    return static_cast<uint8_t*>(memory);
  }
  void Free(uint8_t* memory, uint64_t bytes) override {
    if (munmap(memory, bytes) != 0) {
      spdlog::error("host tier: munmap of {} bytes failed: {}", bytes, std::strerror(errno));
    }
  }
};

}  // namespace

std::unique_ptr<HostMemoryProvider> NewPlainHostMemory() {
  return std::make_unique<PlainHostMemory>();
}

}  // namespace memra
