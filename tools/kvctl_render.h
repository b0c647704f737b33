#ifndef MEMRA_TOOLS_KVCTL_RENDER_H_
#define MEMRA_TOOLS_KVCTL_RENDER_H_

// What memra-kvctl prints for each answer of memra-kvd: the human tables (tools/README.md shows
// them) and --json.
//
// Thread-safety: pure functions.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/message.h"
#include "proto/memra/kv/v1/admin.pb.h"
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

// --json: protobuf JSON, every primitive field printed, field names as in the .proto, one line.
absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message);

// The admission numbers a RESOURCE_EXHAUSTED refusal carries (FromGrpcStatus restores them from
// the wire's StatusDetails), one per line; "" for any other status.
std::string RefusalDetails(const absl::Status& status);

}  // namespace memra::kvctl

#endif  // MEMRA_TOOLS_KVCTL_RENDER_H_
