#include "client/cuda_mapper.h"

#include <cuda_runtime_api.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/cuda_backend.h"
#include "server/testing/test_cuda_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;

// The child half of CrossProcessMapping reads these; unset in a normal run.
constexpr char kHandleEnv[] = "MEMRA_CUDA_IPC_HANDLE_HEX";
constexpr char kBytesEnv[] = "MEMRA_CUDA_IPC_BYTES";
constexpr uint64_t kPatternOffset = 100;
constexpr uint64_t kChildWriteOffset = 200;
constexpr uint8_t kChildByte = 0x5A;

// No device needed: these are refused before any CUDA call.
TEST(CudaArenaMapperTest, ForeignOrMalformedHandlesAreInvalid) {
  CudaArenaMapper mapper(0);
  EXPECT_THAT(mapper.Map("host", "/memra-kv-x", 4096),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("cuda mapper", "\"host\"")));
  EXPECT_THAT(
      mapper.Map("cuda", std::string(10, 'x'), 4096),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstrs(absl::StrCat("is ", sizeof(cudaIpcMemHandle_t), " bytes"), "got 10")));
  EXPECT_THAT(mapper.Unmap(std::string(64, 'x')),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not mapped")));
  EXPECT_EQ(mapper.OpenCount(), 0u);
}

// Runs only as the child of CrossProcessMapping: maps the parent's arena twice (one open),
// checks the parent's pattern, writes a byte back.
TEST(CudaArenaMapperChild, MapReadWrite) {
  const char* handle_hex = std::getenv(kHandleEnv);
  const char* bytes_text = std::getenv(kBytesEnv);
  uint64_t bytes = 0;
  if (handle_hex == nullptr || bytes_text == nullptr || !absl::SimpleAtoi(bytes_text, &bytes)) {
    GTEST_SKIP() << "runs only as the child of CudaBackendIpcTest.CrossProcessMapping";
  }
  const std::string handle = absl::HexStringToBytes(handle_hex);
  CudaArenaMapper mapper(0);
  absl::StatusOr<void*> first = mapper.Map("cuda", handle, bytes);
  ASSERT_THAT(first, IsOk());
  absl::StatusOr<void*> second = mapper.Map("cuda", handle, bytes);
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(*first, *second);
  EXPECT_EQ(mapper.OpenCount(), 1u);
  auto* base = static_cast<uint8_t*>(*first);
  uint8_t seen[4] = {};
  ASSERT_EQ(cudaMemcpy(seen, base + kPatternOffset, sizeof(seen), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_THAT(seen, ::testing::ElementsAre(9, 8, 7, 6));
  ASSERT_EQ(cudaMemcpy(base + kChildWriteOffset, &kChildByte, 1, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_THAT(mapper.Unmap(handle), IsOk());
}

// A CUDA process cannot open its own IPC export, so the engine side runs in a child: this test
// binary again, filtered to CudaArenaMapperChild, with a minimal environment (no Bazel XML
// output file for it to overwrite).
TEST(CudaBackendIpcTest, CrossProcessMapping) {
  std::unique_ptr<CudaBackend> backend = testing::NewCudaBackendOrNull();
  if (backend == nullptr) GTEST_SKIP();
  absl::StatusOr<ArenaId> arena = backend->CreateArena(1, ArenaVisibility::kExported);
  ASSERT_THAT(arena, IsOk());
  ASSERT_THAT(backend->Write(*arena, kPatternOffset, std::vector<uint8_t>{9, 8, 7, 6}), IsOk());
  absl::StatusOr<ArenaExport> exported = backend->Export(*arena);
  ASSERT_THAT(exported, IsOk());

  const pid_t child = testing::SpawnFilteredSelf(
      "CudaArenaMapperChild.*",
      {absl::StrCat(kHandleEnv, "=", absl::BytesToHexString(exported->handle)),
       absl::StrCat(kBytesEnv, "=", exported->bytes)});
  ASSERT_GT(child, 0);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "the child's failures are in this test's log";

  std::vector<uint8_t> written(1);
  ASSERT_THAT(backend->Read(*arena, kChildWriteOffset, absl::MakeSpan(written)), IsOk());
  EXPECT_EQ(written[0], kChildByte);
}

}  // namespace
}  // namespace memra

namespace memra {
namespace {

// cuda_export = "vmm": the engine maps the descriptor the daemon handed over, and sees the
// daemon's bytes; the handle alone opens nothing.
TEST(CudaVmmMapperTest, TheDescriptorMapsTheDaemonsArena) {
  CudaArenaMapper mapper(0);
  constexpr char kHandle[] = "vmm-00112233445566778899aabbccddeeff";
  // The handle alone opens nothing: the descriptor comes over the handoff socket.
  EXPECT_THAT(mapper.Map("cuda", kHandle, 2 << 20),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("CUDA VMM", "handoff socket")));
  // A descriptor of another size is refused before the driver sees it.
  int fetches = 0;
  EXPECT_THAT(mapper.Map("cuda", kHandle, 2 << 20,
                         [&]() -> absl::StatusOr<ArenaFd> {
                           ++fetches;
                           return ArenaFd{.fd = ScopedFd(), .bytes = 4 << 20};
                         }),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("the daemon handed a descriptor of 4194304 bytes",
                                  "asked for 2097152")));
  EXPECT_EQ(fetches, 1);
  EXPECT_EQ(mapper.OpenCount(), 0u);
  if (testing::NewCudaBackendOrNull() == nullptr) GTEST_SKIP();
  absl::StatusOr<std::unique_ptr<CudaBackend>> daemon =
      CudaBackend::Create({.device = 0, .vmm_exports = true});
  ASSERT_THAT(daemon, IsOk());
  absl::StatusOr<ArenaId> arena = (*daemon)->CreateArena(2 << 20, ArenaVisibility::kExported);
  ASSERT_THAT(arena, IsOk());
  ASSERT_THAT((*daemon)->Write(*arena, 64, std::vector<uint8_t>{1, 2, 3}), IsOk());
  absl::StatusOr<int> fd = (*daemon)->DuplicateArenaFd(*arena);
  ASSERT_THAT(fd, IsOk());
  absl::StatusOr<std::unique_ptr<CachingArenaMapper::Mapping>> mapped =
      MapVmmDescriptor(0, *fd, 2 << 20);
  close(*fd);
  ASSERT_THAT(mapped, IsOk());
  uint8_t back[3] = {};
  ASSERT_EQ(cudaMemcpy(back, static_cast<uint8_t*>((*mapped)->data()) + 64, 3,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back[0], 1);
  EXPECT_EQ(back[2], 3);
  // Through the mapper, as a KvClient maps it: the descriptor source gives the arena's fd.
  absl::StatusOr<ArenaExport> exported = (*daemon)->Export(*arena);
  ASSERT_THAT(exported, IsOk());
  absl::StatusOr<void*> through_mapper =
      mapper.Map("cuda", exported->handle, 2 << 20, [&]() -> absl::StatusOr<ArenaFd> {
        absl::StatusOr<int> handed = (*daemon)->DuplicateArenaFd(*arena);
        if (!handed.ok()) return handed.status();
        return ArenaFd{.fd = ScopedFd(*handed), .bytes = 2 << 20};
      });
  ASSERT_THAT(through_mapper, IsOk());
  ASSERT_EQ(cudaMemcpy(back, static_cast<uint8_t*>(*through_mapper) + 64, 3,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back[1], 2);
  EXPECT_THAT(mapper.Unmap(exported->handle), IsOk());
  const absl::Status bad_fd = MapVmmDescriptor(0, -1, 2 << 20).status();
  EXPECT_FALSE(bad_fd.ok());
  EXPECT_THAT(std::string(bad_fd.message()), HasSubstr("cuMemImportFromShareableHandle (fd -1)"));
  EXPECT_THAT(MapVmmDescriptor(0, -1, 12345).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("12345 bytes is not a positive multiple")));
}

}  // namespace
}  // namespace memra
