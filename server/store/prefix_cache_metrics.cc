#include "server/store/prefix_cache_metrics.h"

#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/status_macros.h"
#include "server/store/remote/remote_tier_metrics.h"

namespace memra {

using metrics::CallbackSample;

absl::Status RegisterPrefixCacheMetrics(const PrefixCache* cache, metrics::Registry& registry) {
  auto prefix = [cache](auto read) {
    return [cache, read]() -> std::vector<CallbackSample> {
      if (cache == nullptr) return {};
      return read(cache->Stats());
    };
  };
  auto one = [](uint64_t value) {
    return std::vector<CallbackSample>{{.label_values = {}, .value = static_cast<double>(value)}};
  };
  RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
      "memra_prefix_lookups", "Prefix lookups by result (hit, partial, miss), since start.",
      {"result"}, prefix([](const PrefixCacheStats& s) {
        return std::vector<CallbackSample>{
            {.label_values = {"hit"}, .value = static_cast<double>(s.lookup_hits)},
            {.label_values = {"partial"}, .value = static_cast<double>(s.lookup_partials)},
            {.label_values = {"miss"}, .value = static_cast<double>(s.lookup_misses)}};
      })));
  const std::pair<const char*, const char*> prefix_help[] = {
      {"memra_prefix_tokens_restored", "Tokens restored from prefix entries, since start."},
      {"memra_prefix_stored_bytes", "Bytes the prefix cache stores (shared blocks once)."},
      {"memra_prefix_entries", "Prefix entries stored."},
      {"memra_prefix_evictions", "Prefix entries evicted (budget or admission), since start."},
      {"memra_prefix_dropped", "Prefix entries dropped (checksum mismatch), since start."},
      {"memra_prefix_captures", "Prefix entries captured, since start."},
  };
  uint64_t PrefixCacheStats::*const prefix_fields[] = {
      &PrefixCacheStats::tokens_restored, &PrefixCacheStats::stored_bytes,
      &PrefixCacheStats::entries,         &PrefixCacheStats::evicted_entries,
      &PrefixCacheStats::dropped_entries, &PrefixCacheStats::captures,
  };
  for (size_t i = 0; i < std::size(prefix_fields); ++i) {
    RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        prefix_help[i].first, prefix_help[i].second, {},
        prefix([one, field = prefix_fields[i]](const PrefixCacheStats& s) {
          return one(s.*field);
        })));
  }
  // Slab storage under the stored bytes (server/store/slab_allocator.h).
  const std::pair<const char*, const char*> slab_help[] = {
      {"memra_prefix_slabs", "Slabs (arenas) the prefix cache's storage lives in."},
      {"memra_prefix_slab_bytes", "Bytes of those slabs: what the device budget is charged."},
      {"memra_prefix_slab_free_bytes",
       "Free bytes inside slabs that hold stored pieces (fragmentation)."},
      {"memra_prefix_slab_empty_bytes", "Bytes of emptied slabs kept for the next capture."},
  };
  uint64_t SlabStats::*const slab_fields[] = {&SlabStats::slabs, &SlabStats::slab_bytes,
                                              &SlabStats::free_bytes, &SlabStats::empty_bytes};
  for (size_t i = 0; i < std::size(slab_fields); ++i) {
    RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        slab_help[i].first, slab_help[i].second, {},
        prefix([one, field = slab_fields[i]](const PrefixCacheStats& s) {
          return one(s.slabs.*field);
        })));
  }
  // Tiers (server/store/prefix_cache.h): one sample per tier the daemon has, labelled by medium.
  const std::pair<const char*, const char*> tier_help[] = {
      {"memra_prefix_tier_stored_bytes", "Bytes of prefix pieces in each tier (device, disk)."},
      {"memra_prefix_tier_budget_bytes", "Each prefix tier's budget."},
      {"memra_prefix_tier_hits", "Restores whose slowest piece was in this tier, since start."},
      {"memra_prefix_tier_promotions", "Prefix pieces moved out of this tier by restores, since "
                                       "start."},
      {"memra_prefix_tier_demotions", "Prefix pieces moved into this tier (LRU), since start."},
  };
  uint64_t PrefixTierStats::*const tier_fields[] = {
      &PrefixTierStats::stored_bytes, &PrefixTierStats::budget_bytes, &PrefixTierStats::hits,
      &PrefixTierStats::promotions, &PrefixTierStats::demotions};
  for (size_t i = 0; i < std::size(tier_fields); ++i) {
    RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        tier_help[i].first, tier_help[i].second, {"medium"},
        prefix([field = tier_fields[i]](const PrefixCacheStats& s) {
          std::vector<CallbackSample> samples;
          for (const PrefixTierStats& tier : s.tiers) {
            samples.push_back({.label_values = {std::string(StorageMediumName(tier.medium))},
                               .value = static_cast<double>(tier.*field)});
          }
          return samples;
        })));
  }
  RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
      "memra_prefix_slab_fragmentation",
      "Share (0-1) of the bytes of occupied slabs that no stored piece uses.", {},
      prefix([](const PrefixCacheStats& s) {
        return std::vector<CallbackSample>{
            {.label_values = {}, .value = static_cast<double>(s.slabs.fragmentation_ppm) / 1e6}};
      })));

  return RegisterRemoteTierMetrics(
      [cache]() -> std::optional<RemoteTierStats> {
        if (cache == nullptr) return std::nullopt;
        return cache->Stats().remote;
      },
      registry);
}

}  // namespace memra
