#include "client/group_file.h"

#include <cerrno>
#include <cstdio>
#include <map>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/errors.h"
#include "core/status_macros.h"

namespace memra {
namespace {

// A parsed value with where it came from ("line 7", "entry 2"), for refusals after the parse.
template <typename T>
struct Located {
  T value{};
  std::string where;
};

struct ParsedGroup {
  std::optional<Located<std::string>> name;
  std::optional<Located<uint32_t>> tp;
  std::optional<Located<uint32_t>> pp;
  std::optional<Located<std::vector<uint32_t>>> stage_layers;
  std::vector<Located<GroupRankEndpoint>> ranks;  // in the order given
};

class Refusal {
 public:
  explicit Refusal(absl::string_view source) : source_(source) {}
  absl::Status At(absl::string_view where, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, " ", where, ": ", what));
  }
  absl::Status Whole(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", what));
  }

 private:
  const std::string source_;
};

// Decimal digits only (no sign, no spaces), within u32.
std::optional<uint32_t> ParseCount(absl::string_view text) {
  if (text.empty() || text.size() > 10) return std::nullopt;
  uint64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  if (value > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(value);
}

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxGroupNameBytes) return false;
  for (const char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

absl::Status CheckSocketPath(const Refusal& refuse, absl::string_view where, absl::string_view what,
                             absl::string_view path) {
  if (path.empty() || path.front() != '/') {
    return refuse.At(where, absl::StrCat(what, " \"", path, "\" is not an absolute path"));
  }
  if (path.size() > kMaxSocketPathBytes) {
    return refuse.At(where, absl::StrCat(what, " is ", path.size(), " bytes; a Unix socket path "
                                         "holds at most ", kMaxSocketPathBytes));
  }
  return absl::OkStatus();
}

// Sets a key that may appear once.
template <typename T>
absl::Status SetOnce(const Refusal& refuse, absl::string_view key, absl::string_view where,
                     std::optional<Located<T>>& slot, T value) {
  if (slot.has_value()) {
    return refuse.At(where, absl::StrCat("`", key, "` given twice (", slot->where, " and here)"));
  }
  slot = Located<T>{std::move(value), std::string(where)};
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> CountField(const Refusal& refuse, absl::string_view where,
                                    absl::string_view what, absl::string_view text) {
  const std::optional<uint32_t> value = ParseCount(text);
  if (!value.has_value()) {
    return refuse.At(where, absl::StrCat(what, " \"", text,
                                         "\" is not a whole number of at most ", UINT32_MAX));
  }
  return *value;
}

absl::Status ParseLine(const Refusal& refuse, absl::string_view where,
                       const std::vector<absl::string_view>& fields, ParsedGroup& out) {
  const absl::string_view key = fields[0];
  const size_t values = fields.size() - 1;
  auto expect_values = [&](size_t lo, size_t hi, absl::string_view usage) -> absl::Status {
    if (values < lo || values > hi) {
      return refuse.At(where, absl::StrCat("`", key, "` takes ", usage, ", got ", values,
                                           " value(s)"));
    }
    return absl::OkStatus();
  };
  if (key == "group") {
    RETURN_IF_ERROR(expect_values(1, 1, "one name"));
    if (!ValidName(fields[1])) {
      return refuse.At(where, absl::StrCat("group name \"", fields[1], "\" is not 1..",
                                           kMaxGroupNameBytes, " of [A-Za-z0-9._-]"));
    }
    return SetOnce(refuse, key, where, out.name, std::string(fields[1]));
  }
  if (key == "tp" || key == "pp") {
    RETURN_IF_ERROR(expect_values(1, 1, "one number"));
    ASSIGN_OR_RETURN(const uint32_t value, CountField(refuse, where, key, fields[1]));
    return SetOnce(refuse, key, where, key == "tp" ? out.tp : out.pp, value);
  }
  if (key == "stage_layers") {
    RETURN_IF_ERROR(expect_values(1, 1, "one comma-separated list"));
    std::vector<uint32_t> layers;
    for (const absl::string_view item : absl::StrSplit(fields[1], ',')) {
      ASSIGN_OR_RETURN(const uint32_t count,
                       CountField(refuse, where, absl::StrCat("stage_layers entry ",
                                                              layers.size()), item));
      if (count == 0) {
        return refuse.At(where, absl::StrCat("stage_layers entry ", layers.size(),
                                             " is 0: every stage holds at least one layer"));
      }
      layers.push_back(count);
      if (layers.size() > kMaxGroupRanks) {
        return refuse.At(where, absl::StrCat("stage_layers lists more than ", kMaxGroupRanks,
                                             " stages"));
      }
    }
    return SetOnce(refuse, key, where, out.stage_layers, std::move(layers));
  }
  if (key == "rank") {
    RETURN_IF_ERROR(expect_values(2, 3, "a rank, a socket and optionally an admin socket"));
    ASSIGN_OR_RETURN(const uint32_t rank, CountField(refuse, where, "rank", fields[1]));
    GroupRankEndpoint endpoint{rank, std::string(fields[2]),
                               values == 3 ? std::string(fields[3]) : std::string()};
    out.ranks.push_back({std::move(endpoint), std::string(where)});
    return absl::OkStatus();
  }
  return refuse.At(where, absl::StrCat("unknown key \"", key,
                                       "\" (group, tp, pp, stage_layers, rank)"));
}

// Every rule that needs the whole group (the header's "Rules").
absl::StatusOr<GroupFile> Finish(const Refusal& refuse, ParsedGroup parsed) {
  for (const absl::string_view key : {"group", "tp", "pp"}) {
    const bool present = key == "group" ? parsed.name.has_value()
                         : key == "tp"  ? parsed.tp.has_value()
                                        : parsed.pp.has_value();
    if (!present) return refuse.Whole(absl::StrCat("no `", key, "` line"));
  }
  const uint32_t tp = parsed.tp->value;
  const uint32_t pp = parsed.pp->value;
  const uint64_t size = uint64_t{tp} * pp;
  if (tp == 0 || pp == 0 || size > kMaxGroupRanks) {
    return refuse.At(parsed.tp->where,
                     absl::StrCat("tp ", tp, " x pp ", pp, " is not a group of 1..",
                                  kMaxGroupRanks, " ranks"));
  }
  GroupFile group;
  group.name = parsed.name->value;
  group.shape.tp = tp;
  group.shape.pp = pp;
  if (parsed.stage_layers.has_value()) {
    if (parsed.stage_layers->value.size() != pp) {
      return refuse.At(parsed.stage_layers->where,
                       absl::StrCat("stage_layers lists ", parsed.stage_layers->value.size(),
                                    " stages for pp ", pp));
    }
    group.shape.stage_layers = parsed.stage_layers->value;
  }

  std::vector<const Located<GroupRankEndpoint>*> by_rank(size, nullptr);
  std::map<std::string, const Located<GroupRankEndpoint>*> by_socket;
  for (const Located<GroupRankEndpoint>& entry : parsed.ranks) {
    const GroupRankEndpoint& endpoint = entry.value;
    if (endpoint.rank >= size) {
      return refuse.At(entry.where, absl::StrCat("rank ", endpoint.rank, " is outside tp ", tp,
                                                 " x pp ", pp, " = ", size, " ranks"));
    }
    if (by_rank[endpoint.rank] != nullptr) {
      return refuse.At(entry.where, absl::StrCat("rank ", endpoint.rank, " given twice (",
                                                 by_rank[endpoint.rank]->where, " and here)"));
    }
    by_rank[endpoint.rank] = &entry;
    RETURN_IF_ERROR(CheckSocketPath(refuse, entry.where,
                                    absl::StrCat("rank ", endpoint.rank, "'s socket"),
                                    endpoint.socket));
    if (!endpoint.admin_socket.empty()) {
      RETURN_IF_ERROR(CheckSocketPath(refuse, entry.where,
                                      absl::StrCat("rank ", endpoint.rank, "'s admin socket"),
                                      endpoint.admin_socket));
    }
    for (const std::string* socket : {&endpoint.socket, &endpoint.admin_socket}) {
      if (socket->empty()) continue;
      auto [it, inserted] = by_socket.emplace(*socket, &entry);
      if (!inserted) {
        return refuse.At(entry.where,
                         absl::StrCat("socket ", *socket, " of rank ", endpoint.rank,
                                      " is rank ", it->second->value.rank, "'s too (",
                                      it->second->where, "): one daemon serves one rank"));
      }
    }
  }
  std::vector<std::string> missing;
  for (uint64_t rank = 0; rank < size; ++rank) {
    if (by_rank[rank] == nullptr) missing.push_back(absl::StrCat(rank));
  }
  if (!missing.empty()) {
    const size_t shown = std::min<size_t>(missing.size(), 8);
    return refuse.Whole(absl::StrCat(
        missing.size(), " of tp ", tp, " x pp ", pp, " = ", size, " ranks have no `rank` line: ",
        absl::StrJoin(missing.begin(), missing.begin() + shown, ", "),
        missing.size() > shown ? ", ..." : ""));
  }
  for (const Located<GroupRankEndpoint>* entry : by_rank) group.ranks.push_back(entry->value);
  return group;
}

}  // namespace

absl::StatusOr<GroupFile> ParseGroupFile(absl::string_view text, absl::string_view source) {
  const Refusal refuse(absl::StrCat("group file ", source));
  if (text.size() > kMaxGroupFileBytes) {
    return refuse.Whole(absl::StrCat(text.size(), " bytes is over the limit of ",
                                     kMaxGroupFileBytes));
  }
  ParsedGroup parsed;
  uint64_t line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    RETURN_IF_ERROR(ParseLine(refuse, absl::StrCat("line ", line_number), fields, parsed));
    if (parsed.ranks.size() > kMaxGroupRanks) {
      return refuse.At(absl::StrCat("line ", line_number),
                       absl::StrCat("more than ", kMaxGroupRanks, " `rank` lines"));
    }
  }
  return Finish(refuse, std::move(parsed));
}

absl::StatusOr<GroupFile> ReadGroupFile(const std::string& path) {
  FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return PosixError(absl::StrCat("group file ", path), errno);
  std::string text;
  char buffer[1 << 14];
  size_t got = 0;
  while (text.size() <= kMaxGroupFileBytes &&
         (got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) {
    text.append(buffer, got);
  }
  const bool failed = std::ferror(file) != 0;
  const int read_errno = errno;
  std::fclose(file);
  if (failed) return PosixError(absl::StrCat("group file ", path), read_errno);
  return ParseGroupFile(text, path);
}

absl::StatusOr<GroupFile> GroupFromSockets(absl::string_view name, const GroupShape& shape,
                                           const std::vector<std::string>& sockets,
                                           absl::string_view source) {
  const Refusal refuse(source);
  ParsedGroup parsed;
  if (!ValidName(name)) {
    return refuse.Whole(absl::StrCat("group name \"", name, "\" is not 1..", kMaxGroupNameBytes,
                                     " of [A-Za-z0-9._-]"));
  }
  if (sockets.size() > kMaxGroupRanks) {
    return refuse.Whole(absl::StrCat(sockets.size(), " sockets: a group has at most ",
                                     kMaxGroupRanks, " ranks"));
  }
  parsed.name = Located<std::string>{std::string(name), "name"};
  parsed.tp = Located<uint32_t>{shape.tp, "tp"};
  parsed.pp = Located<uint32_t>{shape.pp, "pp"};
  if (!shape.stage_layers.empty()) {
    parsed.stage_layers = Located<std::vector<uint32_t>>{shape.stage_layers, "stage_layers"};
  }
  if (sockets.size() != uint64_t{shape.tp} * shape.pp) {
    return refuse.Whole(absl::StrCat(sockets.size(), " sockets for tp ", shape.tp, " x pp ",
                                     shape.pp, " = ", uint64_t{shape.tp} * shape.pp, " ranks"));
  }
  for (uint32_t rank = 0; rank < sockets.size(); ++rank) {
    parsed.ranks.push_back({GroupRankEndpoint{rank, sockets[rank], ""},
                            absl::StrCat("entry ", rank)});
  }
  return Finish(refuse, std::move(parsed));
}

}  // namespace memra
