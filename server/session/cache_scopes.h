#ifndef MEMRA_SERVER_CACHE_SCOPES_H_
#define MEMRA_SERVER_CACHE_SCOPES_H_

// Prefix-cache scopes (docs/security-model.md#prefix-trust). Every engine attaches in one cache
// scope, fixed for its lease: its prefix captures are stored there, and its lookups, restores
// and event subscriptions see that scope only. Engines in one scope trust each other's KV (a
// restore copies rows another engine computed). By default an engine's scope is its user's,
// "uid:<uid>" (the uid its handoff connection proved); the configuration may let users or
// groups share a named scope:
//
//   cache_scope_allow = "team-a:1001,1002,@ml; drafts:@inference"
//
// A named scope is [A-Za-z0-9._-], 1 to 64 characters (so never "uid:..."); its members are
// uids or "@group" (an engine is in a group when that group is its primary gid or lists its
// user). Operators (the admin socket) see every scope.

#include <sys/types.h>

#include <cerrno>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/base/peer_credentials.h"

namespace memra {

namespace cache_scopes_internal {

// Runs a getgrnam_r / getpwuid_r style `lookup(&entry, buffer, size, &found)`, doubling the
// buffer on ERANGE from `initial_bytes` up to `max_bytes` (a group of thousands of members
// outgrows any fixed buffer; the pointers in `entry` point into `buffer`). False when the name
// is unknown, the lookup fails otherwise, or it needs more than `max_bytes`.
template <typename Entry, typename Lookup>
bool LookupWithGrowingBuffer(Lookup lookup, Entry& entry, std::string& buffer,
                             size_t initial_bytes, size_t max_bytes) {
  for (size_t size = initial_bytes; size > 0 && size <= max_bytes; size *= 2) {
    buffer.assign(size, '\0');
    Entry* found = nullptr;
    const int error = lookup(&entry, buffer.data(), buffer.size(), &found);
    if (error == ERANGE) continue;
    return error == 0 && found != nullptr;
  }
  return false;
}

}  // namespace cache_scopes_internal

struct CacheScopeRule {
  std::string name;
  std::vector<uid_t> uids;
  std::vector<std::string> groups;  // without the '@'
};

// INVALID_ARGUMENT naming the offending part. Empty text: no named scopes.
absl::StatusOr<std::vector<CacheScopeRule>> ParseCacheScopeAllow(absl::string_view text);

// "uid:<uid>".
std::string DefaultCacheScope(uid_t uid);

// Immutable; thread-safe.
class CacheScopes {
 public:
  static absl::StatusOr<CacheScopes> Create(absl::string_view allow_text);

  // The scope an engine of `peer` attaches in. `requested` empty: DefaultCacheScope(peer.uid)
  // (its own uid's scope by name too). A named scope: PERMISSION_DENIED naming the scope, the
  // engine's uid and gid and the scope's members unless the peer is one of them; also for a
  // scope no rule names, and for another uid's "uid:" scope.
  absl::StatusOr<std::string> ScopeFor(const PeerCredentials& peer,
                                       absl::string_view requested) const;

 private:
  explicit CacheScopes(std::vector<CacheScopeRule> rules) : rules_(std::move(rules)) {}

  std::vector<CacheScopeRule> rules_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_CACHE_SCOPES_H_
