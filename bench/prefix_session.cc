#include "bench/prefix_session.h"

#include <algorithm>
#include <cstring>

#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"

namespace memra::bench {
namespace {

constexpr uint64_t kCommitChunk = 1024;  // rows per transaction while filling the source

}  // namespace

ModelPlan DenseModel() {
  ModelPlan plan = test_plans::DenseModel(16, 64, 8);
  plan.name = "llama-3.2-1b";
  return plan;
}

std::vector<int32_t> TokenIds(uint64_t n, uint64_t salt) {
  std::vector<int32_t> tokens(n);
  for (uint64_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((i * 7919 + salt) % 150000);
  return tokens;
}

std::unique_ptr<grpc::ClientContext> PrefixContext() {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + kPrefixDeadline));
  return context;
}

absl::Status FillSession(Session& session, const std::vector<int32_t>& tokens) {
  const uint64_t rows = tokens.size();
  for (uint64_t done = 0; done < rows;) {
    const uint64_t chunk = std::min<uint64_t>(rows - done, kCommitChunk);
    ASSIGN_OR_RETURN(Transaction transaction, session.Begin());
    RETURN_IF_ERROR(session.PrepareAppend(transaction.generation, chunk).status());
    RETURN_IF_ERROR(session.PublishAppend(transaction.generation).status());
    RETURN_IF_ERROR(session
                        .Commit(transaction.generation, chunk,
                                absl::MakeConstSpan(tokens).subspan(done, chunk))
                        .status());
    done += chunk;
  }
  for (const SessionLayer& layer : session.layout().layers) {
    for (PlaneKind kind : {PlaneKind::kKeys, PlaneKind::kValues, PlaneKind::kConvState,
                           PlaneKind::kSsmState}) {
      absl::StatusOr<PlaneView> view = session.Plane(layer.layer, kind);
      if (view.ok()) std::memset(view->data, 0x5a ^ static_cast<int>(kind), view->bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace memra::bench
