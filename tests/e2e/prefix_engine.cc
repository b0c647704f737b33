// An engine process for the prefix-cache end-to-end test (tests/e2e/prefix_e2e_test.cc).
// Attaches to memra-kvd, registers one of four model plans (--plan: flat, hybrid, swa, latent)
// and, by --mode:
//   capture  commits --tokens rows WITH their token ids, writes the deterministic pattern into
//            every plane through its mappings, Captures the prefix, writes entry_id to --out,
//            releases its session and exits;
//   hold     the same rows and pattern, then opens a transaction whose staged rows hold other
//            bytes, writes --out and holds its lease until killed (the daemon must capture the
//            committed rows only);
//   restore  creates a fresh session, Lookups the --tokens token ids (a HIT of all of them is
//            required), Restores, and checks every restored byte, length and ring base;
//   restore_any  the same, but whatever the lookup says: restores by token ids (entry 0), a
//            NOT_FOUND restore is "restored=0", and checks every byte of what was restored (the
//            remote tier's tests: a miss is allowed, wrong bytes never).
// restore and restore_any write lookup_medium (StorageMedium as a number), lookup_matched and
// restored to --out.
// --backend=cuda maps with CudaArenaMapper and writes / reads through CUDA copies on an engine
// stream (--device: the ordinal); every request that lets the daemon touch the session's memory
// carries the engine's interprocess event (DeviceOrdering). Default host.
// Exit status 0 = every call and every check succeeded.

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/prefix_client.h"
#include "core/index_ring.h"
#include "core/kv_ring.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"
#include "tests/engine_exit.h"
#include "tests/e2e/engine_device.h"
#include "tests/e2e/facts.h"
#include "tests/e2e/plane_memory.h"

ABSL_FLAG(std::string, socket, "", "memra-kvd's Unix socket path");
ABSL_FLAG(std::string, mode, "capture", "capture, hold, restore or restore_any");
ABSL_FLAG(std::string, plan, "flat", "flat, hybrid, swa or latent");
ABSL_FLAG(uint64_t, tokens, 64, "committed / restored tokens (a multiple of the block)");
ABSL_FLAG(uint64_t, capacity, 6000, "session capacity");
ABSL_FLAG(std::string, out, "", "facts file (key=value lines)");
ABSL_FLAG(std::string, backend, "host", "host or cuda: how arenas are mapped and written");
ABSL_FLAG(int, device, 0, "CUDA ordinal (--backend=cuda)");

namespace memra::testing {
namespace {

namespace tp = ::memra::test_plans;

absl::StatusOr<ModelPlan> PlanNamed(const std::string& name) {
  ModelPlan plan;
  if (name == "flat") {
    plan = tp::DenseModel(2, 32, 1);
  } else if (name == "hybrid") {
    plan.layers = {tp::KvLayer(0, 32, 1), tp::RecurrentLayer(1, 16, 4, 64)};
  } else if (name == "swa") {
    plan.swa_ring = true;
    plan.layers = {tp::SlidingLayer(0, 32, 1, 64), tp::KvLayer(1, 32, 1)};
  } else if (name == "latent") {
    plan.index_ring_rows = 32;
    plan.layers = {tp::LatentLayer(0, 16, 8, 4), tp::LatentLayer(1, 16)};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown --plan ", name));
  }
  return plan;
}

std::vector<int32_t> Tokens(uint64_t n) {
  std::vector<int32_t> tokens;
  for (uint64_t i = 0; i < n; ++i) tokens.push_back(static_cast<int32_t>(i * 5 + 7));
  return tokens;
}

uint8_t Pattern(uint32_t layer, PlaneKind kind, uint64_t row, uint64_t byte, uint64_t seed) {
  return static_cast<uint8_t>(layer * 131 + static_cast<uint32_t>(kind) * 31 + row * 7 +
                              byte * 13 + seed * 17 + 1);
}

// Applies `range_op(view, kind, layer, physical_first, first, end, seed)` to every range of rows
// the session's state says is live: flat K/V and latent rows [0, len); a ring layer's rows from
// its base (the writer) or from the aligned window start (the checker, `aligned`) at physical
// row - base; pool keys of ready pools; the indexer's live tail at its ring position; recurrent
// state. Rows [first, end) sit at physical rows [physical_first, physical_first + end - first).
template <typename RangeOp>
absl::Status ForEachLiveRange(Session& session, const SessionSnapshot& state, bool aligned,
                              RangeOp range_op) {
  for (const SessionLayer& layer : session.layout().layers) {
    const uint32_t il = layer.layer;
    uint64_t len = 0;
    uint64_t base = 0;
    uint64_t ready = 0;
    for (const LayerSnapshot& live : state.layers) {
      if (live.layer != il) continue;
      len = live.length;
      base = live.ring_base;
      ready = live.index_pools_ready;
    }
    auto rows = [&](PlaneKind kind, uint64_t first, uint64_t end, uint64_t physical_first,
                    uint64_t seed) -> absl::Status {
      if (end <= first) return absl::OkStatus();
      ASSIGN_OR_RETURN(PlaneView view, session.Plane(il, kind));
      return range_op(view, kind, il, physical_first, first, end, seed);
    };
    if (session.Plane(il, PlaneKind::kConvState).ok()) {
      RETURN_IF_ERROR(rows(PlaneKind::kConvState, 0, 1, 0, state.committed_len));
      RETURN_IF_ERROR(rows(PlaneKind::kSsmState, 0, 1, 0, state.committed_len));
    } else if (session.Plane(il, PlaneKind::kLatentRows).ok()) {
      RETURN_IF_ERROR(rows(PlaneKind::kLatentRows, 0, len, 0, 0));
      if (layer.index_width == 0) continue;
      RETURN_IF_ERROR(rows(PlaneKind::kPoolKeys, 0, ready, 0, 0));
      const uint64_t tail = ready * layer.index_pool;
      ASSIGN_OR_RETURN(uint64_t physical,
                       IndexPlanePhysicalRow(layer.index_ring ? layer.index_physical_rows : 0,
                                             layer.index_pool, tail));
      RETURN_IF_ERROR(rows(PlaneKind::kIndexRows, tail, len, physical, 0));
    } else if (session.Plane(il, PlaneKind::kKeys).ok()) {
      const uint64_t from =
          layer.ring && aligned ? AlignedWindowStart(len, layer.window) : (layer.ring ? base : 0);
      const uint64_t physical = layer.ring ? from - base : 0;
      RETURN_IF_ERROR(rows(PlaneKind::kKeys, from, len, physical, 0));
      RETURN_IF_ERROR(rows(PlaneKind::kValues, from, len, physical, 0));
    }
  }
  return absl::OkStatus();
}

// Recurrent planes are one "row" of the whole plane.
uint64_t RowBytes(const PlaneView& view, PlaneKind kind) {
  return kind == PlaneKind::kConvState || kind == PlaneKind::kSsmState ? view.bytes
                                                                       : view.row_bytes;
}

// The pattern of rows [first, end) of one plane, as the engine writes them.
std::vector<uint8_t> PatternRange(const PlaneView& view, PlaneKind kind, uint32_t layer,
                                  uint64_t first, uint64_t end, uint64_t seed) {
  const uint64_t bytes = RowBytes(view, kind);
  std::vector<uint8_t> pattern((end - first) * bytes);
  for (uint64_t row = first; row < end; ++row) {
    for (uint64_t j = 0; j < bytes; ++j) {
      pattern[(row - first) * bytes + j] = Pattern(layer, kind, row, j, seed);
    }
  }
  return pattern;
}

absl::Status WritePattern(Session& session, PlaneMemory& memory, const SessionSnapshot& state) {
  return ForEachLiveRange(
      session, state, /*aligned=*/false,
      [&](const PlaneView& view, PlaneKind kind, uint32_t layer, uint64_t physical_first,
          uint64_t first, uint64_t end, uint64_t seed) -> absl::Status {
        return memory.Write(view, physical_first * RowBytes(view, kind),
                            PatternRange(view, kind, layer, first, end, seed));
      });
}

absl::Status CheckPattern(Session& session, PlaneMemory& memory, const SessionSnapshot& state) {
  uint64_t checked = 0;
  RETURN_IF_ERROR(ForEachLiveRange(
      session, state, /*aligned=*/true,
      [&](const PlaneView& view, PlaneKind kind, uint32_t layer, uint64_t physical_first,
          uint64_t first, uint64_t end, uint64_t seed) -> absl::Status {
        const std::vector<uint8_t> expected = PatternRange(view, kind, layer, first, end, seed);
        std::vector<uint8_t> held(expected.size());
        RETURN_IF_ERROR(
            memory.Read(view, physical_first * RowBytes(view, kind), absl::MakeSpan(held)));
        const uint64_t bytes = RowBytes(view, kind);
        for (uint64_t i = 0; i < held.size(); ++i) {
          if (held[i] != expected[i]) {
            return absl::DataLossError(absl::StrCat("layer ", layer, " ",
                                                    PlaneKindName(kind).data(), " row ",
                                                    first + i / bytes, " byte ", i % bytes,
                                                    " differs from the source's"));
          }
        }
        checked += held.size();
        return absl::OkStatus();
      }));
  std::fprintf(stderr, "prefix_engine: %llu restored bytes checked\n",
               static_cast<unsigned long long>(checked));
  return checked > 0 ? absl::OkStatus() : absl::InternalError("checked no byte");
}

// Commits `rows` rows in chunks, each commit carrying its token ids.
absl::Status CommitRows(Session& session, const std::vector<int32_t>& tokens, uint64_t rows) {
  for (uint64_t done = 0; done < rows;) {
    const uint64_t chunk = std::min<uint64_t>(rows - done, 512);
    ASSIGN_OR_RETURN(Transaction transaction, session.Begin());
    RETURN_IF_ERROR(session.PrepareAppend(transaction.generation, chunk).status());
    RETURN_IF_ERROR(session.PublishAppend(transaction.generation).status());
    RETURN_IF_ERROR(session
                        .Commit(transaction.generation, chunk,
                                absl::MakeConstSpan(tokens).subspan(done, chunk))
                        .status());
    done += chunk;
  }
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string socket = absl::GetFlag(FLAGS_socket);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  uint64_t n = absl::GetFlag(FLAGS_tokens);
  ASSIGN_OR_RETURN(EngineDevice device,
                   OpenEngineDevice(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_device)));
  PlaneMemory& memory = *device.memory;
  ClientOptions client_options;
  client_options.mapper = device.mapper;
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, KvClient::Connect(socket, client_options));
  RETURN_IF_ERROR(client->Attach(absl::StrCat("prefix-", mode)));
  ASSIGN_OR_RETURN(ModelPlan model, PlanNamed(absl::GetFlag(FLAGS_plan)));
  ASSIGN_OR_RETURN(PlanFingerprint plan, client->RegisterPlan(model));
  SessionOptions options;
  options.capacity = absl::GetFlag(FLAGS_capacity);
  ASSIGN_OR_RETURN(std::unique_ptr<Session> session, client->CreateSession(plan, options));
  session->SetWaitEvent(memory.WaitEvent());
  const std::vector<int32_t> tokens = Tokens(n);

  if (mode == "capture" || mode == "hold") {
    RETURN_IF_ERROR(CommitRows(*session, tokens, n));
    ASSIGN_OR_RETURN(SessionSnapshot state, session->State());
    RETURN_IF_ERROR(WritePattern(*session, memory, state));
    if (mode == "capture") {
      ASSIGN_OR_RETURN(PrefixCaptured captured, client->prefixes().Capture(*session, tokens, n));
      RETURN_IF_ERROR(
          WriteFacts(absl::GetFlag(FLAGS_out), absl::StrCat("entry_id=", captured.entry_id, "\n")));
      return session->Release().status();
    }
    // Staged rows above the committed length, holding bytes no restore may ever see.
    ASSIGN_OR_RETURN(Transaction transaction, session->Begin());
    RETURN_IF_ERROR(session->PrepareAppend(transaction.generation, 16).status());
    RETURN_IF_ERROR(session->PublishAppend(transaction.generation).status());
    for (uint32_t layer = 0; layer < 2; ++layer) {
      ASSIGN_OR_RETURN(PlaneView keys, session->Plane(layer, PlaneKind::kKeys));
      RETURN_IF_ERROR(memory.Fill(keys, n * keys.row_bytes, 0xee, 16 * keys.row_bytes));
    }
    RETURN_IF_ERROR(WriteFacts(absl::GetFlag(FLAGS_out), "ready=1\n"));
    while (true) absl::SleepFor(absl::Seconds(1));  // until SIGKILL
  }

  // restore, restore_any
  const bool any = absl::GetFlag(FLAGS_mode) == "restore_any";
  ASSIGN_OR_RETURN(PrefixMatch found, client->prefixes().Lookup(plan, options, tokens));
  const std::string looked_up =
      absl::StrCat("lookup_medium=", static_cast<int>(found.medium),
                   "\nlookup_matched=", found.matched_tokens, "\n");
  if (!any && (found.outcome != LookupOutcome::kHit || found.matched_tokens != n)) {
    return absl::NotFoundError(absl::StrCat("lookup of ", n, " tokens: outcome ",
                                            static_cast<int>(found.outcome), ", matched ",
                                            found.matched_tokens));
  }
  absl::StatusOr<PrefixRestored> restore =
      client->prefixes().Restore(*session, tokens, any ? 0 : found.entry_id);
  if (any && absl::IsNotFound(restore.status())) {
    RETURN_IF_ERROR(WriteFacts(absl::GetFlag(FLAGS_out), absl::StrCat(looked_up, "restored=0\n")));
    return session->Release().status();
  }
  ASSIGN_OR_RETURN(PrefixRestored restored, std::move(restore));
  if (any) n = restored.restored_tokens;
  if (restored.restored_tokens != n || restored.state.committed_len != n) {
    return absl::InternalError(absl::StrCat("restored ", restored.restored_tokens,
                                            " tokens, committed ", restored.state.committed_len,
                                            "; wanted ", n));
  }
  for (const LayerSnapshot& layer : restored.state.layers) {
    if (layer.ring && layer.ring_base != AlignedWindowStart(n, 64)) {
      return absl::InternalError(
          absl::StrCat("layer ", layer.layer, " ring base ", layer.ring_base));
    }
  }
  RETURN_IF_ERROR(CheckPattern(*session, memory, restored.state));
  RETURN_IF_ERROR(WriteFacts(absl::GetFlag(FLAGS_out),
                             absl::StrCat(looked_up, "restored=", restored.restored_tokens, "\n")));
  return session->Release().status();
}

}  // namespace
}  // namespace memra::testing

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return memra::testing::EngineExit("prefix_engine", absl::GetFlag(FLAGS_mode),
                                     memra::testing::Run());
}
