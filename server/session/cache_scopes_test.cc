#include "server/session/cache_scopes.h"

#include <grp.h>
#include <unistd.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;

PeerCredentials Peer(uid_t uid, gid_t gid) { return PeerCredentials{uid, gid, 1}; }

TEST(CacheScopesTest, ParsesNamesUidsAndGroups) {
  absl::StatusOr<std::vector<CacheScopeRule>> rules =
      ParseCacheScopeAllow(" team-a : 1001, 1002 ,@ml ; drafts:@inference;");
  ASSERT_THAT(rules, IsOk());
  ASSERT_EQ(rules->size(), 2u);
  EXPECT_EQ((*rules)[0].name, "team-a");
  EXPECT_THAT((*rules)[0].uids, ::testing::ElementsAre(1001u, 1002u));
  EXPECT_THAT((*rules)[0].groups, ::testing::ElementsAre("ml"));
  EXPECT_EQ((*rules)[1].name, "drafts");
  EXPECT_THAT((*rules)[1].groups, ::testing::ElementsAre("inference"));
  EXPECT_THAT(ParseCacheScopeAllow(""), IsOkAndHolds(::testing::IsEmpty()));
}

TEST(CacheScopesTest, RefusesMalformedRules) {
  EXPECT_THAT(ParseCacheScopeAllow("team"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("\"team\"", "has no ':'")));
  EXPECT_THAT(ParseCacheScopeAllow("uid:1:2"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("member \"1:2\"", "neither a uid nor @group")));
  EXPECT_THAT(ParseCacheScopeAllow("a b:1"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("name \"a b\"", "1 to 64 characters")));
  EXPECT_THAT(ParseCacheScopeAllow("x:"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("\"x\" has no members")));
  EXPECT_THAT(ParseCacheScopeAllow("x:1;x:2"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("\"x\" is named twice")));
  EXPECT_THAT(ParseCacheScopeAllow("x:@"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("member \"@\"")));
}

TEST(CacheScopesTest, DefaultIsTheUidsOwnScope) {
  absl::StatusOr<CacheScopes> scopes = CacheScopes::Create("");
  ASSERT_THAT(scopes, IsOk());
  EXPECT_THAT(scopes->ScopeFor(Peer(1001, 100), ""), IsOkAndHolds(std::string("uid:1001")));
  EXPECT_THAT(scopes->ScopeFor(Peer(1001, 100), "uid:1001"),
              IsOkAndHolds(std::string("uid:1001")));
  EXPECT_THAT(scopes->ScopeFor(Peer(1001, 100), "uid:1002"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("\"uid:1002\"", "uid 1001 (gid 100)", "no cache_scope_allow rule",
                                  "own scope is uid:1001")));
}

TEST(CacheScopesTest, NamedScopesAdmitTheirUidsAndGroupsOnly) {
  // The group of this test's own primary gid: membership by primary gid.
  struct group* own = getgrgid(getgid());
  ASSERT_NE(own, nullptr);
  absl::StatusOr<CacheScopes> scopes =
      CacheScopes::Create(std::string("team:1001,1002; mine:@") + own->gr_name);
  ASSERT_THAT(scopes, IsOk());
  EXPECT_THAT(scopes->ScopeFor(Peer(1002, 5), "team"), IsOkAndHolds(std::string("team")));
  EXPECT_THAT(scopes->ScopeFor(Peer(1003, 5), "team"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("\"team\" is not allowed to uid 1003 (gid 5)",
                                  "members are 1001,1002", "own scope is uid:1003")));
  EXPECT_THAT(scopes->ScopeFor(Peer(4242, getgid()), "mine"), IsOkAndHolds(std::string("mine")));
  EXPECT_THAT(scopes->ScopeFor(Peer(4242, getgid() + 12345), "mine"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstrs("members are @")));
}

// The group database's answer for a group outgrowing the first buffer (ERANGE) is retried with a
// bigger one, not read as "not a member": root's group from a 1-byte buffer.
TEST(CacheScopesTest, GroupLookupGrowsItsBufferOnErange) {
  auto by_gid = [](struct group* out, char* data, size_t size, struct group** found) {
    return getgrgid_r(0, out, data, size, found);
  };
  struct group entry;
  std::string buffer;
  ASSERT_TRUE(cache_scopes_internal::LookupWithGrowingBuffer(by_gid, entry, buffer, 1, 1 << 20));
  EXPECT_EQ(entry.gr_gid, 0u);
  EXPECT_GT(buffer.size(), 1u);
  // Bounded: a lookup that never fits within max_bytes fails instead of growing for ever.
  EXPECT_FALSE(cache_scopes_internal::LookupWithGrowingBuffer(by_gid, entry, buffer, 1, 2));
}

}  // namespace
}  // namespace memra
