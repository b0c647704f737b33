#include "server/store/remote/remote_tier_metrics.h"

#include <iterator>
#include <utility>
#include <vector>

#include "core/status_macros.h"
#include "server/store/remote/redis_cluster.h"

namespace memra {

using metrics::CallbackSample;

absl::Status RegisterRemoteTierMetrics(std::function<std::optional<RemoteTierStats>()> read_stats,
                                       metrics::Registry& registry) {
  auto remote = [read_stats](auto read) {
    return [read_stats, read]() -> std::vector<CallbackSample> {
      const std::optional<RemoteTierStats> stats = read_stats();
      if (!stats.has_value()) return {};
      return read(*stats);
    };
  };
  RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
      "memra_prefix_remote_up",
      "1 while the remote tier's Redis Cluster answers (client made, circuit breaker closed).",
      {}, remote([](const RemoteTierStats& r) {
        return std::vector<CallbackSample>{{.label_values = {}, .value = r.up ? 1.0 : 0.0}};
      })));
  RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
      "memra_prefix_remote_writes",
      "Remote-tier writes by result (written, dropped: queue full or tier down, error), since "
      "start.",
      {"result"}, remote([](const RemoteTierStats& r) {
        return std::vector<CallbackSample>{
            {.label_values = {"written"}, .value = static_cast<double>(r.writes)},
            {.label_values = {"dropped"}, .value = static_cast<double>(r.dropped_writes)},
            {.label_values = {"error"}, .value = static_cast<double>(r.write_errors)}};
      })));
  RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
      "memra_prefix_remote_reads",
      "Remote-tier reads by result (ok, error, timeout: past the caller's deadline, refused: "
      "tier down or readers busy), since start.",
      {"result"}, remote([](const RemoteTierStats& r) {
        return std::vector<CallbackSample>{
            {.label_values = {"ok"}, .value = static_cast<double>(r.reads)},
            {.label_values = {"error"}, .value = static_cast<double>(r.read_errors)},
            {.label_values = {"timeout"}, .value = static_cast<double>(r.read_timeouts)},
            {.label_values = {"refused"}, .value = static_cast<double>(r.read_refusals)}};
      })));
  RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
      "memra_prefix_remote_refused_values",
      "Remote values refused by a restore (corrupt: DATA_LOSS, deleted; shape_mismatch: "
      "another build or plan), since start.",
      {"reason"}, remote([](const RemoteTierStats& r) {
        return std::vector<CallbackSample>{
            {.label_values = {"corrupt"}, .value = static_cast<double>(r.corrupt)},
            {.label_values = {"shape_mismatch"},
             .value = static_cast<double>(r.shape_mismatches)}};
      })));
  const std::pair<const char*, const char*> remote_help[] = {
      {"memra_prefix_remote_written_bytes", "Bytes of values the remote tier wrote, since start."},
      {"memra_prefix_remote_pulled_bytes",
       "Bytes of verified pieces restores pulled from the remote tier, since start."},
      {"memra_prefix_remote_queued_bytes", "Bytes queued for the remote tier's writer."},
      {"memra_prefix_remote_breaker_opens",
       "Times the remote tier's circuit breaker opened (cluster down), since start."},
      {"memra_prefix_remote_partial_lookups",
       "Remote-tier lookups answered for some keys only (a node down or in back-off: its keys "
       "read as misses; also counted as reads ok), since start."},
  };
  uint64_t RemoteTierStats::*const remote_fields[] = {
      &RemoteTierStats::written_bytes, &RemoteTierStats::pulled_bytes,
      &RemoteTierStats::queued_bytes, &RemoteTierStats::breaker_opens,
      &RemoteTierStats::partial_lookups};
  for (size_t i = 0; i < std::size(remote_fields); ++i) {
    RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        remote_help[i].first, remote_help[i].second, {},
        remote([field = remote_fields[i]](const RemoteTierStats& r) {
          return std::vector<CallbackSample>{
              {.label_values = {}, .value = static_cast<double>(r.*field)}};
        })));
  }
  RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
      "memra_prefix_remote_cluster_events",
      "The Redis Cluster client's counters (moved, ask: redirects followed; refresh: slot maps "
      "applied; connect; connection_failure; node_down_refusal: calls refused without I/O "
      "while their node was in back-off), since start.",
      {"event"}, remote([](const RemoteTierStats& r) {
        const RedisClusterStats& c = r.cluster;
        return std::vector<CallbackSample>{
            {.label_values = {"moved"}, .value = static_cast<double>(c.moved_redirects)},
            {.label_values = {"ask"}, .value = static_cast<double>(c.ask_redirects)},
            {.label_values = {"refresh"}, .value = static_cast<double>(c.slot_map_refreshes)},
            {.label_values = {"connect"}, .value = static_cast<double>(c.connects)},
            {.label_values = {"connection_failure"},
             .value = static_cast<double>(c.connection_failures)},
            {.label_values = {"node_down_refusal"},
             .value = static_cast<double>(c.node_down_refusals)}};
      })));
  return absl::OkStatus();
}

}  // namespace memra
