// BlockStoreClient, the block-store view of a KvClient (client/block_store_client.h): it rides
// the client's one connection, lease and handoff connection (a view taken before Attach serves
// after it, copies are the same view, no second engine), and once its KvClient is gone every
// call is refused, naming the call, and changes nothing. The store's own rules are
// block_store_test's.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "client/block_store_client.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/store/block_store.h"
#include "tests/service/test_daemon.h"
#include "tests/status_matchers.h"
#include "tests/test_block_pool.h"

namespace memra::testing {
namespace {

using ::testing::HasSubstr;

const TestPoolShape kShape;

class BlockStoreClientTest : public DaemonTest {
 protected:
  // The stored blocks' slabs go with the prefix cache, so with the daemon: gone before the
  // fixture checks that the backend holds nothing.
  void TearDown() override {
    client_.reset();
    if (daemon_ != nullptr) daemon_->Shutdown();
    daemon_.reset();
    DaemonTest::TearDown();
  }

  void ConfigureDaemon(DaemonConfig& config) override {
    config.prefix_cache_budget_bytes = uint64_t{4} << 20;
    config.prefix_slab_bytes = uint64_t{1} << 20;
  }

  TestBlockPool MustPool() {
    absl::StatusOr<TestBlockPool> pool = TestBlockPool::Create(kShape);
    EXPECT_THAT(pool.status(), IsOk());
    return *std::move(pool);
  }

  static BlockStoreCall ByHashes(uint64_t registration_id, std::vector<std::string> hashes,
                                 std::vector<uint32_t> block_ids = {}) {
    BlockStoreCall call;
    call.registration_id = registration_id;
    call.keys.hashes = std::move(hashes);
    call.block_ids = std::move(block_ids);
    return call;
  }

  // The refusal of a view's call after its KvClient was destroyed.
  static auto Gone(const std::string& call) {
    return StatusIs(absl::StatusCode::kFailedPrecondition,
                    HasSubstrs(call, "after its KvClient was destroyed",
                               "a view is valid while its KvClient lives"));
  }
};

TEST_F(BlockStoreClientTest, AViewTakenBeforeAttachServesThroughTheLeaseAndHandoffAttachOpens) {
  absl::StatusOr<std::unique_ptr<KvClient>> late = KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(late.status(), IsOk());
  const BlockStoreClient blocks = (*late)->block_store();
  TestBlockPool pool = MustPool();
  EXPECT_THAT(blocks.OfferPoolBuffer(pool.fd(), pool.bytes()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("offering a pool buffer before Attach")));
  const PoolBufferRef no_buffer{.handoff_buffer_id = 1, .bytes = pool.bytes()};
  EXPECT_THAT(blocks.RegisterPool(kShape.Spec(), {&no_buffer, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("RegisterPool before Attach: sessions need a lease")));
  EXPECT_THAT(blocks.Lookup(ByHashes(1, TestBlockHashes(0, 1))),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("LookupBlocks before Attach: sessions need a lease")));

  const size_t engines_before = EngineCount();
  ASSERT_THAT((*late)->Attach("engine-late"), IsOk());
  // The same view value now offers over the handoff connection Attach opened and registers
  // under its lease.
  absl::StatusOr<uint64_t> buffer = blocks.OfferPoolBuffer(pool.fd(), pool.bytes());
  ASSERT_THAT(buffer.status(), IsOk());
  const PoolBufferRef ref{.handoff_buffer_id = *buffer, .bytes = pool.bytes()};
  absl::StatusOr<RegisteredPool> registered = blocks.RegisterPool(kShape.Spec(), {&ref, 1});
  ASSERT_THAT(registered.status(), IsOk());
  const uint64_t id = registered->registration_id;

  // A copy and a fresh view are the same engine: one stores, one pins, the third unpins.
  pool.Fill(0, 7);
  const BlockStoreClient copy = blocks;
  absl::StatusOr<BlockStoreTransfer> stored = copy.Store(ByHashes(id, TestBlockHashes(0, 1), {0}));
  ASSERT_THAT(stored.status(), IsOk());
  ASSERT_EQ(stored->blocks.size(), 1u);
  EXPECT_THAT(stored->blocks[0].status, IsOk());
  BlockStoreCall lookup = ByHashes(id, TestBlockHashes(0, 1));
  lookup.pin_ttl_ms = 1000;
  absl::StatusOr<BlockStoreMatch> match = blocks.Lookup(lookup);
  ASSERT_THAT(match.status(), IsOk());
  EXPECT_EQ(match->matched_blocks, 1u);
  EXPECT_NE(match->pin_id, 0u);
  BlockStoreCall load = ByHashes(id, TestBlockHashes(0, 1), {1});
  absl::StatusOr<BlockStoreTransfer> loaded = (*late)->block_store().Load(load);
  ASSERT_THAT(loaded.status(), IsOk());
  EXPECT_TRUE(pool.Holds(1, 7));
  EXPECT_EQ(daemon_->block_store().counts().pins, 1u);
  EXPECT_THAT((*late)->block_store().Unpin(match->pin_id), IsOk());
  EXPECT_EQ(daemon_->block_store().counts().pins, 0u);
  EXPECT_THAT(copy.UnregisterPool(id), IsOk());
  EXPECT_EQ(daemon_->block_store().counts().registrations, 0u);

  // One engine more for the client and all its views: none attached on its own.
  EXPECT_EQ(EngineCount(), engines_before + 1);
}

TEST_F(BlockStoreClientTest, EveryCallOfAViewWhoseKvClientIsGoneIsRefusedAndChangesNothing) {
  std::unique_ptr<KvClient> other = NewClient("engine-gone");
  ASSERT_NE(other, nullptr);
  TestBlockPool pool = MustPool();
  const BlockStoreClient orphan = other->block_store();
  absl::StatusOr<uint64_t> buffer = orphan.OfferPoolBuffer(pool.fd(), pool.bytes());
  ASSERT_THAT(buffer.status(), IsOk());
  const PoolBufferRef ref{.handoff_buffer_id = *buffer, .bytes = pool.bytes()};
  absl::StatusOr<RegisteredPool> registered = orphan.RegisterPool(kShape.Spec(), {&ref, 1});
  ASSERT_THAT(registered.status(), IsOk());
  const uint64_t id = registered->registration_id;
  ASSERT_THAT(orphan.Store(ByHashes(id, TestBlockHashes(0, 1), {0})).status(), IsOk());
  BlockStoreCall lookup = ByHashes(id, TestBlockHashes(0, 1));
  lookup.pin_ttl_ms = 1000;
  absl::StatusOr<BlockStoreMatch> pinned = orphan.Lookup(lookup);
  ASSERT_THAT(pinned.status(), IsOk());
  const BlockStore::Counts before = daemon_->block_store().counts();
  ASSERT_EQ(before.registrations, 1u);
  ASSERT_EQ(before.pins, 1u);
  other.reset();

  EXPECT_THAT(orphan.OfferPoolBuffer(pool.fd(), pool.bytes()),
              Gone("BlockStoreClient::OfferPoolBuffer"));
  EXPECT_THAT(orphan.RegisterPool(kShape.Spec(), {&ref, 1}),
              Gone("BlockStoreClient::RegisterPool"));
  EXPECT_THAT(orphan.Store(ByHashes(id, TestBlockHashes(1, 1), {1})),
              Gone("BlockStoreClient::Store"));
  EXPECT_THAT(orphan.Lookup(lookup), Gone("BlockStoreClient::Lookup"));
  EXPECT_THAT(orphan.Load(ByHashes(id, TestBlockHashes(0, 1), {2})),
              Gone("BlockStoreClient::Load"));
  EXPECT_THAT(orphan.Unpin(pinned->pin_id), Gone("BlockStoreClient::Unpin"));
  EXPECT_THAT(orphan.UnregisterPool(id), Gone("BlockStoreClient::UnregisterPool"));

  // The engine's registration and pin are as they were: its reclaim (after the grace, which the
  // fake clock never reaches here), not these calls, takes them away. (Offers are not counted:
  // they close with the handoff connection the KvClient's end closed.)
  const BlockStore::Counts after = daemon_->block_store().counts();
  EXPECT_EQ(after.registrations, before.registrations);
  EXPECT_EQ(after.pins, before.pins);
  EXPECT_EQ(after.registered_bytes, before.registered_bytes);
}

}  // namespace
}  // namespace memra::testing
