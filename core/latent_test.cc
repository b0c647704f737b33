#include "core/latent.h"

#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

// A DSA layer of a 64-token session: latent `width`, an indexer of `index_width` f32 and `pool`
// on a `ring`-row tail ring, drained at `len` (pools_ready == len / pool).
LatentLayerState DsaLayer(uint32_t id, uint64_t width, uint64_t index_width, uint64_t ring,
                          uint64_t pool, uint64_t len) {
  constexpr uint64_t kCapacity = 64;
  LatentLayerState layer;
  layer.layer = id;
  layer.width = width;
  layer.len = len;
  layer.index_width = index_width;
  layer.index_ring_rows = ring;
  layer.index_pool = pool;
  layer.index_pools_ready = len / pool;
  layer.rows_elems = kCapacity * width;
  layer.index_rows_elems = ring * index_width;
  layer.pool_keys_elems = kCapacity / pool * (index_width / 2);
  return layer;
}

// A GLM-style DSA layer: latent width 512, indexer 2 x 128 f32, pool 4, a 16-row tail ring
// (the reference's micro-fixture knob).
LatentLayerState GlmLayer(uint64_t len) { return DsaLayer(3, 512, 256, 16, 4, len); }

LatentLayerState Fresh(LatentLayerState layer) {
  layer.len = 0;
  layer.index_pools_ready = 0;
  return layer;
}

TEST(LatentCapture, CarriesRowsKeysAndTheLiveTailAtItsRingAddress) {
  // len 23: 5 final pools (keys 5 x 128), tail rows [20, 23) at ring row 20 % 16 = 4.
  absl::StatusOr<LatentCapturePlan> plan = PlanLatentCapture(GlmLayer(23));
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->snapshot.len, 23u);
  EXPECT_EQ(plan->snapshot.rows_elems, 23u * 512);
  EXPECT_EQ(plan->snapshot.keys_elems, 5u * 128);
  EXPECT_EQ(plan->snapshot.tail_elems, 3u * 256);
  EXPECT_EQ(plan->snapshot.Bytes(), (23u * 512 + 5 * 128 + 3 * 256) * 4);
  ASSERT_EQ(plan->copies.size(), 3u);
  EXPECT_EQ(plan->copies[0], (LatentCopy{LatentPlane::kRows, 0, 0, 23 * 512}));
  EXPECT_EQ(plan->copies[1], (LatentCopy{LatentPlane::kPoolKeys, 0, 0, 5 * 128}));
  EXPECT_EQ(plan->copies[2], (LatentCopy{LatentPlane::kIndexRows, 4 * 256, 0, 3 * 256}));
}

TEST(LatentCapture, PoolAlignedBoundaryCarriesNoTailAndNoIndexerMeansRowsOnly) {
  absl::StatusOr<LatentCapturePlan> aligned = PlanLatentCapture(GlmLayer(24));
  ASSERT_THAT(aligned, IsOk());
  EXPECT_EQ(aligned->snapshot.tail_elems, std::nullopt);
  EXPECT_EQ(aligned->copies.size(), 2u);

  LatentLayerState mla = GlmLayer(3);
  mla.index_width = 0;
  absl::StatusOr<LatentCapturePlan> rows_only = PlanLatentCapture(mla);
  ASSERT_THAT(rows_only, IsOk());
  EXPECT_EQ(rows_only->snapshot.keys_elems, std::nullopt) << "3 tokens: no pool completed";
  EXPECT_EQ(rows_only->copies.size(), 1u);
}

TEST(LatentCapture, RefusesWhatARestoreCouldNotMakeWhole) {
  EXPECT_THAT(PlanLatentCapture(GlmLayer(0)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("layer 3", "len 0")));
  LatentLayerState unresolved = GlmLayer(8);
  unresolved.index_pool = 0;
  EXPECT_THAT(PlanLatentCapture(unresolved),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("index plane (width 256) has an unresolved pool")));
  LatentLayerState undrained = GlmLayer(23);
  undrained.index_pools_ready = 4;
  EXPECT_THAT(PlanLatentCapture(undrained),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("index_pools_ready 4 != len/pool 5 (len 23, pool 4)")));
  LatentLayerState short_keys = GlmLayer(23);
  short_keys.pool_keys_elems = 4 * 128;
  EXPECT_THAT(PlanLatentCapture(short_keys),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstrs("holds 512 f32 but 5 pools x d 128 require 640")));
}

TEST(LatentRestore, RoundTripReestablishesLengthPoolsAndTail) {
  LatentCapturePlan capture = *PlanLatentCapture(GlmLayer(23));
  // Restore into a flat-indexer destination: the tail lands at absolute row 20.
  LatentLayerState destination = Fresh(GlmLayer(0));
  destination.index_ring_rows = 0;
  destination.index_rows_elems = 64 * 256;
  absl::StatusOr<LatentRestorePlan> restore = PlanLatentRestore(destination, capture.snapshot, 64);
  ASSERT_THAT(restore, IsOk());
  EXPECT_TRUE(restore->zero_pool_keys);
  EXPECT_EQ(restore->restored.len, 23u);
  EXPECT_EQ(restore->restored.index_pools_ready, 5u);
  EXPECT_EQ(restore->restored.index_pool, 4u);
  ASSERT_EQ(restore->copies.size(), 3u);
  EXPECT_EQ(restore->copies[2], (LatentCopy{LatentPlane::kIndexRows, 20 * 256, 0, 3 * 256}));
}

TEST(LatentRestore, EveryRefusalNamesItsNumbers) {
  const LatentSnapshot good = PlanLatentCapture(GlmLayer(23))->snapshot;
  const LatentLayerState fresh = Fresh(GlmLayer(0));
  ASSERT_THAT(ValidateLatentRestore(fresh, good, 64), IsOk());

  EXPECT_THAT(ValidateLatentRestore(GlmLayer(4), good, 64),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("not fresh (len 4)")));
  LatentLayerState narrow = fresh;
  narrow.width = 576;
  EXPECT_THAT(ValidateLatentRestore(narrow, good, 64),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("snapshot width 512 != destination width 576")));
  EXPECT_THAT(ValidateLatentRestore(fresh, good, 16),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("snapshot len 23 outside [1,16]")));
  LatentSnapshot truncated = good;
  truncated.rows_elems -= 1;
  EXPECT_THAT(ValidateLatentRestore(fresh, truncated, 64),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs("holds 11775 elements", "requires 11776 (truncated capture)")));
  LatentLayerState small = fresh;
  small.rows_elems = 16 * 512;
  EXPECT_THAT(ValidateLatentRestore(small, good, 64),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("holds 8192 elements but the restore requires 11776")));
  LatentLayerState no_indexer = fresh;
  no_indexer.index_width = 0;
  EXPECT_THAT(ValidateLatentRestore(no_indexer, good, 64),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("snapshot index width 256 != destination 0")));
  LatentSnapshot unresolved = good;
  unresolved.index_pool = 0;
  EXPECT_THAT(ValidateLatentRestore(fresh, unresolved, 64),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstrs("unresolved pool")));
  LatentLayerState other_pool = fresh;
  other_pool.index_pool = 8;
  EXPECT_THAT(ValidateLatentRestore(other_pool, good, 64),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("snapshot pool 4 != destination resident pool 8")));
  LatentSnapshot stale = good;
  stale.index_pools_ready = 4;
  EXPECT_THAT(ValidateLatentRestore(fresh, stale, 64),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("index_pools_ready 4 != len/pool 5")));
  LatentSnapshot short_keys = good;
  short_keys.keys_elems = 100;
  EXPECT_THAT(ValidateLatentRestore(fresh, short_keys, 64),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs("holds 100 f32 but 5 pools x d 128 require 640")));
  LatentSnapshot no_keys = good;
  no_keys.keys_elems.reset();
  EXPECT_THAT(ValidateLatentRestore(fresh, no_keys, 64),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs("claims 5 ready pools but carries no keys")));
  LatentSnapshot no_tail = good;
  no_tail.tail_elems.reset();
  EXPECT_THAT(ValidateLatentRestore(fresh, no_tail, 64),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs("owes 3 live tail rows but carries none")));
  LatentSnapshot aligned = PlanLatentCapture(GlmLayer(24))->snapshot;
  aligned.tail_elems = 256;
  EXPECT_THAT(ValidateLatentRestore(fresh, aligned, 64),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs("carries a tail at a pool-aligned boundary")));
  LatentSnapshot early = PlanLatentCapture(GlmLayer(3))->snapshot;
  early.keys_elems = 128;
  EXPECT_THAT(ValidateLatentRestore(fresh, early, 64),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs("carries keys for zero ready pools")));
  LatentLayerState no_plane = fresh;
  no_plane.index_rows_elems = 0;
  EXPECT_THAT(ValidateLatentRestore(no_plane, good, 64),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("declares an index plane but allocated none")));
  LatentLayerState tiny_ring = fresh;
  tiny_ring.index_rows_elems = 6 * 256;
  EXPECT_THAT(ValidateLatentRestore(tiny_ring, good, 64),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("holds 1536 f32 but the tail window requires 1792")));
}

TEST(LatentRules, PoolsReadyClampOnlyDownwardAndGrowthDrains) {
  LatentLayerState layer = GlmLayer(23);
  layer.index_pools_ready = 3;  // keys for pools 3 and 4 not built yet
  EXPECT_EQ(IndexPoolsReadyAt(layer, 9), 2u) << "pools built over dropped rows are cut";
  EXPECT_EQ(IndexPoolsReadyAt(layer, 20), 3u) << "shrinking never fabricates final keys";
  EXPECT_EQ(IndexPoolsReadyAt(layer, 23), 3u);
  EXPECT_EQ(IndexPoolsReadyAt(layer, 30), 7u) << "a call boundary leaves the drain at len / pool";
  layer.index_pool = 0;
  EXPECT_EQ(IndexPoolsReadyAt(layer, 9), 3u);
}

// The DSA layer: index_width 2, pool 3, a 6-row tail ring (two pools).
LatentLayerState SmallDsaLayer(uint64_t len) { return DsaLayer(7, 4, 2, 6, 3, len); }

TEST(IndexResidency, LiveTailStartsAtTheLastFinalPoolClampedToTheLength) {
  const LatentLayerState layer = SmallDsaLayer(10);  // pools_ready 3
  EXPECT_EQ(LiveIndexTailStart(layer, 10), 9u);
  EXPECT_EQ(LiveIndexTailStart(layer, 4), 3u);
  EXPECT_EQ(LiveIndexTailStart(layer, 6), 6u);
  EXPECT_EQ(LiveIndexTailStart(layer, 14), 12u) << "growth drains to 14 / 3 pools";
  LatentLayerState unknown_pool = layer;
  unknown_pool.index_pool = 0;
  EXPECT_EQ(LiveIndexTailStart(unknown_pool, 5), 5u);
}

TEST(IndexResidency, AnAppendThatLapsTheRingRaisesTheResidentStart) {
  LatentLayerState layer = SmallDsaLayer(4);
  ASSERT_THAT(NoteIndexRowsWritable(layer, 4, 2), IsOk());
  EXPECT_EQ(layer.index_resident_from, 0u) << "rows 4..5 fill free slots";
  ASSERT_THAT(NoteIndexRowsWritable(layer, 4, 6), IsOk());
  EXPECT_EQ(layer.index_resident_from, 4u) << "row 9 lands in row 3's slot";
  ASSERT_THAT(NoteIndexRowsWritable(layer, 4, 1), IsOk());
  EXPECT_EQ(layer.index_resident_from, 4u) << "the resident start never moves down on append";

  LatentLayerState flat = SmallDsaLayer(4);
  flat.index_ring_rows = 0;
  flat.index_rows_elems = 64 * 2;
  ASSERT_THAT(NoteIndexRowsWritable(flat, 4, 60), IsOk());
  EXPECT_EQ(flat.index_resident_from, 0u) << "a flat index plane is never overwritten";

  LatentLayerState no_indexer = SmallDsaLayer(4);
  no_indexer.index_width = 0;
  ASSERT_THAT(NoteIndexRowsWritable(no_indexer, 4, 60), IsOk());
  EXPECT_EQ(no_indexer.index_resident_from, 0u);
}

TEST(IndexResidency, RefusesALengthWhoseLiveTailIsNotResidentWithTheNumbers) {
  LatentLayerState layer = SmallDsaLayer(10);
  layer.index_resident_from = 4;  // commit 4, append 6: slots of rows 0..3 now hold 6..9
  EXPECT_THAT(CheckIndexTailResident(layer, 4),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("layer 7: latent length 4 would make indexer rows [3, 4) live",
                                  "holds rows only from 4",
                                  "pool boundaries (multiples of 3)",
                                  "pool starts at or above row 4")));
  EXPECT_THAT(CheckIndexTailResident(layer, 5),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("rows [3, 4) live")));
  EXPECT_THAT(CheckIndexTailResident(layer, 3), IsOk()) << "a pool boundary has no live tail";
  EXPECT_THAT(CheckIndexTailResident(layer, 6), IsOk());
  EXPECT_THAT(CheckIndexTailResident(layer, 8), IsOk()) << "tail [6, 8) is resident";
  EXPECT_THAT(CheckIndexTailResident(layer, 10), IsOk());

  LatentLayerState carried = SmallDsaLayer(8);  // a restored session: tail [6, 8) only
  carried.index_resident_from = 6;
  EXPECT_THAT(CheckIndexTailResident(carried, 4),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("indexer rows [3, 4) live", "holds rows only from 6")));
  EXPECT_THAT(CheckIndexTailResident(carried, 5),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("rows [3, 5) live")));
}

TEST(IndexResidency, RestoreCarriesOnlyTheLiveTail) {
  const LatentLayerState source = SmallDsaLayer(8);
  absl::StatusOr<LatentCapturePlan> capture = PlanLatentCapture(source);
  ASSERT_THAT(capture, IsOk());
  absl::StatusOr<LatentRestorePlan> restore =
      PlanLatentRestore(SmallDsaLayer(0), capture->snapshot, 64);
  ASSERT_THAT(restore, IsOk());
  EXPECT_EQ(restore->restored.len, 8u);
  EXPECT_EQ(restore->restored.index_resident_from, 6u);
  EXPECT_THAT(CheckIndexTailResident(restore->restored, 4),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("rows [3, 4) live")));
}

}  // namespace
}  // namespace memra
