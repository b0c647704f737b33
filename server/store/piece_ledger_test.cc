#include "server/store/piece_ledger.h"

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/test_host_backend.h"
#include "tests/seeded_random.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr uint64_t kSlab = uint64_t{64} << 10;

class PieceLedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::NewTestHostBackend(testing::TestHostBackendOptions(uint64_t{64} << 20));
    ASSERT_NE(backend_, nullptr);
    SlabAllocatorOptions options;
    options.slab_bytes = kSlab;
    auto slabs = SlabAllocator::Create(options, backend_.get(), nullptr);
    ASSERT_THAT(slabs.status(), IsOk());
    slabs_ = *std::move(slabs);
    ledger_ = std::make_unique<PieceLedger>(slabs_.get());
  }
  void TearDown() override {
    if (ledger_ != nullptr) {
      EXPECT_THAT(ledger_->CheckInvariants(), IsOk());
    }
  }

  // A span as the index holds it: allocated, its allocation hold released.
  SlabSpan Adopted(uint64_t bytes) {
    absl::StatusOr<SlabSpan> span = slabs_->Allocate(bytes);
    EXPECT_THAT(span.status(), IsOk());
    if (!span.ok()) return {};
    EXPECT_THAT(slabs_->Release(span->slab), IsOk());
    return *span;
  }

  PieceLedger::Hold Take(HoldKind kind, uint64_t handle, std::optional<SlabSpan> span) {
    absl::StatusOr<PieceLedger::Hold> hold = ledger_->Take(kind, handle, span);
    EXPECT_THAT(hold.status(), IsOk());
    return hold.ok() ? *std::move(hold) : PieceLedger::Hold();
  }

  std::unique_ptr<HostBackend> backend_;
  std::unique_ptr<SlabAllocator> slabs_;
  std::unique_ptr<PieceLedger> ledger_;
};

TEST_F(PieceLedgerTest, APieceMayGoOnlyWithNoHoldOfAnyKind) {
  EXPECT_TRUE(ledger_->MayGo(7));
  PieceLedger::Hold restore = Take(HoldKind::kRestore, 7, std::nullopt);
  PieceLedger::Hold demotion_a = Take(HoldKind::kDemotion, 7, std::nullopt);
  PieceLedger::Hold demotion_b = Take(HoldKind::kDemotion, 7, std::nullopt);
  EXPECT_THAT(ledger_->CheckMayGo(7), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstrs("piece 7 is held: 1 restore, 2 demotion")));
  EXPECT_EQ(ledger_->Holds(7, HoldKind::kDemotion), 2u);
  EXPECT_TRUE(ledger_->HeldAs(7, HoldKind::kRestore));
  EXPECT_FALSE(ledger_->HeldAs(7, HoldKind::kPromotion));
  EXPECT_TRUE(ledger_->MayGo(8));
  EXPECT_EQ(ledger_->Stats().holds[static_cast<size_t>(HoldKind::kDemotion)], 2u);
  restore.Release();
  restore.Release();  // once only
  EXPECT_FALSE(restore.held());
  demotion_a = std::move(demotion_b);  // the old one is released, the moved one kept
  EXPECT_FALSE(demotion_b.held());
  EXPECT_THAT(ledger_->CheckMayGo(7), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstrs("piece 7 is held: 1 demotion")));
  demotion_a = PieceLedger::Hold();
  EXPECT_TRUE(ledger_->MayGo(7));
  EXPECT_EQ(ledger_->Stats().holds, (std::array<uint64_t, kHoldKinds>{}));
}

TEST_F(PieceLedgerTest, AHeldSpanKeepsItsSlabOutOfTheEvictableBytes) {
  const SlabSpan a = Adopted(1000);
  EXPECT_EQ(ledger_->EvictableBytes(), kSlab);
  {
    PieceLedger::Hold restore = Take(HoldKind::kRestore, 1, a);
    PieceLedger::Hold again = Take(HoldKind::kRestore, 2, a);
    EXPECT_EQ(ledger_->EvictableBytes(), 0u);
    restore.Release();
    EXPECT_EQ(ledger_->EvictableBytes(), 0u);  // the other still holds the slab
  }
  EXPECT_EQ(ledger_->EvictableBytes(), kSlab);
  // A capture's allocation: Allocate's own hold becomes the ledger's.
  absl::StatusOr<SlabSpan> fresh = slabs_->Allocate(2 * kSlab);  // a slab of its own
  ASSERT_THAT(fresh.status(), IsOk());
  PieceLedger::Hold capture = ledger_->AdoptAllocation(HoldKind::kCapture, 0, *fresh);
  EXPECT_EQ(ledger_->EvictableBytes(), kSlab);
  EXPECT_EQ(ledger_->Stats().holds[static_cast<size_t>(HoldKind::kCapture)], 1u);
  capture.Release();
  EXPECT_EQ(ledger_->EvictableBytes(), 3 * kSlab);
}

TEST_F(PieceLedgerTest, ASlabThatIsNotLiveIsRefusedAndNothingIsHeld) {
  const SlabSpan gone{.slab = ArenaId{4242}, .offset = 0, .bytes = 256};
  EXPECT_THAT(ledger_->Take(HoldKind::kRestore, 9, gone).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("4242")));
  EXPECT_TRUE(ledger_->MayGo(9));
  EXPECT_EQ(ledger_->Stats().holds, (std::array<uint64_t, kHoldKinds>{}));
}

TEST_F(PieceLedgerTest, ARestorePinTakesItsSpanOnceThePieceIsInASlab) {
  PieceLedger::Hold pin = Take(HoldKind::kRestore, 5, std::nullopt);
  const SlabSpan promoted = Adopted(512);
  EXPECT_EQ(ledger_->EvictableBytes(), kSlab);
  ASSERT_THAT(ledger_->AttachSpan(pin, promoted), IsOk());
  EXPECT_EQ(ledger_->EvictableBytes(), 0u);
  EXPECT_THAT(ledger_->AttachSpan(pin, promoted),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("restore hold on piece 5 already holds a span",
                                  absl::StrCat("slab ", promoted.slab.value), "offset 0")));
  pin.Release();
  EXPECT_EQ(ledger_->EvictableBytes(), kSlab);
  EXPECT_THAT(ledger_->AttachSpan(pin, promoted),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("restore hold on piece 5 is released")));
}

TEST_F(PieceLedgerTest, AFreeUnderAQueuedRemoteWriteWaitsForTheWrite) {
  const SlabSpan span = Adopted(3000);
  const SlabSpan other = Adopted(1000);
  PieceLedger::Hold write = Take(HoldKind::kRemoteWrite, 0, span);
  EXPECT_TRUE(ledger_->FreeSpan(span));
  EXPECT_TRUE(ledger_->FreeSpan(span));  // counted once
  EXPECT_EQ(ledger_->Stats().deferred_spans, 1u);
  EXPECT_EQ(ledger_->Stats().deferred_bytes, span.bytes);
  EXPECT_EQ(slabs_->Stats().used_bytes, span.bytes + other.bytes);  // still readable
  EXPECT_FALSE(ledger_->FreeSpan(other));  // no write on it: freed now
  EXPECT_EQ(slabs_->Stats().used_bytes, span.bytes);
  // The writer thread releases it.
  std::thread writer([&] { write.Release(); });
  writer.join();
  EXPECT_EQ(slabs_->Stats().used_bytes, 0u);
  EXPECT_EQ(ledger_->Stats().deferred_spans, 0u);
  EXPECT_EQ(ledger_->Stats().deferred_bytes, 0u);
}

TEST_F(PieceLedgerTest, ARemoteWriteReleasedBeforeAnyFreeLeavesTheSpanLive) {
  const SlabSpan span = Adopted(3000);
  Take(HoldKind::kRemoteWrite, 0, span).Release();
  EXPECT_EQ(slabs_->Stats().used_bytes, span.bytes);
  EXPECT_FALSE(ledger_->FreeSpan(span));
  EXPECT_EQ(slabs_->Stats().used_bytes, 0u);
}

// ---- Property test: the store's operations, concurrently, against a model ----
//
// Each thread plays the store's operations on its own pieces (so its model of them is exact)
// over one shared allocator and ledger: capture (allocate, capture hold, maybe a queued remote
// write, adoption), restore pins (with the device span), promotion (disk -> a new span, as
// PromotePinned), demotion (as PlanMoves/MoveChunk: skipped when pinned, committed unless pinned
// meanwhile), the remote writer finishing, and eviction (only what MayGo allows). After every
// step the thread checks the ledger's answers for a piece against its model; between rounds,
// with all threads stopped, the evictable bytes are checked against the slabs the model holds.

struct ModelPiece {
  std::optional<SlabSpan> span;  // nullopt: on disk
  std::vector<PieceLedger::Hold> restores;
  std::array<uint32_t, kHoldKinds> expected{};
};

struct ThreadModel {
  uint64_t next_handle = 0;
  std::map<uint64_t, ModelPiece> pieces;
  // Queued remote writes (their spans may have been freed meanwhile: the free waits).
  std::vector<PieceLedger::Hold> writes;
  std::set<std::pair<uint64_t, uint64_t>> freed_under_write;  // (slab, offset) deferred frees
};

void CheckPiece(const PieceLedger& ledger, uint64_t handle, const ModelPiece& piece) {
  for (size_t k = 0; k < kHoldKinds; ++k) {
    ASSERT_EQ(ledger.Holds(handle, static_cast<HoldKind>(k)), piece.expected[k])
        << "piece " << handle << " kind " << HoldKindName(static_cast<HoldKind>(k));
  }
  const bool held = piece.expected != std::array<uint32_t, kHoldKinds>{};
  ASSERT_EQ(ledger.MayGo(handle), !held) << ledger.CheckMayGo(handle);
  ASSERT_EQ(ledger.CheckMayGo(handle).ok(), !held);
}

void Step(SlabAllocator& slabs, PieceLedger& ledger, ThreadModel& model,
          testing::SeededRandom& random) {
  const uint64_t op = random.Below(8);
  auto pick = [&]() -> std::map<uint64_t, ModelPiece>::iterator {
    if (model.pieces.empty()) return model.pieces.end();
    auto it = model.pieces.begin();
    std::advance(it, random.Below(model.pieces.size()));
    return it;
  };
  constexpr size_t kRestore = static_cast<size_t>(HoldKind::kRestore);
  if (op == 0 || model.pieces.size() < 4) {  // capture
    absl::StatusOr<SlabSpan> span = slabs.Allocate(256 + random.Below(8000));
    ASSERT_THAT(span.status(), IsOk());
    PieceLedger::Hold capture = ledger.AdoptAllocation(HoldKind::kCapture, 0, *span);
    if (random.Below(2) == 0) {
      absl::StatusOr<PieceLedger::Hold> write = ledger.Take(HoldKind::kRemoteWrite, 0, *span);
      ASSERT_THAT(write.status(), IsOk());
      model.writes.push_back(*std::move(write));
    }
    const uint64_t handle = ++model.next_handle;
    model.pieces[handle].span = *span;
    capture.Release();  // adopted by the index
    return;
  }
  auto it = pick();
  ModelPiece& piece = it->second;
  const uint64_t handle = it->first;
  switch (op) {
    case 1:  // a restore pins the piece (its span held where it is in a slab)
      if (piece.span.has_value() || random.Below(2) == 0) {
        absl::StatusOr<PieceLedger::Hold> pin =
            ledger.Take(HoldKind::kRestore, handle, piece.span);
        ASSERT_THAT(pin.status(), IsOk());
        piece.restores.push_back(*std::move(pin));
        ++piece.expected[kRestore];
      }
      break;
    case 2:  // a restore ends
      if (!piece.restores.empty()) {
        piece.restores.pop_back();
        --piece.expected[kRestore];
      }
      break;
    case 3: {  // promotion of a piece on disk
      if (piece.span.has_value()) break;
      absl::StatusOr<PieceLedger::Hold> promoting =
          ledger.Take(HoldKind::kPromotion, handle, std::nullopt);
      ASSERT_THAT(promoting.status(), IsOk());
      ++piece.expected[static_cast<size_t>(HoldKind::kPromotion)];
      CheckPiece(ledger, handle, piece);
      absl::StatusOr<SlabSpan> span = slabs.Allocate(256 + random.Below(4000));
      ASSERT_THAT(span.status(), IsOk());
      PieceLedger::Hold fresh = ledger.AdoptAllocation(HoldKind::kPromotion, 0, *span);
      piece.span = *span;
      // The restore that promoted it holds the new span (as HoldEntry after PromotePinned).
      for (PieceLedger::Hold& pin : piece.restores) {
        if (!pin.span().has_value()) {
          ASSERT_THAT(ledger.AttachSpan(pin, *span), IsOk());
        }
      }
      fresh.Release();
      promoting->Release();
      --piece.expected[static_cast<size_t>(HoldKind::kPromotion)];
      break;
    }
    case 4: {  // demotion to disk: planned only when unpinned
      if (!piece.span.has_value() || ledger.HeldAs(handle, HoldKind::kRestore)) break;
      absl::StatusOr<PieceLedger::Hold> moving =
          ledger.Take(HoldKind::kDemotion, handle, piece.span);
      ASSERT_THAT(moving.status(), IsOk());
      ++piece.expected[static_cast<size_t>(HoldKind::kDemotion)];
      CheckPiece(ledger, handle, piece);
      // A restore may pin it meanwhile: then it stays where it is.
      if (random.Below(4) == 0) {
        absl::StatusOr<PieceLedger::Hold> pin =
            ledger.Take(HoldKind::kRestore, handle, piece.span);
        ASSERT_THAT(pin.status(), IsOk());
        piece.restores.push_back(*std::move(pin));
        ++piece.expected[kRestore];
      }
      const bool pinned = ledger.HeldAs(handle, HoldKind::kRestore);
      moving->Release();
      --piece.expected[static_cast<size_t>(HoldKind::kDemotion)];
      if (!pinned) {
        if (ledger.FreeSpan(*piece.span)) {
          model.freed_under_write.insert({piece.span->slab.value, piece.span->offset});
        }
        piece.span.reset();
      }
      break;
    }
    case 5:  // the remote writer finishes one write
      if (!model.writes.empty()) {
        const size_t i = random.Below(model.writes.size());
        const SlabSpan span = *model.writes[i].span();
        model.writes.erase(model.writes.begin() + i);
        model.freed_under_write.erase({span.slab.value, span.offset});
      }
      break;
    default: {  // eviction: only what the ledger lets go
      const bool held = piece.expected != std::array<uint32_t, kHoldKinds>{};
      ASSERT_EQ(ledger.MayGo(handle), !held);
      if (held) break;
      if (piece.span.has_value() && ledger.FreeSpan(*piece.span)) {
        model.freed_under_write.insert({piece.span->slab.value, piece.span->offset});
      }
      model.pieces.erase(it);
      return;
    }
  }
  CheckPiece(ledger, handle, piece);
}

TEST_F(PieceLedgerTest, PropertyConcurrentStoreOperationsAgreeWithTheModel) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 20;
  constexpr int kSteps = 300;
  std::vector<ThreadModel> models(kThreads);
  std::vector<testing::SeededRandom> randoms;
  for (int t = 0; t < kThreads; ++t) {
    randoms.emplace_back(0x1ed9e7 + 7919 * t);
    models[t].next_handle = uint64_t(t) << 32;  // each thread's pieces are its own
  }
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kSteps && !::testing::Test::HasFatalFailure(); ++i) {
          Step(*slabs_, *ledger_, models[t], randoms[t]);
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    ASSERT_FALSE(HasFailure()) << "round " << round;
    // Quiescent: the evictable bytes are the slabs no modelled hold keeps.
    std::set<uint64_t> held_slabs;
    uint64_t live_bytes = 0;
    uint64_t deferred = 0;
    for (const ThreadModel& model : models) {
      for (const auto& [handle, piece] : model.pieces) {
        if (piece.span.has_value()) live_bytes += piece.span->bytes;
        for (const PieceLedger::Hold& pin : piece.restores) {
          if (pin.span().has_value()) held_slabs.insert(pin.span()->slab.value);
        }
      }
      for (const PieceLedger::Hold& write : model.writes) {
        held_slabs.insert(write.span()->slab.value);
      }
      deferred += model.freed_under_write.size();
      for (const auto& [slab, offset] : model.freed_under_write) {
        for (const PieceLedger::Hold& write : model.writes) {
          if (write.span()->slab.value == slab && write.span()->offset == offset) {
            live_bytes += write.span()->bytes;
          }
        }
      }
    }
    const SlabStats stats = slabs_->Stats();
    ASSERT_EQ(stats.used_bytes, live_bytes) << "round " << round;
    ASSERT_EQ(ledger_->EvictableBytes(), stats.slab_bytes - held_slabs.size() * kSlab)
        << "round " << round << ": " << held_slabs.size() << " slabs held";
    ASSERT_EQ(ledger_->Stats().deferred_spans, deferred) << "round " << round;
    ASSERT_THAT(ledger_->CheckInvariants(), IsOk());
    ASSERT_THAT(slabs_->CheckInvariants(), IsOk());
  }
  // Everything ends: every hold released, every span freed.
  for (ThreadModel& model : models) {
    model.writes.clear();
    for (auto& [handle, piece] : model.pieces) {
      piece.restores.clear();
      if (piece.span.has_value()) {
        EXPECT_FALSE(ledger_->FreeSpan(*piece.span));
      }
    }
  }
  EXPECT_EQ(ledger_->Stats().holds, (std::array<uint64_t, kHoldKinds>{}));
  EXPECT_EQ(ledger_->Stats().deferred_spans, 0u);
  EXPECT_EQ(slabs_->Stats().used_bytes, 0u);
  EXPECT_EQ(ledger_->EvictableBytes(), slabs_->Stats().slab_bytes);
}

}  // namespace
}  // namespace memra
