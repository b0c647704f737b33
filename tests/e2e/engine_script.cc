#include "tests/e2e/engine_script.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "common/codec.h"
#include "tests/service/test_plans.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

void FillRow(const PlaneView& plane, uint32_t layer, PlaneKind kind, uint64_t physical_row,
             uint64_t absolute_row) {
  uint8_t* row = plane.data + physical_row * plane.row_bytes;
  for (uint64_t j = 0; j < plane.row_bytes; ++j) {
    row[j] = PatternByte(layer, kind, absolute_row, j);
  }
}

absl::Status CheckRow(const PlaneView& plane, uint32_t layer, PlaneKind kind, uint64_t physical_row,
                      uint64_t absolute_row) {
  if (physical_row >= plane.rows) {
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " ",
                                              std::string(PlaneKindName(kind)), ": row ",
                                              physical_row, " of ", plane.rows));
  }
  const uint8_t* row = plane.data + physical_row * plane.row_bytes;
  for (uint64_t j = 0; j < plane.row_bytes; ++j) {
    if (row[j] != PatternByte(layer, kind, absolute_row, j)) {
      return absl::DataLossError(
          absl::StrCat("layer ", layer, " ", std::string(PlaneKindName(kind)), " absolute row ",
                       absolute_row, " (physical ", physical_row, ") byte ", j, " holds ", row[j],
                       ", expected ", PatternByte(layer, kind, absolute_row, j)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> ReadI32(const PlaneLookup& planes, uint32_t layer, PlaneKind kind) {
  ASSIGN_OR_RETURN(PlaneView view, planes(layer, kind));
  int32_t value;
  std::memcpy(&value, view.data, sizeof(value));
  return value;
}

// Writes the appended rows [staged, staged + rows) of every K/V layer (after its ring rebase
// copy) and of the latent layer.
absl::Status WriteAppend(Session& session, const PreparedAppend& append, uint64_t staged,
                         uint64_t rows) {
  for (const LayerAppend& layer : append.layers) {
    for (PlaneKind kind : {PlaneKind::kKeys, PlaneKind::kValues}) {
      ASSIGN_OR_RETURN(PlaneView plane, session.Plane(layer.layer, kind));
      if (layer.ring_append.has_value() && layer.ring_append->kind == RingAppend::Kind::kRebase) {
        std::memmove(plane.data, plane.data + layer.ring_append->src_row * plane.row_bytes,
                     layer.ring_append->keep_rows * plane.row_bytes);
      }
      for (uint64_t i = 0; i < rows; ++i) {
        FillRow(plane, layer.layer, kind, layer.write_row + i, staged + i);
      }
    }
  }
  ASSIGN_OR_RETURN(PlaneView latent, session.Plane(kLatentLayer, PlaneKind::kLatentRows));
  for (uint64_t i = 0; i < rows; ++i) {
    FillRow(latent, kLatentLayer, PlaneKind::kLatentRows, staged + i, staged + i);
  }
  return absl::OkStatus();
}

absl::Status FillRecurrent(Session& session, uint8_t fill) {
  for (PlaneKind kind : {PlaneKind::kConvState, PlaneKind::kSsmState}) {
    ASSIGN_OR_RETURN(PlaneView plane, session.Plane(kRecurrentLayer, kind));
    std::memset(plane.data, fill, plane.bytes);
  }
  return absl::OkStatus();
}

}  // namespace

uint8_t PatternByte(uint32_t layer, PlaneKind kind, uint64_t absolute_row, uint64_t byte) {
  return static_cast<uint8_t>(absolute_row * 31 + layer * 7 + static_cast<uint64_t>(kind) * 3 +
                              byte * 5 + (absolute_row >> 8));
}

absl::StatusOr<ScriptResult> RunScript(Session& session) {
  ScriptResult result;
  for (uint64_t step = 0;; ++step) {
    const uint64_t rows = 240 + (step % 4) * 10;
    if (result.committed + rows > kE2eCapacity) break;
    ASSIGN_OR_RETURN(Transaction tx, session.Begin());
    ASSIGN_OR_RETURN(PreparedAppend append, session.PrepareAppend(tx.generation, rows));
    for (const LayerAppend& layer : append.layers) {
      if (layer.ring_append.has_value() && layer.ring_append->kind == RingAppend::Kind::kRebase) {
        ++result.rebases;
      }
    }
    RETURN_IF_ERROR(WriteAppend(session, append, tx.base_len, rows));
    RETURN_IF_ERROR(session.PublishAppend(tx.generation).status());
    // Every third step the verifier rejects the last 7 draft rows.
    const uint64_t accepted = step % 3 == 0 ? rows - 7 : rows;
    ASSIGN_OR_RETURN(result.committed, session.Commit(tx.generation, accepted));
    result.recurrent_fill = static_cast<uint8_t>(step * 13 + 1);
    RETURN_IF_ERROR(FillRecurrent(session, result.recurrent_fill));
    if (step % 5 == 4) {
      const uint64_t target = result.committed - 20;
      ASSIGN_OR_RETURN(bool can, session.CanRewind(target));
      if (!can) return absl::InternalError(absl::StrCat("cannot rewind to ", target));
      ASSIGN_OR_RETURN(pb::SessionState rewound, session.Rewind(target));
      result.committed = rewound.committed_len();
      ++result.rewinds;
    }
  }
  return result;
}

absl::Status RunIdleRound(Session& session, uint64_t round) {
  ASSIGN_OR_RETURN(Transaction tx, session.Begin());
  const uint64_t rows = 1 + round % 3;
  ASSIGN_OR_RETURN(PreparedAppend append, session.PrepareAppend(tx.generation, rows));
  RETURN_IF_ERROR(WriteAppend(session, append, tx.base_len, rows));
  RETURN_IF_ERROR(session.PublishAppend(tx.generation).status());
  RETURN_IF_ERROR(session.Commit(tx.generation, rows).status());
  return session.Rewind(tx.base_len).status();
}

absl::Status VerifySession(const pb::SessionLayout& layout, const pb::SessionState& state,
                           const PlaneLookup& planes, uint8_t recurrent_fill) {
  const uint64_t committed = state.committed_len();
  if (state.staged_len() != committed || state.active_generation() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session not quiescent: staged ", state.staged_len(), ", committed ", committed));
  }
  for (const pb::LayerState& layer : state.layers()) {
    ASSIGN_OR_RETURN(int32_t len, ReadI32(planes, layer.layer(), PlaneKind::kLenMirror));
    if (static_cast<uint64_t>(len) != committed || layer.length() != len) {
      return absl::DataLossError(absl::StrCat("layer ", layer.layer(), ": length mirror ", len,
                                              ", daemon says ", layer.length(), ", committed ",
                                              committed));
    }
    if (layer.ring()) {
      ASSIGN_OR_RETURN(int32_t base, ReadI32(planes, layer.layer(), PlaneKind::kBaseMirror));
      if (static_cast<uint64_t>(base) != layer.ring_base()) {
        return absl::DataLossError(absl::StrCat("layer ", layer.layer(), ": base mirror ", base,
                                                ", daemon says ", layer.ring_base()));
      }
    }
  }
  for (const pb::LayerLayout& layer : layout.layers()) {
    if (layer.kind() == pb::STATE_KIND_KV || layer.kind() == pb::STATE_KIND_SLIDING_KV) {
      uint64_t base = 0;
      uint64_t first = 0;
      if (layer.ring()) {
        for (const pb::LayerState& s : state.layers()) {
          if (s.layer() == layer.layer()) base = s.ring_base();
        }
        // The resident window: everything from the base on (the ring keeps window + slack).
        first = base;
      }
      for (PlaneKind kind : {PlaneKind::kKeys, PlaneKind::kValues}) {
        ASSIGN_OR_RETURN(PlaneView plane, planes(layer.layer(), kind));
        for (uint64_t row = first; row < committed; ++row) {
          RETURN_IF_ERROR(CheckRow(plane, layer.layer(), kind, row - base, row));
        }
      }
    } else if (layer.kind() == pb::STATE_KIND_LATENT) {
      ASSIGN_OR_RETURN(PlaneView plane, planes(layer.layer(), PlaneKind::kLatentRows));
      for (uint64_t row = 0; row < committed; ++row) {
        RETURN_IF_ERROR(CheckRow(plane, layer.layer(), PlaneKind::kLatentRows, row, row));
      }
    } else if (layer.kind() == pb::STATE_KIND_RECURRENT) {
      for (PlaneKind kind : {PlaneKind::kConvState, PlaneKind::kSsmState}) {
        ASSIGN_OR_RETURN(PlaneView plane, planes(layer.layer(), kind));
        for (uint64_t i = 0; i < plane.bytes; ++i) {
          if (plane.data[i] != recurrent_fill) {
            return absl::DataLossError(
                absl::StrCat("layer ", layer.layer(), " ", std::string(PlaneKindName(kind)),
                             " byte ", i, " holds ", plane.data[i], ", expected ", recurrent_fill));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

PlaneLookup LayoutPlanes(const pb::SessionLayout& layout, std::vector<uint8_t*> bases) {
  return [layout, bases = std::move(bases)](uint32_t layer, PlaneKind kind) {
    return ResolvePlane(layout, bases, layer, kind);
  };
}

}  // namespace memra::testing
