// End to end, the prefix cache's disk tier: the real memra-kvd binary (host backend) with a
// device tier too small for what engines capture and a disk tier under the test's directory,
// and separate prefix_engine processes. Entries captured by one process are pushed to disk
// files (0600, in a 0700 directory) as newer ones arrive; another process restores each of
// them and checks every byte (the restore reads the files back through io_uring and verifies
// them against the capture's checksums). A file corrupted on disk makes that restore fail and
// the entry is dropped; an unusable disk directory refuses the daemon's start. With a host tier
// between them (plain memory: the tier chain the cuda backend runs over pinned memory),
// entries pass device -> host -> disk and restore from either.

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "client/prefix_client.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "tests/daemon_process.h"
#include "tests/e2e/operator_view.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

// The "*.piece" files directly under `dir`.
std::vector<std::string> PieceFiles(const std::string& dir) {
  std::vector<std::string> files;
  DIR* listing = opendir(dir.c_str());
  if (listing == nullptr) return files;
  while (dirent* entry = readdir(listing)) {
    if (absl::EndsWith(entry->d_name, ".piece")) files.push_back(dir + "/" + entry->d_name);
  }
  closedir(listing);
  return files;
}

class PrefixTiersE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // 16 KiB of device tier: less than the three model kinds capture together.
    std::vector<std::string> args = {"--budget_bytes=512MiB", "--prefix_cache_budget_bytes=16KiB",
                                     "--prefix_slab_bytes=64KiB", "--prefix_block_tokens=16",
                                     "--prefix_disk_dir=" + tier_dir_,
                                     "--prefix_disk_bytes=64MiB"};
    for (std::string& arg : MoreArgs()) args.push_back(std::move(arg));
    ASSERT_TRUE(daemon_.Start(args));
    absl::StatusOr<std::unique_ptr<KvClient>> checker = KvClient::Connect(daemon_.admin_socket());
    ASSERT_THAT(checker, IsOk());
    checker_ = *std::move(checker);
  }

  virtual std::vector<std::string> MoreArgs() { return {}; }

  void TearDown() override {
    checker_.reset();
    if (daemon_.Signal(SIGTERM)) {
      EXPECT_EQ(daemon_.WaitExit(), 0);
    }
  }

  int RunEngine(const std::string& mode, const std::string& plan, uint64_t tokens) {
    const std::string out = absl::StrCat(dir_, "/", plan, ".", mode, ".", ++runs_);
    return WaitExit(Spawn({Runfile("tests/e2e/prefix_engine"), "--socket=" + socket_,
                           "--mode=" + mode, "--plan=" + plan,
                           absl::StrCat("--tokens=", tokens), "--out=" + out}));
  }

  pb::ListPrefixesResponse List() { return ListPrefixes(*checker_); }

  // Entry medium by boundary tokens (each model kind below captures a different length).
  std::map<uint64_t, pb::PrefixMedium> Media() {
    std::map<uint64_t, pb::PrefixMedium> media;
    const pb::ListPrefixesResponse listed = List();
    for (const pb::PrefixEntry& entry : listed.entries()) {
      media[entry.boundary_tokens()] = entry.medium();
    }
    return media;
  }

  DaemonProcess daemon_{"tier"};
  const std::string& dir_ = daemon_.dir();
  const std::string& socket_ = daemon_.socket();
  const std::string tier_dir_ = daemon_.Path("disk-tier");
  std::unique_ptr<KvClient> checker_;
  int runs_ = 0;
};

struct Kind {
  std::string plan;
  uint64_t tokens;
};
const std::vector<Kind> kKinds = {{"flat", 96}, {"hybrid", 64}, {"latent", 80}};

TEST_F(PrefixTiersE2eTest, EntriesPushedToDiskRestoreBitExactlyInAnotherProcess) {
  for (const Kind& kind : kKinds) {
    ASSERT_EQ(RunEngine("capture", kind.plan, kind.tokens), 0) << kind.plan;
  }
  pb::ListPrefixesResponse listed = List();
  ASSERT_EQ(listed.entries_size(), 3);
  ASSERT_EQ(listed.stats().tiers_size(), 2);
  const pb::PrefixTierStats& device = listed.stats().tiers(0);
  const pb::PrefixTierStats& disk = listed.stats().tiers(1);
  EXPECT_EQ(device.medium(), pb::PREFIX_MEDIUM_DEVICE);
  EXPECT_EQ(device.budget_bytes(), 16u << 10);
  EXPECT_LE(device.stored_bytes(), 16u << 10);
  EXPECT_EQ(disk.medium(), pb::PREFIX_MEDIUM_DISK);
  EXPECT_EQ(disk.budget_bytes(), 64u << 20);
  EXPECT_GT(disk.demotions(), 0u);
  EXPECT_EQ(device.stored_bytes() + disk.stored_bytes(), listed.stats().stored_bytes());
  EXPECT_EQ(listed.stats().evicted_entries(), 0u);
  // The oldest entry went to disk first.
  EXPECT_EQ(Media()[96], pb::PREFIX_MEDIUM_DISK);
  // A router hears the move (client.h's event, replayed from the start: all buffered).
  std::unique_ptr<PrefixEventStream> events = checker_->prefixes().SubscribeEvents();
  uint64_t moved_to_disk = 0;
  for (uint64_t i = 0; i < listed.stats().last_sequence(); ++i) {
    absl::StatusOr<std::optional<PrefixCacheEvent>> event = events->Next();
    ASSERT_THAT(event, IsOk());
    ASSERT_TRUE(event->has_value());
    if ((*event)->kind == PrefixEventKind::kMoved && (*event)->medium == StorageMedium::kDisk) {
      moved_to_disk += (*event)->block_keys.size() + ((*event)->boundary_key.has_value() ? 1 : 0);
    }
  }
  events->Cancel();
  EXPECT_EQ(moved_to_disk, disk.demotions());
  struct stat st;
  ASSERT_EQ(stat(tier_dir_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  const std::vector<std::string> files = PieceFiles(tier_dir_);
  EXPECT_EQ(files.size(), disk.demotions());
  for (const std::string& file : files) {
    ASSERT_EQ(stat(file.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << file;
  }

  // Another process restores each one (and checks every byte); disk pieces come back first.
  uint64_t from_disk = 0;
  for (const Kind& kind : kKinds) {
    if (Media()[kind.tokens] == pb::PREFIX_MEDIUM_DISK) ++from_disk;
    EXPECT_EQ(RunEngine("restore", kind.plan, kind.tokens), 0) << kind.plan;
  }
  listed = List();
  EXPECT_EQ(listed.stats().restores(), 3u);
  EXPECT_EQ(listed.stats().dropped_entries(), 0u);
  EXPECT_GE(from_disk, 1u);
  EXPECT_EQ(listed.stats().tiers(1).hits(), from_disk);
  EXPECT_EQ(listed.stats().tiers(0).hits(), 3u - from_disk);
  EXPECT_GT(listed.stats().tiers(1).promotions(), 0u);
  EXPECT_LE(listed.stats().tiers(0).stored_bytes(), 16u << 10);
}

TEST_F(PrefixTiersE2eTest, ACorruptedFileOnDiskFailsTheRestoreAndDropsTheEntry) {
  for (const Kind& kind : kKinds) {
    ASSERT_EQ(RunEngine("capture", kind.plan, kind.tokens), 0) << kind.plan;
  }
  ASSERT_EQ(Media()[96], pb::PREFIX_MEDIUM_DISK);
  // Every file on disk gets one flipped byte: whichever of flat's pieces are there are corrupt.
  const std::vector<std::string> files = PieceFiles(tier_dir_);
  ASSERT_FALSE(files.empty());
  for (const std::string& file : files) {
    std::fstream bytes(file, std::ios::in | std::ios::out | std::ios::binary);
    bytes.seekg(0, std::ios::end);
    const std::streamoff middle = bytes.tellg() / 2;
    bytes.seekg(middle);
    const char original = static_cast<char>(bytes.get());
    bytes.seekp(middle);
    bytes.put(static_cast<char>(original ^ 0x5a));
  }
  EXPECT_NE(RunEngine("restore", "flat", 96), 0);
  const pb::ListPrefixesResponse listed = List();
  EXPECT_EQ(listed.stats().dropped_entries(), 1u);
  EXPECT_EQ(listed.stats().restores(), 0u);
  EXPECT_EQ(Media().count(96), 0u);
  // The daemon keeps serving: a recapture of the same tokens is stored again.
  EXPECT_EQ(RunEngine("capture", "flat", 96), 0);
  EXPECT_EQ(Media().count(96), 1u);
}

// device (16 KiB) -> host (16 KiB of plain memory) -> disk.
class PrefixHostTierE2eTest : public PrefixTiersE2eTest {
 protected:
  std::vector<std::string> MoreArgs() override {
    return {"--prefix_host_tier_bytes=16KiB", "--prefix_host_tier_memory=plain"};
  }
};

TEST_F(PrefixHostTierE2eTest, EntriesPassThroughTheHostTierAndRestoreBitExactly) {
  for (const Kind& kind : kKinds) {
    ASSERT_EQ(RunEngine("capture", kind.plan, kind.tokens), 0) << kind.plan;
  }
  pb::ListPrefixesResponse listed = List();
  ASSERT_EQ(listed.entries_size(), 3);
  ASSERT_EQ(listed.stats().tiers_size(), 3);
  const pb::PrefixTierStats& device = listed.stats().tiers(0);
  const pb::PrefixTierStats& host = listed.stats().tiers(1);
  const pb::PrefixTierStats& disk = listed.stats().tiers(2);
  EXPECT_EQ(device.medium(), pb::PREFIX_MEDIUM_DEVICE);
  EXPECT_EQ(host.medium(), pb::PREFIX_MEDIUM_PINNED_HOST);
  EXPECT_EQ(disk.medium(), pb::PREFIX_MEDIUM_DISK);
  EXPECT_EQ(host.budget_bytes(), 16u << 10);
  EXPECT_LE(device.stored_bytes(), 16u << 10);
  EXPECT_LE(host.stored_bytes(), 16u << 10);
  EXPECT_GT(host.demotions(), 0u);
  EXPECT_EQ(device.stored_bytes() + host.stored_bytes() + disk.stored_bytes(),
            listed.stats().stored_bytes());
  EXPECT_EQ(listed.stats().evicted_entries(), 0u);
  // The oldest entry left the device first.
  EXPECT_NE(Media()[96], pb::PREFIX_MEDIUM_DEVICE);
  bool some_in_host = false;
  for (const pb::PrefixEntry& entry : listed.entries()) {
    some_in_host = some_in_host || entry.medium() == pb::PREFIX_MEDIUM_PINNED_HOST;
  }
  EXPECT_TRUE(some_in_host || disk.stored_bytes() > 0);

  // Another process restores each one, checking every byte, wherever its pieces are.
  for (const Kind& kind : kKinds) {
    EXPECT_EQ(RunEngine("restore", kind.plan, kind.tokens), 0) << kind.plan;
  }
  listed = List();
  EXPECT_EQ(listed.stats().restores(), 3u);
  EXPECT_EQ(listed.stats().dropped_entries(), 0u);
  EXPECT_EQ(listed.stats().tiers(0).hits() + listed.stats().tiers(1).hits() +
                listed.stats().tiers(2).hits(),
            3u);
  EXPECT_GT(listed.stats().tiers(1).promotions() + listed.stats().tiers(2).promotions(), 0u);
  EXPECT_LE(listed.stats().tiers(0).stored_bytes(), 16u << 10);
  EXPECT_LE(listed.stats().tiers(1).stored_bytes(), 16u << 10);
}

// Pinned host memory is the cuda backend's: asked for on the host backend, the start is
// refused with both keys named.
TEST(PrefixTiersStartTest, APinnedHostTierOnTheHostBackendRefusesTheStart) {
  DaemonProcess daemon{"tierpin"};
  const std::string log = daemon.Path("kvd.log");
  const pid_t pid = Spawn({Runfile("server/memra-kvd"), "--socket_path=" + daemon.socket(),
                           "--watchdog=false", "--metrics_address=",
                           "--prefix_cache_budget_bytes=1MiB", "--prefix_host_tier_bytes=1MiB"},
                          /*stdout_path=*/"", log);  // a configuration error goes to stderr
  ASSERT_GT(pid, 0);
  EXPECT_EQ(WaitExit(pid), 78);
  std::ifstream text(log);
  const std::string logged((std::istreambuf_iterator<char>(text)), {});
  EXPECT_THAT(logged, HasSubstrs("prefix_host_tier_bytes = 1048576",
                                 "prefix_host_tier_memory = pinned needs backend = cuda"));
  EXPECT_FALSE(Exists(daemon.socket()));
}

TEST(PrefixTiersStartTest, AnUnusableDiskDirectoryRefusesTheStart) {
  DaemonProcess daemon{"tierbad"};
  const std::string not_a_dir = daemon.Path("a-file");
  std::ofstream(not_a_dir) << "not a directory";
  const std::string log = daemon.Path("kvd.log");
  const pid_t pid = Spawn({Runfile("server/memra-kvd"), "--socket_path=" + daemon.socket(),
                           "--watchdog=false", "--metrics_address=",
                           "--prefix_cache_budget_bytes=1MiB", "--prefix_disk_dir=" + not_a_dir,
                           "--prefix_disk_bytes=1MiB"},
                          log);  // spdlog writes to stdout
  ASSERT_GT(pid, 0);
  EXPECT_EQ(WaitExit(pid), 78);  // kConfigErrorExitCode: reported once, not restarted
  std::ifstream text(log);
  const std::string logged((std::istreambuf_iterator<char>(text)), {});
  EXPECT_THAT(logged, HasSubstrs("FAILED_PRECONDITION", "prefix cache: disk tier: ", not_a_dir,
                                 "is not a directory"));
  EXPECT_FALSE(Exists(daemon.socket()));
}

}  // namespace
}  // namespace memra::testing
