#ifndef MEMRA_TOOLS_KVCTL_RENDER_H_
#define MEMRA_TOOLS_KVCTL_RENDER_H_

// What memra-kvctl prints for each answer of memra-kvd: the human tables (tools/README.md shows
// them) and --json.
//
// Thread-safety: pure functions.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/message.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/group.pb.h"
#include "proto/memra/kv/v1/prefix.pb.h"

namespace memra::kvctl {

// Human output of each answer (what the command prints without --json); every line ends in
// '\n'. RenderFit takes the context asked about, which FitResponse does not repeat.
std::string RenderStatus(const kv::v1::GetStatusResponse& status);
std::string RenderEngines(const kv::v1::ListEnginesResponse& engines);
std::string RenderSessions(const kv::v1::ListSessionsResponse& sessions);
std::string RenderCost(const kv::v1::CostResponse& cost);
std::string RenderFit(const kv::v1::FitResponse& fit, uint64_t context);
std::string RenderMaxContext(const kv::v1::MaxContextResponse& max_context);
std::string RenderImport(const kv::v1::ImportModelResponse& imported);
std::string RenderDrain(const kv::v1::DrainResponse& drained);
std::string RenderPrefixes(const kv::v1::ListPrefixesResponse& prefixes);
std::string RenderEvict(const kv::v1::EvictPrefixResponse& evicted);

// One rank of a group as memra-kvctl shows it (docs/groups.md#memra-kvctl).
struct GroupRankRow {
  uint32_t rank = 0;
  std::string socket;  // the socket memra-kvctl asked
  uint32_t stage = 0;  // rank / tp
  uint32_t tp_rank = 0;
  // The rank's shard (fit, max-context; status has no model): layers [lo, hi) and which of
  // kv_shards K/V head shards it holds.
  bool has_shard = false;
  uint32_t layer_lo = 0;
  uint32_t layer_hi = 0;
  uint32_t kv_shard = 0;
  uint32_t kv_shards = 1;
};
struct GroupView {
  std::string name;
  uint32_t tp = 1;
  uint32_t pp = 1;
  std::vector<GroupRankRow> ranks;  // by rank
};

// A group's answers, one per rank in rank order (REQUIRES: as many as view.ranks, at least
// one). Each prints one row per rank, then the group's answer: the least over the ranks, and
// the rank that decides it.
// `reservations`: each rank's group reservations (KvGroup.ListGroupRanks), nullopt where the
// daemon was asked on its engine socket (the listing is the operators').
std::string RenderGroupStatus(
    const GroupView& view, const std::vector<kv::v1::GetStatusResponse>& ranks,
    const std::vector<std::optional<kv::v1::ListGroupRanksResponse>>& reservations);
std::string RenderGroupFit(const GroupView& view, const std::vector<kv::v1::FitResponse>& ranks,
                           uint64_t context);
std::string RenderGroupMaxContext(const GroupView& view,
                                  const std::vector<kv::v1::MaxContextResponse>& ranks);
// --json of a group: {"group", "tp", "pp", "ranks": [{"rank", "socket", "stage", "tp_rank",
// ("layer_lo", "layer_hi", "kv_shard", "kv_shards"), "answer": the rank's protobuf JSON,
// ("group_reservations": its ListGroupRanksResponse, where `reservations` has it)}]}.
absl::StatusOr<std::string> RenderGroupJson(
    const GroupView& view, const std::vector<const google::protobuf::Message*>& answers,
    const std::vector<std::optional<kv::v1::ListGroupRanksResponse>>& reservations = {});

// --json: protobuf JSON, every primitive field printed, field names as in the .proto, one line.
absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message);

// The admission numbers a RESOURCE_EXHAUSTED refusal carries (FromGrpcStatus restores them from
// the wire's StatusDetails), one per line; "" for any other status.
std::string RefusalDetails(const absl::Status& status);

}  // namespace memra::kvctl

#endif  // MEMRA_TOOLS_KVCTL_RENDER_H_
