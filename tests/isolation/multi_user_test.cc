// Engines of different Unix users sharing one real memra-kvd are isolated (issue 14,
// docs/security-model.md): the test creates two throwaway users, runs an isolation_engine as
// each (setuid in the child before exec) against one daemon, hands each the other's facts
// (session id, session token, arena handle, entry id, prompt) and checks that neither gets the
// other's arena descriptor (a refusal on the handoff channel), neither opens anything of the
// other through /dev/shm, neither finds, restores or hears of the other's prefix entries, and
// operator calls are refused on the engine socket (and the admin socket is not theirs). Skips,
// saying why, when not root or without useradd; the users are removed even when a check fails.

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/prefix.pb.h"
#include "tests/daemon_process.h"
#include "tests/e2e/facts.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

constexpr char kUseradd[] = "/usr/sbin/useradd";
constexpr char kUserdel[] = "/usr/sbin/userdel";

// A system user (and its own group) for the test's life: removed on destruction, whatever
// happened in between.
class ThrowawayUser {
 public:
  explicit ThrowawayUser(std::string name) : name_(std::move(name)) {
    (void)Run({kUserdel, name_});  // a crashed earlier run's user of the same name
    if (Run({kUseradd, "--system", "--user-group", "--no-create-home", "--shell",
             "/usr/sbin/nologin", name_}) != 0) {
      ADD_FAILURE() << "useradd " << name_ << " failed";
      return;
    }
    struct passwd* entry = getpwnam(name_.c_str());
    if (entry == nullptr) {
      ADD_FAILURE() << "no passwd entry for " << name_ << " after useradd";
      return;
    }
    uid_ = entry->pw_uid;
    gid_ = entry->pw_gid;
    created_ = true;
  }
  ~ThrowawayUser() {
    if (created_ && Run({kUserdel, name_}) != 0) ADD_FAILURE() << "userdel " << name_;
  }
  ThrowawayUser(const ThrowawayUser&) = delete;
  ThrowawayUser& operator=(const ThrowawayUser&) = delete;

  bool created() const { return created_; }
  const std::string& name() const { return name_; }
  uid_t uid() const { return uid_; }
  gid_t gid() const { return gid_; }

 private:
  static int Run(const std::vector<std::string>& args) {
    const pid_t pid = Spawn(args, "/dev/null", "/dev/null");
    return pid > 0 ? WaitExit(pid) : -1;
  }

  const std::string name_;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
  bool created_ = false;
};

// Starts `args` as `user` (its group only, no supplementary groups), stdout and stderr to
// `log` (opened as root before the switch). -1 on failure.
pid_t SpawnAs(const ThrowawayUser& user, const std::vector<std::string>& args,
              const std::string& log) {
  const int log_fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) return -1;
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    if (setgroups(0, nullptr) != 0 || setgid(user.gid()) != 0 || setuid(user.uid()) != 0) {
      _exit(126);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(log_fd);
  return pid;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class MultiUserTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root (creates throwaway users and setuid)";
    if (access(kUseradd, X_OK) != 0 || access(kUserdel, X_OK) != 0) {
      GTEST_SKIP() << "needs " << kUseradd << " and " << kUserdel << " (package passwd)";
    }
  }
};

TEST_F(MultiUserTest, EnginesOfTwoUsersReachNothingOfEachOther) {
  const std::string suffix = absl::StrCat(getpid() % 100000);
  ThrowawayUser user_a("memiso-a-" + suffix);
  ThrowawayUser user_b("memiso-b-" + suffix);
  ASSERT_TRUE(user_a.created() && user_b.created());

  DaemonProcess daemon("iso");
  // The engines' users reach the sockets (0666 here) through the directory; the admin socket
  // stays 0600 root's.
  ASSERT_EQ(chmod(daemon.dir().c_str(), 0755), 0);
  ASSERT_TRUE(daemon.Start({"--socket_mode=0666", "--budget_bytes=256MiB",
                            "--prefix_cache_budget_bytes=16MiB", "--prefix_block_tokens=16"}));
  // The engine binary where the users can execute it (runfiles live under root's home).
  const std::string engine = daemon.Path("isolation_engine");
  std::filesystem::copy_file(Runfile("tests/isolation/isolation_engine"), engine);
  ASSERT_EQ(chmod(engine.c_str(), 0755), 0);

  struct Engine {
    const ThrowawayUser* user;
    std::string dir;
    int first_token;
    pid_t pid = -1;
  };
  std::vector<Engine> engines = {{&user_a, daemon.Path("a"), 1000},
                                 {&user_b, daemon.Path("b"), 2000}};
  for (Engine& e : engines) {
    ASSERT_EQ(mkdir(e.dir.c_str(), 0700), 0);
    ASSERT_EQ(chown(e.dir.c_str(), e.user->uid(), e.user->gid()), 0);
    e.pid = SpawnAs(*e.user,
                    {engine, "--socket=" + daemon.socket(), "--name=" + e.user->name(),
                     "--dir=" + e.dir, absl::StrCat("--first_token=", e.first_token)},
                    daemon.Path(e.user->name() + ".log"));
    ASSERT_GT(e.pid, 0);
  }
  for (Engine& e : engines) {
    ASSERT_TRUE(PollUntil([&] { return Exists(e.dir + "/facts"); }, e.pid))
        << ReadFile(daemon.Path(e.user->name() + ".log"));
  }
  // Each gets the other's facts, its session token included: a leaked capability.
  for (size_t i = 0; i < engines.size(); ++i) {
    std::filesystem::copy_file(engines[1 - i].dir + "/facts", engines[i].dir + "/peer.partial");
    ASSERT_EQ(rename((engines[i].dir + "/peer.partial").c_str(),
                     (engines[i].dir + "/peer").c_str()),
              0);
  }
  std::vector<std::map<std::string, std::string>> results;
  for (Engine& e : engines) {
    ASSERT_TRUE(PollUntil([&] { return Exists(e.dir + "/results"); }, e.pid))
        << ReadFile(daemon.Path(e.user->name() + ".log"));
    results.push_back(ReadFacts(e.dir + "/results"));
  }

  // While both hold their sessions: what the operator sees.
  ClientOptions options;
  options.handoff_socket_path = daemon.Path("kvd.handoff.sock");
  absl::StatusOr<std::unique_ptr<KvClient>> admin =
      KvClient::Connect(daemon.admin_socket(), options);
  ASSERT_THAT(admin.status(), IsOk());
  absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(**admin);
  ASSERT_THAT(status.status(), IsOk());
  std::vector<std::string> identities;
  for (const pb::EngineStatus& engine_status : status->engine_status()) {
    identities.push_back(absl::StrCat(engine_status.uid(), "/", engine_status.gid(), "/",
                                      engine_status.cache_scope()));
  }
  EXPECT_THAT(identities,
              UnorderedElementsAre(
                  absl::StrCat(user_a.uid(), "/", user_a.gid(), "/uid:", user_a.uid()),
                  absl::StrCat(user_b.uid(), "/", user_b.gid(), "/uid:", user_b.uid())));
  pb::ListPrefixesResponse listed;
  ASSERT_TRUE(ClientInternals::Prefix(**admin)
                  .ListPrefixes(ClientInternals::NewContext(**admin).get(),
                                pb::ListPrefixesRequest(), &listed)
                  .ok());
  std::vector<std::string> scopes;
  for (const pb::PrefixEntry& entry : listed.entries()) scopes.push_back(entry.cache_scope());
  EXPECT_THAT(scopes, UnorderedElementsAre(absl::StrCat("uid:", user_a.uid()),
                                           absl::StrCat("uid:", user_b.uid())));

  for (Engine& e : engines) std::ofstream(e.dir + "/done").put('\n');
  for (Engine& e : engines) {
    EXPECT_EQ(WaitExit(e.pid), 0) << ReadFile(daemon.Path(e.user->name() + ".log"));
  }

  for (size_t i = 0; i < results.size(); ++i) {
    SCOPED_TRACE(engines[i].user->name());
    const std::map<std::string, std::string>& r = results[i];
    const ThrowawayUser& self = *engines[i].user;
    EXPECT_EQ(r.at("cache_scope"), absl::StrCat("uid:", self.uid()));
    // The other's arena: refused on the handoff channel, even with its session token.
    EXPECT_EQ(r.at("arena_code"), absl::StrCat(static_cast<int>(absl::StatusCode::kPermissionDenied)));
    EXPECT_THAT(r.at("arena_message"),
                HasSubstr("arenas are handed only to the engine that owns the session"));
    // Nothing of anyone's KV in /dev/shm.
    EXPECT_EQ(r.at("shm_opened"), "0");
    EXPECT_EQ(r.at("shm_naming_peer"), "0");
    // The other's prompt and entry: not in this engine's scope.
    EXPECT_EQ(r.at("lookup_code"), "0");
    EXPECT_EQ(r.at("lookup_matched"), "0");
    EXPECT_EQ(r.at("restore_code"), absl::StrCat(static_cast<int>(absl::StatusCode::kNotFound)));
    EXPECT_EQ(r.at("foreign_events"), "0");
    EXPECT_EQ(r.at("own_events"), "1");
    // Operators apart.
    EXPECT_EQ(r.at("drain_code"), absl::StrCat(static_cast<int>(absl::StatusCode::kPermissionDenied)));
    EXPECT_THAT(r.at("admin_socket"), HasSubstr("refused:Permission denied"));
    EXPECT_EQ(r.at("own_map"), "ok");
  }
}

}  // namespace
}  // namespace memra::testing
