#include "server/device/cuda_backend.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/test_cuda_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::vector<uint8_t> ReadAllOf(DeviceBackend& backend, ArenaId arena, uint64_t offset,
                               uint64_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_THAT(backend.Read(arena, offset, absl::MakeSpan(out)), IsOk());
  return out;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::NewCudaBackendOrNull();
    if (backend_ == nullptr) GTEST_SKIP();
  }

  std::vector<uint8_t> ReadAll(ArenaId arena, uint64_t offset, uint64_t bytes) {
    return ReadAllOf(*backend_, arena, offset, bytes);
  }

  std::unique_ptr<CudaBackend> backend_;
};

TEST_F(CudaBackendTest, ReportsTheDevice) {
  const DeviceInfo info = backend_->Info();
  EXPECT_FALSE(info.name.empty());
  EXPECT_THAT(info.uuid, ::testing::MatchesRegex("GPU-[0-9a-f-]{36}"));
  EXPECT_GT(info.total_bytes, 0u);
  EXPECT_LE(info.free_bytes, info.total_bytes);
  EXPECT_EQ(backend_->Name(), "cuda");
  EXPECT_EQ(backend_->AllocationGranularity(), 2 * kMiB);
}

TEST_F(CudaBackendTest, CreateExportCopyFree) {
  absl::StatusOr<ArenaId> exported = backend_->CreateArena(3 * kMiB, ArenaVisibility::kExported);
  absl::StatusOr<ArenaId> priv = backend_->CreateArena(1, ArenaVisibility::kPrivate);
  ASSERT_THAT(exported, IsOk());
  ASSERT_THAT(priv, IsOk());
  EXPECT_EQ(backend_->AllocatedBytes(), 6 * kMiB);
  EXPECT_EQ(backend_->ArenaCount(), 2u);
  EXPECT_THAT(ReadAll(*exported, 4 * kMiB - 64, 64), Each(0));  // zero-filled, rounded size

  absl::StatusOr<ArenaExport> info = backend_->Export(*exported);
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->backend, "cuda");
  EXPECT_EQ(info->handle.size(), sizeof(cudaIpcMemHandle_t));
  EXPECT_EQ(info->bytes, 4 * kMiB);
  EXPECT_THAT(backend_->Export(*priv),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("private")));

  ASSERT_THAT(backend_->Write(*exported, 10, std::vector<uint8_t>{1, 2, 3, 4, 5, 6}), IsOk());
  ASSERT_THAT(backend_->Copy(*priv, 100, *exported, 11, 4), IsOk());
  EXPECT_THAT(ReadAll(*priv, 99, 6), ElementsAre(0, 2, 3, 4, 5, 0));
  ASSERT_THAT(backend_->Memset(*priv, 100, 0xEE, 2), IsOk());
  ASSERT_THAT(backend_->WriteI32(*priv, 1001, -9), IsOk());
  EXPECT_THAT(ReadAll(*priv, 99, 4), ElementsAre(0, 0xEE, 0xEE, 4));
  absl::StatusOr<int32_t> value = backend_->ReadI32(*priv, 1001);
  ASSERT_THAT(value, IsOk());
  EXPECT_EQ(*value, -9);
  EXPECT_THAT(backend_->Synchronize(), IsOk());

  ASSERT_THAT(backend_->FreeArena(*exported), IsOk());
  ASSERT_THAT(backend_->FreeArena(*priv), IsOk());
  EXPECT_EQ(backend_->AllocatedBytes(), 0u);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
  EXPECT_THAT(backend_->FreeArena(*priv), StatusIs(absl::StatusCode::kNotFound,
                                                   HasSubstr(absl::StrCat("arena ", priv->value))));
}

TEST_F(CudaBackendTest, OverlappingCopyWithinOneArenaIsAMemmove) {
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(1, ArenaVisibility::kPrivate);
  ASSERT_THAT(arena, IsOk());
  std::vector<uint8_t> pattern(16);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i + 1);
  ASSERT_THAT(backend_->Write(*arena, 0, pattern), IsOk());
  ASSERT_THAT(backend_->Copy(*arena, 4, *arena, 0, 10), IsOk());
  EXPECT_THAT(ReadAll(*arena, 0, 16),
              ElementsAre(1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 16));
  ASSERT_THAT(backend_->Copy(*arena, 0, *arena, 4, 10), IsOk());
  EXPECT_THAT(ReadAll(*arena, 0, 16),
              ElementsAre(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 7, 8, 9, 10, 15, 16));
}

TEST_F(CudaBackendTest, WriteI32sAndCopyRangesChecksummedMatchTheHost) {
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(20 * kMiB, ArenaVisibility::kPrivate);
  ASSERT_THAT(arena, IsOk());
  const std::vector<I32Write> writes = {{0, 1}, {13, -2}, {13, 3}, {20 * kMiB - 4, 4}};
  ASSERT_THAT(backend_->WriteI32s(*arena, writes), IsOk());
  absl::StatusOr<int32_t> value = backend_->ReadI32(*arena, 13);
  ASSERT_THAT(value, IsOk());
  EXPECT_EQ(*value, 3);
  // Ranges larger than the 8 MiB hashing chunk; the hash is of the source in range order.
  absl::StatusOr<ArenaId> dst = backend_->CreateArena(20 * kMiB, ArenaVisibility::kPrivate);
  ASSERT_THAT(dst, IsOk());
  std::vector<uint8_t> bytes(17 * kMiB + 5);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 131 + 1);
  ASSERT_THAT(backend_->Write(*arena, 3, bytes), IsOk());
  const uint64_t head = 9 * kMiB;
  const std::vector<CopyRange> ranges = {
      {.dst_offset = 0, .src_offset = 3 + head, .bytes = bytes.size() - head},
      {.dst_offset = bytes.size() - head, .src_offset = 3, .bytes = head}};
  std::vector<uint8_t> expected(bytes.begin() + head, bytes.end());
  expected.insert(expected.end(), bytes.begin(), bytes.begin() + head);
  absl::StatusOr<uint64_t> checksum = backend_->CopyRangesChecksummed(*dst, *arena, ranges);
  ASSERT_THAT(checksum, IsOk());
  EXPECT_EQ(*checksum, XXH3_64bits(expected.data(), expected.size()));
  EXPECT_EQ(ReadAll(*dst, 0, expected.size()), expected);
  EXPECT_THAT(backend_->WriteI32s(*arena, {{{0, 9}, {20 * kMiB - 3, 9}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("WriteI32s", absl::StrCat("offset ", 20 * kMiB - 3))));
  value = backend_->ReadI32(*arena, 0);
  ASSERT_THAT(value, IsOk());
  EXPECT_EQ(*value, 1);  // the refused batch stored nothing
}

// A session's mirrors as one batch (distinct offsets: cudaMemcpyBatchAsync from CUDA 12.8) and
// one copy per mirror give the same device bytes.
TEST_F(CudaBackendTest, MirrorStoresBatchedOrOneByOneLandTheSameValues) {
  std::unique_ptr<CudaBackend> one_by_one =
      testing::NewCudaBackendOrNull({.device = 0, .batch_mirror_writes = false});
  ASSERT_NE(one_by_one, nullptr);
  for (CudaBackend* backend : {backend_.get(), one_by_one.get()}) {
    absl::StatusOr<ArenaId> arena = backend->CreateArena(2 * kMiB, ArenaVisibility::kPrivate);
    ASSERT_THAT(arena, IsOk());
    std::vector<I32Write> writes;
    for (int32_t i = 0; i < 64; ++i) writes.push_back({uint64_t(i) * 256 + 4, 1000 + i * 7});
    ASSERT_THAT(backend->WriteI32s(*arena, writes), IsOk());
    for (const I32Write& write : writes) {
      EXPECT_THAT(backend->ReadI32(*arena, write.offset), IsOkAndHolds(write.value));
    }
    EXPECT_THAT(backend->ReadI32(*arena, 0), IsOkAndHolds(0));  // nothing stored between them
    EXPECT_THAT(backend->FreeArena(*arena), IsOk());
  }
}

TEST_F(CudaBackendTest, OutOfRangeAndOverflowAreRefusedBeforeTheDevice) {
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(1, ArenaVisibility::kPrivate);
  ASSERT_THAT(arena, IsOk());
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  const std::string size = absl::StrCat("arena ", arena->value, " of ", 2 * kMiB, " bytes");
  EXPECT_THAT(backend_->Memset(*arena, 2 * kMiB - 1, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("Memset", absl::StrCat("offset ", 2 * kMiB - 1, " + 2"), size)));
  EXPECT_THAT(
      backend_->Copy(*arena, 0, *arena, max, 1),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("Copy source", "overflows", size)));
  EXPECT_THAT(backend_->CreateArena(max, ArenaVisibility::kPrivate),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

TEST_F(CudaBackendTest, EngineEventHandlesAreChecked) {
  EXPECT_THAT(backend_->WaitForEngineEvent(""), IsOk());
  EXPECT_THAT(backend_->WaitForEngineEvent(std::string(10, 'x')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("64 bytes", "got 10")));
  // 64 bytes that no process exported: the runtime refuses to open them.
  const absl::Status unknown = backend_->WaitForEngineEvent(std::string(64, '\0'));
  EXPECT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.message(), HasSubstr("cudaIpcOpenEventHandle"));
}

}  // namespace
}  // namespace memra

namespace memra {
namespace {

// cuda_export = "vmm": arenas are VMM allocations shared as descriptors, so a kept descriptor
// brings the same device memory back in a second backend (the restarted daemon).
TEST(CudaVmmBackendTest, AKeptDescriptorBringsTheSameDeviceMemoryBack) {
  if (testing::NewCudaBackendOrNull() == nullptr) GTEST_SKIP();
  absl::StatusOr<std::unique_ptr<CudaBackend>> first =
      CudaBackend::Create({.device = 0, .vmm_exports = true});
  ASSERT_THAT(first, IsOk());
  absl::StatusOr<ArenaId> arena = (*first)->CreateArena(3 * kMiB, ArenaVisibility::kExported);
  ASSERT_THAT(arena, IsOk());
  absl::StatusOr<ArenaExport> exported = (*first)->Export(*arena);
  ASSERT_THAT(exported, IsOk());
  EXPECT_THAT(exported->handle, ::testing::MatchesRegex("vmm-[0-9a-f]{32}"));
  EXPECT_EQ(exported->bytes, 4 * kMiB);
  std::vector<uint8_t> zeros(4 * kMiB, 0xff);
  ASSERT_THAT((*first)->Read(*arena, 0, absl::MakeSpan(zeros)), IsOk());
  EXPECT_THAT(zeros, Each(0)) << "a new VMM arena is zero-filled";
  const std::vector<uint8_t> bytes = {9, 8, 7, 6};
  ASSERT_THAT((*first)->Write(*arena, 3 * kMiB + 5, bytes), IsOk());
  absl::StatusOr<int> kept = (*first)->DuplicateArenaFd(*arena);
  ASSERT_THAT(kept, IsOk());
  // The first daemon goes; the kept descriptor holds the allocation.
  first->reset();
  absl::StatusOr<std::unique_ptr<CudaBackend>> next =
      CudaBackend::Create({.device = 0, .vmm_exports = true});
  ASSERT_THAT(next, IsOk());
  absl::StatusOr<ArenaId> adopted = (*next)->AdoptArenaFd(*kept, 4 * kMiB, exported->handle);
  ASSERT_THAT(adopted, IsOk());
  std::vector<uint8_t> back(4);
  ASSERT_THAT((*next)->Read(*adopted, 3 * kMiB + 5, absl::MakeSpan(back)), IsOk());
  EXPECT_EQ(back, bytes);
  ASSERT_THAT((*next)->FreeArena(*adopted), IsOk());
  EXPECT_EQ((*next)->AllocatedBytes(), 0u);
}

TEST(CudaVmmBackendTest, IpcModeCannotAdoptAndPrivateArenasHaveNoDescriptor) {
  std::unique_ptr<CudaBackend> ipc = testing::NewCudaBackendOrNull();
  if (ipc == nullptr) GTEST_SKIP();
  EXPECT_THAT(ipc->AdoptArenaFd(-1, 2 * kMiB, "vmm-0"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("2097152-byte arena", "cuda_export = \"ipc\"")));
  absl::StatusOr<ArenaId> ipc_arena = ipc->CreateArena(kMiB, ArenaVisibility::kExported);
  ASSERT_THAT(ipc_arena, IsOk());
  EXPECT_THAT(ipc->DuplicateArenaFd(*ipc_arena),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not file descriptors")));
  absl::StatusOr<std::unique_ptr<CudaBackend>> vmm =
      CudaBackend::Create({.device = 0, .vmm_exports = true});
  ASSERT_THAT(vmm, IsOk());
  absl::StatusOr<ArenaId> private_arena = (*vmm)->CreateArena(kMiB, ArenaVisibility::kPrivate);
  ASSERT_THAT(private_arena, IsOk());
  EXPECT_THAT((*vmm)->DuplicateArenaFd(*private_arena),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is private")));
}

// --- An engine's pool mapped from its CUDA IPC handle (the block store on cuda) ---

// The child half of EnginePoolFromIpcHandle reads these; unset in a normal run.
constexpr char kPoolHandleFdEnv[] = "MEMRA_POOL_HANDLE_FD";  // writes the handle's hex here
constexpr char kPoolDoneFdEnv[] = "MEMRA_POOL_DONE_FD";      // EOF: the daemon side is done
constexpr uint64_t kPoolAllocationBytes = 4 * kMiB;
constexpr uint64_t kPoolWriteOffset = 2 * kMiB;  // the daemon side writes 0x77 here
constexpr uint8_t kPoolDaemonByte = 0x77;

uint8_t PoolPattern(uint64_t i) { return static_cast<uint8_t>(i % 251); }

// Runs only as the child of EnginePoolFromIpcHandle: the engine. Allocates its pool, fills it,
// hands the IPC handle over, waits for the daemon side, then checks what the daemon wrote.
TEST(CudaEnginePoolChild, ExportAndCheck) {
  int handle_fd = -1;
  int done_fd = -1;
  const char* handle_text = std::getenv(kPoolHandleFdEnv);
  const char* done_text = std::getenv(kPoolDoneFdEnv);
  if (handle_text == nullptr || done_text == nullptr ||
      !absl::SimpleAtoi(handle_text, &handle_fd) || !absl::SimpleAtoi(done_text, &done_fd)) {
    GTEST_SKIP() << "runs only as the child of CudaEnginePoolTest.EnginePoolFromIpcHandle";
  }
  void* pool = nullptr;
  ASSERT_EQ(cudaMalloc(&pool, kPoolAllocationBytes), cudaSuccess);
  std::vector<uint8_t> pattern(kPoolAllocationBytes);
  for (uint64_t i = 0; i < pattern.size(); ++i) pattern[i] = PoolPattern(i);
  ASSERT_EQ(cudaMemcpy(pool, pattern.data(), pattern.size(), cudaMemcpyHostToDevice), cudaSuccess);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, pool), cudaSuccess);
  const std::string hex = absl::StrCat(
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(&handle),
                                               sizeof(handle))),
      "\n");
  ASSERT_EQ(write(handle_fd, hex.data(), hex.size()), static_cast<ssize_t>(hex.size()));
  close(handle_fd);
  char byte;
  while (read(done_fd, &byte, 1) > 0) {
  }
  std::vector<uint8_t> back(4096);
  ASSERT_EQ(cudaMemcpy(back.data(), static_cast<uint8_t*>(pool) + kPoolWriteOffset, back.size(),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_THAT(back, Each(kPoolDaemonByte));
  ASSERT_EQ(cudaFree(pool), cudaSuccess);
}

// A CUDA process cannot open its own IPC export, so the engine runs in a child (this binary
// again, filtered to CudaEnginePoolChild): two buffers of its one allocation map as one arena
// (one open), copies read and write exactly the buffers, a range outside them or past the
// allocation is refused, and the completion event is a 64-byte interprocess handle.
TEST(CudaEnginePoolTest, EnginePoolFromIpcHandle) {
  std::unique_ptr<CudaBackend> backend = testing::NewCudaBackendOrNull();
  if (backend == nullptr) GTEST_SKIP();
  // Close-on-exec everywhere; the child gets only its two ends, at fixed numbers, so the done
  // pipe's EOF reaches it when this side closes.
  int handle_pipe[2];
  int done_pipe[2];
  ASSERT_EQ(pipe2(handle_pipe, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(done_pipe, O_CLOEXEC), 0);
  constexpr int kChildHandleFd = 100;
  constexpr int kChildDoneFd = 101;
  posix_spawn_file_actions_t actions;
  ASSERT_EQ(posix_spawn_file_actions_init(&actions), 0);
  ASSERT_EQ(posix_spawn_file_actions_adddup2(&actions, handle_pipe[1], kChildHandleFd), 0);
  ASSERT_EQ(posix_spawn_file_actions_adddup2(&actions, done_pipe[0], kChildDoneFd), 0);
  const pid_t child = testing::SpawnFilteredSelf(
      "CudaEnginePoolChild.*",
      {absl::StrCat(kPoolHandleFdEnv, "=", kChildHandleFd),
       absl::StrCat(kPoolDoneFdEnv, "=", kChildDoneFd)},
      &actions);
  posix_spawn_file_actions_destroy(&actions);
  ASSERT_GT(child, 0);
  close(handle_pipe[1]);
  close(done_pipe[0]);
  std::string hex;
  char c;
  while (read(handle_pipe[0], &c, 1) == 1 && c != '\n') hex.push_back(c);
  close(handle_pipe[0]);
  ASSERT_EQ(hex.size(), 2 * kCudaIpcHandleBytes) << "the engine child handed no handle";
  const std::string handle = absl::HexStringToBytes(hex);

  // Past the allocation: refused with the driver's size, nothing left open.
  EXPECT_THAT(
      backend->MapEngineIpcBuffers(std::vector<EngineBufferIpc>{
          {.ipc_handle = handle, .offset_in_allocation = kPoolAllocationBytes - 10, .bytes = 20}}),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstrs("buffer 0", "= 4194314", "CUDA allocation of 4194304")));
  absl::StatusOr<MappedEngineBuffers> pool =
      backend->MapEngineIpcBuffers(std::vector<EngineBufferIpc>{
          {.ipc_handle = handle, .offset_in_allocation = 4096, .bytes = kMiB},
          {.ipc_handle = handle, .offset_in_allocation = kPoolWriteOffset, .bytes = kMiB}});
  ASSERT_THAT(pool, IsOk());
  ASSERT_EQ(pool->base.size(), 2u);
  EXPECT_EQ(pool->base[1] - pool->base[0], kPoolWriteOffset - 4096);
  EXPECT_EQ(backend->ArenaCount(), 0u);  // the engine's memory, not charged

  absl::StatusOr<ArenaId> store = backend->CreateArena(kMiB, ArenaVisibility::kPrivate);
  ASSERT_THAT(store, IsOk());
  std::vector<uint8_t> expected(8192);
  for (uint64_t i = 0; i < expected.size(); ++i) expected[i] = PoolPattern(4096 + 100 + i);
  EXPECT_THAT(backend->CopyRangesChecksummed(
                  *store, pool->arena,
                  std::vector<CopyRange>{{.dst_offset = 0, .src_offset = pool->base[0] + 100,
                                          .bytes = expected.size()}}),
              IsOkAndHolds(XXH3_64bits(expected.data(), expected.size())));
  EXPECT_EQ(ReadAllOf(*backend, *store, 0, expected.size()), expected);
  // The end of buffer 0 plus one byte: inside the arena's span, outside every buffer.
  EXPECT_THAT(backend->CopyRangesChecksummed(
                  *store, pool->arena,
                  std::vector<CopyRange>{{.dst_offset = 0, .src_offset = pool->base[0] + kMiB - 1,
                                          .bytes = 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("not inside one of its 2 engine buffers")));
  ASSERT_THAT(backend->Memset(pool->arena, pool->base[1], kPoolDaemonByte, 4096), IsOk());
  absl::StatusOr<std::string> completion = backend->RecordCompletionEvent();
  ASSERT_THAT(completion, IsOk());
  EXPECT_EQ(completion->size(), sizeof(cudaIpcEventHandle_t));
  ASSERT_THAT(backend->FreeArena(pool->arena), IsOk());  // closes the handle
  EXPECT_THAT(backend->Memset(pool->arena, pool->base[1], 0, 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no arena")));

  close(done_pipe[1]);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "the engine child's failures are in this test's log";
}

}  // namespace
}  // namespace memra
