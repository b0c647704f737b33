#include "server/store/store_tier.h"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/host_memory.h"
#include "server/testing/test_host_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr uint64_t kPiece = 10000;

std::vector<uint8_t> Pattern(uint64_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(i * 13 + seed + (i >> 8));
  return out;
}

std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  std::system(absl::StrCat("rm -rf '", dir, "'").c_str());
  return dir;
}

// A device tier, a host tier and a disk tier over the test's own memory, as the store chains them.
class StoreTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::NewTestHostBackend(testing::TestHostBackendOptions(uint64_t{16} << 20));
    ASSERT_NE(backend_, nullptr);
    SlabAllocatorOptions slab_options;
    slab_options.slab_bytes = uint64_t{1} << 20;
    auto slabs = SlabAllocator::Create(slab_options, backend_.get(), nullptr);
    ASSERT_THAT(slabs.status(), IsOk());
    slabs_ = *std::move(slabs);
    host_memory_ = std::make_unique<HostTierMemory>(NewPlainHostMemory());
    auto host_slabs = SlabAllocator::Create(slab_options, host_memory_.get(), nullptr);
    ASSERT_THAT(host_slabs.status(), IsOk());
    host_slabs_ = *std::move(host_slabs);
    DiskTierOptions disk_options;
    disk_options.dir = FreshDir("store_tier");
    disk_options.budget_bytes = uint64_t{1} << 20;
    auto disk = DiskTier::Create(disk_options);
    ASSERT_THAT(disk.status(), IsOk());
    disk_ = *std::move(disk);
    chain_.Add(DeviceStoreTier(backend_.get(), slabs_.get(), 3 << 20, [this](const SlabSpan& span) {
      ++device_frees_;
      EXPECT_THAT(slabs_->Free(span), IsOk());
    }));
    chain_.Add(HostStoreTier(host_slabs_.get(), host_memory_.get(), 2 << 20));
    chain_.Add(DiskStoreTier(disk_.get()));
  }

  // A piece of `bytes` stored in the device tier (held span released, as a recorded piece).
  PieceStorage OnDevice(const std::vector<uint8_t>& bytes) {
    PieceStorage source;
    source.piece_bytes = bytes.size();
    source.checksum = 77;
    source.slice_checksums = {1, 2};
    absl::StatusOr<PieceStorage> stored = chain_.tier(StorageMedium::kDevice)->Insert(
        1, source, PieceSource{.view = absl::MakeConstSpan(bytes), .read_into = NoRead});
    EXPECT_THAT(stored.status(), IsOk());
    if (stored.ok()) {
      EXPECT_THAT(slabs_->Release(stored->span.slab), IsOk());
    }
    return stored.ok() ? *stored : PieceStorage{};
  }

  // Moves `at` from its tier to `to` as the store's demotion does.
  absl::StatusOr<PieceStorage> Move(uint64_t handle, const PieceStorage& at, StorageMedium to) {
    const StoreTier& from = *chain_.tier(at.medium);
    absl::StatusOr<std::optional<absl::Span<const uint8_t>>> view = from.View(handle, at);
    if (!view.ok()) return view.status();
    return chain_.tier(to)->Insert(
        handle, at, PieceSource{.view = *view, .read_into = [&](absl::Span<uint8_t> out) {
                                  return from.ReadInto(handle, at, out);
                                }});
  }

  std::vector<uint8_t> ReadBack(uint64_t handle, const PieceStorage& at) {
    std::vector<uint8_t> buffer;
    absl::StatusOr<absl::Span<const uint8_t>> bytes =
        chain_.tier(at.medium)->Read(handle, at, buffer);
    EXPECT_THAT(bytes.status(), IsOk());
    return bytes.ok() ? std::vector<uint8_t>(bytes->begin(), bytes->end()) : std::vector<uint8_t>{};
  }

  static absl::Status NoRead(absl::Span<uint8_t>) {
    return absl::InternalError("the view should have been used");
  }

  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<SlabAllocator> slabs_;
  std::unique_ptr<HostTierMemory> host_memory_;
  std::unique_ptr<SlabAllocator> host_slabs_;
  std::unique_ptr<DiskTier> disk_;
  TierChain chain_;
  int device_frees_ = 0;
};

TEST_F(StoreTierTest, TheChainRunsDeviceHostDiskWithEachTiersBudget) {
  EXPECT_EQ(chain_.Below(StorageMedium::kDevice), StorageMedium::kPinnedHost);
  EXPECT_EQ(chain_.Below(StorageMedium::kPinnedHost), StorageMedium::kDisk);
  EXPECT_EQ(chain_.Below(StorageMedium::kDisk), std::nullopt);
  EXPECT_EQ(chain_.Below(StorageMedium::kRemote), std::nullopt);
  EXPECT_EQ(chain_.Budget(StorageMedium::kDevice), 3u << 20);
  EXPECT_EQ(chain_.Budget(StorageMedium::kPinnedHost), 2u << 20);
  EXPECT_EQ(chain_.Budget(StorageMedium::kDisk), 1u << 20);
  EXPECT_EQ(chain_.Budget(StorageMedium::kRemote), 0u);
  EXPECT_EQ(chain_.tier(StorageMedium::kRemote), nullptr);
  TierChain device_only;
  device_only.Add(DeviceStoreTier(backend_.get(), slabs_.get(), 5, [](const SlabSpan&) {}));
  EXPECT_EQ(device_only.Below(StorageMedium::kDevice), std::nullopt);
  EXPECT_EQ(device_only.Budget(StorageMedium::kDisk), 0u);
}

TEST_F(StoreTierTest, APieceMovesDownAndBackUpBitExactlyKeepingItsChecksums) {
  const std::vector<uint8_t> bytes = Pattern(kPiece, 3);
  const PieceStorage device = OnDevice(bytes);
  EXPECT_EQ(device.medium, StorageMedium::kDevice);
  EXPECT_EQ(device.span.bytes, *slabs_->RoundedBytes(kPiece));
  EXPECT_EQ(ReadBack(1, device), bytes);

  absl::StatusOr<PieceStorage> host = Move(1, device, StorageMedium::kPinnedHost);
  ASSERT_THAT(host.status(), IsOk());
  EXPECT_EQ(host->medium, StorageMedium::kPinnedHost);
  EXPECT_EQ(host->checksum, 77u);
  EXPECT_EQ(host->slice_checksums, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(ReadBack(1, *host), bytes);
  // In place: the host tier's view is its memory.
  absl::StatusOr<std::optional<absl::Span<const uint8_t>>> view =
      chain_.tier(StorageMedium::kPinnedHost)->View(1, *host);
  ASSERT_THAT(view.status(), IsOk());
  ASSERT_TRUE(view->has_value());
  EXPECT_EQ((*view)->data(),
            host_memory_->Bytes(host->span.slab, host->span.offset, kPiece)->data());
  chain_.tier(StorageMedium::kDevice)->Erase(1, device);
  EXPECT_EQ(device_frees_, 1);

  absl::StatusOr<PieceStorage> disk = Move(1, *host, StorageMedium::kDisk);
  ASSERT_THAT(disk.status(), IsOk());
  EXPECT_EQ(disk->medium, StorageMedium::kDisk);
  EXPECT_EQ(disk->span.bytes, host->span.bytes);  // the rounded size the index counts
  EXPECT_EQ(disk_->stored_bytes(), kPiece);
  EXPECT_EQ(chain_.tier(StorageMedium::kDisk)->IncomingBytes(*host), kPiece);
  EXPECT_EQ(chain_.tier(StorageMedium::kPinnedHost)->IncomingBytes(device), device.span.bytes);
  EXPECT_EQ(ReadBack(1, *disk), bytes);
  chain_.tier(StorageMedium::kPinnedHost)->Erase(1, *host);
  EXPECT_EQ(host_slabs_->Stats().used_bytes, 0u);

  absl::StatusOr<PieceStorage> back = Move(1, *disk, StorageMedium::kDevice);
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_EQ(back->medium, StorageMedium::kDevice);
  EXPECT_EQ(ReadBack(1, *back), bytes);
  // Held once, as Allocate's span: not evictable until the caller records it.
  EXPECT_EQ(slabs_->Stats().evictable_bytes, 0u);
  chain_.tier(StorageMedium::kDisk)->Erase(1, *disk);
  EXPECT_EQ(disk_->stored_bytes(), 0u);
}

TEST_F(StoreTierTest, DescribeNamesWhereEachTierKeepsThePiece) {
  const PieceStorage device = OnDevice(Pattern(kPiece, 1));
  absl::StatusOr<PieceStorage> host = Move(1, device, StorageMedium::kPinnedHost);
  ASSERT_THAT(host.status(), IsOk());
  absl::StatusOr<PieceStorage> disk = Move(1, *host, StorageMedium::kDisk);
  ASSERT_THAT(disk.status(), IsOk());
  EXPECT_EQ(chain_.tier(StorageMedium::kDevice)->Describe(1, device),
            absl::StrCat("device piece (slab ", device.span.slab.value, ", offset ",
                         device.span.offset, ")"));
  EXPECT_EQ(chain_.tier(StorageMedium::kPinnedHost)->Describe(1, *host),
            absl::StrCat("host-tier piece (host memory, slab ", host->span.slab.value,
                         ", offset ", host->span.offset, ")"));
  EXPECT_EQ(chain_.tier(StorageMedium::kDisk)->Describe(1, *disk),
            absl::StrCat("disk file ", disk_->PathOf(1)));
}

TEST_F(StoreTierTest, AFailedInsertKeepsNothing) {
  // The disk tier's budget refuses the file: nothing is written, nothing stays.
  const std::vector<uint8_t> big = Pattern((uint64_t{1} << 20) + 1, 2);
  PieceStorage source;
  source.piece_bytes = big.size();
  EXPECT_THAT(chain_.tier(StorageMedium::kDisk)
                  ->Insert(9, source, PieceSource{.view = absl::MakeConstSpan(big),
                                                  .read_into = NoRead})
                  .status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat(big.size()), absl::StrCat(1 << 20))));
  EXPECT_EQ(disk_->stored_bytes(), 0u);
  // A source that cannot be read: the host span and the device span are given back.
  source.piece_bytes = kPiece;
  const auto broken = [](absl::Span<uint8_t>) { return absl::DataLossError("torn read 42"); };
  EXPECT_THAT(chain_.tier(StorageMedium::kPinnedHost)
                  ->Insert(9, source, PieceSource{.view = std::nullopt, .read_into = broken})
                  .status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstrs("torn read 42")));
  EXPECT_EQ(host_slabs_->Stats().used_bytes, 0u);
  EXPECT_THAT(chain_.tier(StorageMedium::kDevice)
                  ->Insert(9, source, PieceSource{.view = std::nullopt, .read_into = broken})
                  .status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstrs("torn read 42")));
  EXPECT_EQ(slabs_->Stats().used_bytes, 0u);
  EXPECT_EQ(device_frees_, 1);
}

}  // namespace
}  // namespace memra
