#include "tools/kvctl_render.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "core/admission.h"
#include "core/group_layout.h"
#include "core/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "tools/text_format.h"

namespace memra::kvctl {
namespace {

namespace pb = ::memra::kv::v1;
using Align = TextTable::Align;

std::string Count(uint64_t n, absl::string_view one, absl::string_view many) {
  return absl::StrCat(n, " ", n == 1 ? one : many);
}

std::string Age(uint64_t milliseconds) {
  return absl::StrCat(absl::FormatDuration(absl::Milliseconds(milliseconds)), " ago");
}

std::string EngineTable(const google::protobuf::RepeatedPtrField<pb::EngineStatus>& engines) {
  if (engines.empty()) return "no engines attached\n";
  TextTable table({{"ENGINE", Align::kRight},
                   {"NAME"},
                   {"PID", Align::kRight},
                   {"UID", Align::kRight},
                   {"SCOPE"},
                   {"LEASE"},
                   {"SESSIONS", Align::kRight},
                   {"ALLOCATED", Align::kRight},
                   {"RESERVED", Align::kRight},
                   {"RESV", Align::kRight},
                   {"HEARTBEAT"}});
  for (const pb::EngineStatus& engine : engines) {
    table.AddRow({absl::StrCat(engine.engine_id()), engine.engine_name(),
                  absl::StrCat(engine.pid()), absl::StrCat(engine.uid()), engine.cache_scope(),
                  engine.awaiting_reattach() ? "re-adopted"
                  : engine.lease_live()      ? "live"
                                             : "ended",
                  absl::StrCat(engine.sessions()), FormatBytes(engine.allocated_bytes()),
                  FormatBytes(engine.reserved_bytes()), absl::StrCat(engine.reservations()),
                  Age(engine.last_heartbeat_age_ms())});
  }
  return table.Render();
}

// "now / after eviction / when empty" rows: the shape fit and max-context share.
class OutlookTable {
 public:
  OutlookTable()
      : table_({{""},
                {"NOW", Align::kRight},
                {"AFTER EVICTION", Align::kRight},
                {"WHEN EMPTY", Align::kRight}}) {}
  OutlookTable& Add(std::string label, std::string now, std::string after_eviction,
                    std::string when_empty) {
    table_.AddRow(
        {std::move(label), std::move(now), std::move(after_eviction), std::move(when_empty)});
    return *this;
  }
  std::string Render() const { return table_.Render(); }

 private:
  TextTable table_;
};

// The ledger an admission answer was computed from, after `first` (the session's size).
std::string Ledger(std::string first_label, std::string first_value, uint64_t free_bytes,
                   uint64_t evictable_bytes, uint64_t budget_bytes) {
  return FieldList()
      .Add(std::move(first_label), std::move(first_value))
      .Add("free", FormatBytes(free_bytes))
      .Add("evictable", FormatBytes(evictable_bytes))
      .Add("budget", FormatBytes(budget_bytes))
      .Render();
}

std::string KindName(int kind) {
  std::string name = pb::StateKind_Name(static_cast<pb::StateKind>(kind));
  absl::string_view short_name = name;
  absl::ConsumePrefix(&short_name, "STATE_KIND_");
  return std::string(short_name);
}

// "0-3,5,7-9": sorted layer indices as ranges.
std::string Ranges(const std::vector<uint32_t>& indices) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < indices.size();) {
    size_t j = i;
    while (j + 1 < indices.size() && indices[j + 1] == indices[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(indices[i]) : absl::StrCat(indices[i], "-", indices[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

// "device" / "pinned host" / "disk".
std::string MediumName(pb::PrefixMedium medium) {
  switch (medium) {
    case pb::PREFIX_MEDIUM_DEVICE:
      return "device";
    case pb::PREFIX_MEDIUM_PINNED_HOST:
      return "pinned host";
    case pb::PREFIX_MEDIUM_DISK:
      return "disk";
    case pb::PREFIX_MEDIUM_REMOTE:
      return "remote";
    default:
      return absl::StrCat("medium ", static_cast<int>(medium));
  }
}

// "device 12 MiB of 64 MiB (3 hits); disk 1 GiB of 8 GiB (2 hits, 40 in, 5 out)".
std::string RenderTiers(const pb::PrefixCacheStats& stats) {
  std::vector<std::string> tiers;
  for (const pb::PrefixTierStats& tier : stats.tiers()) {
    if (tier.medium() == pb::PREFIX_MEDIUM_REMOTE) {
      tiers.push_back(absl::StrCat("remote (", tier.hits(), " hits, ", tier.demotions(),
                                   " written, ", tier.promotions(), " pulled)"));
      continue;
    }
    std::string moved;
    if (tier.medium() != pb::PREFIX_MEDIUM_DEVICE) {
      moved = absl::StrCat(", ", tier.demotions(), " in, ", tier.promotions(), " out");
    }
    tiers.push_back(absl::StrCat(MediumName(tier.medium()), " ",
                                 FormatBytes(tier.stored_bytes()), " of ",
                                 FormatBytes(tier.budget_bytes()), " (", tier.hits(), " hits",
                                 moved, ")"));
  }
  return tiers.empty() ? "device only" : absl::StrJoin(tiers, "; ");
}

// "none", or "up; 12 written (3 MiB), 0 dropped, 0 errors; 4 pulled (1 MiB) in 2 restores; ...".
std::string RenderRemote(const pb::PrefixCacheStats& stats) {
  if (!stats.has_remote()) return "none";
  const pb::PrefixRemoteStats& r = stats.remote();
  return absl::StrCat(
      r.up() ? "up" : "DOWN (serving from local tiers; reconnecting)", "; ", r.writes(),
      " written (", FormatBytes(r.written_bytes()), "), ", r.dropped_writes(), " dropped, ",
      r.write_errors(), " write errors, ", FormatBytes(r.queued_bytes()), " queued; ",
      r.pulled_pieces(), " pulled (", FormatBytes(r.pulled_bytes()), ") in ", r.hits(),
      " restores; reads ", r.reads(), " ok (", r.partial_lookups(), " partly), ",
      r.read_errors(), " errors, ", r.read_timeouts(),
      " timeouts, ", r.read_refusals(), " refused; ", r.corrupt(), " corrupt, ",
      r.shape_mismatches(), " shape mismatches refused; breaker opened ", r.breaker_opens(),
      " times");
}

std::string RenderPrefixStats(const pb::PrefixCacheStats& stats) {
  return FieldList()
      .Add("stored", absl::StrCat(FormatBytes(stats.stored_bytes()), " in ", stats.entries(),
                                  " entries, ", stats.blocks(), " blocks of ",
                                  stats.block_tokens(), " tokens (shared blocks once)"))
      .Add("slabs", absl::StrCat(stats.slabs(), " (", FormatBytes(stats.slab_bytes()), "; ",
                                 FormatBytes(stats.slab_free_bytes()), " free in use, ",
                                 FormatBytes(stats.slab_empty_bytes()), " empty kept; ",
                                 absl::StrFormat("%.1f", stats.slab_fragmentation_ppm() / 1e4),
                                 "% fragmented)"))
      .Add("tiers", RenderTiers(stats))
      .Add("evictable", FormatBytes(stats.evictable_bytes()))
      .Add("pinned", FormatBytes(stats.pinned_bytes()))
      .Add("budget", FormatBytes(stats.budget_bytes()))
      .Add("lookups", absl::StrCat(stats.lookup_hits(), " hit, ", stats.lookup_partials(),
                                   " partial, ", stats.lookup_misses(), " miss"))
      .Add("restores", absl::StrCat(stats.restores(), " (", stats.tokens_restored(), " tokens)"))
      .Add("captures", absl::StrCat(stats.captures(), " (", stats.death_captures(),
                                    " from dead engines)"))
      .Add("evictions", absl::StrCat(stats.evicted_entries(), " evicted, ",
                                     stats.dropped_entries(), " dropped (checksum)"))
      .Add("remote", RenderRemote(stats))
      .Render();
}

// The least of one column over a group's ranks and the rank holding it, "N (rank R)".
template <typename Response>
std::string Least(const std::vector<Response>& ranks, uint64_t (Response::*field)() const) {
  std::vector<uint64_t> values;
  for (const Response& rank : ranks) values.push_back((rank.*field)());
  const uint32_t tightest = TightestRank(values).value_or(0);
  return absl::StrCat(values.empty() ? 0 : values[tightest], " (rank ", tightest, ")");
}

std::string GroupHeading(const GroupView& view) {
  return absl::StrCat("group ", view.name, ": tp ", view.tp, " x pp ", view.pp, " = ",
                      Count(view.ranks.size(), "rank", "ranks"), "\n\n");
}

// The rank columns every group table starts with.
std::vector<TextTable::Column> RankColumns(bool with_shard) {
  std::vector<TextTable::Column> columns = {
      {"RANK", Align::kRight}, {"STAGE", Align::kRight}, {"TP", Align::kRight}};
  if (with_shard) {
    columns.push_back({"LAYERS"});
    columns.push_back({"HEADS"});
  }
  return columns;
}

std::vector<std::string> RankCells(const GroupRankRow& row) {
  std::vector<std::string> cells = {absl::StrCat(row.rank), absl::StrCat(row.stage),
                                    absl::StrCat(row.tp_rank)};
  if (row.has_shard) {
    cells.push_back(absl::StrCat(row.layer_lo, "-", row.layer_hi - 1));
    cells.push_back(absl::StrCat(row.kv_shard + 1, "/", row.kv_shards));
  }
  return cells;
}

template <typename Response, typename Cells>
std::string RankTable(const GroupView& view, const std::vector<Response>& ranks,
                      std::vector<TextTable::Column> answer_columns, Cells answer_cells) {
  const bool with_shard = !view.ranks.empty() && view.ranks[0].has_shard;
  std::vector<TextTable::Column> columns = RankColumns(with_shard);
  columns.insert(columns.end(), answer_columns.begin(), answer_columns.end());
  columns.push_back({"SOCKET"});
  TextTable table(std::move(columns));
  for (size_t i = 0; i < ranks.size() && i < view.ranks.size(); ++i) {
    std::vector<std::string> cells = RankCells(view.ranks[i]);
    for (std::string& cell : answer_cells(ranks[i], i)) cells.push_back(std::move(cell));
    cells.push_back(view.ranks[i].socket);
    table.AddRow(std::move(cells));
  }
  return table.Render();
}

// JSON string literal (socket paths and names are the only free text here).
std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      absl::StrAppend(&out, "\\", std::string(1, c));
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(&out, absl::StrFormat("\\u%04x", static_cast<unsigned char>(c)));
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace

// "2 pending (1024 B), 1 confirmed (4096 B)", "none", or "-" when not listed.
std::string GroupReservations(const std::optional<pb::ListGroupRanksResponse>& listed) {
  if (!listed.has_value()) return "-";
  uint64_t pending = 0, pending_bytes = 0, confirmed = 0, confirmed_bytes = 0;
  for (const pb::GroupRankState& state : listed->ranks()) {
    if (state.phase() == pb::GROUP_RANK_PHASE_PENDING) {
      ++pending;
      pending_bytes += state.bytes();
    } else {
      ++confirmed;
      confirmed_bytes += state.bytes();
    }
  }
  if (pending + confirmed == 0) return "none";
  std::vector<std::string> parts;
  if (pending > 0) parts.push_back(absl::StrCat(pending, " pending (", pending_bytes, " B)"));
  if (confirmed > 0) {
    parts.push_back(absl::StrCat(confirmed, " confirmed (", confirmed_bytes, " B)"));
  }
  return absl::StrJoin(parts, ", ");
}

std::string RenderGroupStatus(
    const GroupView& view, const std::vector<pb::GetStatusResponse>& ranks,
    const std::vector<std::optional<pb::ListGroupRanksResponse>>& reservations) {
  std::vector<pb::AdmissionStatus> admissions;
  for (const pb::GetStatusResponse& rank : ranks) admissions.push_back(rank.admission());
  FieldList fields;
  fields.Add("least free", absl::StrCat(Least(admissions, &pb::AdmissionStatus::free_bytes),
                                        " B: a group request fits only where every rank's shard "
                                        "fits on its own daemon"));
  fields.Add("least evictable",
             absl::StrCat(Least(admissions, &pb::AdmissionStatus::evictable_bytes), " B"));
  uint32_t draining = 0;
  for (const pb::GetStatusResponse& rank : ranks) draining += rank.draining() ? 1 : 0;
  fields.Add("state", draining == 0 ? "serving"
                                    : absl::StrCat("DRAINING on ", draining,
                                                   " rank(s): the group admits nothing new"));
  const std::string table = RankTable(
      view, ranks,
      {{"STATE"},
       {"BUDGET", Align::kRight},
       {"ALLOCATED", Align::kRight},
       {"RESERVED", Align::kRight},
       {"FREE", Align::kRight},
       {"EVICTABLE", Align::kRight},
       {"SESSIONS", Align::kRight},
       {"ENGINES", Align::kRight},
       {"GROUP RESERVATIONS"}},
      [&](const pb::GetStatusResponse& rank, size_t index) -> std::vector<std::string> {
        const pb::AdmissionStatus& admission = rank.admission();
        return {rank.draining() ? "draining" : "serving",
                absl::StrCat(admission.budget_bytes()),
                absl::StrCat(admission.allocated_bytes()),
                absl::StrCat(admission.reserved_bytes()),
                absl::StrCat(admission.free_bytes()),
                absl::StrCat(admission.evictable_bytes()),
                absl::StrCat(rank.sessions()),
                absl::StrCat(rank.engines()),
                GroupReservations(index < reservations.size() ? reservations[index]
                                                              : std::nullopt)};
      });
  return absl::StrCat(GroupHeading(view), table, "\n", fields.Render());
}

std::string RenderGroupFit(const GroupView& view, const std::vector<pb::FitResponse>& ranks,
                           uint64_t context) {
  const std::string table = RankTable(
      view, ranks,
      {{"SESSION", Align::kRight},
       {"FREE", Align::kRight},
       {"NOW", Align::kRight},
       {"AFTER EVICTION", Align::kRight},
       {"WHEN EMPTY", Align::kRight}},
      [](const pb::FitResponse& fit, size_t) -> std::vector<std::string> {
        return {absl::StrCat(fit.session_bytes()), absl::StrCat(fit.free_bytes()),
                absl::StrCat(fit.sessions_now()), absl::StrCat(fit.sessions_after_eviction()),
                absl::StrCat(fit.sessions_when_empty())};
      });
  OutlookTable outlook;
  outlook.Add("sessions", Least(ranks, &pb::FitResponse::sessions_now),
              Least(ranks, &pb::FitResponse::sessions_after_eviction),
              Least(ranks, &pb::FitResponse::sessions_when_empty));
  outlook.Add("total tokens", Least(ranks, &pb::FitResponse::total_tokens_now), "-",
              Least(ranks, &pb::FitResponse::total_tokens_when_empty));
  return absl::StrCat(GroupHeading(view), "session of ", Count(context, "token", "tokens"),
                      " on every rank (bytes of each rank's shard)\n\n", table,
                      "\ngroup (the least over the ranks, and the rank that decides it):\n",
                      outlook.Render());
}

std::string RenderGroupMaxContext(const GroupView& view,
                                  const std::vector<pb::MaxContextResponse>& ranks) {
  const std::string table = RankTable(
      view, ranks,
      {{"FREE", Align::kRight},
       {"NOW", Align::kRight},
       {"AFTER EVICTION", Align::kRight},
       {"WHEN EMPTY", Align::kRight}},
      [](const pb::MaxContextResponse& max, size_t) -> std::vector<std::string> {
        return {absl::StrCat(max.free_bytes()), absl::StrCat(max.max_context_now()),
                absl::StrCat(max.max_context_after_eviction()),
                absl::StrCat(max.max_context_when_empty())};
      });
  OutlookTable outlook;
  outlook.Add("max context", Least(ranks, &pb::MaxContextResponse::max_context_now),
              Least(ranks, &pb::MaxContextResponse::max_context_after_eviction),
              Least(ranks, &pb::MaxContextResponse::max_context_when_empty));
  return absl::StrCat(GroupHeading(view), "max context tokens of each rank's shard\n\n", table,
                      "\ngroup (the least over the ranks, and the rank that decides it):\n",
                      outlook.Render());
}

absl::StatusOr<std::string> RenderGroupJson(
    const GroupView& view, const std::vector<const google::protobuf::Message*>& answers,
    const std::vector<std::optional<pb::ListGroupRanksResponse>>& reservations) {
  std::vector<std::string> ranks;
  for (size_t i = 0; i < view.ranks.size() && i < answers.size(); ++i) {
    const GroupRankRow& row = view.ranks[i];
    ASSIGN_OR_RETURN(const std::string answer, RenderJson(*answers[i]));
    std::string shard;
    if (row.has_shard) {
      shard = absl::StrCat("\"layer_lo\":", row.layer_lo, ",\"layer_hi\":", row.layer_hi,
                           ",\"kv_shard\":", row.kv_shard, ",\"kv_shards\":", row.kv_shards, ",");
    }
    std::string listed;
    if (i < reservations.size() && reservations[i].has_value()) {
      ASSIGN_OR_RETURN(const std::string json, RenderJson(*reservations[i]));
      listed = absl::StrCat(",\"group_reservations\":", json);
    }
    ranks.push_back(absl::StrCat("{\"rank\":", row.rank, ",\"socket\":", JsonString(row.socket),
                                 ",\"stage\":", row.stage, ",\"tp_rank\":", row.tp_rank, ",",
                                 shard, "\"answer\":", answer, listed, "}"));
  }
  return absl::StrCat("{\"group\":", JsonString(view.name), ",\"tp\":", view.tp,
                      ",\"pp\":", view.pp, ",\"ranks\":[", absl::StrJoin(ranks, ","), "]}");
}

absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  const google::protobuf::util::Status status =
      google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot print ", message.GetTypeName(), " as JSON: ", status.ToString()));
  }
  return json;
}

std::string RenderStatus(const pb::GetStatusResponse& status) {
  const pb::AdmissionStatus& admission = status.admission();
  FieldList fields;
  fields.Add("backend", status.backend());
  fields.Add("device", status.device_uuid().empty()
                           ? status.device_name()
                           : absl::StrCat(status.device_name(), " (", status.device_uuid(), ")"));
  if (status.device_total_bytes() > 0) {
    fields.Add("device memory", absl::StrCat(FormatBytes(status.device_total_bytes()), " total, ",
                                             FormatBytes(status.device_free_bytes()), " free"));
  }
  fields.Add("uptime",
             absl::StrFormat("%s (epoch %016x)",
                             absl::FormatDuration(absl::Trunc(
                                 absl::Milliseconds(status.uptime_ms()), absl::Seconds(1))),
                             status.epoch()));
  fields.Add("state",
             status.draining() ? "DRAINING: new engines and sessions get UNAVAILABLE" : "serving");
  // Whether the KV survives a daemon crash (docs/failure-model.md#the-daemon-dies).
  if (status.restart_survival() == pb::RESTART_SURVIVAL_ON) {
    fields.Add("restarts", absl::StrCat("KV survives a daemon crash (",
                                        status.restart_survival_detail(), ")"));
  } else if (status.restart_survival() == pb::RESTART_SURVIVAL_LOST) {
    fields.Add("restarts", absl::StrCat("SURVIVAL LOST: ", status.restart_survival_detail()));
  } else if (status.restart_survival() == pb::RESTART_SURVIVAL_OFF) {
    fields.Add("restarts", absl::StrCat("KV does not survive a daemon crash (",
                                        status.restart_survival_detail(), ")"));
  }
  if (status.prefix_remote_tier() == pb::REMOTE_TIER_UP) {
    fields.Add("prefix remote tier", "up");
  } else if (status.prefix_remote_tier() == pb::REMOTE_TIER_DOWN) {
    fields.Add("prefix remote tier",
               "DOWN: the Redis Cluster does not answer; serving from local tiers, reconnecting");
  }
  fields.Add("sessions",
             absl::StrCat(status.sessions(), " in ", Count(status.arena_count(), "arena", "arenas"),
                          " of ", FormatBytes(status.allocated_bytes())));
  fields.Add("engines", absl::StrCat(status.engines()));
  fields.Add("plans", absl::StrCat(status.plans(), " registered"));
  fields.Add("admission", admission.budget_rule());
  fields.Add("  budget", FormatBytes(admission.budget_bytes()));
  fields.Add("  allocated", FormatBytes(admission.allocated_bytes()));
  fields.Add("  reserved",
             absl::StrCat(FormatBytes(admission.reserved_bytes()), " in ",
                          Count(admission.reservations(), "reservation", "reservations")));
  fields.Add("  free", FormatBytes(admission.free_bytes()));
  fields.Add("  evictable", FormatBytes(admission.evictable_bytes()));
  if (admission.over_budget_bytes() > 0) {
    fields.Add("  OVER BUDGET", FormatBytes(admission.over_budget_bytes()));
  }
  fields.Add("  granularity", FormatBytes(admission.granularity_bytes()));
  return absl::StrCat(fields.Render(), "\n", EngineTable(status.engine_status()));
}

std::string RenderEngines(const pb::ListEnginesResponse& engines) {
  return EngineTable(engines.engines());
}

std::string RenderSessions(const pb::ListSessionsResponse& sessions) {
  if (sessions.sessions().empty()) return "no sessions\n";
  TextTable table({{"SESSION", Align::kRight},
                   {"ENGINE", Align::kRight},
                   {"MODEL"},
                   {"CAPACITY", Align::kRight},
                   {"LENGTH", Align::kRight},
                   {"ARENA", Align::kRight},
                   {"LAYOUT", Align::kRight},
                   {"STATE"},
                   {"FINGERPRINT"}});
  uint64_t total_bytes = 0;
  for (const pb::SessionSummary& session : sessions.sessions()) {
    std::vector<std::string> flags;
    if (session.in_transaction()) flags.push_back("txn");
    if (session.tainted()) flags.push_back("tainted");
    table.AddRow({absl::StrCat(session.session_id()), absl::StrCat(session.engine_id()),
                  session.model_name(), absl::StrCat(session.capacity()),
                  absl::StrCat(session.logical_len()), FormatBytes(session.arena_bytes()),
                  absl::StrCat(session.layout_version()),
                  flags.empty() ? "ok" : absl::StrJoin(flags, ","),
                  HexBytes(session.plan_fingerprint())});
    total_bytes += session.arena_bytes();
  }
  return absl::StrCat(table.Render(), Count(sessions.sessions_size(), "session", "sessions"), ", ",
                      FormatBytes(total_bytes), "\n");
}

std::string RenderCost(const pb::CostResponse& cost) {
  const pb::CostBreakdown& breakdown = cost.breakdown();
  FieldList fields;
  fields.Add("model", cost.model_name());
  fields.Add("fingerprint", HexBytes(cost.plan_fingerprint()));
  fields.Add("context",
             absl::StrCat(cost.capacity(), " tokens, ", Count(cost.layers(), "layer", "layers")));
  fields.Add("cost", absl::StrCat(FormatBytes(cost.arena_bytes()),
                                  "  (admission charges and the backend allocates this)"));
  fields.Add("per token", absl::StrCat(FormatBytes(breakdown.bytes_per_token()),
                                       "  (what one more token adds at this context)"));
  // The classes are coefficients: sliding rows stop scaling at the ring's cap, and past it
  // their bytes are in `fixed`.
  fields.Add("full K/V", absl::StrCat(FormatBytes(breakdown.kv_bytes_per_token()), " a token"));
  fields.Add("sliding K/V", absl::StrCat(FormatBytes(breakdown.ring_bytes_per_token()), " a token",
                                         breakdown.ring_row_cap() == 0
                                             ? " (no ring)"
                                             : absl::StrCat(", up to the ring's ",
                                                            breakdown.ring_row_cap(), " rows")));
  fields.Add("latent", absl::StrCat(FormatBytes(breakdown.latent_bytes_per_token()), " a token"));
  fields.Add("fixed", FormatBytes(breakdown.fixed_bytes()));
  fields.Add("planes", FormatBytes(breakdown.total_plane_bytes()));
  fields.Add("granularity", FormatBytes(cost.granularity_bytes()));
  return fields.Render();
}

std::string RenderFit(const pb::FitResponse& fit, uint64_t context) {
  OutlookTable outlook;
  outlook.Add("sessions", absl::StrCat(fit.sessions_now()),
              absl::StrCat(fit.sessions_after_eviction()), absl::StrCat(fit.sessions_when_empty()));
  outlook.Add("total tokens", absl::StrCat(fit.total_tokens_now()), "-",
              absl::StrCat(fit.total_tokens_when_empty()));
  return absl::StrCat(Ledger("session",
                             absl::StrCat(FormatBytes(fit.session_bytes()), " at ",
                                          Count(context, "token", "tokens")),
                             fit.free_bytes(), fit.evictable_bytes(), fit.budget_bytes()),
                      "\n", outlook.Render());
}

std::string RenderMaxContext(const pb::MaxContextResponse& max) {
  OutlookTable outlook;
  outlook.Add("max context", absl::StrCat(max.max_context_now()),
              absl::StrCat(max.max_context_after_eviction()),
              absl::StrCat(max.max_context_when_empty()));
  return absl::StrCat(
      Ledger("session",
             absl::StrCat(FormatBytes(max.session_bytes_now()), " at the max context now"),
             max.free_bytes(), max.evictable_bytes(), max.budget_bytes()),
      "\n", outlook.Render());
}

std::string RenderImport(const pb::ImportModelResponse& imported) {
  const pb::ModelPlan& plan = imported.plan();
  const std::string fingerprint = HexBytes(imported.plan_fingerprint());
  FieldList fields;
  fields.Add("architecture", imported.architecture());
  fields.Add("name", plan.name());
  fields.Add("fingerprint", fingerprint);
  fields.Add("registered", imported.registered()
                               ? absl::StrCat("yes: --model=", fingerprint, " names it")
                               : "no (--register keeps it in the daemon)");
  fields.Add("layers",
             absl::StrCat(plan.layers_size(), " trunk + ", plan.mtp_blocks_size(), " MTP"));
  fields.Add("kv formats", absl::StrCat(imported.kv_formats(), " (", imported.kv_dtype(), ")"));
  fields.Add("swa ring", plan.swa_ring() ? "on" : "off");
  fields.Add("index ring", plan.has_index_ring_rows()
                               ? absl::StrCat(plan.index_ring_rows(), " rows")
                               : "default working rows");
  std::map<int, std::vector<uint32_t>> by_kind;
  for (const auto* layers : {&plan.layers(), &plan.mtp_blocks()}) {
    for (const pb::LayerPlan& layer : *layers) by_kind[layer.kind()].push_back(layer.index());
  }
  TextTable kinds({{"KIND"}, {"LAYERS", Align::kRight}, {"INDICES"}});
  for (const auto& [kind, indices] : by_kind) {
    kinds.AddRow({KindName(kind), absl::StrCat(indices.size()), Ranges(indices)});
  }
  return absl::StrCat(fields.Render(), "\n", kinds.Render());
}

std::string RenderPrefixes(const pb::ListPrefixesResponse& prefixes) {
  TextTable table({{"ENTRY", Align::kRight},
                   {"SCOPE"},
                   {"SHAPE"},
                   {"TOKENS", Align::kRight},
                   {"BLOCKS", Align::kRight},
                   {"BLOCK BYTES", Align::kRight},
                   {"BOUNDARY BYTES", Align::kRight},
                   {"MEDIUM"},
                   {"PINS", Align::kRight},
                   {"LAST USE", Align::kRight},
                   {"SOURCE"}});
  for (const pb::PrefixEntry& entry : prefixes.entries()) {
    // A block store entry is one block of an engine's own pool; SHAPE is then its layout.
    const std::string source = entry.from_engine_pool()
                                   ? absl::StrCat("engine ", entry.engine_id(), " pool block")
                                   : "session";
    table.AddRow({absl::StrCat(entry.entry_id()), entry.cache_scope(),
                  HexBytes(entry.shape_fingerprint()).substr(0, 16),
                  absl::StrCat(entry.boundary_tokens()), absl::StrCat(entry.blocks()),
                  FormatBytes(entry.block_bytes()), FormatBytes(entry.boundary_bytes()),
                  MediumName(entry.medium()), absl::StrCat(entry.pins()),
                  absl::StrCat(entry.last_use_tick()), source});
  }
  return absl::StrCat(table.Render(), Count(prefixes.entries_size(), "entry", "entries"), "\n\n",
                      RenderPrefixStats(prefixes.stats()));
}

std::string RenderEvict(const pb::EvictPrefixResponse& evicted) {
  return absl::StrCat("freed ", FormatBytes(evicted.freed_bytes()), "\n",
                      RenderPrefixStats(evicted.stats()));
}

std::string RenderDrain(const pb::DrainResponse& drained) {
  return absl::StrCat("draining: new engines and sessions get UNAVAILABLE; ",
                      Count(drained.sessions_open(), "session stays", "sessions stay"),
                      " open until released\n");
}

std::string RefusalDetails(const absl::Status& status) {
  const std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(status);
  if (!refusal.has_value()) return "";
  return FieldList()
      .Add("  needed", FormatBytes(refusal->needed))
      .Add("  free", FormatBytes(refusal->free))
      .Add("  evictable", FormatBytes(refusal->evictable))
      .Add("  budget", FormatBytes(refusal->budget))
      .Add("  to evict", refusal->bytes_to_evict > 0
                             ? FormatBytes(refusal->bytes_to_evict)
                             : "0 B (it does not fit even after evicting the prefix cache)")
      .Render();
}

}  // namespace memra::kvctl
