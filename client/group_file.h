#ifndef MEMRA_CLIENT_GROUP_FILE_H_
#define MEMRA_CLIENT_GROUP_FILE_H_

// The group file: which daemon serves each rank of a TP x PP group (docs/groups.md#the-group-file).
// A small line-oriented text format, read by the C++ group client, memra-kvctl --group and the
// Python memra_kv.group (one grammar, the same refusals):
//
//   # comment (to the end of any line); blank lines are ignored; fields split on spaces/tabs
//   group llama-70b            name: 1..64 of [A-Za-z0-9._-]            (required, once)
//   tp 2                       tensor-parallel degree                   (required, once)
//   pp 2                       pipeline stages                          (required, once)
//   stage_layers 40,40         trunk layers per stage, pp of them       (optional, once;
//                              default: core/group_layout.h DefaultStageLayers)
//   rank 0 /run/memra-kv/gpu0.sock [/run/memra-kv/gpu0.admin.sock]
//                              rank -> the daemon's engine socket and, optionally, its admin
//                              socket (for memra-kvctl); one line per rank 0..tp*pp-1
//
// Rules: tp x pp is 1..kMaxGroupRanks ranks; every rank appears exactly once; sockets are
// absolute paths of at most kMaxSocketPathBytes bytes; no two ranks share a socket (one daemon
// serves one GPU, and so one rank). Refusals are INVALID_ARGUMENT naming the source, the line
// and the numbers ("group file g.txt line 7: rank 4 is outside tp 2 x pp 2 = 4 ranks").
//
// Thread-safety: pure functions over values, except ReadGroupFile (reads one file).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/group_layout.h"

namespace memra {

// sun_path holds 108 bytes including the terminating NUL.
inline constexpr size_t kMaxSocketPathBytes = 107;
inline constexpr size_t kMaxGroupNameBytes = 64;
// A group file of kMaxGroupRanks ranks with long paths is well below this.
inline constexpr size_t kMaxGroupFileBytes = 1 << 20;

struct GroupRankEndpoint {
  uint32_t rank = 0;
  std::string socket;        // the daemon's engine socket
  std::string admin_socket;  // its admin socket; empty = not given
  bool operator==(const GroupRankEndpoint&) const = default;
};

struct GroupFile {
  std::string name;
  GroupShape shape;                       // tp, pp and (optionally) stage_layers
  std::vector<GroupRankEndpoint> ranks;   // by rank: ranks[r].rank == r, tp * pp of them
};

// Parses `text`; `source` names it in refusals (a path, or "--socket").
absl::StatusOr<GroupFile> ParseGroupFile(absl::string_view text, absl::string_view source);

// Reads and parses the file at `path` (at most kMaxGroupFileBytes). A file that cannot be read
// is its errno's status (common/errors.h) naming the path.
absl::StatusOr<GroupFile> ReadGroupFile(const std::string& path);

// A group from a list of engine sockets in rank order (memra-kvctl --socket=a,b,c): the same
// rules as a file's. `source` names the list in refusals.
absl::StatusOr<GroupFile> GroupFromSockets(absl::string_view name, const GroupShape& shape,
                                           const std::vector<std::string>& sockets,
                                           absl::string_view source);

}  // namespace memra

#endif  // MEMRA_CLIENT_GROUP_FILE_H_
