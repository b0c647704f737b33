#include "tests/e2e/engine_script.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "common/codec.h"
#include "tests/service/test_plans.h"

namespace memra::testing {
namespace {

// A speculative round's draft rows, and how many of them the verifier accepts.
constexpr uint64_t kSpecRows = 12;
constexpr uint64_t kSpecAccepted = 5;

// The pattern of `rows` rows of `row_bytes` from absolute row `first` on.
std::vector<uint8_t> PatternRows(uint32_t layer, PlaneKind kind, uint64_t first, uint64_t rows,
                                 uint64_t row_bytes) {
  std::vector<uint8_t> bytes(rows * row_bytes);
  for (uint64_t i = 0; i < rows; ++i) {
    for (uint64_t j = 0; j < row_bytes; ++j) {
      bytes[i * row_bytes + j] = PatternByte(layer, kind, first + i, j);
    }
  }
  return bytes;
}

// Checks physical rows [physical_first, + rows) against absolute rows [absolute_first, + rows),
// reading them in one go.
absl::Status CheckRows(PlaneMemory& memory, const PlaneView& plane, uint32_t layer,
                       PlaneKind kind, uint64_t physical_first, uint64_t absolute_first,
                       uint64_t rows) {
  if (physical_first > plane.rows || rows > plane.rows - physical_first) {
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " ",
                                              std::string(PlaneKindName(kind)), ": rows ",
                                              physical_first, "+", rows, " of ", plane.rows));
  }
  std::vector<uint8_t> held(rows * plane.row_bytes);
  RETURN_IF_ERROR(memory.Read(plane, physical_first * plane.row_bytes, absl::MakeSpan(held)));
  for (uint64_t i = 0; i < rows; ++i) {
    const uint64_t absolute_row = absolute_first + i;
    for (uint64_t j = 0; j < plane.row_bytes; ++j) {
      const uint8_t expected = PatternByte(layer, kind, absolute_row, j);
      if (held[i * plane.row_bytes + j] != expected) {
        return absl::DataLossError(absl::StrCat(
            "layer ", layer, " ", std::string(PlaneKindName(kind)), " absolute row ",
            absolute_row, " (physical ", physical_first + i, ") byte ", j, " holds ",
            held[i * plane.row_bytes + j], ", expected ", expected));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> ReadI32(const PlaneLookup& planes, PlaneMemory& memory, uint32_t layer,
                                PlaneKind kind) {
  ASSIGN_OR_RETURN(PlaneView view, planes(layer, kind));
  int32_t value;
  RETURN_IF_ERROR(memory.Read(
      view, 0, absl::MakeSpan(reinterpret_cast<uint8_t*>(&value), sizeof(value))));
  return value;
}

// Writes the appended rows [staged, staged + rows) of every K/V layer (after its ring rebase
// copy) and of the latent layer.
absl::Status WriteAppend(Session& session, PlaneMemory& memory, const PreparedAppend& append,
                         uint64_t staged, uint64_t rows) {
  for (const LayerAppend& layer : append.layers) {
    for (PlaneKind kind : {PlaneKind::kKeys, PlaneKind::kValues}) {
      ASSIGN_OR_RETURN(PlaneView plane, session.Plane(layer.layer, kind));
      if (layer.ring_append.has_value() && layer.ring_append->kind == RingAppend::Kind::kRebase) {
        RETURN_IF_ERROR(memory.Move(plane, 0, layer.ring_append->src_row * plane.row_bytes,
                                    layer.ring_append->keep_rows * plane.row_bytes));
      }
      RETURN_IF_ERROR(memory.Write(plane, layer.write_row * plane.row_bytes,
                                   PatternRows(layer.layer, kind, staged, rows, plane.row_bytes)));
    }
  }
  ASSIGN_OR_RETURN(PlaneView latent, session.Plane(kLatentLayer, PlaneKind::kLatentRows));
  return memory.Write(latent, staged * latent.row_bytes,
                      PatternRows(kLatentLayer, PlaneKind::kLatentRows, staged, rows,
                                  latent.row_bytes));
}

absl::Status FillRecurrent(Session& session, PlaneMemory& memory, uint8_t fill) {
  for (PlaneKind kind : {PlaneKind::kConvState, PlaneKind::kSsmState}) {
    ASSIGN_OR_RETURN(PlaneView plane, session.Plane(kRecurrentLayer, kind));
    RETURN_IF_ERROR(memory.Fill(plane, 0, fill, plane.bytes));
  }
  return absl::OkStatus();
}

// Every byte of the recurrent planes of `layer` holds `fill`.
absl::Status CheckRecurrent(const PlaneLookup& planes, PlaneMemory& memory, uint32_t layer,
                            uint8_t fill) {
  for (PlaneKind kind : {PlaneKind::kConvState, PlaneKind::kSsmState}) {
    ASSIGN_OR_RETURN(PlaneView plane, planes(layer, kind));
    std::vector<uint8_t> held(plane.bytes);
    RETURN_IF_ERROR(memory.Read(plane, 0, absl::MakeSpan(held)));
    for (uint64_t i = 0; i < plane.bytes; ++i) {
      if (held[i] != fill) {
        return absl::DataLossError(absl::StrCat("layer ", layer, " ",
                                                std::string(PlaneKindName(kind)), " byte ", i,
                                                " holds ", held[i], ", expected ", fill));
      }
    }
  }
  return absl::OkStatus();
}

// Ring layers of `append` that rebase first.
uint64_t RingRebases(const PreparedAppend& append) {
  uint64_t rebases = 0;
  for (const LayerAppend& layer : append.layers) {
    if (layer.ring_append.has_value() && layer.ring_append->kind == RingAppend::Kind::kRebase) {
      ++rebases;
    }
  }
  return rebases;
}

PlaneLookup SessionPlanes(const Session& session) {
  return [&session](uint32_t layer, PlaneKind kind) { return session.Plane(layer, kind); };
}

// A speculative round on a quiescent session whose recurrent planes hold `fill`: snapshot, a
// draft of kSpecRows that overwrites the recurrent state and commits, then a rollback keeping
// kSpecAccepted rows. Returns the committed length afterwards.
absl::StatusOr<uint64_t> RunSpecRound(Session& session, PlaneMemory& memory, uint8_t fill,
                                      uint64_t* rebases) {
  ASSIGN_OR_RETURN(SessionSnapshot snapshot, session.SpecSnapshot());
  const uint64_t base = snapshot.committed_len;
  ASSIGN_OR_RETURN(Transaction tx, session.Begin());
  ASSIGN_OR_RETURN(PreparedAppend append, session.PrepareAppend(tx.generation, kSpecRows));
  *rebases += RingRebases(append);
  RETURN_IF_ERROR(WriteAppend(session, memory, append, tx.base_len, kSpecRows));
  RETURN_IF_ERROR(FillRecurrent(session, memory, static_cast<uint8_t>(~fill)));
  RETURN_IF_ERROR(session.PublishAppend(tx.generation).status());
  RETURN_IF_ERROR(session.Commit(tx.generation, kSpecRows).status());
  ASSIGN_OR_RETURN(SessionSnapshot rolled, session.SpecRollback(kSpecAccepted));
  if (rolled.committed_len != base + kSpecAccepted) {
    return absl::InternalError(absl::StrCat("spec rollback to ", base, " + ", kSpecAccepted,
                                            " left ", rolled.committed_len, " committed"));
  }
  // The daemon's copies back from the snapshot buffers are complete: it replied.
  RETURN_IF_ERROR(CheckRecurrent(SessionPlanes(session), memory, kRecurrentLayer, fill));
  return rolled.committed_len;
}

// One transaction: `rows` rows appended (ring rebases counted into `rebases`), written,
// published, and `accepted` of them committed. Returns the committed length.
absl::StatusOr<uint64_t> AppendAndCommit(Session& session, PlaneMemory& memory, uint64_t rows,
                                         uint64_t accepted, uint64_t* rebases) {
  ASSIGN_OR_RETURN(Transaction tx, session.Begin());
  ASSIGN_OR_RETURN(PreparedAppend append, session.PrepareAppend(tx.generation, rows));
  *rebases += RingRebases(append);
  RETURN_IF_ERROR(WriteAppend(session, memory, append, tx.base_len, rows));
  RETURN_IF_ERROR(session.PublishAppend(tx.generation).status());
  return session.Commit(tx.generation, accepted);
}

}  // namespace

uint8_t PatternByte(uint32_t layer, PlaneKind kind, uint64_t absolute_row, uint64_t byte) {
  return static_cast<uint8_t>(absolute_row * 31 + layer * 7 + static_cast<uint64_t>(kind) * 3 +
                              byte * 5 + (absolute_row >> 8));
}

absl::StatusOr<ScriptResult> RunScript(Session& session, PlaneMemory& memory,
                                       const ScriptOptions& options) {
  ScriptResult result;
  for (uint64_t step = 0;; ++step) {
    // A chunk longer than the indexer's 16-row tail ring starts at a pool boundary: from inside a
    // pool it would lap the tail an abort needs, and the daemon refuses it (docs/rules.md,
    // "Indexer residency"). So the engine first fills the pool in a short transaction of its own.
    if (const uint64_t into_pool = result.committed % kIndexPool; into_pool != 0) {
      const uint64_t fill = kIndexPool - into_pool;
      if (result.committed + fill > kE2eCapacity) break;
      ASSIGN_OR_RETURN(result.committed,
                       AppendAndCommit(session, memory, fill, fill, &result.rebases));
    }
    const uint64_t rows = 240 + (step % 4) * 10;
    if (result.committed + rows > kE2eCapacity) break;
    // Every third step the verifier rejects the last 7 draft rows.
    const uint64_t accepted = step % 3 == 0 ? rows - 7 : rows;
    ASSIGN_OR_RETURN(result.committed,
                     AppendAndCommit(session, memory, rows, accepted, &result.rebases));
    result.recurrent_fill = static_cast<uint8_t>(step * 13 + 1);
    RETURN_IF_ERROR(FillRecurrent(session, memory, result.recurrent_fill));
    if (step % 5 == 4) {
      // The indexer's 16-row tail ring holds only the last rows of this 240-row append, so 20
      // rows back is reachable only at a pool boundary (docs/rules.md, "Indexer residency"):
      // the daemon must refuse the unaligned target and accept the boundary below it.
      const uint64_t deep = result.committed - 20;
      const uint64_t target = deep / kIndexPool * kIndexPool;
      if (deep != target) {
        ASSIGN_OR_RETURN(bool lapped, session.CanRewind(deep));
        if (lapped) {
          return absl::InternalError(absl::StrCat(
              "rewind to ", deep, " would read lapped indexer rows, but CanRewind allowed it"));
        }
      }
      ASSIGN_OR_RETURN(bool can, session.CanRewind(target));
      if (!can) return absl::InternalError(absl::StrCat("cannot rewind to ", target));
      ASSIGN_OR_RETURN(SessionSnapshot rewound, session.Rewind(target));
      result.committed = rewound.committed_len;
      ++result.rewinds;
    }
    if (options.spec_rounds && step % 4 == 2 && result.committed + kSpecRows <= kE2eCapacity) {
      ASSIGN_OR_RETURN(result.committed,
                       RunSpecRound(session, memory, result.recurrent_fill, &result.rebases));
      ++result.spec_rollbacks;
    }
  }
  return result;
}

absl::Status RunIdleRound(KvClient& client, Session& session, PlaneMemory& memory,
                          uint64_t round) {
  const uint64_t rows = 1 + round % 3;
  StepBatch batch(StepAddressing::kSlot);
  // The daemon writes mirrors when the second step publishes: it waits for the engine's event.
  if (!session.wait_event().empty()) batch.SetWaitEvent(session.wait_event());
  batch.Advance(session, /*generation=*/0, 0, rows);  // begin and prepare
  std::vector<StepOutcome> outcomes;
  RETURN_IF_ERROR(client.Step(batch, outcomes));
  RETURN_IF_ERROR(outcomes[0].status);
  const Transaction tx = outcomes[0].begun;
  if (!outcomes[0].prepared.has_value()) {
    return absl::InternalError("an Advance with next rows prepared no append");
  }
  RETURN_IF_ERROR(WriteAppend(session, memory, *outcomes[0].prepared, tx.base_len, rows));
  batch.Clear();
  if (!session.wait_event().empty()) batch.SetWaitEvent(session.wait_event());
  batch.Advance(session, tx.generation, rows, /*next_rows=*/0);  // publish and commit
  RETURN_IF_ERROR(client.Step(batch, outcomes));
  RETURN_IF_ERROR(outcomes[0].status);
  if (outcomes[0].committed_len != tx.base_len + rows) {
    return absl::InternalError(absl::StrCat("committed ", outcomes[0].committed_len, " after ",
                                            rows, " rows on ", tx.base_len));
  }
  return session.Rewind(tx.base_len).status();
}

absl::Status VerifySession(const SessionLayout& layout, const SessionSnapshot& state,
                           const PlaneLookup& planes, PlaneMemory& memory, uint8_t recurrent_fill) {
  const uint64_t committed = state.committed_len;
  if (state.staged_len != committed || state.active_generation != 0) {
    return absl::FailedPreconditionError(absl::StrCat("session not quiescent: staged ",
                                                      state.staged_len, ", committed ", committed));
  }
  for (const LayerSnapshot& layer : state.layers) {
    ASSIGN_OR_RETURN(int32_t len, ReadI32(planes, memory, layer.layer, PlaneKind::kLenMirror));
    if (static_cast<uint64_t>(len) != committed || layer.length != len) {
      return absl::DataLossError(absl::StrCat("layer ", layer.layer, ": length mirror ", len,
                                              ", daemon says ", layer.length, ", committed ",
                                              committed));
    }
    if (layer.ring) {
      ASSIGN_OR_RETURN(int32_t base, ReadI32(planes, memory, layer.layer, PlaneKind::kBaseMirror));
      if (static_cast<uint64_t>(base) != layer.ring_base) {
        return absl::DataLossError(absl::StrCat("layer ", layer.layer, ": base mirror ", base,
                                                ", daemon says ", layer.ring_base));
      }
    }
  }
  for (const SessionLayer& layer : layout.layers) {
    if (layer.kind == StateKind::kKv || layer.kind == StateKind::kSlidingKv) {
      uint64_t base = 0;
      uint64_t first = 0;
      if (layer.ring) {
        for (const LayerSnapshot& s : state.layers) {
          if (s.layer == layer.layer) base = s.ring_base;
        }
        // The resident window: everything from the base on (the ring keeps window + slack).
        first = base;
      }
      for (PlaneKind kind : {PlaneKind::kKeys, PlaneKind::kValues}) {
        ASSIGN_OR_RETURN(PlaneView plane, planes(layer.layer, kind));
        RETURN_IF_ERROR(
            CheckRows(memory, plane, layer.layer, kind, first - base, first, committed - first));
      }
    } else if (layer.kind == StateKind::kLatent) {
      ASSIGN_OR_RETURN(PlaneView plane, planes(layer.layer, PlaneKind::kLatentRows));
      RETURN_IF_ERROR(
          CheckRows(memory, plane, layer.layer, PlaneKind::kLatentRows, 0, 0, committed));
    } else if (layer.kind == StateKind::kRecurrent) {
      RETURN_IF_ERROR(CheckRecurrent(planes, memory, layer.layer, recurrent_fill));
    }
  }
  return absl::OkStatus();
}

PlaneLookup LayoutPlanes(const SessionLayout& layout, std::vector<uint8_t*> bases) {
  return [layout, bases = std::move(bases)](uint32_t layer, PlaneKind kind) {
    return ResolvePlane(layout, bases, layer, kind);
  };
}

}  // namespace memra::testing
