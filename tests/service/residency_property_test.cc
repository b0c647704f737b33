// The residency invariant of every plane kind (docs/rules.md, "Indexer residency"), checked as an
// engine sees it: random operation sequences against an in-process memra-kvd over its real
// socket, on flat, SWA-ring, MLA (with and without a DSA indexer) and hybrid plans. The test
// plays the engine: it writes a distinct tag into every row of every plane it appends, through
// the mapped arena, and keeps a logical record of the tag last written for each absolute row of
// the conversation. After every accepted operation, every row the session reports as live (from
// its state and length/base mirrors) must hold exactly that tag; after every refused operation,
// the session's state must be byte-for-byte what it was, and the live rows still intact.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/internal.h"
#include "client/prefix_client.h"
#include "core/index_ring.h"
#include "core/kv_ring.h"
#include "core/test_model_plans.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "tests/seeded_random.h"
#include "tests/service/test_daemon.h"
#include "tests/service/test_plans.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr uint32_t kBlockTokens = 4;
constexpr int kOpsPerSequence = 160;
constexpr uint64_t kSeeds[] = {0x9e3779b97f4a7c15u, 0xd1b54a32d192ed03u, 0x2545f4914f6cdd1du};

struct PlanCase {
  std::string name;
  ModelPlan plan;
  uint64_t capacity = 0;
  uint64_t small_append = 0;  // most appends are 1..small_append rows
  uint64_t large_append = 0;  // a few "prefill chunks" of up to this many rows
  uint64_t prefill = 0;       // rows committed when a sequence starts (SWA rings near a wrap)
};

std::vector<PlanCase> PlanCases() {
  using test_plans::KvLayer;
  using test_plans::LatentLayer;
  using test_plans::SlidingLayer;
  std::vector<PlanCase> cases;
  {
    ModelPlan plan = test_plans::DenseModel(2, 32, 2);
    plan.name = "residency-flat";
    cases.push_back({"flat", plan, 256, 12, 64});
  }
  {
    // SWA rings wrap only past window + one prime chunk + slack (4672 rows for window 32).
    ModelPlan plan;
    plan.name = "residency-swa";
    plan.swa_ring = true;
    plan.layers = {SlidingLayer(0, 32, 2, kSlidingWindow), KvLayer(1, 32, 2)};
    cases.push_back({"swa-ring", plan, 9000, 12, 1500, 4650});
  }
  {
    ModelPlan plan;
    plan.name = "residency-mla";
    plan.layers = {LatentLayer(0, 8), LatentLayer(1, 8)};
    cases.push_back({"mla", plan, 256, 12, 64});
  }
  {
    // The indexer: index_width 2, pool 3, a 6-row tail ring (two pools).
    ModelPlan plan;
    plan.name = "residency-dsa";
    plan.index_ring_rows = 6;
    plan.layers = {LatentLayer(0, 8, /*index_width=*/2, /*index_pool=*/3)};
    cases.push_back({"mla-indexer", plan, 256, 5, 20});
  }
  cases.push_back({"hybrid", HybridTestPlan(), 9000, 12, 1500, 4650});
  return cases;
}

// A plane of the conversation, as a map key.
using PlaneKey = std::pair<uint32_t, PlaneKind>;

// What the engine wrote into one conversation: the tag last written for each absolute row of
// each row-addressed plane (0 = never written), the recurrent state's tag per layer, and the
// token id of every row (derived from its tag, so rewritten rows get new tokens).
struct Conversation {
  std::map<PlaneKey, std::vector<uint64_t>> rows;
  std::map<uint32_t, uint64_t> recurrent;
  std::vector<int32_t> tokens;

  void SetRow(PlaneKey plane, uint64_t row, uint64_t tag) {
    std::vector<uint64_t>& tags = rows[plane];
    if (tags.size() <= row) tags.resize(row + 1, 0);
    tags[row] = tag;
  }
  uint64_t Row(PlaneKey plane, uint64_t row) const {
    auto it = rows.find(plane);
    return it == rows.end() || it->second.size() <= row ? 0 : it->second[row];
  }
  void SetToken(uint64_t row, uint64_t tag) {
    if (tokens.size() <= row) tokens.resize(row + 1, 0);
    tokens[row] = static_cast<int32_t>(tag & 0x7fffffff);
  }
};

// A prefix entry the test captured, with the conversation as it stood.
struct Captured {
  uint64_t boundary = 0;
  Conversation conversation;
};

std::string KindName(PlaneKind kind) { return std::string(PlaneKindName(kind)); }

// The repeated little-endian bytes of `tag`, `bytes` long.
void FillTag(uint8_t* at, uint64_t bytes, uint64_t tag) {
  for (uint64_t i = 0; i < bytes; ++i) at[i] = static_cast<uint8_t>(tag >> (8 * (i % 8)));
}
bool HoldsTag(const uint8_t* at, uint64_t bytes, uint64_t tag) {
  for (uint64_t i = 0; i < bytes; ++i) {
    if (at[i] != static_cast<uint8_t>(tag >> (8 * (i % 8)))) return false;
  }
  return true;
}

class ResidencyPropertyTest : public DaemonTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    config.prefix_cache_budget_bytes = uint64_t{16} << 20;
    config.prefix_block_tokens = kBlockTokens;
  }
};

// One sequence on one plan: the engine, its session and the record of what it wrote.
class Sequence {
 public:
  Sequence(KvClient& client, const PlanCase& plan_case, PlanFingerprint plan, uint64_t seed)
      : client_(client), case_(plan_case), plan_(plan), random_(seed) {
    for (const LayerPlan& layer : case_.plan.layers) {
      if (layer.kind == StateKind::kKv || layer.kind == StateKind::kSlidingKv) {
        kv_layers_.push_back(layer);
      } else if (layer.kind == StateKind::kLatent) {
        latent_layers_.push_back(layer);
      } else if (layer.kind == StateKind::kRecurrent) {
        recurrent_layers_.push_back(layer.index);
      }
    }
  }

  // Runs the sequence; false after the first violation (reported with the operations so far).
  bool Run() {
    capacity_ = case_.capacity;
    session_ = NewSession(capacity_);
    if (session_ == nullptr) return false;
    while (ok_ && State().committed_len < case_.prefill) {
      const SessionSnapshot before = State();
      Append(before, case_.large_append);
      CommitOrAbort(State(), /*abort=*/false, /*all=*/true);
    }
    for (int op = 0; op < kOpsPerSequence && ok_; ++op) Step();
    if (session_ != nullptr) {
      if (absl::StatusOr<uint64_t> freed = session_->Release(); !freed.ok()) {
        Fail(absl::StrCat("release: ", freed.status().ToString()));
      }
    }
    return ok_;
  }

  int accepted() const { return accepted_; }
  int refused() const { return refused_; }
  // Accepted and refused counts per operation kind, and the events worth knowing were reached.
  const std::map<std::string, std::pair<int, int>>& outcomes() const { return outcomes_; }
  int ring_rebases() const { return ring_rebases_; }
  int residency_refusals() const { return residency_refusals_; }
  int lap_refusals() const { return lap_refusals_; }

 private:
  std::unique_ptr<Session> NewSession(uint64_t capacity) {
    SessionOptions options;
    options.capacity = capacity;
    options.spec_snapshot = true;
    absl::StatusOr<std::unique_ptr<Session>> session = client_.CreateSession(plan_, options);
    if (!session.ok()) {
      Fail(absl::StrCat("create session: ", session.status().ToString()));
      return nullptr;
    }
    return *std::move(session);
  }

  void Fail(const std::string& what) {
    if (!ok_) return;
    ok_ = false;
    const size_t shown = std::min<size_t>(history_.size(), 40);
    ADD_FAILURE() << case_.name << ": " << what << "\nlast " << shown << " of "
                  << history_.size() << " operations: "
                  << absl::StrJoin(history_.end() - shown, history_.end(), "; ");
  }

  uint64_t NextTag() { return ++last_tag_; }

  SessionSnapshot State() {
    absl::StatusOr<SessionSnapshot> state = session_->State();
    if (!state.ok()) Fail(absl::StrCat("state: ", state.status().ToString()));
    return state.ok() ? *state : SessionSnapshot();
  }

  const LayerSnapshot* LayerOf(const SessionSnapshot& state, uint32_t layer) {
    for (const LayerSnapshot& entry : state.layers) {
      if (entry.layer == layer) return &entry;
    }
    Fail(absl::StrCat("state has no layer ", layer));
    return nullptr;
  }

  std::optional<PlaneView> Plane(uint32_t layer, PlaneKind kind) {
    absl::StatusOr<PlaneView> view = session_->Plane(layer, kind);
    if (!view.ok()) {
      Fail(absl::StrCat("plane ", layer, "/", KindName(kind), ": ",
                        view.status().ToString()));
      return std::nullopt;
    }
    return *view;
  }

  int32_t Mirror(uint32_t layer, PlaneKind kind) {
    std::optional<PlaneView> view = Plane(layer, kind);
    int32_t value = -1;
    if (view.has_value()) std::memcpy(&value, view->data, sizeof(value));
    return value;
  }

  // Physical row of absolute indexer row `row` (the ring's rows when the plane is a ring).
  std::optional<uint64_t> IndexRow(const PlaneView& view, uint32_t pool, uint64_t row) {
    const uint64_t ring = view.rows < capacity_ ? view.rows : 0;
    absl::StatusOr<uint64_t> physical = IndexPlanePhysicalRow(ring, pool, row);
    if (!physical.ok() || *physical >= view.rows) {
      Fail(absl::StrCat("indexer row ", row, " has no physical row in ", view.rows));
      return std::nullopt;
    }
    return *physical;
  }

  void WriteRow(const PlaneView& view, uint64_t physical, PlaneKey plane, uint64_t row,
                uint64_t tag) {
    if (physical >= view.rows) {
      Fail(absl::StrCat("row ", row, " maps to physical row ", physical, " of ", view.rows));
      return;
    }
    FillTag(view.data + physical * view.row_bytes, view.row_bytes, tag);
    conversation_.SetRow(plane, row, tag);
  }

  bool CheckRow(const PlaneView& view, uint64_t physical, PlaneKey plane, uint64_t row,
                const std::string& what) {
    const uint64_t want = conversation_.Row(plane, row);
    if (want == 0) {
      Fail(absl::StrCat(what, ": live row ", row, " of layer ", plane.first, " ",
                        KindName(plane.second), " was never written in this conversation"));
      return false;
    }
    if (physical >= view.rows ||
        !HoldsTag(view.data + physical * view.row_bytes, view.row_bytes, want)) {
      uint64_t held = 0;
      if (physical < view.rows) {
        std::memcpy(&held, view.data + physical * view.row_bytes,
                    std::min<uint64_t>(sizeof(held), view.row_bytes));
      }
      Fail(absl::StrCat(what, ": live row ", row, " of layer ", plane.first, " ",
                        KindName(plane.second), " (physical ", physical, ") holds tag ",
                        held, ", last written ", want));
      return false;
    }
    return true;
  }

  // Every row the session reports as live holds the tag last written for it. While an append is
  // prepared and not yet published, the engine owns what it may write besides its new rows (the
  // indexer tail it drains into a pool key, ring rows a rebase moves): those are checked again
  // by the operation that ends the append (publish, commit, abort, rewind, rollback).
  void CheckLive(const std::string& what) {
    const SessionSnapshot state = State();
    if (!ok_) return;
    const uint64_t len = state.staged_len;
    for (const LayerPlan& layer : kv_layers_) {
      const LayerSnapshot* entry = LayerOf(state, layer.index);
      if (entry == nullptr) return;
      if (Mirror(layer.index, PlaneKind::kLenMirror) != static_cast<int32_t>(len) ||
          static_cast<uint64_t>(entry->length) != len) {
        return Fail(absl::StrCat(what, ": layer ", layer.index, " length mirror ",
                                 Mirror(layer.index, PlaneKind::kLenMirror), ", state ",
                                 entry->length, ", staged ", len));
      }
      uint64_t start = 0;
      uint64_t base = 0;
      if (entry->ring) {
        if (prepared_) continue;
        base = entry->ring_base;
        if (Mirror(layer.index, PlaneKind::kBaseMirror) != static_cast<int32_t>(base)) {
          return Fail(absl::StrCat(what, ": layer ", layer.index, " base mirror ",
                                   Mirror(layer.index, PlaneKind::kBaseMirror), ", state ", base));
        }
        start = AlignedWindowStart(len, layer.window);
        if (start < base) {
          return Fail(absl::StrCat(what, ": layer ", layer.index, " live window starts at ",
                                   start, " below the ring base ", base));
        }
      }
      for (PlaneKind kind : {PlaneKind::kKeys, PlaneKind::kValues}) {
        std::optional<PlaneView> view = Plane(layer.index, kind);
        if (!view.has_value()) return;
        for (uint64_t row = start; row < len; ++row) {
          if (!CheckRow(*view, row - base, {layer.index, kind}, row, what)) return;
        }
      }
    }
    for (const LayerPlan& layer : latent_layers_) {
      const LayerSnapshot* entry = LayerOf(state, layer.index);
      if (entry == nullptr) return;
      if (static_cast<uint64_t>(entry->length) != len ||
          Mirror(layer.index, PlaneKind::kLenMirror) != static_cast<int32_t>(len)) {
        return Fail(absl::StrCat(what, ": latent layer ", layer.index, " length ", entry->length,
                                 " / mirror ", Mirror(layer.index, PlaneKind::kLenMirror),
                                 ", staged ", len));
      }
      std::optional<PlaneView> rows = Plane(layer.index, PlaneKind::kLatentRows);
      if (!rows.has_value()) return;
      for (uint64_t row = 0; row < len; ++row) {
        if (!CheckRow(*rows, row, {layer.index, PlaneKind::kLatentRows}, row, what)) return;
      }
      if (layer.index_width == 0) continue;
      const uint64_t ready = entry->index_pools_ready;
      if (ready > len / layer.index_pool) {
        return Fail(absl::StrCat(what, ": layer ", layer.index, " claims ", ready,
                                 " ready pools at length ", len));
      }
      std::optional<PlaneView> keys = Plane(layer.index, PlaneKind::kPoolKeys);
      std::optional<PlaneView> index = Plane(layer.index, PlaneKind::kIndexRows);
      if (!keys.has_value() || !index.has_value()) return;
      for (uint64_t pool = 0; pool < ready; ++pool) {
        if (!CheckRow(*keys, pool, {layer.index, PlaneKind::kPoolKeys}, pool, what)) return;
      }
      for (uint64_t row = ready * layer.index_pool; row < len && !prepared_; ++row) {
        std::optional<uint64_t> physical = IndexRow(*index, layer.index_pool, row);
        if (!physical.has_value() ||
            !CheckRow(*index, *physical, {layer.index, PlaneKind::kIndexRows}, row, what)) {
          return;
        }
      }
    }
    for (uint32_t layer : recurrent_layers_) {
      auto written = conversation_.recurrent.find(layer);
      if (written == conversation_.recurrent.end()) continue;
      for (PlaneKind kind : {PlaneKind::kConvState, PlaneKind::kSsmState}) {
        std::optional<PlaneView> view = Plane(layer, kind);
        if (!view.has_value()) return;
        if (!HoldsTag(view->data, view->bytes, written->second)) {
          return Fail(absl::StrCat(what, ": recurrent layer ", layer, " ",
                                   KindName(kind), " does not hold tag ", written->second));
        }
      }
    }
  }

  void WriteRecurrent() {
    for (uint32_t layer : recurrent_layers_) {
      const uint64_t tag = NextTag();
      for (PlaneKind kind : {PlaneKind::kConvState, PlaneKind::kSsmState}) {
        std::optional<PlaneView> view = Plane(layer, kind);
        if (!view.has_value()) return;
        FillTag(view->data, view->bytes, tag);
      }
      conversation_.recurrent[layer] = tag;
    }
  }

  // The engine's writes for rows [first, first + rows) after a prepared append: ring rebase
  // copies first, then every plane's rows, the indexer drained pool by pool.
  void WriteAppend(const PreparedAppend& append, uint64_t first, uint64_t rows) {
    std::vector<uint64_t> tags;
    for (uint64_t i = 0; i < rows; ++i) {
      tags.push_back(NextTag());
      conversation_.SetToken(first + i, tags.back());
    }
    for (const LayerAppend& layer : append.layers) {
      for (PlaneKind kind : {PlaneKind::kKeys, PlaneKind::kValues}) {
        std::optional<PlaneView> view = Plane(layer.layer, kind);
        if (!view.has_value()) return;
        if (layer.ring_append.has_value() &&
            layer.ring_append->kind == RingAppend::Kind::kRebase) {
          if (kind == PlaneKind::kKeys) ++ring_rebases_;
          std::memmove(view->data, view->data + layer.ring_append->src_row * view->row_bytes,
                       layer.ring_append->keep_rows * view->row_bytes);
        }
        for (uint64_t i = 0; i < rows; ++i) {
          WriteRow(*view, layer.write_row + i, {layer.layer, kind}, first + i, tags[i]);
        }
      }
    }
    for (const LayerPlan& layer : latent_layers_) {
      std::optional<PlaneView> latent = Plane(layer.index, PlaneKind::kLatentRows);
      if (!latent.has_value()) return;
      for (uint64_t i = 0; i < rows; ++i) {
        WriteRow(*latent, first + i, {layer.index, PlaneKind::kLatentRows}, first + i, tags[i]);
      }
      if (layer.index_width == 0) continue;
      std::optional<PlaneView> index = Plane(layer.index, PlaneKind::kIndexRows);
      std::optional<PlaneView> keys = Plane(layer.index, PlaneKind::kPoolKeys);
      if (!index.has_value() || !keys.has_value()) return;
      for (uint64_t i = 0; i < rows; ++i) {
        const uint64_t row = first + i;
        std::optional<uint64_t> physical = IndexRow(*index, layer.index_pool, row);
        if (!physical.has_value()) return;
        WriteRow(*index, *physical, {layer.index, PlaneKind::kIndexRows}, row, tags[i]);
        if ((row + 1) % layer.index_pool == 0) {  // the pool is complete: build its key
          const uint64_t pool = row / layer.index_pool;
          WriteRow(*keys, pool, {layer.index, PlaneKind::kPoolKeys}, pool, NextTag());
        }
      }
    }
    WriteRecurrent();
  }

  // Records the outcome of one operation and checks the invariant after it. A refusal must
  // leave the serialised state exactly as it was.
  void After(const std::string& what, const absl::Status& status, const SessionSnapshot& before) {
    history_.push_back(absl::StrCat(what, status.ok() ? "" : " (refused)"));
    const std::string kind = what.substr(0, what.find(' '));
    ++(status.ok() ? outcomes_[kind].first : outcomes_[kind].second);
    if (absl::StrContains(status.message(), "would make indexer rows")) ++residency_refusals_;
    if (absl::StrContains(status.message(), "would overwrite indexer rows")) ++lap_refusals_;
    if (status.ok()) {
      ++accepted_;
    } else {
      ++refused_;
      if (status.code() != absl::StatusCode::kFailedPrecondition &&
          status.code() != absl::StatusCode::kInvalidArgument &&
          status.code() != absl::StatusCode::kNotFound) {
        return Fail(absl::StrCat(what, ": unexpected refusal ", status.ToString()));
      }
      if (State() != before) {
        return Fail(absl::StrCat(what, " was refused (", status.ToString(),
                                 ") but changed the session's state"));
      }
    }
    CheckLive(what);
  }

  void Step() {
    const SessionSnapshot before = State();
    if (!ok_) return;
    const uint64_t choice = random_.Below(100);
    if (choice < 34) return Append(before);
    if (choice < 38) return AbandonLongPrepare();
    if (choice < 50) return CommitOrAbort(before, /*abort=*/false);
    if (choice < 58) return CommitOrAbort(before, /*abort=*/true);
    if (choice < 70) return RewindTo(before);
    if (choice < 75) return SpecSnapshot(before);
    if (choice < 82) return SpecRollback(before);
    if (choice < 86) return Grow(before);
    if (choice < 89) return Hydrate();
    if (choice < 95) return Capture(before);
    if (choice < 99) return Restore();
    return Reset(before);
  }

  // Appends 1..max_rows rows (random when 0), sometimes leaving them unpublished.
  void Append(const SessionSnapshot& before, uint64_t max_rows = 0) {
    if (!transaction_.has_value()) {
      absl::StatusOr<Transaction> begun = session_->Begin();
      After("begin", begun.status(), before);
      if (!begun.ok()) return;
      transaction_ = *begun;
    }
    const uint64_t max = random_.Below(10) == 0 ? case_.large_append : case_.small_append;
    const uint64_t rows = max_rows != 0 ? max_rows : 1 + random_.Below(max);
    const SessionSnapshot prepared_before = State();
    const uint64_t first = State().staged_len;
    absl::StatusOr<PreparedAppend> append = session_->PrepareAppend(transaction_->generation, rows);
    if (append.ok()) {
      WriteAppend(*append, first, rows);
      prepared_ = true;
    }
    After(absl::StrCat("prepare ", rows, " at ", first), append.status(), prepared_before);
    // Sometimes left unpublished.
    if (!append.ok() || (max_rows == 0 && random_.Below(8) == 0)) return;
    const SessionSnapshot published_before = State();
    const absl::Status published = session_->PublishAppend(transaction_->generation).status();
    if (published.ok()) prepared_ = false;
    After("publish", published, published_before);
  }

  // Ends the transaction: abort, commit everything staged (`all`), or commit a random part.
  void CommitOrAbort(const SessionSnapshot& before, bool abort, bool all = false) {
    if (!transaction_.has_value()) return;
    const SessionSnapshot state = State();
    const uint64_t base = transaction_->base_len;
    absl::Status status;
    std::string what;
    accepted_all_published_ = false;
    if (abort) {
      status = session_->Abort(transaction_->generation).status();
      what = absl::StrCat("abort to ", base);
    } else {
      const uint64_t staged = state.staged_len - base;
      const uint64_t accepted = all ? staged : random_.Below(staged + 1);
      accepted_all_published_ = accepted == staged;
      std::vector<int32_t> tokens(conversation_.tokens.begin() + base,
                                  conversation_.tokens.begin() + base + accepted);
      status = session_->Commit(transaction_->generation, accepted, tokens).status();
      what = absl::StrCat("commit ", accepted, " of ", state.staged_len - base, " at ", base);
    }
    // The way out (docs/rules.md, "Indexer residency"): an abort, or a commit of every published
    // row, is never refused; the prepare that would have made it impossible was refused instead.
    if (!status.ok() && (abort || accepted_all_published_)) {
      history_.push_back(absl::StrCat(what, " (refused)"));
      return Fail(absl::StrCat(what, " was refused (", status.ToString(),
                               "): an engine must always be able to end its transaction"));
    }
    if (status.ok()) EndTransaction();
    After(what, status, before);
  }

  // A prepare longer than the indexer ring (and, on SWA and flat plans, a long one), ended
  // without a publish by an abort, a 0-row commit or a rewind to the base: ending it is never
  // refused, and the session then takes a short append (issue 26: the resident start stayed
  // raised, so the next append was refused at publish).
  void AbandonLongPrepare() {
    if (transaction_.has_value()) {
      CommitOrAbort(State(), /*abort=*/true);
      if (!ok_ || transaction_.has_value()) return;
    }
    const SessionSnapshot before = State();
    absl::StatusOr<Transaction> begun = session_->Begin();
    After("begin", begun.status(), before);
    if (!begun.ok()) return;
    transaction_ = *begun;
    const uint64_t base = begun->base_len;
    const uint64_t rows = case_.large_append;
    const SessionSnapshot prepared_before = State();
    absl::StatusOr<PreparedAppend> append = session_->PrepareAppend(begun->generation, rows);
    if (append.ok()) {
      WriteAppend(*append, base, rows);
      prepared_ = true;
    }
    After(absl::StrCat("prepare ", rows, " at ", base, " to abandon"), append.status(),
          prepared_before);
    if (!ok_) return;
    const SessionSnapshot ending_before = State();
    absl::Status ended;
    std::string what;
    switch (random_.Below(3)) {
      case 0:
        ended = session_->Abort(begun->generation).status();
        what = absl::StrCat("abort to ", base, " (abandoned prepare)");
        break;
      case 1:
        ended = session_->Commit(begun->generation, 0, {}).status();
        what = absl::StrCat("commit 0 at ", base, " (abandoned prepare)");
        break;
      default:
        ended = session_->Rewind(base).status();
        what = absl::StrCat("rewind ", base, " -> ", base, " (abandoned prepare)");
        break;
    }
    if (!ended.ok()) {
      history_.push_back(absl::StrCat(what, " (refused)"));
      return Fail(absl::StrCat(what, " was refused: ", ended.ToString()));
    }
    EndTransaction();
    After(what, ended, ending_before);
    if (!ok_) return;
    // Short enough for any plan's room (an indexer ring leaves at least ring - pool + 1 rows).
    const uint64_t short_rows = 1 + random_.Below(2);
    if (State().staged_len + short_rows > capacity_) return;
    const SessionSnapshot short_before = State();
    absl::StatusOr<Transaction> next = session_->Begin();
    After("begin", next.status(), short_before);
    if (!next.ok()) return Fail(absl::StrCat("begin after an abandoned prepare: ",
                                             next.status().ToString()));
    transaction_ = *next;
    const SessionSnapshot short_prepared = State();
    absl::StatusOr<PreparedAppend> short_append =
        session_->PrepareAppend(next->generation, short_rows);
    if (short_append.ok()) {
      WriteAppend(*short_append, next->base_len, short_rows);
      prepared_ = true;
    }
    After(absl::StrCat("prepare ", short_rows, " at ", next->base_len, " after abandoning"),
          short_append.status(), short_prepared);
    if (!short_append.ok()) {
      return Fail(absl::StrCat("a ", short_rows, "-row prepare after an abandoned prepare was "
                               "refused: ", short_append.status().ToString()));
    }
    const SessionSnapshot published_before = State();
    const absl::Status published = session_->PublishAppend(next->generation).status();
    if (published.ok()) prepared_ = false;
    After("publish after abandoning", published, published_before);
    if (!published.ok()) {
      Fail(absl::StrCat("publishing ", short_rows, " rows after an abandoned prepare was "
                        "refused: ", published.ToString()));
    }
  }

  void RewindTo(const SessionSnapshot& before) {
    const uint64_t staged = State().staged_len;
    const uint64_t target = random_.Below(staged + 2);
    absl::StatusOr<bool> can = session_->CanRewind(target);
    if (!can.ok()) return Fail(absl::StrCat("can rewind ", target, ": ", can.status().ToString()));
    const uint64_t committed = State().committed_len;
    const absl::Status status = session_->Rewind(target).status();
    if (status.ok()) CommittedLengthMoved(committed, target);
    if (*can != status.ok()) {
      return Fail(absl::StrCat("CanRewind(", target, ") said ", *can, " but Rewind answered ",
                               status.ToString()));
    }
    if (status.ok()) EndTransaction();
    After(absl::StrCat("rewind ", staged, " -> ", target), status, before);
  }

  void SpecSnapshot(const SessionSnapshot& before) {
    const absl::Status status = session_->SpecSnapshot().status();
    if (status.ok()) {
      spec_recurrent_ = conversation_.recurrent;
      spec_committed_ = State().committed_len;
    }
    After("spec snapshot", status, before);
  }

  void SpecRollback(const SessionSnapshot& before) {
    const uint64_t staged = State().staged_len;
    const uint64_t accept = random_.Below(staged + 2 - std::min(staged, spec_committed_));
    const uint64_t committed = State().committed_len;
    const absl::Status status = session_->SpecRollback(accept).status();
    if (status.ok()) {
      CommittedLengthMoved(committed, State().committed_len);
      conversation_.recurrent = spec_recurrent_;  // the daemon copied the snapshot back
      EndTransaction();
    }
    After(absl::StrCat("spec rollback accepting ", accept), status, before);
  }

  void Grow(const SessionSnapshot& before) {
    if (capacity_ + 64 > case_.capacity * 2) return;
    const uint64_t target = capacity_ + 1 + random_.Below(64);
    const absl::Status status = session_->Grow(target).status();
    if (status.ok()) {
      capacity_ = target;
      spec_recurrent_.clear();
    }
    After(absl::StrCat("grow to ", target), status, before);
  }

  // Replaces the session by a fresh one the engine fills itself and hydrates.
  void Hydrate() {
    if (!ReplaceSession()) return;
    const uint64_t len = 1 + random_.Below(std::min<uint64_t>(capacity_ - 1, 3 * case_.small_append));
    for (uint64_t row = 0; row < len; ++row) conversation_.SetToken(row, NextTag());
    const SessionSnapshot fresh = State();
    for (const LayerPlan& layer : kv_layers_) {
      const LayerSnapshot* entry = LayerOf(fresh, layer.index);
      if (entry == nullptr) return;
      // Ring layers hold the aligned live window from physical row 0 (Hydrate's default).
      const uint64_t start = entry->ring ? AlignedWindowStart(len, layer.window) : 0;
      for (PlaneKind kind : {PlaneKind::kKeys, PlaneKind::kValues}) {
        std::optional<PlaneView> view = Plane(layer.index, kind);
        if (!view.has_value()) return;
        for (uint64_t row = start; row < len; ++row) {
          WriteRow(*view, row - start, {layer.index, kind}, row, NextTag());
        }
      }
    }
    for (const LayerPlan& layer : latent_layers_) {
      std::optional<PlaneView> latent = Plane(layer.index, PlaneKind::kLatentRows);
      if (!latent.has_value()) return;
      for (uint64_t row = 0; row < len; ++row) {
        WriteRow(*latent, row, {layer.index, PlaneKind::kLatentRows}, row, NextTag());
      }
      if (layer.index_width == 0) continue;
      // An engine hydrating from its own tier owes the final keys and the live tail only.
      std::optional<PlaneView> index = Plane(layer.index, PlaneKind::kIndexRows);
      std::optional<PlaneView> keys = Plane(layer.index, PlaneKind::kPoolKeys);
      if (!index.has_value() || !keys.has_value()) return;
      const uint64_t ready = len / layer.index_pool;
      for (uint64_t pool = 0; pool < ready; ++pool) {
        WriteRow(*keys, pool, {layer.index, PlaneKind::kPoolKeys}, pool, NextTag());
      }
      for (uint64_t row = ready * layer.index_pool; row < len; ++row) {
        std::optional<uint64_t> physical = IndexRow(*index, layer.index_pool, row);
        if (!physical.has_value()) return;
        WriteRow(*index, *physical, {layer.index, PlaneKind::kIndexRows}, row, NextTag());
      }
    }
    WriteRecurrent();
    const SessionSnapshot before = State();
    const absl::Status hydrated = session_->Hydrate(len).status();
    if (hydrated.ok()) tokens_committed_ = false;
    After(absl::StrCat("hydrate ", len), hydrated, before);
  }

  // Captures at the committed length, first ending any transaction (committing what is
  // published) and rewinding to a block boundary, as an engine preparing a capture would.
  void Capture(const SessionSnapshot& before) {
    if (!tokens_committed_ && !transaction_.has_value() && random_.Below(4) != 0) {
      // Most of the time the engine knows its ids are not committed (it hydrated, or a rewind
      // moved over uncommitted rows) and starts over, committing a block of rows with their ids;
      // otherwise it tries anyway and the refusal below is checked.
      Reset(before);
      if (!ok_) return;
      Append(State(), kBlockTokens * (1 + random_.Below(3)));
      if (!ok_ || !transaction_.has_value()) return;
      CommitOrAbort(State(), /*abort=*/false, /*all=*/true);
      if (!ok_ || transaction_.has_value()) return;
    }
    if (transaction_.has_value()) {
      if (prepared_) return;
      CommitOrAbort(before, /*abort=*/false, /*all=*/true);
      if (!ok_ || transaction_.has_value()) return;
    }
    const uint64_t committed = State().committed_len;
    if (committed % kBlockTokens != 0) {
      const SessionSnapshot unaligned = State();
      const uint64_t target = committed / kBlockTokens * kBlockTokens;
      const absl::Status status = session_->Rewind(target).status();
      After(absl::StrCat("rewind ", committed, " -> ", target), status, unaligned);
      if (!status.ok()) return;
    }
    const SessionSnapshot aligned = State();
    const SessionSnapshot state = State();
    const uint64_t boundary = state.committed_len;
    if (!ok_ || boundary == 0) return;
    absl::StatusOr<PrefixCaptured> captured = client_.prefixes().Capture(
        *session_, absl::MakeConstSpan(conversation_.tokens).subspan(0, boundary), boundary);
    // Rows hydrated, or published by a rewind or rollback, were never committed with their
    // token ids: nothing to key a capture by.
    const bool unknown_tokens =
        absl::StrContains(captured.status().message(), "commit with token ids to capture");
    if (unknown_tokens == tokens_committed_) {
      return Fail(absl::StrCat("capture with token ids ", tokens_committed_ ? "" : "not ",
                               "all committed: ", captured.status().ToString()));
    }
    // An entry already stored for these tokens keeps its first capture's bytes.
    if (captured.ok() && !captured->already_present) {
      captured_.push_back({boundary, conversation_});
    }
    After(absl::StrCat("capture ", boundary), captured.status(), aligned);
    // An engine that wants its prefix cached starts over, committing with token ids.
    if (unknown_tokens && ok_) Reset(State());
  }

  // Replaces the session by a fresh one restored from an entry this sequence captured.
  void Restore() {
    if (captured_.empty()) return;
    const Captured entry = captured_[random_.Below(captured_.size())];
    if (entry.boundary > case_.capacity || !ReplaceSession()) return;
    const SessionSnapshot before = State();
    absl::StatusOr<PrefixRestored> restored = client_.prefixes().Restore(
        *session_, absl::MakeConstSpan(entry.conversation.tokens).subspan(0, entry.boundary));
    const absl::Status status = restored.status();
    if (status.ok()) {
      if (restored->restored_tokens != entry.boundary) {
        return Fail(
            absl::StrCat("restore of ", entry.boundary, " restored ", restored->restored_tokens));
      }
      const uint64_t last_tag = last_tag_;
      conversation_ = entry.conversation;
      last_tag_ = last_tag;
    }
    After(absl::StrCat("restore ", entry.boundary), status, before);
  }

  void Reset(const SessionSnapshot& before) {
    const absl::Status status = session_->Reset().status();
    if (status.ok()) {
      conversation_ = Conversation();
      EndTransaction();
      spec_recurrent_.clear();
      tokens_committed_ = true;
    }
    After("reset", status, before);
  }

  // Rows a rewind or a rollback publishes above the committed length carried no token ids.
  void CommittedLengthMoved(uint64_t before, uint64_t after) {
    if (after > before) tokens_committed_ = false;
  }

  void EndTransaction() {
    transaction_.reset();
    prepared_ = false;
  }

  // Releases the session and creates a fresh one at the case's capacity.
  bool ReplaceSession() {
    if (absl::StatusOr<uint64_t> freed = session_->Release(); !freed.ok()) {
      Fail(absl::StrCat("release: ", freed.status().ToString()));
      return false;
    }
    capacity_ = case_.capacity;
    session_ = NewSession(capacity_);
    conversation_ = Conversation();
    EndTransaction();
    spec_recurrent_.clear();
    spec_committed_ = 0;
    tokens_committed_ = true;
    return session_ != nullptr;
  }

  KvClient& client_;
  const PlanCase& case_;
  const PlanFingerprint plan_;
  SeededRandom random_;
  std::vector<LayerPlan> kv_layers_;
  std::vector<LayerPlan> latent_layers_;
  std::vector<uint32_t> recurrent_layers_;

  std::unique_ptr<Session> session_;
  uint64_t capacity_ = 0;
  Conversation conversation_;
  std::optional<Transaction> transaction_;
  bool prepared_ = false;  // an append is prepared and not published
  // Every committed row's token id reached the daemon with its commit (false once hydrated or
  // once a rewind or rollback moved the committed length up).
  bool tokens_committed_ = true;
  std::map<uint32_t, uint64_t> spec_recurrent_;
  uint64_t spec_committed_ = 0;
  std::vector<Captured> captured_;
  uint64_t last_tag_ = 0;
  std::vector<std::string> history_;
  bool ok_ = true;
  int accepted_ = 0;
  int refused_ = 0;
  std::map<std::string, std::pair<int, int>> outcomes_;
  int ring_rebases_ = 0;
  int residency_refusals_ = 0;
  int lap_refusals_ = 0;
  // The commit being checked accepts every published row (a way out of the transaction).
  bool accepted_all_published_ = false;
};

TEST_F(ResidencyPropertyTest, EveryLiveRowHoldsWhatWasLastWrittenOnEveryPlanKind) {
  for (const PlanCase& plan_case : PlanCases()) {
    absl::StatusOr<PlanFingerprint> plan = client_->RegisterPlan(plan_case.plan);
    ASSERT_TRUE(plan.ok()) << plan_case.name << ": " << plan.status();
    std::map<std::string, std::pair<int, int>> outcomes;
    int ring_rebases = 0;
    int residency_refusals = 0;
    int lap_refusals = 0;
    for (uint64_t seed : kSeeds) {
      Sequence sequence(*client_, plan_case, *plan, seed);
      EXPECT_TRUE(sequence.Run()) << plan_case.name << " seed " << seed;
      for (const auto& [kind, counts] : sequence.outcomes()) {
        outcomes[kind].first += counts.first;
        outcomes[kind].second += counts.second;
      }
      ring_rebases += sequence.ring_rebases();
      residency_refusals += sequence.residency_refusals();
      lap_refusals += sequence.lap_refusals();
    }
    std::string summary;
    for (const auto& [kind, counts] : outcomes) {
      absl::StrAppend(&summary, " ", kind, " ", counts.first, "/", counts.second);
    }
    std::printf(
        "%s (accepted/refused):%s; ring rebases %d, residency refusals %d, lapping prepares "
        "refused %d\n",
        plan_case.name.c_str(), summary.c_str(), ring_rebases, residency_refusals, lap_refusals);
    // The sequences must reach what they claim to check: every operation accepted at least once,
    // the SWA rings wrapped, and the indexer's residency rule exercised.
    for (const char* kind : {"prepare", "publish", "commit", "abort", "rewind", "spec", "grow",
                             "hydrate", "capture", "restore"}) {
      EXPECT_GT(outcomes[kind].first, 0) << plan_case.name << ": no accepted " << kind;
    }
    if (plan_case.plan.swa_ring) {
      EXPECT_GT(ring_rebases, 0) << plan_case.name;
    }
    if (plan_case.name == "mla-indexer" || plan_case.name == "hybrid") {
      EXPECT_GT(residency_refusals, 0) << plan_case.name;
      EXPECT_GT(lap_refusals, 0) << plan_case.name;
    }
  }
  // The daemon's prefix storage is freed before the fixture counts arenas.
  // (Operator calls, on the admin socket: the raw stub.)
  std::unique_ptr<KvClient> operator_client = NewOperator();
  ASSERT_NE(operator_client, nullptr);
  pb::KvPrefixCache::Stub& prefix = ClientInternals::Prefix(*operator_client);
  pb::ListPrefixesResponse listed;
  ASSERT_TRUE(
      prefix.ListPrefixes(ClientInternals::NewContext(*operator_client).get(), {}, &listed).ok());
  for (const pb::PrefixEntry& entry : listed.entries()) {
    pb::EvictPrefixRequest evict;
    evict.set_entry_id(entry.entry_id());
    pb::EvictPrefixResponse evicted;
    EXPECT_TRUE(prefix.EvictPrefix(ClientInternals::NewContext(*operator_client).get(), evict,
                                   &evicted)
                    .ok());
  }
}

}  // namespace
}  // namespace memra::testing
