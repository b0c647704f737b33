#include "server/parts_factory.h"

#include <sys/resource.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/admission.h"
#include "core/status_macros.h"
#include "server/device/pinned_host_memory.h"
#include "spdlog/spdlog.h"

namespace memra {

std::pair<uint64_t, std::string> BudgetFor(const DaemonConfig& config, DeviceBackend& backend) {
  const DeviceInfo info = backend.Info();
  if (config.backend == Backend::kCuda) {
    return {UsableCudaBudget(info.total_bytes, config.admission.cuda_memory_fraction,
                             config.admission.cuda_reserve_bytes),
            absl::StrCat("cuda: ", config.admission.cuda_memory_fraction, " x ", info.total_bytes,
                         " total - ", config.admission.cuda_reserve_bytes, " reserve")};
  }
  const uint64_t bytes =
      std::min(UsableHostBudget(config.admission.budget_bytes), info.total_bytes);
  if (bytes < config.admission.budget_bytes) {
    return {bytes, absl::StrCat("host: budget_bytes ", config.admission.budget_bytes,
                                " capped at the backend's start-up capacity ", info.total_bytes)};
  }
  return {bytes, absl::StrCat("host: budget_bytes ", bytes)};
}

std::unique_ptr<DeviceBudget> MakeDeviceBudget(const DaemonConfig& config,
                                               DeviceBackend& backend) {
  auto [budget_bytes, rule] = BudgetFor(config, backend);
  const uint64_t max_arenas = EffectiveMaxArenas(config);
  const AdmissionLimits limits{.max_arenas = max_arenas,
                               .owner_share_percent = config.admission.max_engine_budget_share,
                               .max_owner_arenas = EffectiveMaxEngineArenas(config, max_arenas)};
  spdlog::info(
      "admission budget {} bytes ({}); at most {} arenas ({} per engine), {}% of the budget per "
      "engine",
      budget_bytes, rule, limits.max_arenas, limits.max_owner_arenas, limits.owner_share_percent);
  auto budget = std::make_unique<DeviceBudget>(budget_bytes, rule, limits);
  return budget;
}

namespace {

// Handoff connections the descriptor shares hold, each at its most (open: socket and pending
// descriptors; in flight: unread answers).
uint64_t HandoffConnectionsFor(const DescriptorShares& shares) {
  return std::max<uint64_t>(
      1, std::min(shares.handoff_descriptors / ArenaHandoff::kOpenDescriptorsPerConnection,
                  shares.in_flight / ArenaHandoff::kInFlightDescriptorsPerConnection));
}

// How the handoff connection limit was derived, for its refusal and the start-up log.
std::string HandoffConnectionsSource(const DaemonConfig& config, const DescriptorShares& shares) {
  return absl::StrCat("max_attached_engines ", config.leases.max_engines, " or RLIMIT_NOFILE ",
                      shares.open_files, "'s shares: ", shares.handoff_descriptors,
                      " descriptors open, ", ArenaHandoff::kOpenDescriptorsPerConnection,
                      " per connection; ", shares.in_flight, " in flight, ",
                      ArenaHandoff::kInFlightDescriptorsPerConnection, " per connection");
}

}  // namespace

DescriptorShares OwnDescriptorShares() {
  rlimit open_files{};
  uint64_t limit = UINT64_MAX;
  if (getrlimit(RLIMIT_NOFILE, &open_files) == 0 && open_files.rlim_cur != RLIM_INFINITY) {
    limit = open_files.rlim_cur;
  }
  return ShareDescriptors(limit);
}

void LimitByDescriptors(DaemonConfig& config) {
  const DescriptorShares shares = OwnDescriptorShares();
  const uint64_t arenas = EffectiveMaxArenas(config);
  config.admission.max_arenas = std::min(arenas, shares.arenas);
  ConnectionGate::Limits& connections = config.connections;
  connections.max_connections = std::min(connections.max_connections, shares.connections);
  connections.max_connections_per_uid =
      std::min(connections.max_connections_per_uid, connections.max_connections);
  config.block_store.max_offers =
      std::min<size_t>(config.block_store.max_offers, shares.block_store_offers);
  const uint64_t engines = config.leases.max_engines;
  spdlog::info(
      "descriptors: RLIMIT_NOFILE {} ({} kept for the daemon): at most {} arenas (max_arenas or "
      "vm.max_map_count: {}; descriptors: {}), {} gRPC connections per socket and {} per uid "
      "(max_connections or descriptors: {}), {} handoff connections ({}), {} step channels "
      "(max_attached_engines or descriptors: {}), {} block store offers (block_store_max_offers "
      "or descriptors: {})",
      shares.open_files, kReservedDescriptors, config.admission.max_arenas, arenas, shares.arenas,
      connections.max_connections, connections.max_connections_per_uid, shares.connections,
      std::min(engines, HandoffConnectionsFor(shares)), HandoffConnectionsSource(config, shares),
      std::min(engines, shares.step_channels), shares.step_channels,
      config.block_store.max_offers, shares.block_store_offers);
}

ArenaHandoff::Options HandoffOptionsOf(const DaemonConfig& config, const DescriptorShares& shares,
                                       uint64_t instance) {
  ArenaHandoff::Options options;
  options.path = config.HandoffSocketPath();
  options.group = config.sockets.socket_group;
  options.mode = config.sockets.socket_mode;
  options.max_connections = static_cast<size_t>(
      std::min<uint64_t>(config.leases.max_engines, HandoffConnectionsFor(shares)));
  options.max_connections_source = HandoffConnectionsSource(config, shares);
  // Connections with no engine yet: one uid may hold at most half of them.
  options.max_unbound_per_uid =
      std::min(options.max_unbound_per_uid, std::max<size_t>(1, options.max_connections / 2));
  options.instance = instance;
  return options;
}

StepChannels::Options StepChannelOptionsOf(const DaemonConfig& config,
                                           const DescriptorShares& shares) {
  StepChannels::Options options;
  options.max_channels =
      static_cast<size_t>(std::min<uint64_t>(config.leases.max_engines, shares.step_channels));
  options.max_channels_source =
      absl::StrCat("max_attached_engines ", config.leases.max_engines, " or RLIMIT_NOFILE ",
                   shares.open_files, "'s share: ", shares.step_channels, ", an eventfd each");
  return options;
}

ConcurrencyLimit::Limits EventStreamLimits(const DaemonConfig& config, bool per_engine) {
  return {.total = config.sockets.max_event_streams,
          .total_name = "max_event_streams, per socket",
          .per_key = per_engine ? config.sockets.max_engine_event_streams : 0,
          .per_key_name = "max_engine_event_streams"};
}

BlockStoreLimits BlockStoreLimitsOf(const DaemonConfig& config) {
  BlockStoreLimits limits = config.block_store;
  // One engine may keep at most a quarter of the device tier's budget from eviction.
  limits.pinned_bytes_per_engine = config.prefix.budget_bytes / 4;
  // Daemon-wide caps split fairly (docs/security-model.md#resources): one engine may map a
  // quarter of the buffers, and hold half of the offers (at most a registration's worth).
  limits.mapped_buffers_per_engine =
      std::max<size_t>(1, limits.max_mapped_buffers / kBlockStoreEngineShareDivisor);
  limits.offers_per_engine =
      std::clamp<size_t>(limits.max_offers / 2, 1, BlockStoreLimits{}.offers_per_engine);
  return limits;
}

absl::StatusOr<std::unique_ptr<PrefixCache>> MakePrefixCache(const DaemonConfig& config,
                                                             DeviceBackend* backend,
                                                             DeviceBudget* budget,
                                                             uint64_t epoch) {
  if (config.prefix.budget_bytes == 0) return nullptr;
  PrefixCacheOptions options = config.prefix;
  if (!config.prefix_remote.cluster.seed_nodes.empty()) options.remote = config.prefix_remote;
  std::unique_ptr<HostMemoryProvider> host_memory;
  if (config.prefix.host_tier_bytes > 0) {
    if (config.prefix_host_tier_memory == PrefixHostMemory::kPinned) {
      ASSIGN_OR_RETURN(host_memory, NewCudaPinnedHostMemory());
    } else {
      host_memory = NewPlainHostMemory();
    }
  }
  // The daemon's random epoch: a router tells a restarted daemon from a reconnect (0 means
  // "any epoch" to a subscriber, so it is never used).
  options.epoch = epoch == 0 ? 1 : epoch;
  ASSIGN_OR_RETURN(std::unique_ptr<PrefixCache> cache,
                   PrefixCache::Create(options, backend, budget, std::move(host_memory)));
  cache->InstallEvictor(*budget);
  return cache;
}

}  // namespace memra
