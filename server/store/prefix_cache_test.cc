#include "server/store/prefix_cache.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/index_ring.h"
#include "core/kv_ring.h"
#include "core/model_plan.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/device_budget.h"
#include "server/session/daemon_session.h"
#include "server/session/session_prefix.h"
#include "server/store/host_tier_memory.h"
#include "server/store/remote/redis_cluster.h"
#include "server/store/remote/remote_tier.h"
#include "server/testing/test_host_backend.h"
#include "server/testing/test_redis_cluster.h"
#include "tests/seeded_random.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;
namespace tp = ::memra::test_plans;

constexpr uint32_t kBlock = 16;
constexpr char kScope[] = "uid:1000";  // the test sessions' cache scope unless one is given
// A FlatPlan block's stored bytes: 16 tokens x 2 layers x (a 34-byte q8_0 K row of 32 dims + a
// 24-byte q5_1 V row).
constexpr uint64_t kFlatBlockBytes = kBlock * 2 * (34 + 24);
// The slab span a FlatPlan block takes (kFlatBlockBytes rounded up to 256).
constexpr uint64_t kFlatSpanBytes = 2048;
constexpr uint64_t kSlabBytes = uint64_t{256} << 10;

// The byte an "engine" wrote at (layer, plane, absolute row, byte). Position-addressed rows do
// not depend on the session, so a shared prefix is the same bytes in every session; recurrent
// state carries `seed` (the state differs with where the sequence stopped).
uint8_t Pattern(uint32_t layer, PlaneKind kind, uint64_t row, uint64_t byte, uint64_t seed = 0) {
  return static_cast<uint8_t>(layer * 131 + static_cast<uint32_t>(kind) * 31 + row * 7 +
                              byte * 13 + seed * 17 + 1);
}

std::vector<int32_t> Tokens(uint64_t n, int32_t salt = 0) {
  std::vector<int32_t> tokens;
  for (uint64_t i = 0; i < n; ++i) tokens.push_back(static_cast<int32_t>(i * 3 + 1000 + salt));
  return tokens;
}

ModelPlan FlatPlan() { return tp::DenseModel(2, 32, 1); }
ModelPlan HybridPlan() {
  ModelPlan plan;
  plan.layers = {tp::KvLayer(0, 32, 1), tp::RecurrentLayer(1, 16, 4, 64)};
  return plan;
}
ModelPlan SwaPlan() {
  ModelPlan plan;
  plan.swa_ring = true;
  plan.layers = {tp::SlidingLayer(0, 32, 1, 64), tp::KvLayer(1, 32, 1)};
  return plan;
}
ModelPlan LatentPlan() {
  ModelPlan plan;
  plan.index_ring_rows = 32;  // a tail ring: the live tail sits at a ring position
  plan.layers = {tp::LatentLayer(0, 16, 8, 4), tp::LatentLayer(1, 16)};
  return plan;
}

// One range of one plane an engine wrote: rows [first, end) of row_bytes at physical row
// `physical_first`.
struct Written {
  PlaneRef plane;
  uint64_t first = 0;
  uint64_t end = 0;
  uint64_t physical_first = 0;
  uint64_t row_bytes = 0;
  uint64_t seed = 0;
};

// What a session at committed length `len` holds, addressed independently of the code under
// test: flat rows [0, len); a ring's window [from, len) at physical row - base; latent rows;
// pool keys [0, ready) (a "row" per pool); the indexer tail at its ring position; recurrent
// state whole. `window_from` picks the ring rows (the resident rows for a writer, the aligned
// window for a checker).
std::vector<Written> Content(const SessionPlan& plan, const SessionState& state, bool aligned) {
  std::vector<Written> out;
  const uint64_t len = state.committed_len();
  for (const LayerGeometry& g : plan.layers) {
    switch (g.kind) {
      case StateKind::kKv:
      case StateKind::kSlidingKv: {
        uint64_t from = 0;
        uint64_t base = 0;
        if (g.ring) {
          for (size_t i = 0; i < state.kv().layer_count(); ++i) {
            if (state.kv().shapes()[i].layer == g.layer) base = state.kv().ring(i)->base();
          }
          from = aligned ? AlignedWindowStart(len, g.window) : base;
        }
        out.push_back({{g.layer, PlaneKind::kKeys}, from, len, from - base, g.k_token_bytes});
        out.push_back({{g.layer, PlaneKind::kValues}, from, len, from - base, g.v_token_bytes});
        break;
      }
      case StateKind::kLatent: {
        out.push_back({{g.layer, PlaneKind::kLatentRows}, 0, len, 0, g.latent_width * 4});
        if (g.index_width == 0) break;
        const uint64_t ready = len / g.index_pool;
        out.push_back({{g.layer, PlaneKind::kPoolKeys}, 0, ready, 0, g.index_width / 2 * 4});
        const uint64_t tail = ready * g.index_pool;
        const uint64_t physical =
            IndexPlanePhysicalRow(g.index_ring ? g.index_physical_rows : 0, g.index_pool, tail)
                .value();
        out.push_back({{g.layer, PlaneKind::kIndexRows}, tail, len, physical, g.index_width * 4});
        break;
      }
      case StateKind::kRecurrent:
        out.push_back({{g.layer, PlaneKind::kConvState}, 0, 1, 0, g.conv_elems * 4, len});
        out.push_back({{g.layer, PlaneKind::kSsmState}, 0, 1, 0, g.ssm_elems * 4, len});
        break;
      default:
        break;
    }
  }
  return out;
}

class PrefixCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::NewTestHostBackend(testing::TestHostBackendOptions(uint64_t{256} << 20));
    ASSERT_NE(backend_, nullptr);
    cache_ = MakeCache(uint64_t{64} << 20);
  }

  std::unique_ptr<PrefixCache> MakeCache(uint64_t budget, DeviceBudget* device_budget = nullptr,
                                         uint64_t event_capacity = 4096,
                                         uint32_t copy_threads = 1,
                                         uint64_t slice_bytes = uint64_t{8} << 20,
                                         uint64_t slab_bytes = kSlabBytes) {
    PrefixCacheOptions options;
    options.copy_threads = copy_threads;
    options.checksum_slice_bytes = slice_bytes;
    options.slab_bytes = slab_bytes;
    options.parallel_copy_bytes = 1;  // every multi-block capture or restore may split
    options.budget_bytes = budget;
    options.block_tokens = kBlock;
    options.epoch = 77;
    options.event_capacity = event_capacity;
    absl::StatusOr<std::unique_ptr<PrefixCache>> cache =
        PrefixCache::Create(options, backend_.get(), device_budget);
    EXPECT_THAT(cache.status(), IsOk());
    return cache.ok() ? *std::move(cache) : nullptr;
  }

  // A cache with a disk tier under a fresh directory of the test's tmpdir.
  absl::StatusOr<std::unique_ptr<PrefixCache>> MakeTieredCache(
      uint64_t device_bytes, uint64_t disk_bytes, DeviceBudget* device_budget,
      const std::string& dir_name,
      std::function<void(uint64_t, StorageMedium)> before_demotion_copy = {}) {
    return MakeTierChain(device_bytes, /*host_bytes=*/0, disk_bytes, device_budget, dir_name,
                         std::move(before_demotion_copy));
  }

  // device -> host (plain host memory, as the cuda backend's pinned memory would be; none when
  // host_bytes is 0) -> disk (none when disk_bytes is 0).
  absl::StatusOr<std::unique_ptr<PrefixCache>> MakeTierChain(
      uint64_t device_bytes, uint64_t host_bytes, uint64_t disk_bytes,
      DeviceBudget* device_budget, const std::string& dir_name,
      std::function<void(uint64_t, StorageMedium)> before_demotion_copy = {}) {
    PrefixCacheOptions options;
    options.copy_threads = 2;
    options.checksum_slice_bytes = 512;  // a block is 4 slices: each verified on its own
    options.slab_bytes = tier_slab_bytes_;
    options.parallel_copy_bytes = 1;
    options.budget_bytes = device_bytes;
    options.block_tokens = kBlock;
    options.epoch = 77;
    if (disk_bytes > 0) {
      const char* tmp = std::getenv("TEST_TMPDIR");
      disk_dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", dir_name);
      std::system(absl::StrCat("rm -rf '", disk_dir_, "'").c_str());
      options.disk_dir = disk_dir_;
      options.disk_bytes = disk_bytes;
      options.disk_queue_depth = 2;
    }
    options.host_tier_bytes = host_bytes;
    options.demotion_chunk_bytes = demotion_chunk_bytes_;
    options.before_demotion_copy = std::move(before_demotion_copy);
    return PrefixCache::Create(options, backend_.get(), device_budget,
                               host_bytes > 0 ? NewPlainHostMemory() : nullptr);
  }

  std::unique_ptr<DaemonSession> NewSession(const ModelPlan& plan, uint64_t capacity,
                                           const std::string& scope = kScope) {
    DaemonSession::Params params;
    params.id = SessionId{next_id_++};
    params.owner = EngineId{1};
    params.cache_scope = scope;
    params.token = "0123456789abcdef";
    params.model = std::make_shared<const ModelPlan>(plan);
    params.shape.capacity = capacity;
    absl::StatusOr<std::unique_ptr<DaemonSession>> session =
        DaemonSession::Create(std::move(params), backend_.get(), &session_budget_);
    EXPECT_THAT(session.status(), IsOk());
    return session.ok() ? *std::move(session) : nullptr;
  }

  // Commits `rows` more rows (chunks the ring can take) with their token ids, then writes the
  // pattern for everything the session holds (the engine's kernels, done after the fact).
  void Append(DaemonSession& session, const std::vector<int32_t>& all_tokens, uint64_t rows) {
    uint64_t done = 0;
    while (done < rows) {
      const uint64_t chunk = std::min<uint64_t>(rows - done, 512);
      absl::StatusOr<TransactionId> begin = session.Begin();
      ASSERT_THAT(begin, IsOk());
      ASSERT_THAT(session.PrepareAppend(begin->generation, chunk), IsOk());
      ASSERT_THAT(session.PublishAppend(begin->generation), IsOk());
      const uint64_t at = begin->base_len;
      ASSERT_THAT(session.Commit(begin->generation, chunk,
                                 absl::MakeConstSpan(all_tokens).subspan(at, chunk)),
                  IsOk());
      done += chunk;
    }
    WritePattern(session);
  }

  void WritePattern(DaemonSession& session) {
    ASSERT_THAT(session.ViewLocked([&](const SessionState& state,
                                       const SessionLayoutVersion& layout,
                                       const std::optional<std::vector<int32_t>>&) {
      for (const Written& w : Content(layout.plan, state, /*aligned=*/false)) {
        std::vector<uint8_t> row(w.row_bytes);
        for (uint64_t r = w.first; r < w.end; ++r) {
          for (uint64_t j = 0; j < w.row_bytes; ++j) row[j] = Pattern(w.plane.layer, w.plane.kind, r, j, w.seed);
          const uint64_t physical = w.physical_first + (r - w.first);
          ASSIGN_OR_RETURN(uint64_t at, PlaneRangeOffset(layout, w.plane, physical * w.row_bytes,
                                                         w.row_bytes));
          RETURN_IF_ERROR(backend_->Write(layout.arena, at, row));
        }
      }
      return absl::OkStatus();
    }),
                IsOk());
  }

  // Every byte the restored length covers holds what the source wrote; `seed` is the
  // source's committed length (its recurrent state).
  void ExpectRestored(DaemonSession& session, uint64_t len, uint64_t seed) {
    ASSERT_THAT(session.ViewLocked([&](const SessionState& state,
                                       const SessionLayoutVersion& layout,
                                       const std::optional<std::vector<int32_t>>&) {
      EXPECT_EQ(state.committed_len(), len);
      for (const Written& w : Content(layout.plan, state, /*aligned=*/true)) {
        std::vector<uint8_t> row(w.row_bytes);
        for (uint64_t r = w.first; r < w.end; ++r) {
          const uint64_t physical = w.physical_first + (r - w.first);
          ASSIGN_OR_RETURN(uint64_t at, PlaneRangeOffset(layout, w.plane, physical * w.row_bytes,
                                                         w.row_bytes));
          RETURN_IF_ERROR(backend_->Read(layout.arena, at, absl::MakeSpan(row)));
          for (uint64_t j = 0; j < w.row_bytes; ++j) {
            const uint64_t s = w.plane.kind == PlaneKind::kConvState ||
                                       w.plane.kind == PlaneKind::kSsmState
                                   ? seed
                                   : 0;
            if (row[j] != Pattern(w.plane.layer, w.plane.kind, r, j, s)) {
              ADD_FAILURE() << "layer " << w.plane.layer << " " << PlaneKindName(w.plane.kind)
                            << " row " << r << " byte " << j;
              return absl::OkStatus();
            }
          }
        }
      }
      return absl::OkStatus();
    }),
                IsOk());
  }

  // Digest of the session's whole arena: "untouched" means this does not change.
  std::vector<uint8_t> ArenaBytes(DaemonSession& session) {
    std::vector<uint8_t> bytes;
    EXPECT_THAT(session.ViewLocked([&](const SessionState&, const SessionLayoutVersion& layout,
                                       const std::optional<std::vector<int32_t>>&) {
      bytes.resize(layout.exported.bytes);
      return backend_->Read(layout.arena, 0, absl::MakeSpan(bytes));
    }),
                IsOk());
    return bytes;
  }

  // Overwrites the committed K/V rows [from_row, len) of a flat-K/V session with bytes from
  // `seed`: content that differs between sessions at every row (the pattern does not), so a
  // restore that mixed up two entries' storage cannot pass KvRows' comparison.
  void FillRandom(DaemonSession& session, uint64_t seed, uint64_t from_row) {
    testing::SeededRandom random(seed);
    ASSERT_THAT(session.ViewLocked([&](const SessionState& state,
                                       const SessionLayoutVersion& layout,
                                       const std::optional<std::vector<int32_t>>&) {
      for (const Written& w : Content(layout.plan, state, /*aligned=*/false)) {
        const uint64_t first = std::max(w.first, from_row);
        if (first >= w.end) continue;
        std::vector<uint8_t> bytes((w.end - first) * w.row_bytes);
        for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(random.Below(256));
        ASSIGN_OR_RETURN(uint64_t at,
                         PlaneRangeOffset(layout, w.plane, first * w.row_bytes, bytes.size()));
        RETURN_IF_ERROR(backend_->Write(layout.arena, at, bytes));
      }
      return absl::OkStatus();
    }),
                IsOk());
  }

  // The bytes of a flat-K/V session's rows [0, len), every plane in layer order.
  std::vector<uint8_t> KvRows(DaemonSession& session, uint64_t len) {
    std::vector<uint8_t> out;
    EXPECT_THAT(session.ViewLocked([&](const SessionState&, const SessionLayoutVersion& layout,
                                       const std::optional<std::vector<int32_t>>&) {
      for (const LayerGeometry& g : layout.plan.layers) {
        for (const auto& [kind, row_bytes] : {std::pair{PlaneKind::kKeys, g.k_token_bytes},
                                              std::pair{PlaneKind::kValues, g.v_token_bytes}}) {
          std::vector<uint8_t> rows(len * row_bytes);
          ASSIGN_OR_RETURN(uint64_t at, PlaneRangeOffset(layout, {g.layer, kind}, 0, rows.size()));
          RETURN_IF_ERROR(backend_->Read(layout.arena, at, absl::MakeSpan(rows)));
          out.insert(out.end(), rows.begin(), rows.end());
        }
      }
      return absl::OkStatus();
    }),
                IsOk());
    return out;
  }

  // A flat-K/V entry's source session and the tokens it was captured under, by entry id.
  struct ChurnSource {
    std::unique_ptr<DaemonSession> session;
    std::vector<int32_t> tokens;
    uint64_t len = 0;
  };
  using ChurnSources = absl::flat_hash_map<uint64_t, ChurnSource>;

  // One step of random churn: a third of the time a bit-exact restore of a random entry, else a
  // capture of 1-5 blocks of random content under fresh tokens (`salt`, `fill_seed`).
  void ChurnStep(testing::SeededRandom& random, ChurnSources& sources, int32_t salt,
                 uint64_t fill_seed) {
    const std::vector<ScopedEntry> entries = cache_->ListEntries();
    if (random.Below(3) == 0 && !entries.empty()) {
      const EntryView& entry = entries[random.Below(entries.size())].view;
      const ChurnSource& source = sources.at(entry.id.value);
      auto dest = NewSession(FlatPlan(), 256);
      ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, entry.id, source.tokens).status(), IsOk());
      ASSERT_EQ(KvRows(*dest, source.len), KvRows(*source.session, source.len));
      return;
    }
    const uint64_t len = (1 + random.Below(5)) * kBlock;
    std::vector<int32_t> tokens = Tokens(len, salt);
    auto session = NewSession(FlatPlan(), 256);
    Append(*session, tokens, len);
    FillRandom(*session, fill_seed, 0);
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *session, tokens, len);
    ASSERT_THAT(captured.status(), IsOk());
    sources[captured->entry.value] = ChurnSource{std::move(session), tokens, len};
  }

  // A cache of 4 device block pieces over `below` (disk, or the host tier as the last one) of 4
  // and slack that is no fifth piece but keeps the index's budget (the tiers' sum) above 8
  // pieces. Slabs of 2 pieces: an admission returns a slab once both of its pieces moved down.
  void UseFourPieceTiers(StorageMedium below, const std::string& dir_name) {
    constexpr uint64_t kFourPiecesAndSlack = 4 * kFlatSpanBytes + 1000;
    const bool disk = below == StorageMedium::kDisk;
    tier_slab_bytes_ = 2 * kFlatSpanBytes;
    absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
        MakeTierChain(4 * kFlatSpanBytes, disk ? 0 : kFourPiecesAndSlack,
                      disk ? kFourPiecesAndSlack : 0, nullptr, dir_name);
    ASSERT_THAT(tiered.status(), IsOk());
    cache_ = *std::move(tiered);
  }

  // A session of `blocks` blocks of random content (`seed`) under tokens salted `salt`.
  ChurnSource BlocksSource(uint64_t blocks, int32_t salt, uint64_t seed) {
    ChurnSource source{NewSession(FlatPlan(), 128), Tokens(blocks * kBlock, salt), blocks * kBlock};
    Append(*source.session, source.tokens, source.len);
    FillRandom(*source.session, seed, 0);
    return source;
  }

  // Captures `source`'s tokens [0, rows); the ledgers agree after.
  EntryId CaptureChecked(const ChurnSource& source, uint64_t rows) {
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *source.session, source.tokens, rows);
    EXPECT_THAT(captured.status(), IsOk());
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
    return captured.ok() ? captured->entry : EntryId{};
  }

  // A 2-block entry sharing nothing (tokens salted `salt`); its source goes into `sources`.
  EntryId CaptureOwnEntry(int32_t salt, ChurnSources& sources) {
    ChurnSource source = BlocksSource(2, salt, 30 + salt);
    const EntryId entry = CaptureChecked(source, source.len);
    sources[entry.value] = std::move(source);
    return entry;
  }

  std::vector<EntryId> ListedIds() {
    std::vector<EntryId> ids;
    for (const ScopedEntry& entry : cache_->ListEntries()) ids.push_back(entry.view.id);
    return ids;
  }

  // Every entry the cache still holds restores bit-exactly.
  void ExpectEveryEntryRestores(const ChurnSources& sources) {
    for (const ScopedEntry& scoped : cache_->ListEntries()) {
      const ChurnSource& source = sources.at(scoped.view.id.value);
      auto dest = NewSession(FlatPlan(), 256);
      ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, scoped.view.id, source.tokens).status(),
                  IsOk());
      EXPECT_EQ(KvRows(*dest, source.len), KvRows(*source.session, source.len));
    }
  }

  uint64_t Committed(DaemonSession& session) {
    absl::StatusOr<SessionReport> report = session.GetState();
    EXPECT_THAT(report, IsOk());
    const SessionStatus state = report.ok() ? report->state : SessionStatus{};
    return state.committed_len;
  }

  PlanFingerprint Shape(const ModelPlan& plan) {
    return FingerprintModelPlan(plan, FormatDefaults()).value();
  }

  std::unique_ptr<HostBackend> backend_;
  DeviceBudget session_budget_{uint64_t{1} << 30, "sessions"};  // charges the test sessions
  std::unique_ptr<PrefixCache> cache_;
  uint64_t next_id_ = 1;
  std::string disk_dir_;
  // What MakeTierChain's caches commit a demotion batch in (PrefixCacheOptions).
  uint64_t demotion_chunk_bytes_ = PrefixCacheOptions{}.demotion_chunk_bytes;
  uint64_t tier_slab_bytes_ = 16 << 10;  // MakeTierChain's slabs
};

TEST_F(PrefixCacheTest, ScopesShareNothingButTheStore) {
  const std::vector<int32_t> tokens = Tokens(64);
  auto mine = NewSession(FlatPlan(), 128, "uid:1001");
  Append(*mine, tokens, 64);
  absl::StatusOr<PrefixCaptureResult> captured = CaptureSessionPrefix(*cache_, *mine, tokens, 64);
  ASSERT_THAT(captured.status(), IsOk());
  EXPECT_EQ(captured->shape, Shape(FlatPlan()));  // the plain shape, the scope apart
  EXPECT_EQ(cache_->Lookup("uid:1001", Shape(FlatPlan()), tokens).outcome, LookupOutcome::kHit);
  EXPECT_EQ(cache_->Lookup("uid:1002", Shape(FlatPlan()), tokens).outcome, LookupOutcome::kMiss);

  // Another scope's session restores nothing of it, by match or by id (as if unknown).
  auto theirs = NewSession(FlatPlan(), 128, "uid:1002");
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *theirs, std::nullopt, tokens).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no stored prefix matches")));
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *theirs, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs(absl::StrCat("prefix entry ", captured->entry.value),
                                  "is not in cache scope uid:1002")));
  ExpectRestored(*theirs, 0, 0);

  // The same prompt captured in the other scope is its own entry (keys chain from the scope).
  auto their_source = NewSession(FlatPlan(), 128, "uid:1002");
  Append(*their_source, tokens, 64);
  absl::StatusOr<PrefixCaptureResult> again =
      CaptureSessionPrefix(*cache_, *their_source, tokens, 64);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_FALSE(again->already_present);
  EXPECT_NE(again->entry, captured->entry);
  EXPECT_EQ(cache_->Stats().entries, 2u);

  // Events: a scope's reader sees its own; operators (nullopt) see both, with their scopes.
  const ScopedEventReplay first = cache_->EventsSince(77, 0, std::string("uid:1002"));
  EXPECT_FALSE(first.gap);
  ASSERT_EQ(first.events.size(), 1u);  // sequence 1 was the other scope's
  EXPECT_EQ(first.events[0].cache_scope, "uid:1002");
  EXPECT_EQ(first.events[0].event.sequence, 2u);
  EXPECT_EQ(first.events[0].event.fingerprint, Shape(FlatPlan()));
  EXPECT_TRUE(cache_->EventsSince(77, 1, std::string("uid:1001")).events.empty());
  EXPECT_EQ(cache_->EventsSince(77, 0, std::nullopt).events.size(), 2u);
  const std::vector<ScopedEntry> listed = cache_->ListEntries();
  ASSERT_EQ(listed.size(), 2u);
  std::vector<std::string> scopes = {listed[0].cache_scope, listed[1].cache_scope};
  EXPECT_THAT(scopes, ::testing::UnorderedElementsAre("uid:1001", "uid:1002"));
  EXPECT_EQ(listed[0].view.fingerprint, Shape(FlatPlan()));
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

// The tier of a stored piece, from the cache's own seams.
// The plain view of an Inspect (the scope apart).
absl::StatusOr<EntryView> ViewOf(absl::StatusOr<ScopedEntry> scoped) {
  if (!scoped.ok()) return scoped.status();
  return std::move(scoped->view);
}

StorageMedium PieceMedium(const PrefixCache& cache, uint64_t handle) {
  absl::StatusOr<StorageMedium> medium = cache.StorageMediumOf(handle);
  EXPECT_THAT(medium.status(), IsOk());
  return medium.value_or(StorageMedium::kDevice);
}

TEST_F(PrefixCacheTest, FlatKvCaptureLookupRestoreAnyBlockBoundary) {
  const std::vector<int32_t> tokens = Tokens(100);
  auto source = NewSession(FlatPlan(), 256);
  Append(*source, tokens, 100);
  absl::StatusOr<PrefixCaptureResult> captured = CaptureSessionPrefix(*cache_, *source, tokens, 96);
  ASSERT_THAT(captured.status(), IsOk());
  EXPECT_EQ(captured->boundary_tokens, 96u);
  EXPECT_FALSE(captured->already_present);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());

  PrefixLookupResult hit = cache_->Lookup(kScope, Shape(FlatPlan()), tokens);
  EXPECT_EQ(hit.outcome, LookupOutcome::kHit);
  EXPECT_EQ(hit.matched_tokens, 96u);
  // Diverging in block 3: blocks 0-2 (48 tokens) are still restorable (position-addressed).
  std::vector<int32_t> other = tokens;
  other[50] = -1;
  PrefixLookupResult partial = cache_->Lookup(kScope, Shape(FlatPlan()), other);
  EXPECT_EQ(partial.outcome, LookupOutcome::kPartial);
  EXPECT_EQ(partial.matched_tokens, 48u);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), Tokens(40, 5)).outcome, LookupOutcome::kMiss);

  auto full = NewSession(FlatPlan(), 128);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*cache_, *full, captured->entry, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 96u);
  ExpectRestored(*full, 96, 0);

  auto shorter = NewSession(FlatPlan(), 128);
  restored = RestoreSessionPrefix(*cache_, *shorter, std::nullopt, other);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 48u);
  ExpectRestored(*shorter, 48, 0);
  const PrefixCacheStats stats = cache_->Stats();
  EXPECT_EQ(stats.lookup_hits, 1u);
  EXPECT_EQ(stats.lookup_partials, 2u);  // the explicit one and Restore's own
  EXPECT_EQ(stats.lookup_misses, 1u);
  EXPECT_EQ(stats.restores, 2u);
  EXPECT_EQ(stats.tokens_restored, 144u);
  EXPECT_EQ(stats.stored_bytes, stats.evictable_bytes);  // nothing pinned after restores
}

TEST_F(PrefixCacheTest, CommonPrefixBlocksAreStoredOnce) {
  std::vector<int32_t> a = Tokens(64);
  std::vector<int32_t> b = a;
  for (size_t i = 32; i < 64; ++i) b[i] = -static_cast<int32_t>(i);
  auto first = NewSession(FlatPlan(), 128);
  auto second = NewSession(FlatPlan(), 128);
  Append(*first, a, 64);
  Append(*second, b, 64);
  absl::StatusOr<PrefixCaptureResult> one = CaptureSessionPrefix(*cache_, *first, a, 64);
  ASSERT_THAT(one.status(), IsOk());
  const uint64_t block_bytes = one->added_bytes / 4;
  absl::StatusOr<PrefixCaptureResult> two = CaptureSessionPrefix(*cache_, *second, b, 64);
  ASSERT_THAT(two.status(), IsOk());
  EXPECT_EQ(two->added_bytes, 2 * block_bytes);  // the system prompt's 2 blocks are shared
  EXPECT_EQ(cache_->Stats().blocks, 6u);
  EXPECT_EQ(cache_->Stats().stored_bytes, 6 * block_bytes);
  EXPECT_EQ(cache_->Stats().stored_bytes, 6 * kFlatSpanBytes);
  // Two sessions + one slab holding the six stored blocks: no arena per block.
  EXPECT_EQ(cache_->Stats().slabs.slabs, 1u);
  EXPECT_EQ(cache_->Stats().slabs.used_bytes, 6 * kFlatSpanBytes);
  EXPECT_EQ(backend_->ArenaCount(), 2u + 1u);
  absl::StatusOr<PrefixCaptureResult> again = CaptureSessionPrefix(*cache_, *second, b, 64);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_TRUE(again->already_present);
  EXPECT_EQ(again->added_bytes, 0u);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

TEST_F(PrefixCacheTest, RecurrentStateRestoresOnlyAtTheCapturedBoundary) {
  const std::vector<int32_t> tokens = Tokens(64);
  auto source = NewSession(HybridPlan(), 128);
  Append(*source, tokens, 64);
  absl::StatusOr<PrefixCaptureResult> captured = CaptureSessionPrefix(*cache_, *source, tokens, 64);
  ASSERT_THAT(captured.status(), IsOk());
  // Recurrent state exists only at the committed length.
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *source, tokens, 32).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("recurrent state exists only at the position 64 (committed 64), "
                                 "not at boundary 32")));
  // A query that stops inside the entry has no boundary state to restore.
  EXPECT_EQ(cache_->Lookup(kScope, Shape(HybridPlan()), Tokens(48)).outcome, LookupOutcome::kMiss);
  auto short_dest = NewSession(HybridPlan(), 128);
  const std::vector<uint8_t> before = ArenaBytes(*short_dest);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *short_dest, captured->entry, Tokens(48)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("only at its 64-token boundary; the token ids match 48")));
  EXPECT_EQ(ArenaBytes(*short_dest), before);

  PrefixLookupResult hit = cache_->Lookup(kScope, Shape(HybridPlan()), Tokens(70));
  EXPECT_EQ(hit.outcome, LookupOutcome::kHit);
  EXPECT_EQ(hit.matched_tokens, 64u);
  auto dest = NewSession(HybridPlan(), 256);
  ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, hit.entry, Tokens(70)).status(), IsOk());
  ExpectRestored(*dest, 64, 64);
  absl::StatusOr<SessionReport> report = dest->GetState();
  ASSERT_THAT(report, IsOk());
  const SessionStatus state = report.ok() ? report->state : SessionStatus{};
  EXPECT_EQ(state.position, 64u);
}

TEST_F(PrefixCacheTest, SwaRingAfterAWrapRestoresTheAlignedWindow) {
  const uint64_t len = 4800;  // past the 64 + 4096 + 512 + 31 = 4703-row ring: it wrapped
  const std::vector<int32_t> tokens = Tokens(len);
  auto source = NewSession(SwaPlan(), 6000);
  Append(*source, tokens, len);
  absl::StatusOr<PrefixCaptureResult> captured =
      CaptureSessionPrefix(*cache_, *source, tokens, len);
  ASSERT_THAT(captured.status(), IsOk());
  // A boundary whose window was lapped by the wrap is refused.
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *source, tokens, 64).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("layer 0: the SWA window ending at 64 is no longer resident")));
  auto dest = NewSession(SwaPlan(), 6000);
  ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(), IsOk());
  ExpectRestored(*dest, len, 0);
  absl::StatusOr<SessionReport> report = dest->GetState();
  ASSERT_THAT(report, IsOk());
  const SessionStatus state = report.ok() ? report->state : SessionStatus{};
  ASSERT_GE(state.layers.size(), 1u);
  EXPECT_EQ(state.layers[0].ring_base, AlignedWindowStart(len, 64));
  // A destination too small for the restored length.
  auto small = NewSession(SwaPlan(), 4096);
  const std::vector<uint8_t> before = ArenaBytes(*small);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *small, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("needs capacity 4800; session 3 has 4096")));
  EXPECT_EQ(ArenaBytes(*small), before);
  EXPECT_EQ(Committed(*small), 0u);
}

TEST_F(PrefixCacheTest, LatentWithIndexerTailAndPoolKeys) {
  const uint64_t len = 80;  // 20 pools; the 32-row tail ring has wrapped
  const std::vector<int32_t> tokens = Tokens(len + 2);
  auto source = NewSession(LatentPlan(), 256);
  Append(*source, tokens, len + 2);  // 82: a two-row live tail
  // The indexer's state exists at the latent length only.
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *source, tokens, 80).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("layer 0: the indexer's tail and pool keys exist only at the "
                                 "latent length 82, not at boundary 80")));
  ASSERT_THAT(source->Rewind(len), IsOk());
  // After the rewind the session has committed `len` of the ids (a capture names no more).
  absl::StatusOr<PrefixCaptureResult> captured =
      CaptureSessionPrefix(*cache_, *source, absl::MakeConstSpan(tokens).subspan(0, len), len);
  ASSERT_THAT(captured.status(), IsOk());
  auto dest = NewSession(LatentPlan(), 128);
  ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(), IsOk());
  ExpectRestored(*dest, len, 0);
  absl::StatusOr<SessionReport> report = dest->GetState();
  ASSERT_THAT(report, IsOk());
  const SessionStatus state = report.ok() ? report->state : SessionStatus{};
  EXPECT_EQ(state.layers[0].index_pools_ready, 20u);
}

TEST_F(PrefixCacheTest, RefusalsLeaveTheDestinationUntouched) {
  const std::vector<int32_t> tokens = Tokens(64);
  auto source = NewSession(FlatPlan(), 128);
  Append(*source, tokens, 64);
  absl::StatusOr<PrefixCaptureResult> captured = CaptureSessionPrefix(*cache_, *source, tokens, 64);
  ASSERT_THAT(captured.status(), IsOk());

  auto other_model = NewSession(tp::DenseModel(3, 32, 1), 128);
  std::vector<uint8_t> before = ArenaBytes(*other_model);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *other_model, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("prefix entry ", captured->entry.value,
                                              " was captured for shape"))));
  EXPECT_EQ(ArenaBytes(*other_model), before);

  auto small = NewSession(FlatPlan(), 32);
  before = ArenaBytes(*small);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *small, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("restoring 64 tokens of prefix entry 1 needs capacity 64; "
                                 "session 3 has 32")));
  EXPECT_EQ(ArenaBytes(*small), before);
  EXPECT_EQ(Committed(*small), 0u);

  auto used = NewSession(FlatPlan(), 128);
  Append(*used, Tokens(16, 9), 16);
  before = ArenaBytes(*used);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *used, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("session 4 has committed 16, staged 16 rows")));
  EXPECT_EQ(ArenaBytes(*used), before);

  auto fresh = NewSession(FlatPlan(), 128);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *fresh, captured->entry, Tokens(64, 1)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the 64 token ids match none of prefix entry 1's 4 blocks")));
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *fresh, EntryId{99}, tokens).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("99")));
  EXPECT_EQ(Committed(*fresh), 0u);

  // Capture refusals: an open transaction, a boundary off the block grid or past the rows.
  absl::StatusOr<TransactionId> begin = source->Begin();
  ASSERT_THAT(begin, IsOk());
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *source, tokens, 64).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("transaction generation 2 is open (committed 64, staged 64)")));
  ASSERT_THAT(source->Abort(begin->generation), IsOk());
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *source, tokens, 40).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("boundary 40 is not a positive multiple of the 16-token block")));
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *source, tokens, 80).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("boundary 80 exceeds the committed length 64")));
  EXPECT_EQ(cache_->Stats().entries, 1u);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

TEST_F(PrefixCacheTest, CorruptBlockIsDataLossAndTheEntryIsDropped) {
  const std::vector<int32_t> tokens = Tokens(48);
  auto source = NewSession(FlatPlan(), 128);
  Append(*source, tokens, 48);
  absl::StatusOr<PrefixCaptureResult> captured = CaptureSessionPrefix(*cache_, *source, tokens, 48);
  ASSERT_THAT(captured.status(), IsOk());
  absl::StatusOr<ScopedEntry> scoped = cache_->Inspect(captured->entry);
  ASSERT_THAT(scoped, IsOk());
  absl::StatusOr<EntryView> view = scoped->view;
  ASSERT_THAT(view.status(), IsOk());
  absl::StatusOr<SlabSpan> span = cache_->StorageSpan(view->blocks[1].stored.storage_handle);
  ASSERT_THAT(span.status(), IsOk());
  EXPECT_EQ(span->bytes, kFlatSpanBytes);
  std::vector<uint8_t> byte(1);
  ASSERT_THAT(backend_->Read(span->slab, span->offset + 7, absl::MakeSpan(byte)), IsOk());
  byte[0] ^= 0x40;
  ASSERT_THAT(backend_->Write(span->slab, span->offset + 7, byte), IsOk());

  auto dest = NewSession(FlatPlan(), 128);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs(absl::StrCat("prefix entry ", captured->entry.value,
                                               ": stored piece 1 (slab ", span->slab.value,
                                               ", offset ", span->offset, "), slice 0 of 1 (",
                                               kFlatBlockBytes, " bytes), has xxHash3 "),
                                  "captured as ")));
  // Block 0 was verified and copied before block 1 failed its check: those bytes are the
  // unspecified content of a session that stays fresh (nothing adopted, no mirror written).
  EXPECT_EQ(Committed(*dest), 0u);
  EXPECT_THAT(cache_->Inspect(captured->entry).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
  const PrefixCacheStats stats = cache_->Stats();
  EXPECT_EQ(stats.dropped_entries, 1u);
  EXPECT_EQ(stats.stored_bytes, 0u);
  // The two sessions and the emptied slab, kept warm for the next capture (within the budget).
  EXPECT_EQ(stats.slabs.used_bytes, 0u);
  EXPECT_EQ(stats.slabs.empty_slabs, 1u);
  EXPECT_EQ(backend_->ArenaCount(), 2u + 1u);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  const ScopedEventReplay events = cache_->EventsSince(77, 1, std::nullopt);
  ASSERT_EQ(events.events.size(), 1u);
  EXPECT_EQ(events.events[0].event.kind, PrefixEventKind::kDropped);
  EXPECT_THAT(events.events[0].event.reason, HasSubstr("xxHash3"));
}

// Three threads share the blocks of a restore: the bytes are the same as one thread's, and a
// corrupt block in the middle still fails the whole restore with DATA_LOSS.
TEST_F(PrefixCacheTest, ParallelRestoreCopiesEveryBlockAndFailsOnAnyCorruptOne) {
  cache_ = MakeCache(uint64_t{64} << 20, nullptr, 4096, /*copy_threads=*/3);
  const std::vector<int32_t> tokens = Tokens(112);
  auto source = NewSession(FlatPlan(), 256);
  Append(*source, tokens, 112);
  absl::StatusOr<PrefixCaptureResult> captured =
      CaptureSessionPrefix(*cache_, *source, tokens, 112);
  ASSERT_THAT(captured.status(), IsOk());
  auto dest = NewSession(FlatPlan(), 128);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 112u);
  ExpectRestored(*dest, 112, 0);

  absl::StatusOr<ScopedEntry> scoped = cache_->Inspect(captured->entry);
  ASSERT_THAT(scoped, IsOk());
  absl::StatusOr<EntryView> view = scoped->view;
  ASSERT_THAT(view.status(), IsOk());
  ASSERT_EQ(view->blocks.size(), 7u);
  absl::StatusOr<SlabSpan> span = cache_->StorageSpan(view->blocks[4].stored.storage_handle);
  ASSERT_THAT(span.status(), IsOk());
  ASSERT_THAT(backend_->Memset(span->slab, span->offset + 3, 0xEE, 1), IsOk());
  auto again = NewSession(FlatPlan(), 128);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *again, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(absl::StrCat("stored piece 4 (slab ", span->slab.value,
                                              ", offset ", span->offset, "), slice 0 of 1 (",
                                              kFlatBlockBytes, " bytes)"))));
  EXPECT_EQ(Committed(*again), 0u);
}

TEST_F(PrefixCacheTest, ZeroRestoreThreadsIsRefused) {
  PrefixCacheOptions options;
  options.budget_bytes = 1 << 20;
  options.copy_threads = 0;
  EXPECT_THAT(PrefixCache::Create(options, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("copy_threads (0), parallel_copy_bytes (33554432), "
                                 "checksum_slice_bytes (8388608) and demotion_chunk_bytes "
                                 "(8388608) must all be at least 1")));
  options.copy_threads = 1;
  options.demotion_chunk_bytes = 0;
  EXPECT_THAT(PrefixCache::Create(options, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("copy_threads (1), parallel_copy_bytes (33554432), "
                                 "checksum_slice_bytes (8388608) and demotion_chunk_bytes (0) "
                                 "must all be at least 1")));
}

TEST_F(PrefixCacheTest, LruEvictionUnderTheBudget) {
  // Learn one entry's size, then allow two and a half.
  const std::vector<int32_t> probe = Tokens(32, 500);
  auto s0 = NewSession(FlatPlan(), 64);
  Append(*s0, probe, 32);
  absl::StatusOr<PrefixCaptureResult> first = CaptureSessionPrefix(*cache_, *s0, probe, 32);
  ASSERT_THAT(first.status(), IsOk());
  const uint64_t entry_bytes = first->added_bytes;
  cache_ = MakeCache(entry_bytes * 5 / 2);
  std::vector<EntryId> ids;
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> tokens = Tokens(32, 1000 * (i + 1));
    auto session = NewSession(FlatPlan(), 64);
    Append(*session, tokens, 32);
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *session, tokens, 32);
    ASSERT_THAT(captured.status(), IsOk());
    ids.push_back(captured->entry);
  }
  const PrefixCacheStats stats = cache_->Stats();
  EXPECT_EQ(stats.entries, 2u);
  EXPECT_EQ(stats.evicted_entries, 1u);
  EXPECT_EQ(stats.stored_bytes, 2 * entry_bytes);
  EXPECT_THAT(cache_->Inspect(ids[0]).status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
  EXPECT_THAT(cache_->EvictEntry(ids[1]), ::memra::testing::IsOkAndHolds(entry_bytes));
  EXPECT_EQ(cache_->Stats().stored_bytes, entry_bytes);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

TEST_F(PrefixCacheTest, AdmissionEvictsThroughTheDeviceBudget) {
  const std::vector<int32_t> tokens = Tokens(32);
  auto session = NewSession(FlatPlan(), 64);
  Append(*session, tokens, 32);
  const uint64_t total = uint64_t{1} << 20;
  DeviceBudget budget(total, "test");
  cache_ = MakeCache(uint64_t{64} << 20, &budget);
  cache_->InstallEvictor(budget);
  absl::StatusOr<PrefixCaptureResult> captured =
      CaptureSessionPrefix(*cache_, *session, tokens, 32);
  ASSERT_THAT(captured.status(), IsOk());
  EXPECT_EQ(captured->added_bytes, 2 * kFlatSpanBytes);
  // The device is charged the whole slab (one arena), all of it evictable.
  EXPECT_EQ(budget.Snapshot().evictable(), kSlabBytes);
  EXPECT_EQ(budget.Snapshot().allocated(), kSlabBytes);
  EXPECT_EQ(budget.Snapshot().allocation_count(), 1u);
  // An engine needs everything: the admission evicts the prefix entry first.
  absl::StatusOr<AllocationId> admitted = budget.Allocate(/*owner=*/1, total);
  ASSERT_THAT(admitted.status(), IsOk());
  EXPECT_EQ(cache_->Stats().entries, 0u);
  EXPECT_EQ(cache_->Stats().evicted_entries, 1u);
  EXPECT_EQ(cache_->Stats().slabs.slabs, 0u);  // returned, not kept: admission wanted it
  EXPECT_EQ(budget.Snapshot().evictable(), 0u);
  EXPECT_EQ(budget.Snapshot().allocated(), total);  // the slab's charge was released
  // Now the device is full: a capture is refused by the budget and stores nothing.
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *session, tokens, 32).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("")));
  EXPECT_EQ(backend_->ArenaCount(), 1u);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  cache_.reset();  // before the budget it charges
}

TEST_F(PrefixCacheTest, EventsReplayAndGap) {
  cache_ = MakeCache(uint64_t{64} << 20, nullptr, /*event_capacity=*/2);
  std::vector<EntryId> ids;
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t> tokens = Tokens(16, 100 * i);
    auto session = NewSession(FlatPlan(), 64);
    Append(*session, tokens, 16);
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *session, tokens, 16);
    ASSERT_THAT(captured.status(), IsOk());
    ids.push_back(captured->entry);
  }
  ScopedEventReplay replay = cache_->EventsSince(77, 1, std::nullopt);
  EXPECT_FALSE(replay.gap);
  ASSERT_EQ(replay.events.size(), 2u);
  EXPECT_EQ(replay.events[0].event.sequence, 2u);
  EXPECT_EQ(replay.events[0].event.kind, PrefixEventKind::kStored);
  EXPECT_EQ(replay.events[0].event.block_keys.size(), 1u);
  EXPECT_EQ(replay.events[0].event.epoch, 77u);
  // Sequence 1 left the 2-event buffer; another epoch is a gap too.
  EXPECT_TRUE(cache_->EventsSince(77, 0, std::nullopt).gap);
  EXPECT_TRUE(cache_->EventsSince(78, 3, std::nullopt).gap);
  EXPECT_EQ(cache_->AwaitEvent(2, absl::ZeroDuration()), 3u);
  ASSERT_THAT(cache_->EvictEntry(ids[2]).status(), IsOk());
  replay = cache_->EventsSince(77, 3, std::nullopt);
  ASSERT_EQ(replay.events.size(), 1u);
  EXPECT_EQ(replay.events[0].event.kind, PrefixEventKind::kEvicted);
}

TEST_F(PrefixCacheTest, DeathCaptureTakesCommittedRowsNeverStagedOnes) {
  const std::vector<int32_t> tokens = Tokens(64);
  auto session = NewSession(FlatPlan(), 128);
  Append(*session, tokens, 40);  // 40 committed: blocks 0-1 (32 tokens) are capturable
  absl::StatusOr<TransactionId> begin = session->Begin();
  ASSERT_THAT(begin, IsOk());
  ASSERT_THAT(session->PrepareAppend(begin->generation, 24), IsOk());
  ASSERT_THAT(session->PublishAppend(begin->generation), IsOk());  // staged 64
  absl::StatusOr<std::optional<PrefixCaptureResult>> captured =
      CaptureCommittedPrefix(*cache_, *session);
  ASSERT_THAT(captured.status(), IsOk());
  ASSERT_TRUE(captured->has_value());
  EXPECT_EQ((*captured)->boundary_tokens, 32u);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), tokens).matched_tokens, 32u);
  EXPECT_EQ(cache_->Stats().death_captures, 1u);

  // A commit without token ids makes the session's tokens unknown: nothing to capture.
  auto unknown = NewSession(FlatPlan(), 128);
  begin = unknown->Begin();
  ASSERT_THAT(begin, IsOk());
  ASSERT_THAT(unknown->PrepareAppend(begin->generation, 32), IsOk());
  ASSERT_THAT(unknown->PublishAppend(begin->generation), IsOk());
  ASSERT_THAT(unknown->Commit(begin->generation, 32), IsOk());
  captured = CaptureCommittedPrefix(*cache_, *unknown);
  ASSERT_THAT(captured.status(), IsOk());
  EXPECT_FALSE(captured->has_value());
  // A mismatched token count is refused before anything changes.
  begin = unknown->Begin();
  ASSERT_THAT(begin, IsOk());
  EXPECT_THAT(unknown->Commit(begin->generation, 0, tokens),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("commit carries 64 token ids for 0 accepted rows")));
}

// The daemon holds 200,000 stored blocks (1-token blocks of a 1-layer plan: 58 bytes, a
// 256-byte span each) in a few dozen slabs, never an arena per block: a ledger that allows 100
// arenas admits them all. Evicting them returns every slab.
TEST_F(PrefixCacheTest, TwoHundredThousandBlocksLiveInAFewSlabs) {
  constexpr uint64_t kBlocks = 200000;
  const ModelPlan plan = tp::DenseModel(1, 32, 1);
  DeviceBudget budget(uint64_t{256} << 20, "test", AdmissionLimits{.max_arenas = 100});
  PrefixCacheOptions options;
  options.budget_bytes = uint64_t{64} << 20;
  options.block_tokens = 1;
  options.slab_bytes = uint64_t{1} << 20;
  options.copy_threads = 2;
  absl::StatusOr<std::unique_ptr<PrefixCache>> cache =
      PrefixCache::Create(options, backend_.get(), &budget);
  ASSERT_THAT(cache.status(), IsOk());
  cache_ = *std::move(cache);
  cache_->InstallEvictor(budget);
  const std::vector<int32_t> tokens = Tokens(kBlocks);
  auto source = NewSession(plan, kBlocks);
  Append(*source, tokens, kBlocks);
  absl::StatusOr<PrefixCaptureResult> captured =
      CaptureSessionPrefix(*cache_, *source, tokens, kBlocks);
  ASSERT_THAT(captured.status(), IsOk());
  PrefixCacheStats stats = cache_->Stats();
  EXPECT_EQ(stats.blocks, kBlocks);
  EXPECT_EQ(stats.stored_bytes, kBlocks * 256);
  EXPECT_EQ(stats.slabs.spans, kBlocks);
  EXPECT_EQ(stats.slabs.slabs, (kBlocks * 256 + (1 << 20) - 1) >> 20);  // 49 slabs, packed
  EXPECT_EQ(backend_->ArenaCount(), 1u + stats.slabs.slabs);  // the session + the slabs
  EXPECT_EQ(budget.Snapshot().allocation_count(), stats.slabs.slabs);
  EXPECT_EQ(budget.Snapshot().allocated(), stats.slabs.slab_bytes);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());

  auto dest = NewSession(plan, kBlocks);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*cache_, *dest, std::nullopt, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, kBlocks);
  EXPECT_EQ(KvRows(*dest, kBlocks), KvRows(*source, kBlocks));

  // Evicted: the slabs are empty and kept (within the budget), then an admission takes them.
  ASSERT_THAT(cache_->EvictEntry(captured->entry).status(), IsOk());
  stats = cache_->Stats();
  EXPECT_EQ(stats.blocks, 0u);
  EXPECT_EQ(stats.slabs.spans, 0u);
  EXPECT_EQ(stats.slabs.used_bytes, 0u);
  EXPECT_EQ(stats.slabs.empty_slabs, stats.slabs.slabs);
  EXPECT_EQ(budget.Snapshot().evictable(), stats.slabs.slab_bytes);
  ASSERT_THAT(budget.Allocate(/*owner=*/1, budget.Snapshot().budget()).status(), IsOk());
  EXPECT_EQ(cache_->Stats().slabs.slabs, 0u);
  EXPECT_EQ(backend_->ArenaCount(), 2u);  // the two sessions: no slab leaked
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  cache_.reset();  // before the budget it charges
}

// Captures of random lengths and contents into a cache a few entries big, with LRU and
// operator evictions and restores in between, fragment the slabs; every surviving entry still
// restores exactly the bytes its source session held.
TEST_F(PrefixCacheTest, RestoreAfterHeavyChurnIsBitExact) {
  // About six 6-block entries fit; slabs of 16 KiB hold 8 blocks (2 KiB spans) each.
  cache_ = MakeCache(36 * kFlatSpanBytes, nullptr, 4096, /*copy_threads=*/2,
                     /*slice_bytes=*/512, /*slab_bytes=*/16 << 10);
  testing::SeededRandom random(20261201);
  struct Source {
    std::unique_ptr<DaemonSession> session;
    std::vector<int32_t> tokens;
    uint64_t len = 0;
  };
  absl::flat_hash_map<uint64_t, Source> sources;  // by entry id
  uint64_t max_fragmentation_ppm = 0;
  for (int round = 0; round < 120; ++round) {
    const uint64_t blocks = 1 + random.Below(10);
    const uint64_t len = blocks * kBlock;
    // Half the captures extend a shared 2-block prefix: shared blocks, refcounts, partial frees.
    std::vector<int32_t> tokens = Tokens(len, static_cast<int32_t>(100000 + round * 1000));
    const bool shared = random.Below(2) == 0;
    if (shared) {
      const std::vector<int32_t> common = Tokens(2 * kBlock, 7);
      std::copy(common.begin(), common.begin() + std::min<uint64_t>(len, 2 * kBlock),
                tokens.begin());
    }
    auto session = NewSession(FlatPlan(), 256);
    Append(*session, tokens, len);
    // Position-addressed rows depend only on the prefix: the shared prefix keeps the pattern
    // (the same bytes in every session), the rest is this session's own.
    FillRandom(*session, static_cast<uint64_t>(round) + 1,
               shared ? std::min<uint64_t>(len, 2 * kBlock) : 0);
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *session, tokens, len);
    ASSERT_THAT(captured.status(), IsOk());
    if (!captured->already_present) {
      sources[captured->entry.value] = Source{std::move(session), tokens, len};
    }
    if (random.Below(5) == 0 && !sources.empty()) {
      std::vector<ScopedEntry> entries = cache_->ListEntries();
      if (!entries.empty()) {
        (void)cache_->EvictEntry(entries[random.Below(entries.size())].view.id);
      }
    }
    max_fragmentation_ppm =
        std::max(max_fragmentation_ppm, cache_->Stats().slabs.fragmentation_ppm);
    ASSERT_THAT(cache_->CheckInvariants(), IsOk());
  }
  EXPECT_GT(cache_->Stats().evicted_entries, 50u);
  EXPECT_GT(max_fragmentation_ppm, 0u);  // holes appeared and were reported
  std::vector<ScopedEntry> survivors = cache_->ListEntries();
  ASSERT_FALSE(survivors.empty());
  for (const ScopedEntry& scoped : survivors) {
    const EntryView& entry = scoped.view;
    auto it = sources.find(entry.id.value);
    ASSERT_NE(it, sources.end());
    const Source& source = it->second;
    auto dest = NewSession(FlatPlan(), 256);
    absl::StatusOr<PrefixRestoreResult> restored =
        RestoreSessionPrefix(*cache_, *dest, entry.id, source.tokens);
    ASSERT_THAT(restored.status(), IsOk());
    ASSERT_EQ(restored->restored_tokens, source.len);
    EXPECT_EQ(KvRows(*dest, source.len), KvRows(*source.session, source.len))
        << "entry " << entry.id.value;
  }
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

// A boundary piece larger than a slice (a hybrid model's recurrent state) is sealed per slice
// and restored by several threads; a flipped byte in one slice is DATA_LOSS naming that slice,
// and the entry is dropped.
TEST_F(PrefixCacheTest, LargePiecesAreVerifiedPerSlice) {
  cache_ = MakeCache(uint64_t{64} << 20, nullptr, 4096, /*copy_threads=*/3,
                     /*slice_bytes=*/64);
  const std::vector<int32_t> tokens = Tokens(64);
  auto source = NewSession(HybridPlan(), 128);
  Append(*source, tokens, 64);
  absl::StatusOr<PrefixCaptureResult> captured = CaptureSessionPrefix(*cache_, *source, tokens, 64);
  ASSERT_THAT(captured.status(), IsOk());
  auto dest = NewSession(HybridPlan(), 128);
  ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(), IsOk());
  ExpectRestored(*dest, 64, 64);

  absl::StatusOr<ScopedEntry> scoped = cache_->Inspect(captured->entry);
  ASSERT_THAT(scoped.status(), IsOk());
  const EntryView* view = &scoped->view;
  ASSERT_TRUE(view->boundary.has_value());
  ASSERT_GT(view->boundary_bytes, 3u * 64);
  absl::StatusOr<SlabSpan> span = cache_->StorageSpan(view->boundary->storage_handle);
  ASSERT_THAT(span.status(), IsOk());
  ASSERT_THAT(backend_->Memset(span->slab, span->offset + 2 * 64 + 5, 0x5A, 1), IsOk());
  auto again = NewSession(HybridPlan(), 128);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *again, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs(absl::StrCat("prefix entry ", captured->entry.value,
                                               ": stored piece 4 (slab ", span->slab.value),
                                  "slice 2 of ", "(64 bytes)", "never served")));
  EXPECT_EQ(Committed(*again), 0u);
  EXPECT_THAT(cache_->Inspect(captured->entry).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
  EXPECT_EQ(cache_->Stats().dropped_entries, 1u);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

}  // namespace
}  // namespace memra

namespace memra {
namespace {

// Device tier: 8 block spans; a 4-block entry and then a 6-block one push the first entry's
// least recently used pieces to disk; restoring it promotes them back bit-exactly.
TEST_F(PrefixCacheTest, AnEntryDemotedToDiskRestoresBitExactly) {
  absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
      MakeTieredCache(8 * kFlatSpanBytes, 1 << 20, nullptr, "demoted");
  ASSERT_THAT(tiered.status(), IsOk());
  cache_ = *std::move(tiered);
  const std::vector<int32_t> old_tokens = Tokens(4 * kBlock, 1);
  auto old_source = NewSession(FlatPlan(), 128);
  Append(*old_source, old_tokens, 4 * kBlock);
  FillRandom(*old_source, 11, 0);
  absl::StatusOr<PrefixCaptureResult> old_entry =
      CaptureSessionPrefix(*cache_, *old_source, old_tokens, 64);
  ASSERT_THAT(old_entry.status(), IsOk());
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), old_tokens).medium, StorageMedium::kDevice);
  const std::vector<int32_t> new_tokens = Tokens(6 * kBlock, 2);
  auto new_source = NewSession(FlatPlan(), 128);
  Append(*new_source, new_tokens, 6 * kBlock);
  FillRandom(*new_source, 12, 0);
  ASSERT_THAT(CaptureSessionPrefix(*cache_, *new_source, new_tokens, 96).status(), IsOk());

  // 10 blocks for 8 spans: two of the older entry's blocks went to disk, the newer stayed.
  PrefixCacheStats stats = cache_->Stats();
  ASSERT_EQ(stats.tiers.size(), 2u);
  EXPECT_EQ(stats.tiers[0].medium, StorageMedium::kDevice);
  EXPECT_EQ(stats.tiers[0].stored_bytes, 8 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].medium, StorageMedium::kDisk);
  EXPECT_EQ(stats.tiers[1].stored_bytes, 2 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].demotions, 2u);
  EXPECT_EQ(stats.stored_bytes, 10 * kFlatSpanBytes);
  EXPECT_EQ(stats.evicted_entries, 0u);
  absl::StatusOr<EntryView> view = ViewOf(cache_->Inspect(old_entry->entry));
  ASSERT_THAT(view.status(), IsOk());
  EXPECT_EQ(cache_->MediumOf(*view), StorageMedium::kDisk);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), old_tokens).medium, StorageMedium::kDisk);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), new_tokens).medium, StorageMedium::kDevice);
  const uint64_t demoted = view->blocks[0].stored.storage_handle;
  ASSERT_EQ(PieceMedium(*cache_, demoted), StorageMedium::kDisk);
  absl::StatusOr<std::string> file = cache_->StorageFile(demoted);
  ASSERT_THAT(file.status(), IsOk());
  struct stat st;
  ASSERT_EQ(stat(file->c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kFlatBlockBytes);  // the piece, not its span
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  const ScopedEventReplay moved = cache_->EventsSince(77, 2, std::nullopt);
  ASSERT_FALSE(moved.gap);
  ASSERT_EQ(moved.events.size(), 1u);
  EXPECT_EQ(moved.events[0].event.kind, PrefixEventKind::kMoved);
  EXPECT_EQ(moved.events[0].event.medium, StorageMedium::kDisk);
  EXPECT_EQ(moved.events[0].event.block_keys.size(), 2u);

  // A restore the destination cannot take is refused before anything is promoted: the pieces
  // stay on disk and no event is sent.
  auto small = NewSession(FlatPlan(), 32);
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *small, old_entry->entry, old_tokens).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("restoring 64 tokens of prefix entry 1 needs capacity 64")));
  EXPECT_EQ(PieceMedium(*cache_, demoted), StorageMedium::kDisk);
  EXPECT_EQ(cache_->Stats().tiers[1].promotions, 0u);
  EXPECT_TRUE(cache_->EventsSince(77, 3, std::nullopt).events.empty());

  auto dest = NewSession(FlatPlan(), 128);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*cache_, *dest, old_entry->entry, old_tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 64u);
  EXPECT_EQ(KvRows(*dest, 64), KvRows(*old_source, 64));
  // Promoted (the file is gone) and now the most recent: the newer entry's LRU blocks moved.
  EXPECT_EQ(PieceMedium(*cache_, demoted), StorageMedium::kDevice);
  EXPECT_NE(access(file->c_str(), F_OK), 0);
  stats = cache_->Stats();
  EXPECT_EQ(stats.tiers[1].hits, 1u);
  EXPECT_EQ(stats.tiers[0].hits, 0u);
  EXPECT_EQ(stats.tiers[1].promotions, 2u);
  EXPECT_EQ(stats.tiers[1].demotions, 4u);
  EXPECT_EQ(stats.tiers[0].stored_bytes, 8 * kFlatSpanBytes);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), old_tokens).medium, StorageMedium::kDevice);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), new_tokens).medium, StorageMedium::kDisk);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  // And the newer entry, now partly on disk, restores bit-exactly too.
  auto second = NewSession(FlatPlan(), 128);
  ASSERT_THAT(RestoreSessionPrefix(*cache_, *second, std::nullopt, new_tokens).status(), IsOk());
  EXPECT_EQ(KvRows(*second, 96), KvRows(*new_source, 96));
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

// A boundary-state plan's recurrent piece goes to the tier below (disk, or the host tier) and
// back like a block: a newer entry of another model takes the whole device tier.
TEST_F(PrefixCacheTest, ADemotedBoundaryStateRestoresBitExactly) {
  for (const StorageMedium below : {StorageMedium::kDisk, StorageMedium::kPinnedHost}) {
    SCOPED_TRACE(StorageMediumName(below));
    const bool host = below == StorageMedium::kPinnedHost;
    absl::StatusOr<std::unique_ptr<PrefixCache>> tiered = MakeTierChain(
        4 * kFlatSpanBytes, host ? 1 << 20 : 0, host ? 0 : 1 << 20, nullptr, "boundary");
    ASSERT_THAT(tiered.status(), IsOk());
    cache_ = *std::move(tiered);
    const std::vector<int32_t> tokens = Tokens(32);
    auto source = NewSession(HybridPlan(), 64);
    Append(*source, tokens, 32);
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *source, tokens, 32);
    ASSERT_THAT(captured.status(), IsOk());
    const std::vector<int32_t> flat_tokens = Tokens(4 * kBlock, 9);
    auto flat = NewSession(FlatPlan(), 128);
    Append(*flat, flat_tokens, 4 * kBlock);
    ASSERT_THAT(CaptureSessionPrefix(*cache_, *flat, flat_tokens, 64).status(), IsOk());
    absl::StatusOr<EntryView> view = ViewOf(cache_->Inspect(captured->entry));
    ASSERT_THAT(view.status(), IsOk());
    ASSERT_TRUE(view->boundary.has_value());
    EXPECT_EQ(PieceMedium(*cache_, view->boundary->storage_handle), below);
    EXPECT_EQ(PieceMedium(*cache_, view->blocks[0].stored.storage_handle), below);
    auto dest = NewSession(HybridPlan(), 64);
    ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(), IsOk());
    ExpectRestored(*dest, 32, 32);
    EXPECT_EQ(PieceMedium(*cache_, view->boundary->storage_handle), StorageMedium::kDevice);
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  }
}

// A piece whose bytes changed in the tier below (a disk file, host-tier memory) fails the
// restore with DATA_LOSS naming where it was, and the entry is dropped from every tier.
TEST_F(PrefixCacheTest, CorruptedBytesInATierBelowAreDataLossAndTheEntryIsDropped) {
  for (const StorageMedium below : {StorageMedium::kDisk, StorageMedium::kPinnedHost}) {
    SCOPED_TRACE(StorageMediumName(below));
    const bool host = below == StorageMedium::kPinnedHost;
    absl::StatusOr<std::unique_ptr<PrefixCache>> tiered = MakeTierChain(
        2 * kFlatSpanBytes, host ? 4 * kFlatSpanBytes : 0, host ? 0 : 1 << 20, nullptr,
        "corrupt");
    ASSERT_THAT(tiered.status(), IsOk());
    cache_ = *std::move(tiered);
    const std::vector<int32_t> tokens = Tokens(3 * kBlock);
    auto source = NewSession(FlatPlan(), 128);
    Append(*source, tokens, 3 * kBlock);
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *source, tokens, 48);
    ASSERT_THAT(captured.status(), IsOk());
    absl::StatusOr<EntryView> view = ViewOf(cache_->Inspect(captured->entry));
    ASSERT_THAT(view.status(), IsOk());
    const uint64_t handle = view->blocks[0].stored.storage_handle;
    ASSERT_EQ(PieceMedium(*cache_, handle), below);
    // One byte of slice 1 of the block's 512-byte slices flips where the piece is.
    std::string where;
    absl::StatusOr<std::string> file = cache_->StorageFile(handle);
    if (host) {
      EXPECT_THAT(file.status(),
                  StatusIs(absl::StatusCode::kFailedPrecondition,
                           HasSubstrs("in the pinned_host tier, not the disk tier")));
      absl::StatusOr<absl::Span<uint8_t>> memory = cache_->StorageHostBytes(handle);
      ASSERT_THAT(memory.status(), IsOk());
      ASSERT_EQ(memory->size(), kFlatBlockBytes);
      (*memory)[600] ^= 0x10;
      where = "host-tier piece (host memory, slab ";
    } else {
      ASSERT_THAT(file.status(), IsOk());
      std::fstream bytes(*file, std::ios::in | std::ios::out | std::ios::binary);
      bytes.seekg(600);
      const char original = static_cast<char>(bytes.get());
      bytes.seekp(600);
      bytes.put(static_cast<char>(original ^ 0x10));
      where = absl::StrCat("disk file ", *file, " (", kFlatBlockBytes, " bytes)");
    }
    auto dest = NewSession(FlatPlan(), 128);
    EXPECT_THAT(
        RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(),
        StatusIs(absl::StatusCode::kDataLoss,
                 HasSubstrs(absl::StrCat("prefix entry ", captured->entry.value, ": ", where),
                            absl::StrCat("(", kFlatBlockBytes, " bytes)"), "at slice 1 of 4",
                            "dropped")));
    EXPECT_EQ(Committed(*dest), 0u);
    EXPECT_THAT(cache_->Inspect(captured->entry).status(),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
    if (!host) {
      EXPECT_NE(access(file->c_str(), F_OK), 0);
    }
    const PrefixCacheStats stats = cache_->Stats();
    EXPECT_EQ(stats.dropped_entries, 1u);
    EXPECT_EQ(stats.stored_bytes, 0u);
    for (const PrefixTierStats& tier : stats.tiers) EXPECT_EQ(tier.stored_bytes, 0u);
    EXPECT_EQ(stats.tiers[1].hits, 0u);
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  }
}

// Random captures, restores and evictions: after every step each tier is within its budget,
// the ledgers agree, and every surviving entry restores bit-exactly at the end.
TEST_F(PrefixCacheTest, TierBudgetsHoldUnderChurn) {
  const uint64_t device_bytes = 8 * kFlatSpanBytes;
  const uint64_t disk_bytes = 12 * kFlatBlockBytes;
  absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
      MakeTieredCache(device_bytes, disk_bytes, nullptr, "churn");
  ASSERT_THAT(tiered.status(), IsOk());
  cache_ = *std::move(tiered);
  testing::SeededRandom random(20261202);
  ChurnSources sources;
  uint64_t max_disk = 0;
  for (int round = 0; round < 80; ++round) {
    ASSERT_NO_FATAL_FAILURE(ChurnStep(random, sources, 500000 + round * 1000,
                                      static_cast<uint64_t>(round) + 100));
    const PrefixCacheStats stats = cache_->Stats();
    ASSERT_LE(stats.tiers[0].stored_bytes, device_bytes) << "round " << round;
    ASSERT_LE(stats.tiers[1].stored_bytes / kFlatSpanBytes * kFlatBlockBytes, disk_bytes);
    max_disk = std::max(max_disk, stats.tiers[1].stored_bytes);
    ASSERT_THAT(cache_->CheckInvariants(), IsOk()) << "round " << round;
  }
  const PrefixCacheStats stats = cache_->Stats();
  // The disk tier filled up to within one entry (at most 5 blocks, evicted whole) of its budget.
  EXPECT_GE(max_disk + 5 * kFlatSpanBytes, 12 * kFlatSpanBytes);
  EXPECT_GT(stats.evicted_entries, 5u);      // and full, it evicted the LRU entries
  EXPECT_GT(stats.tiers[1].promotions, 0u);
  EXPECT_GT(stats.tiers[1].hits, 0u);
  ExpectEveryEntryRestores(sources);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

// An engine's admission that needs the device memory demotes prefix pieces to the tier below
// (disk, or the host tier) instead of evicting entries: only slabs count against the device
// budget, never the host tier's memory.
TEST_F(PrefixCacheTest, AdmissionDemotesToTheTierBelowBeforeEvicting) {
  for (const bool host_tier : {false, true}) {
    SCOPED_TRACE(host_tier ? "device -> host" : "device -> disk");
    const std::vector<int32_t> tokens = Tokens(32);
    auto session = NewSession(FlatPlan(), 64);
    Append(*session, tokens, 32);
    const uint64_t total = uint64_t{1} << 20;
    DeviceBudget budget(total, "test");
    absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
        MakeTierChain(uint64_t{64} << 20, host_tier ? 1 << 20 : 0, host_tier ? 0 : 1 << 20,
                      &budget, "admission");
    ASSERT_THAT(tiered.status(), IsOk());
    cache_ = *std::move(tiered);
    cache_->InstallEvictor(budget);
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *session, tokens, 32);
    ASSERT_THAT(captured.status(), IsOk());
    EXPECT_EQ(budget.Snapshot().allocated(), 16u << 10);  // one slab
    absl::StatusOr<AllocationId> admitted = budget.Allocate(/*owner=*/1, total);
    ASSERT_THAT(admitted.status(), IsOk());
    PrefixCacheStats stats = cache_->Stats();
    EXPECT_EQ(stats.entries, 1u);
    EXPECT_EQ(stats.evicted_entries, 0u);
    EXPECT_EQ(stats.slabs.slabs, 0u);
    EXPECT_EQ(stats.tiers[0].stored_bytes, 0u);
    EXPECT_EQ(stats.tiers[1].medium,
              host_tier ? StorageMedium::kPinnedHost : StorageMedium::kDisk);
    EXPECT_EQ(stats.tiers[1].stored_bytes, 2 * kFlatSpanBytes);
    EXPECT_EQ(budget.Snapshot().allocated(), total);  // a host-tier slab is not in it
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
    // With the device full the entry cannot come back: RESOURCE_EXHAUSTED, the entry stays.
    auto dest = NewSession(FlatPlan(), 64);
    EXPECT_THAT(RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("")));
    EXPECT_EQ(cache_->Stats().entries, 1u);
    ASSERT_THAT(budget.Release(*admitted), IsOk());
    ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(), IsOk());
    ExpectRestored(*dest, 32, 0);
    stats = cache_->Stats();
    EXPECT_EQ(stats.tiers[1].hits, 1u);
    EXPECT_EQ(stats.tiers[1].promotions, 2u);
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
    cache_.reset();  // before the budget it charges
  }
}

// Restores of entries that share disk pieces, from several threads at once: a piece one restore
// is reading back is waited for by the other (never read twice, never lost), every restore is
// bit-exact, and the ledgers agree afterwards.
TEST_F(PrefixCacheTest, ConcurrentRestoresPromoteSharedDiskPiecesOnce) {
  absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
      MakeTieredCache(8 * kFlatSpanBytes, 1 << 20, nullptr, "concurrent");
  ASSERT_THAT(tiered.status(), IsOk());
  cache_ = *std::move(tiered);
  struct Source {
    std::unique_ptr<DaemonSession> session;
    std::vector<int32_t> tokens;
  };
  std::vector<Source> sources;
  const std::vector<int32_t> common = Tokens(2 * kBlock, 3);
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> tokens = Tokens(4 * kBlock, 1000 * (i + 1));
    std::copy(common.begin(), common.end(), tokens.begin());  // 2 shared blocks, 2 own
    auto session = NewSession(FlatPlan(), 128);
    Append(*session, tokens, 4 * kBlock);
    FillRandom(*session, 40 + i, 2 * kBlock);
    ASSERT_THAT(CaptureSessionPrefix(*cache_, *session, tokens, 4 * kBlock).status(), IsOk());
    sources.push_back({std::move(session), tokens});
  }
  // 2 shared + 4 x 2 own = 10 blocks for 8 spans: the oldest pieces are on disk.
  ASSERT_GT(cache_->Stats().tiers[1].stored_bytes, 0u);
  for (int round = 0; round < 5; ++round) {
    std::vector<std::unique_ptr<DaemonSession>> dests;
    for (size_t i = 0; i < sources.size(); ++i) dests.push_back(NewSession(FlatPlan(), 128));
    std::vector<absl::Status> results(sources.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < sources.size(); ++i) {
      threads.emplace_back([&, i] {
        results[i] =
            RestoreSessionPrefix(*cache_, *dests[i], std::nullopt, sources[i].tokens).status();
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (size_t i = 0; i < sources.size(); ++i) {
      ASSERT_THAT(results[i], IsOk()) << "round " << round << " restore " << i;
      EXPECT_EQ(KvRows(*dests[i], 4 * kBlock), KvRows(*sources[i].session, 4 * kBlock));
    }
    ASSERT_THAT(cache_->CheckInvariants(), IsOk());
    EXPECT_LE(cache_->Stats().tiers[0].stored_bytes, 8 * kFlatSpanBytes);
  }
  const PrefixCacheStats stats = cache_->Stats();
  EXPECT_EQ(stats.restores, 20u);
  EXPECT_EQ(stats.dropped_entries, 0u);
  EXPECT_GT(stats.tiers[1].promotions, 0u);
}

// A gate a demotion waits at (the before_demotion_copy seam): the `hold_copy`th piece copied
// down (the first by default) blocks there until the test opens it; the others pass.
class DemotionGate {
 public:
  explicit DemotionGate(uint64_t hold_copy = 1) : hold_copy_(hold_copy) {}

  std::function<void(uint64_t, StorageMedium)> Hook() {
    return [this](uint64_t, StorageMedium to) {
      absl::MutexLock lock(&mu_);
      ++copies_;
      if (copies_ != hold_copy_) return;
      last_to_ = to;
      entered_ = true;
      mu_.Await(absl::Condition(&open_));
    };
  }
  void AwaitEntered() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&entered_));
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  StorageMedium last_to() {
    absl::MutexLock lock(&mu_);
    return last_to_;
  }

 private:
  const uint64_t hold_copy_;
  absl::Mutex mu_;
  bool entered_ ABSL_GUARDED_BY(mu_) = false;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t copies_ ABSL_GUARDED_BY(mu_) = 0;
  StorageMedium last_to_ ABSL_GUARDED_BY(mu_) = StorageMedium::kDevice;
};

// Two flat entries in a device tier of 8 block spans: `old_tokens` (4 blocks), then
// `new_tokens` (6 blocks) captured on another thread, whose demotion of the old entry's two
// LRU blocks waits at `gate`. Returns that thread (joined by the caller).
struct HeldDemotion {
  std::unique_ptr<DaemonSession> old_source;
  std::unique_ptr<DaemonSession> new_source;
  std::vector<int32_t> old_tokens;
  std::vector<int32_t> new_tokens;
  EntryId old_entry;
  std::thread capture;
  absl::Status captured;
};

TEST_F(PrefixCacheTest, ADemotionCopiesWithoutHoldingTheCacheLock) {
  DemotionGate gate;
  absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
      MakeTieredCache(8 * kFlatSpanBytes, 1 << 20, nullptr, "unlocked", gate.Hook());
  ASSERT_THAT(tiered.status(), IsOk());
  cache_ = *std::move(tiered);
  const std::vector<int32_t> old_tokens = Tokens(4 * kBlock, 1);
  auto old_source = NewSession(FlatPlan(), 128);
  Append(*old_source, old_tokens, 4 * kBlock);
  FillRandom(*old_source, 21, 0);
  absl::StatusOr<PrefixCaptureResult> old_entry =
      CaptureSessionPrefix(*cache_, *old_source, old_tokens, 64);
  ASSERT_THAT(old_entry.status(), IsOk());
  const std::vector<int32_t> new_tokens = Tokens(6 * kBlock, 2);
  auto new_source = NewSession(FlatPlan(), 128);
  Append(*new_source, new_tokens, 6 * kBlock);
  FillRandom(*new_source, 22, 0);
  auto dest = NewSession(FlatPlan(), 128);
  absl::Status captured;
  std::thread capture(
      [&] { captured = CaptureSessionPrefix(*cache_, *new_source, new_tokens, 96).status(); });
  gate.AwaitEntered();
  EXPECT_EQ(gate.last_to(), StorageMedium::kDisk);
  // The demotion is mid-copy: lookups, stats, listings and a restore of the new entry (none of
  // whose pieces is moving) all complete. The moving pieces still serve from the device.
  const PrefixLookupResult old_lookup = cache_->Lookup(kScope, Shape(FlatPlan()), old_tokens);
  EXPECT_EQ(old_lookup.outcome, LookupOutcome::kHit);
  EXPECT_EQ(old_lookup.medium, StorageMedium::kDevice);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), new_tokens).outcome, LookupOutcome::kHit);
  EXPECT_EQ(cache_->ListEntries().size(), 2u);
  PrefixCacheStats stats = cache_->Stats();
  EXPECT_EQ(stats.tiers[0].stored_bytes, 10 * kFlatSpanBytes);  // nothing committed yet
  EXPECT_EQ(stats.tiers[1].demotions, 0u);
  ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, std::nullopt, new_tokens).status(), IsOk());
  EXPECT_EQ(KvRows(*dest, 96), KvRows(*new_source, 96));
  gate.Open();
  capture.join();
  ASSERT_THAT(captured, IsOk());
  stats = cache_->Stats();
  EXPECT_EQ(stats.tiers[0].stored_bytes, 8 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].stored_bytes, 2 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].demotions, 2u);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), old_tokens).medium, StorageMedium::kDisk);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  auto old_dest = NewSession(FlatPlan(), 128);
  ASSERT_THAT(RestoreSessionPrefix(*cache_, *old_dest, old_entry->entry, old_tokens).status(),
              IsOk());
  EXPECT_EQ(KvRows(*old_dest, 64), KvRows(*old_source, 64));
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

// A demotion batch commits a chunk at a time (here one piece each): while a later piece of the
// batch is held mid-copy, the earlier ones are on disk, counted, and their entry restores from
// there; a restore needing only those never waits for the rest of the batch.
TEST_F(PrefixCacheTest, ADemotionBatchCommitsChunkByChunk) {
  DemotionGate gate(/*hold_copy=*/3);
  demotion_chunk_bytes_ = 1;
  absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
      MakeTieredCache(8 * kFlatSpanBytes, 1 << 20, nullptr, "chunked", gate.Hook());
  ASSERT_THAT(tiered.status(), IsOk());
  cache_ = *std::move(tiered);
  // A (2 blocks, least recently used), B (2 blocks), C (4 blocks): the device tier is full.
  struct Captured {
    std::vector<int32_t> tokens;
    std::unique_ptr<DaemonSession> source;
  };
  std::vector<Captured> entries;
  for (const auto& [blocks, salt] : std::vector<std::pair<uint64_t, int32_t>>{{2, 1}, {2, 2}, {4, 3}}) {
    Captured& entry = entries.emplace_back();
    entry.tokens = Tokens(blocks * kBlock, salt);
    entry.source = NewSession(FlatPlan(), 128);
    Append(*entry.source, entry.tokens, blocks * kBlock);
    FillRandom(*entry.source, 40 + salt, 0);
    ASSERT_THAT(
        CaptureSessionPrefix(*cache_, *entry.source, entry.tokens, blocks * kBlock).status(),
        IsOk());
  }
  const Captured& a = entries[0];
  const Captured& b = entries[1];
  // D (4 blocks) on another thread: its demotion's batch is A's two pieces, then B's two; the
  // third copy (B's first piece) is held.
  const std::vector<int32_t> d_tokens = Tokens(4 * kBlock, 4);
  auto d_source = NewSession(FlatPlan(), 128);
  Append(*d_source, d_tokens, 4 * kBlock);
  FillRandom(*d_source, 44, 0);
  absl::Status captured;
  std::thread capture(
      [&] { captured = CaptureSessionPrefix(*cache_, *d_source, d_tokens, 4 * kBlock).status(); });
  gate.AwaitEntered();
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), a.tokens).medium, StorageMedium::kDisk);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), b.tokens).medium, StorageMedium::kDevice);
  PrefixCacheStats stats = cache_->Stats();
  EXPECT_EQ(stats.tiers[1].demotions, 2u);
  EXPECT_EQ(stats.tiers[1].stored_bytes, 2 * kFlatSpanBytes);
  // A restores from disk while B's copy is still held (bounded: a wait for the whole batch
  // would never end before the gate opens).
  absl::Notification restored;
  absl::Status restore_status;
  auto a_dest = NewSession(FlatPlan(), 128);
  std::thread restore([&] {
    restore_status = RestoreSessionPrefix(*cache_, *a_dest, std::nullopt, a.tokens).status();
    restored.Notify();
  });
  const bool restored_while_held = restored.WaitForNotificationWithTimeout(absl::Seconds(30));
  gate.Open();
  restore.join();
  capture.join();
  EXPECT_TRUE(restored_while_held);
  ASSERT_THAT(restore_status, IsOk());
  ASSERT_THAT(captured, IsOk());
  EXPECT_EQ(KvRows(*a_dest, 2 * kBlock), KvRows(*a.source, 2 * kBlock));
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), b.tokens).medium, StorageMedium::kDisk);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

// A restore that pins pieces a demotion is copying waits for that copy, which then leaves the
// pieces where they were (the restore wanted them near); an entry evicted while its pieces
// move is freed in both tiers when the copy commits.
TEST_F(PrefixCacheTest, PiecesPinnedOrEvictedWhileTheyMoveStayConsistent) {
  for (const bool evict : {false, true}) {
    SCOPED_TRACE(evict ? "evicted meanwhile" : "pinned meanwhile");
    DemotionGate gate;
    absl::StatusOr<std::unique_ptr<PrefixCache>> tiered = MakeTieredCache(
        8 * kFlatSpanBytes, 1 << 20, nullptr, evict ? "evicted" : "pinned", gate.Hook());
    ASSERT_THAT(tiered.status(), IsOk());
    cache_ = *std::move(tiered);
    const std::vector<int32_t> old_tokens = Tokens(4 * kBlock, 1);
    auto old_source = NewSession(FlatPlan(), 128);
    Append(*old_source, old_tokens, 4 * kBlock);
    FillRandom(*old_source, 31, 0);
    absl::StatusOr<PrefixCaptureResult> old_entry =
        CaptureSessionPrefix(*cache_, *old_source, old_tokens, 64);
    ASSERT_THAT(old_entry.status(), IsOk());
    absl::StatusOr<EntryView> old_view = ViewOf(cache_->Inspect(old_entry->entry));
    ASSERT_THAT(old_view.status(), IsOk());
    const uint64_t first_old = old_view->blocks[0].stored.storage_handle;
    const std::vector<int32_t> new_tokens = Tokens(6 * kBlock, 2);
    auto new_source = NewSession(FlatPlan(), 128);
    Append(*new_source, new_tokens, 6 * kBlock);
    absl::Status captured;
    std::thread capture(
        [&] { captured = CaptureSessionPrefix(*cache_, *new_source, new_tokens, 96).status(); });
    gate.AwaitEntered();
    auto dest = NewSession(FlatPlan(), 128);
    absl::Status restored;
    std::thread restore;
    if (evict) {
      ASSERT_THAT(cache_->EvictEntry(old_entry->entry).status(), IsOk());
      EXPECT_EQ(cache_->Stats().tiers[0].stored_bytes, 6 * kFlatSpanBytes);
    } else {
      restore = std::thread([&] {
        restored = RestoreSessionPrefix(*cache_, *dest, old_entry->entry, old_tokens).status();
      });
      // Bounded: the restore pins the entry before it waits for the moving pieces.
      for (int i = 0; i < 10000 && cache_->Stats().pinned_bytes == 0; ++i) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      ASSERT_GT(cache_->Stats().pinned_bytes, 0u);
    }
    gate.Open();
    capture.join();
    if (restore.joinable()) restore.join();
    ASSERT_THAT(captured, IsOk());
    const PrefixCacheStats stats = cache_->Stats();
    if (evict) {
      EXPECT_THAT(cache_->Inspect(old_entry->entry).status(),
                  StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
      EXPECT_EQ(stats.entries, 1u);
      EXPECT_EQ(stats.tiers[0].stored_bytes, 6 * kFlatSpanBytes);
      EXPECT_EQ(stats.tiers[1].stored_bytes, 0u);  // the copied files are gone too
      EXPECT_EQ(stats.tiers[1].demotions, 0u);
    } else {
      ASSERT_THAT(restored, IsOk());
      EXPECT_EQ(KvRows(*dest, 64), KvRows(*old_source, 64));
      // The restored entry is now the most recent: its pieces stayed, the new entry's moved.
      EXPECT_EQ(PieceMedium(*cache_, first_old), StorageMedium::kDevice);
      EXPECT_EQ(stats.tiers[0].stored_bytes, 8 * kFlatSpanBytes);
      EXPECT_EQ(stats.tiers[1].stored_bytes, 2 * kFlatSpanBytes);
      EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), new_tokens).medium,
                StorageMedium::kDisk);
    }
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  }
}

// Captures, restores, lookups and evictions from several threads over a small device tier and
// disk tier (and a host tier between them), so demotions (copying without the lock),
// promotions and evictions interleave:
// every restore is bit-exact and the ledgers agree after every round.
TEST_F(PrefixCacheTest, ConcurrentTrafficKeepsTheTierInvariants) {
  for (const uint64_t host_bytes : {uint64_t{0}, 4 * kFlatSpanBytes}) {
    SCOPED_TRACE(host_bytes > 0 ? "device -> host -> disk" : "device -> disk");
    absl::StatusOr<std::unique_ptr<PrefixCache>> tiered = MakeTierChain(
        8 * kFlatSpanBytes, host_bytes, 16 * kFlatBlockBytes, nullptr, "stress");
    ASSERT_THAT(tiered.status(), IsOk());
    cache_ = *std::move(tiered);
    struct Source {
      std::unique_ptr<DaemonSession> session;
      std::vector<int32_t> tokens;
      uint64_t len = 0;
      EntryId entry;
    };
    constexpr int kThreads = 4;
    absl::Mutex sessions_mu;  // NewSession's id counter
    auto new_session = [&] {
      absl::MutexLock lock(&sessions_mu);
      return NewSession(FlatPlan(), 128);
    };
    std::atomic<uint64_t> restores{0};
    for (int round = 0; round < 6; ++round) {
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          testing::SeededRandom random(uint64_t{1000} * round + t);
          std::vector<Source> sources;
          for (int op = 0; op < 20; ++op) {
            const uint64_t pick = random.Below(4);
            if (pick == 0 || sources.empty()) {
              const uint64_t len = (1 + random.Below(4)) * kBlock;
              Source source;
              source.tokens = Tokens(len, static_cast<int32_t>(1000000 * (t + 1) + 10000 * round +
                                                               100 * op));
              source.len = len;
              source.session = new_session();
              Append(*source.session, source.tokens, len);
              FillRandom(*source.session, random.Below(1 << 30), 0);
              absl::StatusOr<PrefixCaptureResult> captured =
                  CaptureSessionPrefix(*cache_, *source.session, source.tokens, len);
              ASSERT_THAT(captured.status(), IsOk());
              source.entry = captured->entry;
              sources.push_back(std::move(source));
            } else if (pick == 1 || pick == 2) {
              const Source& source = sources[random.Below(sources.size())];
              auto dest = new_session();
              const absl::Status restored =
                  RestoreSessionPrefix(*cache_, *dest, source.entry, source.tokens).status();
              if (restored.ok()) {
                ASSERT_EQ(KvRows(*dest, source.len), KvRows(*source.session, source.len));
                restores.fetch_add(1);
              } else {
                // Evicted by another thread's capture (the disk tier is small).
                ASSERT_THAT(restored, StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
              }
              (void)cache_->Lookup(kScope, Shape(FlatPlan()), source.tokens);
            } else {
              const Source& source = sources[random.Below(sources.size())];
              const absl::Status evicted = cache_->EvictEntry(source.entry).status();
              if (!evicted.ok()) {
                ASSERT_TRUE(absl::IsNotFound(evicted) || absl::IsFailedPrecondition(evicted))
                    << evicted;
              }
            }
          }
        });
      }
      for (std::thread& thread : threads) thread.join();
      ASSERT_THAT(cache_->CheckInvariants(), IsOk()) << "round " << round;
      const PrefixCacheStats stats = cache_->Stats();
      EXPECT_LE(stats.tiers[0].stored_bytes, 8 * kFlatSpanBytes) << "round " << round;
      EXPECT_LE(stats.tiers.back().stored_bytes / kFlatSpanBytes * kFlatBlockBytes,
                16 * kFlatBlockBytes);
    }
    const PrefixCacheStats stats = cache_->Stats();
    EXPECT_GT(restores.load(), 0u);
    EXPECT_GT(stats.tiers[1].demotions, 0u);
    EXPECT_EQ(stats.dropped_entries, 0u);
    if (host_bytes > 0) {
      EXPECT_LE(stats.tiers[1].stored_bytes, host_bytes);
    }
  }
}

// The whole chain, device (8 block spans) -> host (4) -> disk: a third entry pushes the
// oldest one's blocks through the host tier to disk and the next one's into the host tier;
// restores promote them back bit-exactly, and each tier stays within its budget.
TEST_F(PrefixCacheTest, AnEntryDemotedThroughTheHostTierToDiskRestoresBitExactly) {
  absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
      MakeTierChain(8 * kFlatSpanBytes, 4 * kFlatSpanBytes, 1 << 20, nullptr, "chain");
  ASSERT_THAT(tiered.status(), IsOk());
  cache_ = *std::move(tiered);
  struct Source {
    std::unique_ptr<DaemonSession> session;
    std::vector<int32_t> tokens;
    EntryId entry;
  };
  std::vector<Source> sources;
  for (int i = 0; i < 3; ++i) {
    const uint64_t blocks = i < 2 ? 4 : 6;
    Source source{NewSession(FlatPlan(), 128), Tokens(blocks * kBlock, 10 * (i + 1)), EntryId{}};
    Append(*source.session, source.tokens, blocks * kBlock);
    FillRandom(*source.session, 50 + i, 0);
    absl::StatusOr<PrefixCaptureResult> captured =
        CaptureSessionPrefix(*cache_, *source.session, source.tokens, blocks * kBlock);
    ASSERT_THAT(captured.status(), IsOk());
    source.entry = captured->entry;
    sources.push_back(std::move(source));
  }
  // 14 blocks: the 6 LRU ones (A's 4, B's first 2) went to the host tier, which then passed
  // its 2 LRU ones (A's first 2) on to disk.
  PrefixCacheStats stats = cache_->Stats();
  ASSERT_EQ(stats.tiers.size(), 3u);
  EXPECT_EQ(stats.tiers[0].medium, StorageMedium::kDevice);
  EXPECT_EQ(stats.tiers[1].medium, StorageMedium::kPinnedHost);
  EXPECT_EQ(stats.tiers[2].medium, StorageMedium::kDisk);
  EXPECT_EQ(stats.tiers[0].stored_bytes, 8 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].stored_bytes, 4 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].budget_bytes, 4 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[2].stored_bytes, 2 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].demotions, 6u);
  EXPECT_EQ(stats.tiers[2].demotions, 2u);
  EXPECT_EQ(stats.stored_bytes, 14 * kFlatSpanBytes);
  EXPECT_EQ(stats.budget_bytes, 12 * kFlatSpanBytes + (1 << 20));
  EXPECT_EQ(stats.evicted_entries, 0u);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  absl::StatusOr<EntryView> a = ViewOf(cache_->Inspect(sources[0].entry));
  absl::StatusOr<EntryView> b = ViewOf(cache_->Inspect(sources[1].entry));
  ASSERT_THAT(a.status(), IsOk());
  ASSERT_THAT(b.status(), IsOk());
  const std::vector<StorageMedium> a_tiers = {StorageMedium::kDisk, StorageMedium::kDisk,
                                              StorageMedium::kPinnedHost,
                                              StorageMedium::kPinnedHost};
  const std::vector<StorageMedium> b_tiers = {StorageMedium::kPinnedHost,
                                              StorageMedium::kPinnedHost, StorageMedium::kDevice,
                                              StorageMedium::kDevice};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(PieceMedium(*cache_, a->blocks[i].stored.storage_handle), a_tiers[i]) << i;
    EXPECT_EQ(PieceMedium(*cache_, b->blocks[i].stored.storage_handle), b_tiers[i]) << i;
  }
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), sources[0].tokens).medium,
            StorageMedium::kDisk);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), sources[1].tokens).medium,
            StorageMedium::kPinnedHost);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(FlatPlan()), sources[2].tokens).medium,
            StorageMedium::kDevice);
  // The kMoved events (one per shape and move) name where the bytes went: A's 4 and B's 2 to
  // the host tier, then A's 2 on to disk.
  const ScopedEventReplay events = cache_->EventsSince(77, 3, std::nullopt);
  ASSERT_FALSE(events.gap);
  std::vector<std::pair<StorageMedium, size_t>> moved;
  for (const ScopedPrefixEvent& event : events.events) {
    ASSERT_EQ(event.event.kind, PrefixEventKind::kMoved);
    moved.emplace_back(event.event.medium, event.event.block_keys.size());
  }
  EXPECT_THAT(moved, ::testing::ElementsAre(std::pair{StorageMedium::kPinnedHost, size_t{6}},
                                            std::pair{StorageMedium::kDisk, size_t{2}}));

  // A (disk + host) restores bit-exactly; its pieces are promoted to the device.
  auto dest_a = NewSession(FlatPlan(), 128);
  ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest_a, sources[0].entry, sources[0].tokens).status(),
              IsOk());
  EXPECT_EQ(KvRows(*dest_a, 64), KvRows(*sources[0].session, 64));
  for (const LookupBlock& block : a->blocks) {
    EXPECT_EQ(PieceMedium(*cache_, block.stored.storage_handle), StorageMedium::kDevice);
  }
  stats = cache_->Stats();
  EXPECT_EQ(stats.tiers[2].hits, 1u);
  EXPECT_EQ(stats.tiers[1].promotions, 2u);
  EXPECT_EQ(stats.tiers[2].promotions, 2u);
  EXPECT_EQ(stats.tiers[0].stored_bytes, 8 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].stored_bytes, 4 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[2].stored_bytes, 2 * kFlatSpanBytes);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  // And B and C, wherever their pieces went since.
  for (size_t i = 1; i < 3; ++i) {
    const uint64_t rows = sources[i].tokens.size();
    auto dest = NewSession(FlatPlan(), 128);
    ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, sources[i].entry, sources[i].tokens).status(),
                IsOk());
    EXPECT_EQ(KvRows(*dest, rows), KvRows(*sources[i].session, rows));
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  }
  stats = cache_->Stats();
  EXPECT_EQ(stats.restores, 3u);
  EXPECT_EQ(stats.tiers[0].hits + stats.tiers[1].hits + stats.tiers[2].hits, 3u);
  EXPECT_LE(stats.tiers[1].stored_bytes, 4 * kFlatSpanBytes);
}

// A full tier makes room by evicting only entries whose eviction frees a piece there: a prefix
// whose pieces there are all shared with its (more recently used) extension would leave the
// cache for no room, so it stays, and the next LRU entry, whose pieces are its own, goes.
TEST_F(PrefixCacheTest, AFullTierEvictsOnlyEntriesThatFreeRoomThere) {
  for (const StorageMedium below : {StorageMedium::kDisk, StorageMedium::kPinnedHost}) {
    SCOPED_TRACE(StorageMediumName(below));
    ASSERT_NO_FATAL_FAILURE(UseFourPieceTiers(below, "frees-room"));
    // The shorter entry is the longer one's first 2 blocks (shared).
    const ChurnSource long_source = BlocksSource(4, 1, 21);
    const EntryId shorter = CaptureChecked(long_source, 2 * kBlock);
    const EntryId longer = CaptureChecked(long_source, 4 * kBlock);
    ChurnSources own;
    // 6 pieces for 4: the shared 2 (the LRU entry's) go below.
    const EntryId evictable = CaptureOwnEntry(2, own);
    // The longer entry is used again (an identical capture touches it): LRU shorter, evictable,
    // longer.
    EXPECT_EQ(CaptureChecked(long_source, 4 * kBlock), longer);
    // 6 pieces for 4 again: the evictable entry's 2 go below, which is now full.
    const EntryId newest = CaptureOwnEntry(3, own);
    PrefixCacheStats stats = cache_->Stats();
    ASSERT_EQ(stats.tiers.size(), 2u);
    ASSERT_EQ(stats.tiers[1].medium, below);
    EXPECT_EQ(stats.tiers[1].stored_bytes, 4 * kFlatSpanBytes);
    EXPECT_EQ(stats.evicted_entries, 0u);

    // An admission takes one more slab: the longer entry's own 2 blocks go below, which must
    // make room for them. The shorter entry is the LRU one with pieces there, but they are all
    // shared with the longer entry: evicting it would free nothing there. The next entry's
    // pieces are its own: it goes.
    cache_->ReleaseEmptySlabs();
    EXPECT_EQ(cache_->EvictForAdmission(2 * kFlatSpanBytes), 2 * kFlatSpanBytes);
    EXPECT_THAT(ListedIds(), ::testing::UnorderedElementsAre(shorter, longer, newest));
    stats = cache_->Stats();
    EXPECT_EQ(stats.evicted_entries, 1u);
    EXPECT_EQ(stats.tiers[0].stored_bytes, 2 * kFlatSpanBytes);
    EXPECT_EQ(stats.tiers[1].stored_bytes, 4 * kFlatSpanBytes);  // the shared 2 + the moved 2
    EXPECT_EQ(stats.stored_bytes, 6 * kFlatSpanBytes);
    EXPECT_THAT(cache_->Inspect(evictable).status(),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("prefix entry 3 not found")));
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());

    // The kept prefix restores bit-exactly from the tier below, and so does its extension.
    auto dest = NewSession(FlatPlan(), 128);
    absl::StatusOr<PrefixRestoreResult> restored =
        RestoreSessionPrefix(*cache_, *dest, shorter, long_source.tokens);
    ASSERT_THAT(restored.status(), IsOk());
    EXPECT_EQ(restored->restored_tokens, 2 * kBlock);
    EXPECT_EQ(KvRows(*dest, 2 * kBlock), KvRows(*long_source.session, 2 * kBlock));
    EXPECT_EQ(cache_->Stats().tiers[1].hits, 1u);
    auto dest_long = NewSession(FlatPlan(), 128);
    ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest_long, longer, long_source.tokens).status(),
                IsOk());
    EXPECT_EQ(KvRows(*dest_long, 4 * kBlock), KvRows(*long_source.session, 4 * kBlock));
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
    cache_.reset();
  }
}

// The tier below holds only pieces that prefixes share with their extensions, whose own pieces
// are above: no entry alone frees one. Room is still made (the second pass takes prefixes and
// extensions holding pieces there, LRU first), instead of the tier staying full for good and
// every demotion to it failing.
TEST_F(PrefixCacheTest, ATierFullOfSharedPiecesStillMakesRoom) {
  for (const StorageMedium below : {StorageMedium::kDisk, StorageMedium::kPinnedHost}) {
    SCOPED_TRACE(StorageMediumName(below));
    ASSERT_NO_FATAL_FAILURE(UseFourPieceTiers(below, "shared-full"));
    const ChurnSource first = BlocksSource(4, 1, 21);
    const ChurnSource second = BlocksSource(4, 2, 22);
    const EntryId first_prefix = CaptureChecked(first, 2 * kBlock);
    const EntryId first_whole = CaptureChecked(first, 4 * kBlock);
    CaptureChecked(second, 2 * kBlock);  // the first prefix's 2 pieces go below
    EXPECT_EQ(CaptureChecked(first, 4 * kBlock), first_whole);  // used again
    const EntryId second_whole = CaptureChecked(second, 4 * kBlock);  // the second prefix's go
    PrefixCacheStats stats = cache_->Stats();
    ASSERT_EQ(stats.tiers.size(), 2u);
    ASSERT_EQ(stats.tiers[1].stored_bytes, 4 * kFlatSpanBytes);  // full: 4 shared pieces
    ASSERT_EQ(stats.tiers[0].stored_bytes, 4 * kFlatSpanBytes);  // the two extensions' own
    EXPECT_EQ(stats.evicted_entries, 0u);

    // An admission: the first extension's own pieces must go below, which is full of shared
    // pieces: the first prefix and extension (least recently used) leave for room.
    cache_->ReleaseEmptySlabs();
    EXPECT_EQ(cache_->EvictForAdmission(2 * kFlatSpanBytes), 2 * kFlatSpanBytes);
    EXPECT_THAT(cache_->Inspect(first_prefix).status(),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("not found")));
    stats = cache_->Stats();
    EXPECT_LE(stats.tiers[1].stored_bytes, 4 * kFlatSpanBytes);
    EXPECT_LE(stats.tiers[0].stored_bytes, 2 * kFlatSpanBytes);
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
    // The newest entry is whole and restores bit-exactly.
    auto dest = NewSession(FlatPlan(), 128);
    ASSERT_THAT(RestoreSessionPrefix(*cache_, *dest, second_whole, second.tokens).status(), IsOk());
    EXPECT_EQ(KvRows(*dest, 4 * kBlock), KvRows(*second.session, 4 * kBlock));
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
    cache_.reset();
  }
}

// Room is made in one pass over the LRU order, each entry judged when it is reached: evicting
// an extension leaves its prefix the only user of their shared pieces, so the prefix, reached
// next, frees room too and goes, while the entries whose pieces are moving down stay.
TEST_F(PrefixCacheTest, EvictingAnExtensionMakesItsPrefixFreeRoomWhenReached) {
  for (const StorageMedium below : {StorageMedium::kDisk, StorageMedium::kPinnedHost}) {
    SCOPED_TRACE(StorageMediumName(below));
    ASSERT_NO_FATAL_FAILURE(UseFourPieceTiers(below, "rejudged"));
    // The extension first: LRU longer, shorter.
    const ChurnSource long_source = BlocksSource(4, 1, 21);
    const EntryId longer = CaptureChecked(long_source, 4 * kBlock);
    const EntryId shorter = CaptureChecked(long_source, 2 * kBlock);
    ChurnSources own;
    const EntryId first = CaptureOwnEntry(2, own);   // the shared 2 go below
    const EntryId second = CaptureOwnEntry(3, own);  // the longer one's own 2 go below: full
    EXPECT_EQ(cache_->Stats().tiers[1].stored_bytes, 4 * kFlatSpanBytes);

    // An admission takes both slabs: the own entries' 4 pieces move down, so the tier below
    // must let go of all it holds. The longer entry frees its own 2, not enough; the shorter
    // one, reached next, is then the only user of the shared 2, and frees them.
    cache_->ReleaseEmptySlabs();
    EXPECT_EQ(cache_->EvictForAdmission(4 * kFlatSpanBytes), 4 * kFlatSpanBytes);
    EXPECT_THAT(ListedIds(), ::testing::UnorderedElementsAre(first, second));
    const PrefixCacheStats stats = cache_->Stats();
    EXPECT_EQ(stats.evicted_entries, 2u);
    EXPECT_EQ(stats.tiers[0].stored_bytes, 0u);
    EXPECT_EQ(stats.tiers[1].stored_bytes, 4 * kFlatSpanBytes);
    EXPECT_THAT(cache_->Inspect(longer).status(),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("prefix entry 1 not found")));
    EXPECT_THAT(cache_->Inspect(shorter).status(),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("prefix entry 2 not found")));
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
    ExpectEveryEntryRestores(own);
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
    cache_.reset();
  }
}

// Random captures, restores and evictions over device -> host (-> disk): after every step each
// tier is within its budget and the ledgers agree; with no disk tier the host tier is the last
// one and evicts its LRU entries.
TEST_F(PrefixCacheTest, HostTierBudgetsHoldUnderChurn) {
  for (const bool with_disk : {true, false}) {
    SCOPED_TRACE(with_disk ? "device -> host -> disk" : "device -> host");
    const uint64_t device_bytes = 6 * kFlatSpanBytes;
    const uint64_t host_bytes = 6 * kFlatSpanBytes;
    const uint64_t disk_bytes = with_disk ? 10 * kFlatBlockBytes : 0;
    absl::StatusOr<std::unique_ptr<PrefixCache>> tiered =
        MakeTierChain(device_bytes, host_bytes, disk_bytes, nullptr, "host-churn");
    ASSERT_THAT(tiered.status(), IsOk());
    cache_ = *std::move(tiered);
    testing::SeededRandom random(with_disk ? 7 : 8);
    ChurnSources sources;
    for (int round = 0; round < 60; ++round) {
      ASSERT_NO_FATAL_FAILURE(ChurnStep(random, sources, 700000 + round * 1000,
                                        static_cast<uint64_t>(round) + 300));
      const PrefixCacheStats stats = cache_->Stats();
      ASSERT_EQ(stats.tiers.size(), with_disk ? 3u : 2u);
      ASSERT_LE(stats.tiers[0].stored_bytes, device_bytes) << "round " << round;
      ASSERT_LE(stats.tiers[1].stored_bytes, host_bytes) << "round " << round;
      if (with_disk) {
        ASSERT_LE(stats.tiers[2].stored_bytes / kFlatSpanBytes * kFlatBlockBytes, disk_bytes);
      }
      ASSERT_THAT(cache_->CheckInvariants(), IsOk()) << "round " << round;
    }
    const PrefixCacheStats stats = cache_->Stats();
    EXPECT_GT(stats.evicted_entries, 3u);
    EXPECT_GT(stats.tiers[1].demotions, 0u);
    EXPECT_GT(stats.tiers[1].promotions, 0u);
    if (with_disk) {
      EXPECT_GT(stats.tiers[2].demotions, 0u);
    }
    ExpectEveryEntryRestores(sources);
    EXPECT_THAT(cache_->CheckInvariants(), IsOk());
  }
}

TEST_F(PrefixCacheTest, AHostTierNeedsItsMemoryAndMemoryNeedsAHostTier) {
  PrefixCacheOptions options;
  options.budget_bytes = 1 << 20;
  options.block_tokens = kBlock;
  options.host_tier_bytes = 12345;
  EXPECT_THAT(PrefixCache::Create(options, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("host tier of 12345 bytes has no memory provider")));
  options.host_tier_bytes = 0;
  EXPECT_THAT(PrefixCache::Create(options, backend_.get(), nullptr, NewPlainHostMemory()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("host tier of 0 bytes is off but was given memory")));
}

TEST_F(PrefixCacheTest, DiskTierRefusalsCarryCodesAndNumbers) {
  EXPECT_THAT(MakeTieredCache(1 << 20, uint64_t{1} << 62, nullptr, "huge").status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("prefix_disk_bytes is 4611686018427387904 bytes",
                                  "bytes free")));
  const char* tmp = std::getenv("TEST_TMPDIR");
  PrefixCacheOptions zero;
  zero.budget_bytes = 1 << 20;
  zero.block_tokens = kBlock;
  zero.disk_dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/zero");
  zero.disk_bytes = 0;
  EXPECT_THAT(PrefixCache::Create(zero, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("budget (0 bytes)")));
  const std::string file = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/a-file");
  std::ofstream(file) << "x";
  PrefixCacheOptions options;
  options.budget_bytes = 1 << 20;
  options.block_tokens = kBlock;
  options.disk_dir = file;
  options.disk_bytes = 1 << 20;
  EXPECT_THAT(PrefixCache::Create(options, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("not a directory")));
  options.disk_dir = "relative";
  EXPECT_THAT(PrefixCache::Create(options, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("\"relative\"")));
}

TEST_F(PrefixCacheTest, RefusesNonPositiveRemoteTimeouts) {
  PrefixCacheOptions options;
  options.budget_bytes = uint64_t{16} << 20;
  options.block_tokens = kBlock;
  options.slab_bytes = kSlabBytes;
  RemoteTierOptions remote;
  remote.cluster.seed_nodes = {{"127.0.0.1", 1}};  // never reached: refused first
  options.remote = remote;
  options.remote_lookup_timeout = absl::ZeroDuration();
  EXPECT_THAT(PrefixCache::Create(options, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("lookup timeout (0)", "must be positive")));
  options.remote_lookup_timeout = absl::Milliseconds(50);
  options.remote_fetch_timeout = absl::Milliseconds(-5);
  EXPECT_THAT(PrefixCache::Create(options, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("lookup timeout (50ms)", "fetch timeout (-5ms)")));
}

// ---- The remote tier: two caches ("machines") sharing a real 3-master / 3-replica cluster ----

class PrefixCacheRemoteTest : public testing::WithRedisCluster<PrefixCacheTest> {
 protected:
  void SetUp() override {
    WithRedisCluster::SetUp();  // PrefixCacheTest::SetUp too
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(cluster_->WaitHealthy());
    absl::StatusOr<std::vector<int>> masters = cluster_->MasterPorts();
    ASSERT_THAT(masters, IsOk());
    for (const int master : *masters) ASSERT_THAT(cluster_->Command(master, {"FLUSHALL"}), IsOk());
    RedisClusterOptions options = ClusterOptions();
    absl::StatusOr<std::unique_ptr<RedisClusterClient>> client =
        RedisClusterClient::Create(options);
    ASSERT_THAT(client, IsOk());
    redis_ = *std::move(client);
  }

  static RedisClusterOptions ClusterOptions() {
    RedisClusterOptions options;
    options.seed_nodes = *ParseRedisNodeList(cluster_->NodeList());
    options.password_file = cluster_->WritePasswordFile("default.pass", testing::kRedisPassword);
    options.command_timeout = absl::Milliseconds(300);
    return options;
  }

  // A cache with a remote tier on the cluster (checksum slices of `slice_bytes`); with
  // `disk_bytes`, a disk tier below a device tier of `device_bytes`; `before_write_read` the
  // tier's seam.
  std::unique_ptr<PrefixCache> MakeRemoteCache(uint64_t slice_bytes = uint64_t{8} << 20,
                                               uint64_t queue_bytes = uint64_t{64} << 20,
                                               uint64_t disk_bytes = 0,
                                               std::function<void()> before_write_read = {},
                                               uint64_t device_bytes = uint64_t{16} << 20) {
    PrefixCacheOptions options;
    if (disk_bytes > 0) {
      const char* tmp = std::getenv("TEST_TMPDIR");
      disk_dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/remote-disk");
      std::system(absl::StrCat("rm -rf '", disk_dir_, "'").c_str());
      options.disk_dir = disk_dir_;
      options.disk_bytes = disk_bytes;
    }
    options.budget_bytes = device_bytes;
    options.block_tokens = kBlock;
    options.slab_bytes = kSlabBytes;
    options.checksum_slice_bytes = slice_bytes;
    options.epoch = 78;
    RemoteTierOptions remote;
    remote.cluster = ClusterOptions();
    remote.queue_bytes = queue_bytes;
    remote.before_write_read = std::move(before_write_read);
    options.remote = remote;
    options.remote_lookup_timeout = absl::Seconds(2);  // no spurious misses on a loaded machine
    absl::StatusOr<std::unique_ptr<PrefixCache>> cache =
        PrefixCache::Create(options, backend_.get(), nullptr);
    EXPECT_THAT(cache.status(), IsOk());
    return cache.ok() ? *std::move(cache) : nullptr;
  }

  // Captures `blocks` blocks of `plan` on `cache` and waits for the write-behind.
  void CaptureAndFlush(PrefixCache& cache, const ModelPlan& plan,
                       const std::vector<int32_t>& tokens, uint64_t blocks) {
    auto source = NewSession(plan, 256);
    Append(*source, tokens, blocks * kBlock);
    ASSERT_THAT(CaptureSessionPrefix(cache, *source,
                                     absl::MakeConstSpan(tokens).subspan(0, blocks * kBlock),
                                     blocks * kBlock)
                    .status(),
                IsOk());
    ASSERT_TRUE(cache.remote_tier()->Flush(absl::Seconds(30)));
  }

  // Two caches ("machines") on the cluster, `a` having captured and flushed `blocks` blocks of
  // FlatPlan's `tokens`.
  void CapturedOnA(const std::vector<int32_t>& tokens, uint64_t blocks,
                   std::unique_ptr<PrefixCache>& a, std::unique_ptr<PrefixCache>& b) {
    a = MakeRemoteCache();
    b = MakeRemoteCache();
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    CaptureAndFlush(*a, FlatPlan(), tokens, blocks);
  }

  std::string BlockKeyName(const ModelPlan& plan, const std::vector<int32_t>& tokens,
                           size_t block) {
    const PlanFingerprint key = ScopedShapeFingerprint(kScope, Shape(plan));
    return RemoteBlockKey(kScope, ChainBlockKeys(key, tokens, kBlock).value()[block]);
  }

  // A flat session of `tokens` (all committed) holding random bytes from `seed`.
  std::unique_ptr<DaemonSession> RandomSource(const std::vector<int32_t>& tokens, uint64_t seed) {
    auto source = NewSession(FlatPlan(), 256);
    Append(*source, tokens, tokens.size());
    FillRandom(*source, seed, 0);
    return source;
  }

  std::unique_ptr<RedisClusterClient> redis_;
};

TEST_F(PrefixCacheRemoteTest, CapturedOnOneCacheRestoresBitExactlyOnAnother) {
  std::unique_ptr<PrefixCache> a = MakeRemoteCache();
  // B slices checksums differently: it re-slices what it pulls, and still verifies.
  std::unique_ptr<PrefixCache> b = MakeRemoteCache(/*slice_bytes=*/512);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> flat = Tokens(6 * kBlock);
  const std::vector<int32_t> hybrid = Tokens(4 * kBlock, 7);
  CaptureAndFlush(*a, FlatPlan(), flat, 6);
  CaptureAndFlush(*a, HybridPlan(), hybrid, 4);
  ASSERT_TRUE(a->Stats().remote.has_value());
  EXPECT_EQ(a->Stats().remote->writes, 6u + 4u + 1u);

  for (const auto& [plan, tokens] :
       std::vector<std::pair<ModelPlan, std::vector<int32_t>>>{{FlatPlan(), flat},
                                                               {HybridPlan(), hybrid}}) {
    const PrefixLookupResult found = b->Lookup(kScope, Shape(plan), tokens);
    EXPECT_EQ(found.outcome, LookupOutcome::kHit);
    EXPECT_EQ(found.matched_tokens, tokens.size());
    EXPECT_EQ(found.medium, StorageMedium::kRemote);
    EXPECT_EQ(found.entry, std::nullopt);  // a restore by tokens pulls it
    auto dest = NewSession(plan, 256);
    absl::StatusOr<PrefixRestoreResult> restored =
        RestoreSessionPrefix(*b, *dest, std::nullopt, tokens);
    ASSERT_THAT(restored.status(), IsOk());
    EXPECT_EQ(restored->restored_tokens, tokens.size());
    ExpectRestored(*dest, tokens.size(), tokens.size());
    EXPECT_EQ(b->Lookup(kScope, Shape(plan), tokens).medium, StorageMedium::kDevice);
  }
  const PrefixCacheStats stats = b->Stats();
  EXPECT_EQ(stats.entries, 2u);
  EXPECT_EQ(stats.captures, 0u);
  EXPECT_EQ(stats.restores, 2u);
  EXPECT_EQ(stats.remote->hits, 2u);
  EXPECT_EQ(stats.remote->pulled_pieces, 11u);
  EXPECT_EQ(stats.remote->corrupt, 0u);
  ASSERT_EQ(stats.tiers.size(), 2u);
  EXPECT_EQ(stats.tiers[1].medium, StorageMedium::kRemote);
  EXPECT_EQ(stats.tiers[1].promotions, 11u);
  // A router hears B's pulled entries as stored on B's device.
  const ScopedEventReplay events = b->EventsSince(0, 0, std::nullopt);
  ASSERT_EQ(events.events.size(), 2u);
  EXPECT_EQ(events.events[0].event.kind, PrefixEventKind::kStored);
  EXPECT_EQ(events.events[0].event.medium, StorageMedium::kDevice);
  EXPECT_THAT(b->CheckInvariants(), IsOk());
  // Another scope neither sees nor pulls it.
  EXPECT_EQ(b->Lookup("uid:2000", Shape(FlatPlan()), flat).outcome, LookupOutcome::kMiss);
}

// A pulled entry's STORED event tells a router what a captured one does: the tokens of the
// blocks it added, the block before them and the engine whose restore pulled them.
TEST_F(PrefixCacheRemoteTest, APulledEntrysEventNamesItsTokensParentAndEngine) {
  const std::vector<int32_t> tokens = Tokens(6 * kBlock);
  std::unique_ptr<PrefixCache> a, b;
  ASSERT_NO_FATAL_FAILURE(CapturedOnA(tokens, 6, a, b));
  CaptureAndFlush(*b, FlatPlan(), tokens, 2);  // B holds blocks 0 and 1 itself
  auto dest = NewSession(FlatPlan(), 256);     // owned by engine 1
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*b, *dest, std::nullopt, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 6 * kBlock);
  EXPECT_EQ(b->Stats().remote->pulled_pieces, 4u);
  const ScopedEventReplay events = b->EventsSince(0, 0, std::nullopt);
  ASSERT_EQ(events.events.size(), 2u);
  const PrefixEvent& pulled = events.events[1].event;
  EXPECT_EQ(pulled.kind, PrefixEventKind::kStored);
  ASSERT_EQ(pulled.block_keys.size(), 4u);
  EXPECT_EQ(pulled.origin.block_tokens, kBlock);
  EXPECT_EQ(pulled.origin.engine_id, 1u);
  EXPECT_EQ(pulled.origin.token_ids,
            std::vector<int32_t>(tokens.begin() + 2 * kBlock, tokens.end()));
  const PlanFingerprint key = ScopedShapeFingerprint(kScope, Shape(FlatPlan()));
  const BlockKey parent = ChainBlockKeys(key, tokens, kBlock).value()[1];
  EXPECT_EQ(pulled.origin.parent_block_hash, std::string(parent.begin(), parent.end()));
}

// A pull never takes more than the device tier's budget: the blocks that fit are pulled (and
// restored), the rest stays remote.
TEST_F(PrefixCacheRemoteTest, APullLargerThanTheDeviceBudgetPullsWhatFits) {
  std::unique_ptr<PrefixCache> a = MakeRemoteCache();
  std::unique_ptr<PrefixCache> b = MakeRemoteCache(uint64_t{8} << 20, uint64_t{64} << 20,
                                                   /*disk_bytes=*/0, {},
                                                   /*device_bytes=*/3 * kFlatSpanBytes);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> tokens = Tokens(6 * kBlock);
  CaptureAndFlush(*a, FlatPlan(), tokens, 6);
  auto dest = NewSession(FlatPlan(), 256);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*b, *dest, std::nullopt, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 3 * kBlock);
  ExpectRestored(*dest, 3 * kBlock, 0);
  const PrefixCacheStats stats = b->Stats();
  EXPECT_EQ(stats.remote->pulled_pieces, 3u);
  EXPECT_EQ(stats.remote->pulled_bytes, 3 * kFlatBlockBytes);
  EXPECT_LE(stats.tiers[0].stored_bytes, 3 * kFlatSpanBytes);
  EXPECT_THAT(b->CheckInvariants(), IsOk());
}

// A boundary-state model whose whole match is local restores without asking the cluster.
TEST_F(PrefixCacheRemoteTest, AWhollyLocalBoundaryEntryRestoresWithoutAskingTheCluster) {
  std::unique_ptr<PrefixCache> b = MakeRemoteCache();
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> tokens = Tokens(4 * kBlock, 7);
  CaptureAndFlush(*b, HybridPlan(), tokens, 4);
  const RemoteTierStats before = *b->Stats().remote;
  auto dest = NewSession(HybridPlan(), 256);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*b, *dest, std::nullopt, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 4 * kBlock);
  const RemoteTierStats after = *b->Stats().remote;
  EXPECT_EQ(after.reads, before.reads);
  EXPECT_EQ(after.read_errors + after.read_timeouts + after.read_refusals,
            before.read_errors + before.read_timeouts + before.read_refusals);
}

TEST_F(PrefixCacheRemoteTest, ACorruptValueIsDeletedAndAnotherShapesIsSkipped) {
  const std::vector<int32_t> tokens = Tokens(6 * kBlock);
  std::unique_ptr<PrefixCache> a, b;
  ASSERT_NO_FATAL_FAILURE(CapturedOnA(tokens, 6, a, b));
  // Block 4: one flipped payload byte. Block 2: a valid value of another layout.
  const std::string corrupt_key = BlockKeyName(FlatPlan(), tokens, 4);
  absl::StatusOr<std::optional<std::string>> value = redis_->Get(corrupt_key);
  ASSERT_THAT(value, IsOk());
  ASSERT_TRUE(value->has_value());
  (**value)[kRemoteHeaderBytes + 10] ^= 1;
  ASSERT_THAT(redis_->Set(corrupt_key, **value), IsOk());
  const std::string foreign_key = BlockKeyName(FlatPlan(), tokens, 2);
  absl::StatusOr<std::optional<std::string>> original = redis_->Get(foreign_key);
  ASSERT_THAT(original, IsOk());
  ASSERT_TRUE(original->has_value());
  RemoteValueHeader foreign;
  foreign.payload_bytes = kFlatBlockBytes;
  foreign.block_tokens = kBlock;
  foreign.slice_bytes = 1 << 20;
  foreign.layout_digest = 12345;
  ASSERT_THAT(redis_->Set(foreign_key, NewRemoteValue(foreign_key, foreign)), IsOk());

  // The restore pulls blocks 0 and 1, refuses block 2 (another shape: skipped, kept).
  auto first = NewSession(FlatPlan(), 256);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*b, *first, std::nullopt, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 2 * kBlock);
  ExpectRestored(*first, 2 * kBlock, 0);
  PrefixCacheStats stats = b->Stats();
  EXPECT_EQ(stats.remote->shape_mismatches, 1u);
  EXPECT_EQ(stats.remote->corrupt, 0u);
  EXPECT_THAT(redis_->Get(foreign_key), testing::IsOkAndHolds(::testing::Optional(::testing::_)));

  // Block 2's own value back: B pulls blocks 2 and 3 and refuses 4 as corrupt: never restored,
  // deleted from the cluster.
  ASSERT_THAT(redis_->Set(foreign_key, **original), IsOk());
  auto second = NewSession(FlatPlan(), 256);
  restored = RestoreSessionPrefix(*b, *second, std::nullopt, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 4 * kBlock);
  ExpectRestored(*second, 4 * kBlock, 0);
  stats = b->Stats();
  EXPECT_EQ(stats.remote->corrupt, 1u);
  EXPECT_EQ(stats.remote->pulled_pieces, 4u);
  ASSERT_TRUE(b->remote_tier()->Flush(absl::Seconds(30)));  // the delete rides the write queue
  EXPECT_THAT(redis_->Get(corrupt_key), testing::IsOkAndHolds(std::nullopt));
  EXPECT_THAT(b->CheckInvariants(), IsOk());
}

TEST_F(PrefixCacheRemoteTest, AFullQueueDropsTheRemoteWriteNeverTheCapture) {
  // Room for less than one block's value: every capture's remote write is dropped.
  std::unique_ptr<PrefixCache> a = MakeRemoteCache(uint64_t{8} << 20, /*queue_bytes=*/1024);
  ASSERT_NE(a, nullptr);
  const std::vector<int32_t> tokens = Tokens(2 * kBlock);
  CaptureAndFlush(*a, FlatPlan(), tokens, 2);
  const PrefixCacheStats stats = a->Stats();
  EXPECT_EQ(stats.captures, 1u);
  EXPECT_EQ(stats.remote->writes, 0u);
  EXPECT_EQ(stats.remote->dropped_writes, 1u);
  EXPECT_EQ(a->Lookup(kScope, Shape(FlatPlan()), tokens).medium, StorageMedium::kDevice);
}

// Stalled masters: a lookup that matches short locally answers with the local match at its
// deadline; a restore by tokens restores the local match.
TEST_F(PrefixCacheRemoteTest, AStalledClusterCostsALookupItsDeadlineAndServesLocally) {
  PrefixCacheOptions options;
  options.budget_bytes = uint64_t{16} << 20;
  options.block_tokens = kBlock;
  options.slab_bytes = kSlabBytes;
  RemoteTierOptions remote;
  remote.cluster = ClusterOptions();
  options.remote = remote;
  options.remote_lookup_timeout = absl::Milliseconds(50);
  absl::StatusOr<std::unique_ptr<PrefixCache>> cache =
      PrefixCache::Create(options, backend_.get(), nullptr);
  ASSERT_THAT(cache.status(), IsOk());
  const std::vector<int32_t> tokens = Tokens(4 * kBlock);
  CaptureAndFlush(**cache, FlatPlan(), tokens, 2);
  absl::StatusOr<std::vector<int>> masters = cluster_->MasterPorts();
  ASSERT_THAT(masters, IsOk());
  for (const int master : *masters) cluster_->Signal(master, SIGSTOP);
  const absl::Time start = absl::Now();
  const PrefixLookupResult found = (*cache)->Lookup(kScope, Shape(FlatPlan()), tokens);
  const absl::Duration took = absl::Now() - start;
  auto dest = NewSession(FlatPlan(), 256);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(**cache, *dest, std::nullopt, tokens);
  for (const int master : *masters) cluster_->Signal(master, SIGCONT);
  EXPECT_EQ(found.outcome, LookupOutcome::kPartial);
  EXPECT_EQ(found.matched_tokens, 2 * kBlock);
  EXPECT_EQ(found.medium, StorageMedium::kDevice);
  EXPECT_LT(took, absl::Milliseconds(400));
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 2 * kBlock);
  EXPECT_GE((*cache)->Stats().remote->read_timeouts, 1u);
}

// Holds the remote tier's writer before it reads a queued value until Release() (at most
// testing::kPatience, so a failed test still ends).
class WriterGate {
 public:
  std::function<void()> Seam() {
    return [this] {
      waiting_.fetch_add(1);
      released_.WaitForNotificationWithTimeout(testing::kPatience);
    };
  }
  // Whether the writer has stopped at the gate (its first queued value unread).
  bool WriterWaits() {
    return testing::PollUntil([&] { return waiting_.load() > 0; });
  }
  void Release() {
    if (!released_.HasBeenNotified()) released_.Notify();
  }

 private:
  std::atomic<int> waiting_{0};
  absl::Notification released_;
};

// The queue holds references, not copies: an entry evicted while its writes wait is still
// written from the bytes the capture sealed (their spans freed only once read, never reused
// meanwhile by the next capture), and its device memory returns after.
TEST_F(PrefixCacheRemoteTest, AnEntryEvictedWhileItsWritesAreQueuedIsWrittenFromItsSealedBytes) {
  WriterGate gate;
  std::unique_ptr<PrefixCache> a =
      MakeRemoteCache(uint64_t{8} << 20, uint64_t{64} << 20, 0, gate.Seam());
  std::unique_ptr<PrefixCache> b = MakeRemoteCache();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> evicted_tokens = Tokens(4 * kBlock, 21);
  auto evicted_source = RandomSource(evicted_tokens, 31);
  absl::StatusOr<PrefixCaptureResult> evicted =
      CaptureSessionPrefix(*a, *evicted_source, evicted_tokens, 4 * kBlock);
  ASSERT_THAT(evicted.status(), IsOk());
  ASSERT_TRUE(gate.WriterWaits());
  const uint64_t used_with_entry = a->Stats().slabs.used_bytes;
  ASSERT_THAT(a->EvictEntry(evicted->entry), IsOk());
  EXPECT_EQ(a->Stats().entries, 0u);
  // The index let go; the spans wait for the writer (counted by the invariants).
  EXPECT_EQ(a->Stats().slabs.used_bytes, used_with_entry);
  EXPECT_THAT(a->CheckInvariants(), IsOk());
  // The next capture cannot land in those spans.
  const std::vector<int32_t> next_tokens = Tokens(4 * kBlock, 22);
  auto next_source = RandomSource(next_tokens, 32);
  ASSERT_THAT(CaptureSessionPrefix(*a, *next_source, next_tokens, 4 * kBlock).status(), IsOk());
  EXPECT_EQ(a->Stats().slabs.used_bytes, 2 * used_with_entry);
  gate.Release();
  ASSERT_TRUE(a->remote_tier()->Flush(absl::Seconds(30)));
  const PrefixCacheStats stats = a->Stats();
  EXPECT_EQ(stats.remote->writes, 8u);
  EXPECT_EQ(stats.remote->write_errors, 0u);
  EXPECT_EQ(stats.remote->dropped_writes, 0u);
  EXPECT_EQ(stats.slabs.used_bytes, used_with_entry);  // the evicted spans are free now
  EXPECT_THAT(a->CheckInvariants(), IsOk());
  // B restores both from the cluster, each bit-exactly its own.
  for (const auto& [tokens, source] :
       {std::pair{&evicted_tokens, evicted_source.get()}, std::pair{&next_tokens, next_source.get()}}) {
    auto dest = NewSession(FlatPlan(), 256);
    absl::StatusOr<PrefixRestoreResult> restored =
        RestoreSessionPrefix(*b, *dest, std::nullopt, *tokens);
    ASSERT_THAT(restored.status(), IsOk());
    EXPECT_EQ(restored->restored_tokens, 4 * kBlock);
    EXPECT_EQ(KvRows(*dest, 4 * kBlock), KvRows(*source, 4 * kBlock));
  }
  EXPECT_THAT(b->CheckInvariants(), IsOk());
}

// Pieces demoted to disk while their writes wait: the demotion goes ahead (the index counts
// them on disk at once), the writer reads the device bytes the demotion left to it, then they
// are freed; both the local disk copy and the remote one restore bit-exactly.
TEST_F(PrefixCacheRemoteTest, PiecesDemotedWhileTheirWritesAreQueuedAreWrittenAndStayOnDisk) {
  WriterGate gate;
  // Room for 4 blocks on the device: a second 3-block capture demotes 2 of the first's.
  std::unique_ptr<PrefixCache> a = MakeRemoteCache(uint64_t{8} << 20, uint64_t{64} << 20,
                                                   /*disk_bytes=*/8 << 20, gate.Seam(),
                                                   /*device_bytes=*/4 * kFlatSpanBytes);
  std::unique_ptr<PrefixCache> b = MakeRemoteCache();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<int32_t> old_tokens = Tokens(3 * kBlock, 23);
  auto old_source = RandomSource(old_tokens, 33);
  absl::StatusOr<PrefixCaptureResult> old_entry =
      CaptureSessionPrefix(*a, *old_source, old_tokens, 3 * kBlock);
  ASSERT_THAT(old_entry.status(), IsOk());
  ASSERT_TRUE(gate.WriterWaits());
  const std::vector<int32_t> new_tokens = Tokens(3 * kBlock, 24);
  auto new_source = RandomSource(new_tokens, 34);
  ASSERT_THAT(CaptureSessionPrefix(*a, *new_source, new_tokens, 3 * kBlock).status(), IsOk());
  absl::StatusOr<EntryView> view = ViewOf(a->Inspect(old_entry->entry));
  ASSERT_THAT(view.status(), IsOk());
  EXPECT_EQ(PieceMedium(*a, view->blocks[0].stored.storage_handle), StorageMedium::kDisk);
  EXPECT_EQ(PieceMedium(*a, view->blocks[1].stored.storage_handle), StorageMedium::kDisk);
  PrefixCacheStats stats = a->Stats();
  EXPECT_EQ(stats.tiers[0].stored_bytes, 4 * kFlatSpanBytes);
  EXPECT_EQ(stats.tiers[1].demotions, 2u);
  // The demoted pieces' device spans still wait for the writer.
  EXPECT_EQ(stats.slabs.used_bytes, 6 * kFlatSpanBytes);
  EXPECT_THAT(a->CheckInvariants(), IsOk());
  gate.Release();
  ASSERT_TRUE(a->remote_tier()->Flush(absl::Seconds(30)));
  stats = a->Stats();
  EXPECT_EQ(stats.remote->writes, 6u);
  EXPECT_EQ(stats.slabs.used_bytes, 4 * kFlatSpanBytes);
  EXPECT_THAT(a->CheckInvariants(), IsOk());
  auto local = NewSession(FlatPlan(), 256);
  ASSERT_THAT(RestoreSessionPrefix(*a, *local, old_entry->entry, old_tokens).status(), IsOk());
  EXPECT_EQ(KvRows(*local, 3 * kBlock), KvRows(*old_source, 3 * kBlock));
  auto remote = NewSession(FlatPlan(), 256);
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*b, *remote, std::nullopt, old_tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 3 * kBlock);
  EXPECT_EQ(KvRows(*remote, 3 * kBlock), KvRows(*old_source, 3 * kBlock));
}

// A cache destroyed with writes still queued (of an evicted entry): the tier drops them as it
// stops, and each releases its span into slabs that still exist (run under --config=asan).
TEST_F(PrefixCacheRemoteTest, ACacheDestroyedWithWritesQueuedReleasesThem) {
  WriterGate gate;
  std::unique_ptr<PrefixCache> a =
      MakeRemoteCache(uint64_t{8} << 20, uint64_t{64} << 20, 0, gate.Seam());
  ASSERT_NE(a, nullptr);
  const std::vector<int32_t> tokens = Tokens(2 * kBlock, 24);
  auto source = NewSession(FlatPlan(), 256);
  Append(*source, tokens, 2 * kBlock);
  absl::StatusOr<PrefixCaptureResult> captured =
      CaptureSessionPrefix(*a, *source, tokens, 2 * kBlock);
  ASSERT_THAT(captured.status(), IsOk());
  ASSERT_TRUE(gate.WriterWaits());
  ASSERT_THAT(a->EvictEntry(captured->entry), IsOk());
  EXPECT_GT(a->Stats().slabs.used_bytes, 0u);
  gate.Release();
  a.reset();
}

}  // namespace
}  // namespace memra
