#include "server/session/cache_scopes.h"

#include <grp.h>
#include <pwd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace memra {
namespace {

constexpr size_t kMaxScopeChars = 64;
constexpr size_t kNameBufferBytes = 16 * 1024;
constexpr size_t kMaxNameBufferBytes = 4 * 1024 * 1024;

bool ValidScopeName(absl::string_view name) {
  return !name.empty() && name.size() <= kMaxScopeChars &&
         std::all_of(name.begin(), name.end(), [](char c) {
           return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                  c == '-';
         });
}

// Whether the peer belongs to `group`: its primary gid, or the group lists the peer's user.
bool InGroup(const PeerCredentials& peer, const std::string& group) {
  struct group entry;
  std::string buffer;
  if (!cache_scopes_internal::LookupWithGrowingBuffer(
          [&](struct group* out, char* data, size_t size, struct group** found) {
            return getgrnam_r(group.c_str(), out, data, size, found);
          },
          entry, buffer, kNameBufferBytes, kMaxNameBufferBytes)) {
    return false;
  }
  if (entry.gr_gid == peer.gid) return true;
  struct passwd user;
  std::string user_buffer;
  if (!cache_scopes_internal::LookupWithGrowingBuffer(
          [&](struct passwd* out, char* data, size_t size, struct passwd** found) {
            return getpwuid_r(peer.uid, out, data, size, found);
          },
          user, user_buffer, kNameBufferBytes, kMaxNameBufferBytes)) {
    return false;
  }
  for (char** member = entry.gr_mem; member != nullptr && *member != nullptr; ++member) {
    if (user.pw_name == std::string(*member)) return true;
  }
  return false;
}

std::string Members(const CacheScopeRule& rule) {
  std::vector<std::string> members;
  for (uid_t uid : rule.uids) members.push_back(absl::StrCat(uid));
  for (const std::string& group : rule.groups) members.push_back(absl::StrCat("@", group));
  return absl::StrJoin(members, ",");
}

}  // namespace

std::string DefaultCacheScope(uid_t uid) { return absl::StrCat("uid:", uid); }

absl::StatusOr<std::vector<CacheScopeRule>> ParseCacheScopeAllow(absl::string_view text) {
  std::vector<CacheScopeRule> rules;
  for (absl::string_view part : absl::StrSplit(text, ';', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    const size_t colon = part.find(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache scope rule \"", part, "\" has no ':' (name:member,member,...)"));
    }
    CacheScopeRule rule;
    rule.name = std::string(absl::StripAsciiWhitespace(part.substr(0, colon)));
    if (!ValidScopeName(rule.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cache scope name \"", rule.name, "\" is not 1 to ", kMaxScopeChars,
          " characters of [A-Za-z0-9._-]"));
    }
    if (std::any_of(rules.begin(), rules.end(),
                    [&](const CacheScopeRule& other) { return other.name == rule.name; })) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache scope \"", rule.name, "\" is named twice"));
    }
    for (absl::string_view member :
         absl::StrSplit(part.substr(colon + 1), ',', absl::SkipWhitespace())) {
      member = absl::StripAsciiWhitespace(member);
      absl::string_view group = member;
      uint32_t uid = 0;
      if (absl::ConsumePrefix(&group, "@") && !group.empty()) {
        rule.groups.emplace_back(group);
      } else if (absl::SimpleAtoi(member, &uid)) {
        rule.uids.push_back(static_cast<uid_t>(uid));
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "cache scope \"", rule.name, "\": member \"", member,
            "\" is neither a uid nor @group"));
      }
    }
    if (rule.uids.empty() && rule.groups.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache scope \"", rule.name, "\" has no members"));
    }
    rules.push_back(std::move(rule));
  }
  return rules;
}

absl::StatusOr<CacheScopes> CacheScopes::Create(absl::string_view allow_text) {
  absl::StatusOr<std::vector<CacheScopeRule>> rules = ParseCacheScopeAllow(allow_text);
  if (!rules.ok()) return rules.status();
  return CacheScopes(*std::move(rules));
}

absl::StatusOr<std::string> CacheScopes::ScopeFor(const PeerCredentials& peer,
                                                  absl::string_view requested) const {
  const std::string own = DefaultCacheScope(peer.uid);
  if (requested.empty() || requested == own) return own;
  for (const CacheScopeRule& rule : rules_) {
    if (rule.name != requested) continue;
    const bool allowed =
        std::find(rule.uids.begin(), rule.uids.end(), peer.uid) != rule.uids.end() ||
        std::any_of(rule.groups.begin(), rule.groups.end(),
                    [&](const std::string& group) { return InGroup(peer, group); });
    if (allowed) return rule.name;
    return absl::PermissionDeniedError(absl::StrCat(
        "cache scope \"", requested, "\" is not allowed to uid ", peer.uid, " (gid ", peer.gid,
        "): its members are ", Members(rule), " (cache_scope_allow); this engine's own scope is ",
        own));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "cache scope \"", requested, "\" is not allowed to uid ", peer.uid, " (gid ", peer.gid,
      "): no cache_scope_allow rule names it; this engine's own scope is ", own));
}

}  // namespace memra
