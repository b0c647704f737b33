#ifndef MEMRA_SERVER_PARTS_FACTORY_H_
#define MEMRA_SERVER_PARTS_FACTORY_H_

// What the composition root (server/daemon.h) builds from the configuration before it wires the
// parts: the admission budget and the prefix cache, and the limits derived from the
// configuration and the machine. The parts take their sections of DaemonConfig as they are
// (server/config.h); what is here is what a section alone does not say.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "server/base/concurrency_limit.h"
#include "server/config.h"
#include "server/device/backend.h"
#include "server/device/device_budget.h"
#include "server/edge/arena_handoff.h"
#include "server/edge/step_channel.h"
#include "server/store/block_store.h"
#include "server/store/prefix_cache.h"

namespace memra {

// The admission budget the configuration and the device allow, and how it was derived.
// Host: budget_bytes, capped at the capacity the backend was created with (it cannot grow).
// CUDA: cuda_memory_fraction of the device's TOTAL memory minus cuda_reserve_bytes.
std::pair<uint64_t, std::string> BudgetFor(const DaemonConfig& config, DeviceBackend& backend);

// The one admission budget: BudgetFor, with the arena limits in force (EffectiveMaxArenas,
// EffectiveMaxEngineArenas) and max_engine_budget_share; logs what it admits.
std::unique_ptr<DeviceBudget> MakeDeviceBudget(const DaemonConfig& config, DeviceBackend& backend);

// The daemon's own RLIMIT_NOFILE (soft; unlimited or unreadable: no cap), shared out.
DescriptorShares OwnDescriptorShares();

// Caps max_arenas, max_connections and block_store_max_offers by the daemon's own RLIMIT_NOFILE
// (ShareDescriptors), and says so with the caps the daemon applies to its handoff connections
// and step channels (Daemon::HandoffOptions, StepChannelOptions).
void LimitByDescriptors(DaemonConfig& config);

// The handoff socket's options: its path and mode, and its connection limits (max_attached_engines
// or the descriptor shares, whichever allows fewer; a uid's unbound connections at most half).
ArenaHandoff::Options HandoffOptionsOf(const DaemonConfig& config, const DescriptorShares& shares,
                                       uint64_t instance);

// The step channels' options: at most one channel per attached engine, capped by the shares.
StepChannels::Options StepChannelOptionsOf(const DaemonConfig& config,
                                           const DescriptorShares& shares);

// SubscribeEvents streams of one socket: per engine on the engine socket, and all together.
ConcurrencyLimit::Limits EventStreamLimits(const DaemonConfig& config, bool per_engine);

// The block store's limits: the configured ones, and the per-engine shares derived from them.
BlockStoreLimits BlockStoreLimitsOf(const DaemonConfig& config);

// The prefix cache the configuration asks for (null when prefix_cache_budget_bytes is 0). Its
// device storage is charged to the one admission budget; admissions demote (with a tier below)
// or evict LRU entries for room. A host tier (prefix_host_tier_bytes) sits between the device
// and the disk: pinned host memory on cuda, plain memory when asked for. A disk tier that
// cannot be set up (prefix_disk_dir unusable, too little free space, no io_uring) refuses the
// start: the operator asked for it. So does a remote tier whose options cannot work (a password
// file that cannot be read); a cluster that does not answer does not: the daemon serves without
// it, reports it down and reconnects (server/store/remote/remote_tier.h). `epoch` is this
// daemon's. REQUIRES: `backend` and `budget` outlive the cache.
absl::StatusOr<std::unique_ptr<PrefixCache>> MakePrefixCache(const DaemonConfig& config,
                                                             DeviceBackend* backend,
                                                             DeviceBudget* budget,
                                                             uint64_t epoch);

}  // namespace memra

#endif  // MEMRA_SERVER_PARTS_FACTORY_H_
