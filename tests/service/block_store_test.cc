// The block store (block_store.proto) against the in-process daemon: engines register their own
// memfd pools over the real handoff socket and store and load blocks through KvClient.
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/block_store_client.h"
#include "client/client.h"
#include "client/prefix_client.h"
#include "core/block_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/store/block_store.h"
#include "server/store/prefix_cache.h"
#include "tests/service/test_daemon.h"
#include "tests/test_block_pool.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const TestPoolShape kShape;                                  // group 0 only
const TestPoolShape kHybrid{.hybrid = true};                // groups 0 and 1 (with STATE)
constexpr uint64_t kNumBlocks = 16;
constexpr uint32_t kTokensPerBlock = 16;

TestBlockPool MustPool(const TestPoolShape& shape = kShape, bool seal = true) {
  absl::StatusOr<TestBlockPool> pool = TestBlockPool::Create(shape, seal);
  EXPECT_THAT(pool, IsOk());
  return *std::move(pool);
}

std::vector<std::string> Hashes(uint64_t first, uint64_t count) {
  return TestBlockHashes(first, count);
}

class BlockStoreTest : public DaemonTest {
 protected:
  // The stored blocks' slabs go with the prefix cache, so with the daemon: gone before the
  // fixture checks that the backend holds nothing.
  void TearDown() override {
    client_.reset();
    operator_.reset();
    if (daemon_ != nullptr) daemon_->Shutdown();
    daemon_.reset();
    DaemonTest::TearDown();
  }

  void ConfigureDaemon(DaemonConfig& config) override {
    config.prefix.budget_bytes = prefix_budget_;
    config.prefix.slab_bytes = uint64_t{1} << 20;
    config.cache_scope_allow = absl::StrCat("other:", getuid());
    config.block_store.pins_per_engine = 4;
  }

  // Offers `pool` and registers it with `spec`.
  absl::StatusOr<RegisteredPool> Register(KvClient& client, const TestBlockPool& pool,
                                          const BlockPoolSpec& spec) {
    absl::StatusOr<uint64_t> buffer = client.block_store().OfferPoolBuffer(pool.fd(), pool.bytes());
    if (!buffer.ok()) return buffer.status();
    const PoolBufferRef ref{.handoff_buffer_id = *buffer, .bytes = pool.bytes()};
    return client.block_store().RegisterPool(spec, {&ref, 1});
  }

  RegisteredPool MustRegister(KvClient& client, const TestBlockPool& pool,
                              const TestPoolShape& shape = kShape) {
    absl::StatusOr<RegisteredPool> registered = Register(client, pool, shape.Spec());
    EXPECT_THAT(registered, IsOk());
    return registered.value_or(RegisteredPool{});
  }

  // An attached engine and one pool of `shape` it registered.
  struct EngineWithPool {
    std::unique_ptr<KvClient> client;
    TestBlockPool pool;
    RegisteredPool registered;
  };
  EngineWithPool MustEngineWithPool(const std::string& name, const TestPoolShape& shape = kShape) {
    EngineWithPool engine{NewClient(name), MustPool(shape), {}};
    if (engine.client != nullptr) engine.registered = MustRegister(*engine.client, engine.pool, shape);
    return engine;
  }

  static BlockStoreCall ByHashes(const RegisteredPool& pool, std::vector<std::string> hashes,
                                 std::vector<uint32_t> block_ids = {}, uint32_t kv_group = 0) {
    BlockStoreCall call;
    call.registration_id = pool.registration_id;
    call.kv_group = kv_group;
    call.keys.hashes = std::move(hashes);
    call.block_ids = std::move(block_ids);
    return call;
  }

  static std::vector<absl::StatusCode> Codes(const BlockStoreTransfer& transfer) {
    std::vector<absl::StatusCode> codes;
    for (const BlockStoreOutcome& block : transfer.blocks) codes.push_back(block.status.code());
    return codes;
  }

  uint64_t prefix_budget_ = uint64_t{4} << 20;
};

TEST_F(BlockStoreTest, BlocksStoredFromOneEnginesPoolLoadIntoAnothersByteForByte) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  std::unique_ptr<KvClient> b = NewClient("engine-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  TestBlockPool pool_a = MustPool();
  TestBlockPool pool_b = MustPool();
  const RegisteredPool registered_a = MustRegister(*a, pool_a);
  const RegisteredPool registered_b = MustRegister(*b, pool_b);
  // Ids count up from the epoch's own base: a kept id of a previous daemon names nothing here.
  EXPECT_GT(registered_a.registration_id, BlockStore::FirstIdOfEpoch(a->epoch()));
  EXPECT_LT(registered_a.registration_id, BlockStore::FirstIdOfEpoch(a->epoch()) + 100);
  EXPECT_EQ(BlockStore::FirstIdOfEpoch(78) - BlockStore::FirstIdOfEpoch(77), uint64_t{1} << 40);
  ASSERT_EQ(registered_a.groups.size(), 1u);
  EXPECT_EQ(registered_a.groups[0].block_bytes, kShape.block_bytes());
  EXPECT_EQ(registered_a.groups[0].layout_fingerprint, registered_b.groups[0].layout_fingerprint);
  for (uint32_t block = 0; block < 4; ++block) pool_a.Fill(block, static_cast<uint8_t>(block + 1));

  BlockStoreCall store = ByHashes(registered_a, Hashes(0, 4), {0, 1, 2, 3});
  store.event_token_ids.assign(4 * kTokensPerBlock, 5);
  absl::StatusOr<BlockStoreTransfer> stored = a->block_store().Store(store);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Codes(*stored), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kOk,
                                          absl::StatusCode::kOk, absl::StatusCode::kOk));
  EXPECT_EQ(stored->copied_bytes, 4 * kShape.block_bytes());
  // Stored again: nothing copied.
  absl::StatusOr<BlockStoreTransfer> again = a->block_store().Store(store);
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->copied_bytes, 0u);
  EXPECT_TRUE(again->blocks[0].already_present);

  // Engine B: a lookup of five hashes finds the four stored, pinned for its load.
  BlockStoreCall lookup = ByHashes(registered_b, Hashes(0, 5));
  lookup.pin_ttl_ms = 10'000;
  absl::StatusOr<BlockStoreMatch> match = b->block_store().Lookup(lookup);
  ASSERT_THAT(match, IsOk());
  EXPECT_EQ(match->matched_blocks, 4u);
  EXPECT_NE(match->pin_id, 0u);
  BlockStoreCall load = ByHashes(registered_b, Hashes(0, 4), {7, 6, 5, 4});
  load.pin_id = match->pin_id;
  absl::StatusOr<BlockStoreTransfer> loaded = b->block_store().Load(load);
  ASSERT_THAT(loaded, IsOk());
  EXPECT_THAT(Codes(*loaded), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kOk,
                                          absl::StatusCode::kOk, absl::StatusCode::kOk));
  for (uint32_t i = 0; i < 4; ++i) EXPECT_TRUE(pool_a.SameBlock(i, pool_b, 7 - i)) << i;
  EXPECT_EQ(daemon_->block_store().counts().pins, 0u);  // the load released the lookup's pin
  EXPECT_THAT(b->block_store().Unpin(match->pin_id),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(absl::StrCat("no pin ", match->pin_id))));

  // The operator's view and the events tell engine-pool entries apart and carry the hashes.
  size_t pool_entries = 0;
  for (const ScopedEntry& entry : daemon_->prefix_cache()->ListEntries()) {
    if (!entry.from_engine_pool) continue;
    ++pool_entries;
    EXPECT_EQ(entry.view.boundary_tokens, kTokensPerBlock);
    EXPECT_EQ(entry.cache_scope, a->cache_scope());
  }
  EXPECT_EQ(pool_entries, 4u);
  const ScopedEventReplay events = daemon_->prefix_cache()->EventsSince(0, 0, std::nullopt);
  ASSERT_GE(events.events.size(), 1u);
  // One StoreBlocks is one STORED event carrying its whole run of blocks, not one per block
  // (thousands of per-block events would push every scope's subscribers past the buffer).
  size_t stored_events = 0;
  for (const ScopedPrefixEvent& event : events.events) {
    stored_events += event.event.kind == PrefixEventKind::kStored;
  }
  EXPECT_EQ(stored_events, 1u);
  EXPECT_EQ(events.events[0].event.block_keys.size(), 4u);
  const PrefixEventOrigin& first = events.events[0].event.origin;
  EXPECT_TRUE(first.from_engine_pool);
  EXPECT_EQ(first.engine_id, a->engine_id());
  EXPECT_THAT(first.block_hashes,
              ElementsAre("block-hash-0", "block-hash-1", "block-hash-2", "block-hash-3"));
  EXPECT_EQ(first.parent_block_hash, "");
  EXPECT_EQ(first.token_ids.size(), 4 * kTokensPerBlock);
  EXPECT_THAT(daemon_->prefix_cache()->CheckInvariants(), IsOk());
  // And on the wire, as a router subscribed on the engine socket sees them.
  std::unique_ptr<PrefixEventStream> stream = b->prefixes().SubscribeEvents();
  absl::StatusOr<std::optional<PrefixCacheEvent>> wire = stream->Next();
  ASSERT_THAT(wire, IsOk());
  ASSERT_TRUE(wire->has_value());
  EXPECT_EQ((*wire)->kind, PrefixEventKind::kStored);
  EXPECT_EQ((*wire)->origin, first);
  stream->Cancel();
}

TEST_F(BlockStoreTest, EventBlockHashesNameTheBlocksInEventsNotInKeys) {
  auto [a, pool, registered] = MustEngineWithPool("engine-a");
  ASSERT_NE(a, nullptr);
  BlockStoreCall store = ByHashes(registered, Hashes(0, 3), {0, 1, 2});
  store.parent_hash = "vllm-parent";
  store.event_block_hashes = {"vllm-0", "vllm-1", "vllm-2"};
  ASSERT_THAT(a->block_store().Store(store), IsOk());
  const ScopedEventReplay events = daemon_->prefix_cache()->EventsSince(0, 0, std::nullopt);
  ASSERT_EQ(events.events.size(), 1u);
  const PrefixEventOrigin& origin = events.events[0].event.origin;
  EXPECT_THAT(origin.block_hashes, ElementsAre("vllm-0", "vllm-1", "vllm-2"));
  EXPECT_EQ(origin.parent_block_hash, "vllm-parent");
  // The keys are still the engine's: a lookup by them finds the blocks, vLLM's name nothing.
  absl::StatusOr<BlockStoreMatch> by_keys =
      a->block_store().Lookup(ByHashes(registered, Hashes(0, 3)));
  ASSERT_THAT(by_keys, IsOk());
  EXPECT_EQ(by_keys->matched_blocks, 3u);
  BlockStoreCall by_routed;
  by_routed.registration_id = registered.registration_id;
  by_routed.keys.hashes = store.event_block_hashes;
  absl::StatusOr<BlockStoreMatch> by_event_hashes = a->block_store().Lookup(by_routed);
  ASSERT_THAT(by_event_hashes, IsOk());
  EXPECT_EQ(by_event_hashes->matched_blocks, 0u);
}

TEST_F(BlockStoreTest, TokenIdKeysChainFromTheStartAndSkipWhatIsStored) {
  auto [a, pool, registered] = MustEngineWithPool("engine-a");
  ASSERT_NE(a, nullptr);
  for (uint32_t block = 0; block < 3; ++block) pool.Fill(block, static_cast<uint8_t>(9 + block));
  std::vector<int32_t> tokens(3 * kTokensPerBlock + 5);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(1000 + i);
  BlockStoreCall store;
  store.registration_id = registered.registration_id;
  store.keys.token_ids.assign(tokens.begin(), tokens.begin() + 2 * kTokensPerBlock);
  store.block_ids = {0, 1};
  ASSERT_THAT(a->block_store().Store(store), IsOk());
  // The third block, after the two stored ones.
  store.keys.token_ids = tokens;
  store.skip_blocks = 2;
  store.block_ids = {2};
  absl::StatusOr<BlockStoreTransfer> third = a->block_store().Store(store);
  ASSERT_THAT(third, IsOk());
  EXPECT_EQ(third->copied_bytes, kShape.block_bytes());
  BlockStoreCall lookup;
  lookup.registration_id = registered.registration_id;
  lookup.keys.token_ids = tokens;
  EXPECT_THAT(a->block_store().Lookup(lookup), IsOkAndHolds(::testing::Field(
                                           &BlockStoreMatch::matched_blocks, 3u)));
  // Another first block changes every key after it.
  lookup.keys.token_ids[0] = 7;
  EXPECT_THAT(a->block_store().Lookup(lookup), IsOkAndHolds(::testing::Field(
                                           &BlockStoreMatch::matched_blocks, 0u)));
}

TEST_F(BlockStoreTest, AnotherScopeOrLayoutSeesNothing) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  ASSERT_NE(a, nullptr);
  ClientOptions options;
  options.cache_scope = "other";
  absl::StatusOr<std::unique_ptr<KvClient>> other =
      KvClient::Connect(daemon_->socket_path(), options);
  ASSERT_THAT(other, IsOk());
  ASSERT_THAT((*other)->Attach("engine-other"), IsOk());
  TestBlockPool pool_a = MustPool();
  TestBlockPool pool_other = MustPool();
  const RegisteredPool registered_a = MustRegister(*a, pool_a);
  const RegisteredPool registered_other = MustRegister(**other, pool_other);
  ASSERT_THAT(a->block_store().Store(ByHashes(registered_a, Hashes(0, 2), {0, 1})), IsOk());
  EXPECT_THAT((*other)->block_store().Lookup(ByHashes(registered_other, Hashes(0, 2))),
              IsOkAndHolds(::testing::Field(&BlockStoreMatch::matched_blocks, 0u)));
  // Same scope, another model: another layout fingerprint, other keys.
  BlockPoolSpec spec = kShape.Spec();
  spec.model = "another-model";
  TestBlockPool pool_model = MustPool();
  absl::StatusOr<RegisteredPool> registered_model = Register(*a, pool_model, spec);
  ASSERT_THAT(registered_model, IsOk());
  EXPECT_NE(registered_model->groups[0].layout_fingerprint,
            registered_a.groups[0].layout_fingerprint);
  EXPECT_THAT(a->block_store().Lookup(ByHashes(*registered_model, Hashes(0, 2))),
              IsOkAndHolds(::testing::Field(&BlockStoreMatch::matched_blocks, 0u)));
  EXPECT_THAT(a->block_store().Lookup(ByHashes(registered_a, Hashes(0, 2))),
              IsOkAndHolds(::testing::Field(&BlockStoreMatch::matched_blocks, 2u)));
}

TEST_F(BlockStoreTest, BadOffersRegistrationsAndCallsAreRefusedWithTheirNumbersChangingNothing) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  std::unique_ptr<KvClient> b = NewClient("engine-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // Offers: not sealed against shrinking; larger than the file.
  TestBlockPool unsealed = MustPool(kShape, /*seal=*/false);
  EXPECT_THAT(a->block_store().OfferPoolBuffer(unsealed.fd(), kShape.pool_bytes()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("seals are 0x0", "F_SEAL_SHRINK")));
  TestBlockPool pool = MustPool();
  EXPECT_THAT(a->block_store().OfferPoolBuffer(pool.fd(), kShape.pool_bytes() + 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrCat("holds ", kShape.pool_bytes(), " bytes; the offer says ",
                                               kShape.pool_bytes() + 1))));
  // Registrations: a layout outside the buffer, an unknown id, another engine's id.
  absl::StatusOr<uint64_t> buffer =
      a->block_store().OfferPoolBuffer(pool.fd(), kShape.pool_bytes());
  ASSERT_THAT(buffer, IsOk());
  BlockPoolSpec outside = kShape.Spec();
  outside.tensors[3].offset = kShape.pool_bytes() - kShape.tensor_bytes() + 1;
  const PoolBufferRef ref{.handoff_buffer_id = *buffer, .bytes = kShape.pool_bytes()};
  EXPECT_THAT(a->block_store().RegisterPool(outside, {&ref, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("tensor 3", absl::StrCat("holds ", kShape.pool_bytes(), " bytes"))));
  const PoolBufferRef unknown{.handoff_buffer_id = 999, .bytes = kShape.pool_bytes()};
  EXPECT_THAT(a->block_store().RegisterPool(kShape.Spec(), {&unknown, 1}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("no offered buffer 999")));
  EXPECT_THAT(b->block_store().RegisterPool(kShape.Spec(), {&ref, 1}),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs(absl::StrCat("offered buffer ", *buffer, " is not engine ",
                                               b->engine_id()))));
  const PoolBufferRef too_long{.handoff_buffer_id = *buffer,
                               .bytes = kShape.pool_bytes(),
                               .offset_in_allocation = 4096};
  EXPECT_THAT(a->block_store().RegisterPool(kShape.Spec(), {&too_long, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("at offset 4096", absl::StrCat("holds ", kShape.pool_bytes()))));
  // CUDA IPC handles: the host backend opens none; mixed with handoff buffers in one
  // registration they are refused before that.
  const PoolBufferRef ipc{.bytes = kShape.pool_bytes(), .cuda_ipc_handle = std::string(64, 'h')};
  EXPECT_THAT(a->block_store().RegisterPool(kShape.Spec(), {&ipc, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("host backend: cannot map 1 engine buffers from CUDA IPC")));
  BlockPoolSpec two_buffers = kShape.Spec();
  const PoolBufferRef mixed[] = {ref, ipc};
  EXPECT_THAT(a->block_store().RegisterPool(two_buffers, mixed),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("buffer 0 is a handoff buffer but buffer 1 is not")));
  EXPECT_EQ(daemon_->block_store().counts().registrations, 0u);
  // The refusals used nothing up: the offer still registers.
  absl::StatusOr<RegisteredPool> registered =
      a->block_store().RegisterPool(kShape.Spec(), {&ref, 1});
  ASSERT_THAT(registered, IsOk());
  EXPECT_THAT(a->block_store().RegisterPool(kShape.Spec(), {&ref, 1}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("used up by one registration")));

  // Calls: a block id past the pool, counts that differ, a duplicate id in a load, an unknown
  // group, another engine's registration. Nothing is stored.
  const PrefixCacheStats before = daemon_->prefix_cache()->Stats();
  EXPECT_THAT(a->block_store().Store(ByHashes(*registered, Hashes(0, 2), {0, 16})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("block id 16 (index 1) of a pool of 16 blocks")));
  EXPECT_THAT(a->block_store().Store(ByHashes(*registered, Hashes(0, 3), {0, 1})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("2 block ids for 3 blocks")));
  EXPECT_THAT(a->block_store().Load(ByHashes(*registered, Hashes(0, 2), {4, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("block id 4 (index 1) appears twice")));
  EXPECT_THAT(a->block_store().Store(ByHashes(*registered, Hashes(0, 1), {0}, /*kv_group=*/3)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("kv_group 3 is not registered", "groups 0")));
  EXPECT_THAT(a->block_store().Store(ByHashes(*registered, {std::string(65, 'h')}, {0})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("block hash 0 is 65 bytes; 1 to 64")));
  EXPECT_THAT(b->block_store().Store(ByHashes(*registered, Hashes(0, 1), {0})),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs(absl::StrCat("registration ", registered->registration_id,
                                               " is not engine ", b->engine_id()))));
  EXPECT_THAT(b->block_store().UnregisterPool(registered->registration_id),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("is not engine")));
  const PrefixCacheStats after = daemon_->prefix_cache()->Stats();
  EXPECT_EQ(after.entries, before.entries);
  EXPECT_EQ(after.stored_bytes, before.stored_bytes);
  // Loading what was never stored is a per-block NOT_FOUND, not a refusal.
  absl::StatusOr<BlockStoreTransfer> missing =
      a->block_store().Load(ByHashes(*registered, Hashes(40, 1), {0}));
  ASSERT_THAT(missing, IsOk());
  EXPECT_THAT(Codes(*missing), ElementsAre(absl::StatusCode::kNotFound));
  EXPECT_THAT(missing->blocks[0].status.message(), HasSubstr("is not stored"));
  ASSERT_THAT(a->block_store().UnregisterPool(registered->registration_id), IsOk());
  EXPECT_THAT(a->block_store().UnregisterPool(registered->registration_id),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr(absl::StrCat("no registration ", registered->registration_id))));
}

TEST_F(BlockStoreTest, OffersAreCheckedSealsFirstThenTheirFileSystem) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  ASSERT_NE(a, nullptr);
  // A pipe: refused by its seals before anything stats it (fstat of a FUSE file can block).
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const ScopedFd read_end(pipe_fds[0]);
  const ScopedFd write_end(pipe_fds[1]);
  EXPECT_THAT(a->block_store().OfferPoolBuffer(read_end.get(), 4096),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("seals are unavailable", "F_SEAL_SHRINK")));
  // A sealed memfd on hugetlbfs: its pages can run out under the mapping.
  const int huge = memfd_create("block-store-huge", MFD_HUGETLB | MFD_ALLOW_SEALING);
  if (huge < 0) GTEST_SKIP() << "no hugetlb memfd here: " << strerror(errno);
  const ScopedFd huge_fd(huge);
  ASSERT_EQ(ftruncate(huge_fd.get(), 2 << 20), 0) << strerror(errno);
  ASSERT_EQ(fcntl(huge_fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0) << strerror(errno);
  EXPECT_THAT(a->block_store().OfferPoolBuffer(huge_fd.get(), 4096),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrFormat("file system 0x%x, not tmpfs (0x%x)",
                                                  HUGETLBFS_MAGIC, TMPFS_MAGIC))));
  EXPECT_EQ(daemon_->block_store().counts().offers, 0u);
}

TEST_F(BlockStoreTest, ACorruptStoredBlockIsDataLossForThatBlockAndDropped) {
  auto [a, pool, registered] = MustEngineWithPool("engine-a");
  ASSERT_NE(a, nullptr);
  for (uint32_t block = 0; block < 3; ++block) pool.Fill(block, static_cast<uint8_t>(block + 40));
  ASSERT_THAT(a->block_store().Store(ByHashes(registered, Hashes(0, 3), {0, 1, 2})), IsOk());
  // Flip a byte of block 1's stored copy.
  const PlanFingerprint space =
      ScopedShapeFingerprint(a->cache_scope(), registered.groups[0].layout_fingerprint);
  const std::vector<BlockKey> keys = EngineHashKeys(space, Hashes(1, 1)).value();
  const std::optional<EntryId> entry = daemon_->prefix_cache()->PoolEntry(keys[0]);
  ASSERT_TRUE(entry.has_value());
  absl::StatusOr<ScopedEntry> view = daemon_->prefix_cache()->Inspect(*entry);
  ASSERT_THAT(view, IsOk());
  absl::StatusOr<SlabSpan> span =
      daemon_->prefix_cache()->StorageSpan(view->view.blocks[0].stored.storage_handle);
  ASSERT_THAT(span, IsOk());
  const std::vector<uint8_t> garbage = {0xde, 0xad};
  ASSERT_THAT(host_->Write(span->slab, span->offset + 100, garbage), IsOk());

  // Loaded with its lookup's pin: the pin is released before the corrupt entry drops.
  BlockStoreCall lookup = ByHashes(registered, Hashes(0, 3));
  lookup.pin_ttl_ms = 10'000;
  absl::StatusOr<BlockStoreMatch> match = a->block_store().Lookup(lookup);
  ASSERT_THAT(match, IsOk());
  ASSERT_EQ(match->matched_blocks, 3u);
  BlockStoreCall load = ByHashes(registered, Hashes(0, 3), {10, 11, 12});
  load.pin_id = match->pin_id;
  absl::StatusOr<BlockStoreTransfer> loaded = a->block_store().Load(load);
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(daemon_->prefix_cache()->Stats().pinned_bytes, 0u);
  EXPECT_THAT(Codes(*loaded), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kDataLoss,
                                          absl::StatusCode::kOk));
  EXPECT_THAT(loaded->blocks[1].status.message(), HasSubstrs("xxHash3", "never served"));
  EXPECT_TRUE(pool.SameBlock(0, pool, 10));
  EXPECT_TRUE(pool.SameBlock(2, pool, 12));
  // Dropped: a lookup stops before it now.
  EXPECT_THAT(a->block_store().Lookup(ByHashes(registered, Hashes(0, 3))),
              IsOkAndHolds(::testing::Field(&BlockStoreMatch::matched_blocks, 1u)));
  EXPECT_THAT(daemon_->prefix_cache()->CheckInvariants(), IsOk());
}

TEST_F(BlockStoreTest, HybridStateGoesWithTheLastBlockAndLookupsStopAtAStoredState) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  ASSERT_NE(a, nullptr);
  TestBlockPool pool = MustPool(kHybrid);
  const RegisteredPool registered = MustRegister(*a, pool, kHybrid);
  ASSERT_EQ(registered.groups.size(), 2u);
  EXPECT_EQ(registered.groups[1].state_bytes, kHybrid.state_bytes);
  std::memset(pool.StateSlot(2), 0x5a, kHybrid.state_bytes);
  ASSERT_THAT(a->block_store().Store(ByHashes(registered, Hashes(0, 3), {0, 1, 2}, 1)), IsOk());
  EXPECT_THAT(a->block_store().Lookup(ByHashes(registered, Hashes(0, 4), {}, 1)),
              IsOkAndHolds(::testing::Field(&BlockStoreMatch::matched_blocks, 3u)));
  // No state at the second block's boundary: nothing of the two is usable.
  EXPECT_THAT(a->block_store().Lookup(ByHashes(registered, Hashes(0, 2), {}, 1)),
              IsOkAndHolds(::testing::Field(&BlockStoreMatch::matched_blocks, 0u)));
  absl::StatusOr<BlockStoreTransfer> loaded =
      a->block_store().Load(ByHashes(registered, Hashes(0, 3), {5, 6, 7}, 1));
  ASSERT_THAT(loaded, IsOk());
  EXPECT_THAT(Codes(*loaded), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kOk,
                                          absl::StatusCode::kOk));
  EXPECT_EQ(std::memcmp(pool.StateSlot(7), pool.StateSlot(2), kHybrid.state_bytes), 0);
  // A load ending where no state is stored: the last block is NOT_FOUND.
  absl::StatusOr<BlockStoreTransfer> short_load =
      a->block_store().Load(ByHashes(registered, Hashes(0, 2), {5, 6}, 1));
  ASSERT_THAT(short_load, IsOk());
  EXPECT_THAT(Codes(*short_load), ElementsAre(absl::StatusCode::kOk, absl::StatusCode::kNotFound));
}

TEST_F(BlockStoreTest, PinsAreCappedExpireAndBelongToTheirEngine) {
  auto [a, pool, registered] = MustEngineWithPool("engine-a");
  std::unique_ptr<KvClient> b = NewClient("engine-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_THAT(a->block_store().Store(ByHashes(registered, Hashes(0, 1), {0})), IsOk());
  BlockStoreCall lookup = ByHashes(registered, Hashes(0, 1));
  lookup.pin_ttl_ms = 1000;
  std::vector<uint64_t> pins;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<BlockStoreMatch> match = a->block_store().Lookup(lookup);
    ASSERT_THAT(match, IsOk());
    pins.push_back(match->pin_id);
  }
  EXPECT_THAT(a->block_store().Lookup(lookup),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("holds 4 pins; the limit is 4")));
  EXPECT_THAT(b->block_store().Unpin(pins[0]),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs(absl::StrCat("pin ", pins[0], " is not engine ", b->engine_id()))));
  // A pinned block is not evicted.
  const std::optional<EntryId> entry = daemon_->prefix_cache()->PoolEntry(
      EngineHashKeys(ScopedShapeFingerprint(a->cache_scope(),
                                            registered.groups[0].layout_fingerprint),
                     Hashes(0, 1))
          .value()[0]);
  ASSERT_TRUE(entry.has_value());
  EXPECT_THAT(daemon_->prefix_cache()->EvictEntry(*entry),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("pinned")));
  ASSERT_THAT(a->block_store().Unpin(pins[0]), IsOk());
  clock_.Advance(absl::Milliseconds(1001));
  daemon_->CheckLeases();
  EXPECT_EQ(daemon_->block_store().counts().pins, 0u);
  EXPECT_THAT(daemon_->prefix_cache()->EvictEntry(*entry), IsOk());
}

// A pin keeps its entries from eviction: one engine may hold at most a quarter of the prefix
// cache's budget pinned (64 KiB here: 16384 bytes, 8 blocks of 2048), so it cannot lock the
// cache for everyone. A refused lookup leaves nothing pinned.
class BlockStoreSmallCacheTest : public BlockStoreTest {
 protected:
  BlockStoreSmallCacheTest() { prefix_budget_ = uint64_t{64} << 10; }
};

TEST_F(BlockStoreSmallCacheTest, AnEnginesPinnedBytesAreCapped) {
  auto [a, pool, registered] = MustEngineWithPool("engine-a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(registered.groups[0].block_bytes, 2048u);
  std::vector<uint32_t> ids(12);
  for (uint32_t i = 0; i < 12; ++i) ids[i] = i;
  ASSERT_THAT(a->block_store().Store(ByHashes(registered, Hashes(0, 12), ids)), IsOk());
  BlockStoreCall all = ByHashes(registered, Hashes(0, 12));
  all.pin_ttl_ms = 10'000;
  EXPECT_THAT(a->block_store().Lookup(all),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("holds 0 pinned bytes and this lookup would pin 24576 more",
                                  "the limit is 16384")));
  EXPECT_EQ(daemon_->block_store().counts().pins, 0u);
  BlockStoreCall first = ByHashes(registered, Hashes(0, 6));
  first.pin_ttl_ms = 10'000;
  ASSERT_THAT(a->block_store().Lookup(first), IsOk());
  BlockStoreCall more = ByHashes(registered, Hashes(6, 3));
  more.pin_ttl_ms = 10'000;
  EXPECT_THAT(a->block_store().Lookup(more),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("holds 12288 pinned bytes and this lookup would pin 6144 more",
                                  "the limit is 16384")));
  EXPECT_EQ(daemon_->block_store().counts().pins, 1u);
  // The refused lookup's entries were unpinned again: evictable.
  const std::optional<EntryId> entry = daemon_->prefix_cache()->PoolEntry(
      EngineHashKeys(ScopedShapeFingerprint(a->cache_scope(),
                                            registered.groups[0].layout_fingerprint),
                     Hashes(6, 1))
          .value()[0]);
  ASSERT_TRUE(entry.has_value());
  EXPECT_THAT(daemon_->prefix_cache()->EvictEntry(*entry), IsOk());
}

TEST_F(BlockStoreTest, RegistrationsAndPinsDieWithTheEnginesLease) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  client_ = NewClient("engine-survivor");
  ASSERT_NE(a, nullptr);
  TestBlockPool pool = MustPool();
  const RegisteredPool registered = MustRegister(*a, pool);
  ASSERT_THAT(a->block_store().Store(ByHashes(registered, Hashes(0, 2), {0, 1})), IsOk());
  BlockStoreCall lookup = ByHashes(registered, Hashes(0, 2));
  lookup.pin_ttl_ms = 60'000;
  ASSERT_THAT(a->block_store().Lookup(lookup), IsOk());
  ASSERT_THAT(a->block_store().OfferPoolBuffer(pool.fd(), 4096), IsOk());
  EXPECT_EQ(daemon_->block_store().counts().registrations, 1u);
  KillEngine(*a);
  const BlockStore::Counts counts = daemon_->block_store().counts();
  EXPECT_EQ(counts.registrations, 0u);
  EXPECT_EQ(counts.pins, 0u);
  EXPECT_EQ(counts.offers, 0u);
  // The stored blocks stay (they are the cache's), unpinned: evictable.
  EXPECT_EQ(daemon_->prefix_cache()->Stats().pinned_bytes, 0u);
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 2u);
}

TEST_F(BlockStoreTest, AnEngineThatReattachesWithinItsGraceKeepsItsRegistration) {
  auto [a, pool, registered] = MustEngineWithPool("engine-a");
  ASSERT_NE(a, nullptr);
  ASSERT_THAT(a->block_store().Store(ByHashes(registered, Hashes(0, 1), {0})), IsOk());
  // Its connection is replaced below.
  ASSERT_THAT(a->block_store().OfferPoolBuffer(pool.fd(), 4096), IsOk());
  // The lease lapses (its stream is cancelled); the client re-attaches as the same engine
  // within the grace while the daemon checks its leases.
  clock_.Advance(absl::Milliseconds(kLeaseTimeoutMs + 1));
  for (int i = 0; i < 3000 && a->reattaches() == 0; ++i) {
    daemon_->CheckLeases();
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GE(a->reattaches(), 1u) << a->lease_lost();
  daemon_->CheckLeases();
  EXPECT_EQ(daemon_->block_store().counts().registrations, 1u);
  // The re-attach's new handoff connection replaced the one the offer came over: the offer
  // could never register, and holds no descriptor or bytes any more.
  EXPECT_EQ(daemon_->block_store().counts().offers, 0u);
  absl::StatusOr<BlockStoreTransfer> stored =
      a->block_store().Store(ByHashes(registered, Hashes(1, 1), {1}));
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Codes(*stored), ElementsAre(absl::StatusCode::kOk));
}

// One offered buffer is one mapping of one registration: naming it twice is refused with both
// positions and the id, and the offer stays usable.
TEST_F(BlockStoreTest, ARegistrationNamingOneOfferTwiceIsRefused) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  ASSERT_NE(a, nullptr);
  TestBlockPool pool = MustPool();
  absl::StatusOr<uint64_t> offer = a->block_store().OfferPoolBuffer(pool.fd(), pool.bytes());
  ASSERT_THAT(offer, IsOk());
  const PoolBufferRef ref{.handoff_buffer_id = *offer, .bytes = pool.bytes()};
  const PoolBufferRef twice[] = {ref, ref};
  EXPECT_THAT(a->block_store().RegisterPool(kShape.Spec(), twice),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(absl::StrCat("buffers 0 and 1 name the same offered buffer ",
                                               *offer))));
  EXPECT_EQ(daemon_->block_store().counts().registrations, 0u);
  EXPECT_THAT(a->block_store().RegisterPool(kShape.Spec(), {&ref, 1}), IsOk());
}

TEST_F(BlockStoreTest, MalformedKeysAndEventFieldsAreRefusedWithTheirNumbers) {
  auto [a, pool, registered] = MustEngineWithPool("engine-a");
  std::unique_ptr<KvClient> b = NewClient("engine-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  BlockStoreCall both = ByHashes(registered, Hashes(0, 1), {0});
  both.keys.token_ids.assign(kTokensPerBlock, 1);
  EXPECT_THAT(a->block_store().Store(both),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("keys give both 1 block hashes and 16 token ids")));
  BlockStoreCall many = ByHashes(registered, Hashes(0, 65537));
  EXPECT_THAT(a->block_store().Lookup(many),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("keys name 65537 blocks; a call names at most 65536")));
  BlockStoreCall parent = ByHashes(registered, Hashes(0, 1), {0});
  parent.parent_hash = std::string(65, 'p');
  EXPECT_THAT(a->block_store().Store(parent),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("parent_hash is 65 bytes; at most 64")));
  BlockStoreCall tokens = ByHashes(registered, Hashes(0, 2), {0, 1});
  tokens.event_token_ids.assign(3, 7);
  EXPECT_THAT(a->block_store().Store(tokens),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("3 event token ids for 2 blocks of 16 tokens (give none or 32)")));
  BlockStoreCall skip_hashes = ByHashes(registered, Hashes(0, 2), {1});
  skip_hashes.skip_blocks = 1;
  EXPECT_THAT(a->block_store().Store(skip_hashes),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("skip_blocks 1 with block hashes")));
  BlockStoreCall skip_past;
  skip_past.registration_id = registered.registration_id;
  skip_past.keys.token_ids.assign(2 * kTokensPerBlock, 3);
  skip_past.skip_blocks = 3;
  EXPECT_THAT(a->block_store().Store(skip_past),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("skip_blocks 3 exceeds the 2 whole blocks")));
  BlockStoreCall routed = ByHashes(registered, Hashes(0, 2), {0, 1});
  routed.event_block_hashes = {"vllm-0"};
  EXPECT_THAT(a->block_store().Store(routed),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("1 event block hashes for 2 blocks (give none or 2)")));
  routed.event_block_hashes = {"vllm-0", std::string(65, 'v')};
  EXPECT_THAT(a->block_store().Store(routed),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("event block hash 1 is 65 bytes; 1 to 64")));
  BlockStoreCall routed_tokens;
  routed_tokens.registration_id = registered.registration_id;
  routed_tokens.keys.token_ids.assign(kTokensPerBlock, 3);
  routed_tokens.block_ids = {0};
  routed_tokens.event_block_hashes = {"vllm-0"};
  EXPECT_THAT(a->block_store().Store(routed_tokens),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("1 event block hashes for 1 blocks named by token ids")));
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 0u);
  // Another engine's pin is not a load's to release.
  ASSERT_THAT(a->block_store().Store(ByHashes(registered, Hashes(0, 1), {0})), IsOk());
  BlockStoreCall lookup = ByHashes(registered, Hashes(0, 1));
  lookup.pin_ttl_ms = 10'000;
  absl::StatusOr<BlockStoreMatch> match = a->block_store().Lookup(lookup);
  ASSERT_THAT(match, IsOk());
  TestBlockPool pool_b = MustPool();
  const RegisteredPool registered_b = MustRegister(*b, pool_b);
  BlockStoreCall load = ByHashes(registered_b, Hashes(0, 1), {3});
  load.pin_id = match->pin_id;
  EXPECT_THAT(b->block_store().Load(load),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs(absl::StrCat("pin ", match->pin_id, " is not engine ",
                                               b->engine_id()))));
  EXPECT_EQ(daemon_->block_store().counts().pins, 1u);
}

TEST_F(BlockStoreTest, PerEngineOfferAndRegistrationCountsAreCapped) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  ASSERT_NE(a, nullptr);
  std::vector<TestBlockPool> pools;
  for (int i = 0; i < 16; ++i) {
    pools.push_back(MustPool());
    MustRegister(*a, pools.back());
  }
  TestBlockPool extra = MustPool();
  EXPECT_THAT(Register(*a, extra, kShape.Spec()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("engine ", a->engine_id(),
                                               " holds 16 registrations; the limit is 16"))));
  // The refused registration left its offer: 255 more fill the engine's 256.
  for (int i = 0; i < 255; ++i) {
    ASSERT_THAT(a->block_store().OfferPoolBuffer(extra.fd(), 4096), IsOk()) << i;
  }
  EXPECT_THAT(a->block_store().OfferPoolBuffer(extra.fd(), 4096),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("engine ", a->engine_id(), " holds 256 unregistered "
                                               "buffer offers; the limit is 256"))));
}

class BlockStoreEngineBytesTest : public BlockStoreTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    BlockStoreTest::ConfigureDaemon(config);
    config.block_store.engine_bytes = 8192;
  }
};

TEST_F(BlockStoreEngineBytesTest, OffersAndRegistrationsAreCappedByTheEnginesBytes) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  ASSERT_NE(a, nullptr);
  TestBlockPool pool = MustPool();
  absl::StatusOr<uint64_t> offer = a->block_store().OfferPoolBuffer(pool.fd(), 4096);
  ASSERT_THAT(offer, IsOk());
  EXPECT_THAT(a->block_store().OfferPoolBuffer(pool.fd(), 8192),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("engine ", a->engine_id(), " offers 8192 bytes and "
                                               "holds 4096 offered or registered; the limit is "
                                               "8192 (block_store_engine_bytes)"))));
  // Registering the whole file over a 4096-byte offer: the registration's bytes count.
  const PoolBufferRef ref{.handoff_buffer_id = *offer, .bytes = pool.bytes()};
  EXPECT_THAT(a->block_store().RegisterPool(kShape.Spec(), {&ref, 1}),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("engine ", a->engine_id(), " registers ",
                                               pool.bytes(), " bytes and holds 0; the limit is "
                                               "8192 (block_store_engine_bytes)"))));
  EXPECT_EQ(daemon_->block_store().counts().registrations, 0u);
}

class BlockStoreDaemonWideTest : public BlockStoreTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    BlockStoreTest::ConfigureDaemon(config);
    config.block_store.max_offers = 2;
    config.block_store.max_mapped_buffers = 1;
  }
};

TEST_F(BlockStoreDaemonWideTest, OffersAndMappedBuffersAreCappedAcrossEngines) {
  std::unique_ptr<KvClient> a = NewClient("engine-a");
  std::unique_ptr<KvClient> b = NewClient("engine-b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  TestBlockPool pool_a = MustPool();
  TestBlockPool pool_b = MustPool();
  absl::StatusOr<uint64_t> offer_a = a->block_store().OfferPoolBuffer(pool_a.fd(), pool_a.bytes());
  absl::StatusOr<uint64_t> offer_b = b->block_store().OfferPoolBuffer(pool_b.fd(), pool_b.bytes());
  ASSERT_THAT(offer_a, IsOk());
  ASSERT_THAT(offer_b, IsOk());
  // Each engine is far below its own limits; the daemon's descriptors are not.
  EXPECT_THAT(a->block_store().OfferPoolBuffer(pool_a.fd(), 4096),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("the daemon holds 2 unregistered buffer offers of all engines; "
                                  "the limit is 2 (block_store_max_offers)")));
  const PoolBufferRef ref_a{.handoff_buffer_id = *offer_a, .bytes = pool_a.bytes()};
  const PoolBufferRef ref_b{.handoff_buffer_id = *offer_b, .bytes = pool_b.bytes()};
  ASSERT_THAT(a->block_store().RegisterPool(kShape.Spec(), {&ref_a, 1}), IsOk());
  EXPECT_THAT(b->block_store().RegisterPool(kShape.Spec(), {&ref_b, 1}),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("registering 1 buffers: the daemon maps 1 of all engines; the "
                                  "limit is 1 (block_store_max_mapped_buffers)")));
  const BlockStore::Counts counts = daemon_->block_store().counts();
  EXPECT_EQ(counts.registrations, 1u);
  EXPECT_EQ(counts.offers, 1u);  // b's, unused by the refusal
}

class BlockStoreEngineShareTest : public BlockStoreTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    BlockStoreTest::ConfigureDaemon(config);
    config.block_store.max_mapped_buffers = 8;  // an engine's share: 2
    config.block_store.max_offers = 6;          // an engine's share: 3
  }
};

// 16 registrations x 256 offers took all of block_store_max_mapped_buffers from one engine: now
// an engine maps its quarter and holds half of the offers, and another engine still registers.
TEST_F(BlockStoreEngineShareTest, OneEngineTakesOnlyItsShareOfTheDaemonWideCaps) {
  std::unique_ptr<KvClient> hostile = NewClient("hostile");
  ASSERT_NE(hostile, nullptr);
  std::vector<TestBlockPool> pools;
  for (int i = 0; i < 2; ++i) {
    pools.push_back(MustPool());
    MustRegister(*hostile, pools.back());
  }
  TestBlockPool extra = MustPool();
  EXPECT_THAT(Register(*hostile, extra, kShape.Spec()),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("registering 1 buffers: engine ",
                                               hostile->engine_id(), " maps 2"),
                                  "may map at most 2",
                                  "share of block_store_max_mapped_buffers 8")));
  // The refused registration left its offer: two more fill the engine's 3 of the daemon's 6.
  for (int i = 0; i < 2; ++i) {
    ASSERT_THAT(hostile->block_store().OfferPoolBuffer(extra.fd(), 4096), IsOk());
  }
  EXPECT_THAT(hostile->block_store().OfferPoolBuffer(extra.fd(), 4096),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("engine ", hostile->engine_id(),
                                               " holds 3 unregistered buffer offers"),
                                  "limit is 3 per engine",
                                  "share of block_store_max_offers 6")));
  EngineWithPool honest = MustEngineWithPool("honest");
  ASSERT_NE(honest.client, nullptr);
  EXPECT_GT(honest.registered.registration_id, 0u);
  BlockStoreCall store = ByHashes(honest.registered, Hashes(0, 1), {0});
  store.event_token_ids.assign(kTokensPerBlock, 5);
  EXPECT_THAT(honest.client->block_store().Store(store), IsOk());
  EXPECT_EQ(daemon_->block_store().counts().registrations, 3u);
}

// Offers hold a descriptor each, and block_store_max_offers (512) was its own key whatever the
// daemon's RLIMIT_NOFILE. Now the daemon caps it by its descriptors: (512 - 128) / 32 = 12
// offers, 6 per engine; the hostile engine is refused past its 6 with the numbers, and another
// engine offers and registers its pool.
class BlockStoreDescriptorShareTest : public BlockStoreTest {
 protected:
  static constexpr rlim_t kOpenFiles = 512;
  void ConfigureDaemon(DaemonConfig& config) override {
    BlockStoreTest::ConfigureDaemon(config);
    open_files_.Lower(kOpenFiles);
  }
  void TearDown() override {
    BlockStoreTest::TearDown();
    open_files_.Restore();
  }
  LoweredOpenFileLimit open_files_;
};

TEST_F(BlockStoreDescriptorShareTest, OffersAreBoundedByTheDescriptorsTheDaemonHas) {
  std::unique_ptr<KvClient> hostile = NewClient("hostile");
  ASSERT_NE(hostile, nullptr);
  TestBlockPool pool = MustPool();
  for (int i = 0; i < 6; ++i) {
    ASSERT_THAT(hostile->block_store().OfferPoolBuffer(pool.fd(), 4096), IsOk());
  }
  EXPECT_THAT(hostile->block_store().OfferPoolBuffer(pool.fd(), 4096),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("engine ", hostile->engine_id(),
                                               " holds 6 unregistered buffer offers"),
                                  "limit is 6 per engine", "share of block_store_max_offers 12")));
  EngineWithPool honest = MustEngineWithPool("honest");
  ASSERT_NE(honest.client, nullptr);
  EXPECT_GT(honest.registered.registration_id, 0u);
  EXPECT_EQ(daemon_->block_store().counts().offers, 6u);
}

class BlockStoreBudgetTest : public BlockStoreTest {
 protected:
  // Room for six blocks of 2 KiB (rounded to the slabs' 256-byte alignment: exactly).
  BlockStoreBudgetTest() { prefix_budget_ = 6 * kShape.block_bytes(); }
};

TEST_F(BlockStoreBudgetTest, StoresPastTheBudgetEvictTheLeastRecentlyUsedBlocks) {
  auto [a, pool, registered] = MustEngineWithPool("engine-a");
  ASSERT_NE(a, nullptr);
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<BlockStoreTransfer> stored =
        a->block_store().Store(ByHashes(registered, Hashes(i, 1), {static_cast<uint32_t>(i)}));
    ASSERT_THAT(stored, IsOk());
    EXPECT_THAT(Codes(*stored), ElementsAre(absl::StatusCode::kOk)) << i;
  }
  const PrefixCacheStats stats = daemon_->prefix_cache()->Stats();
  EXPECT_EQ(stats.entries, 6u);
  EXPECT_LE(stats.stored_bytes, stats.budget_bytes);
  EXPECT_GE(stats.evicted_entries, 4u);
  EXPECT_THAT(a->block_store().Lookup(ByHashes(registered, Hashes(0, 1))),
              IsOkAndHolds(::testing::Field(&BlockStoreMatch::matched_blocks, 0u)));
  EXPECT_THAT(a->block_store().Lookup(ByHashes(registered, Hashes(4, 6))),
              IsOkAndHolds(::testing::Field(&BlockStoreMatch::matched_blocks, 6u)));
  EXPECT_THAT(daemon_->prefix_cache()->CheckInvariants(), IsOk());
}

}  // namespace
}  // namespace memra::testing
