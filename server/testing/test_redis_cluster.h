#ifndef MEMRA_SERVER_TEST_REDIS_CLUSTER_H_
#define MEMRA_SERVER_TEST_REDIS_CLUSTER_H_

// Tests only: a real Redis Cluster (Debian's redis-server 7) of 3 masters and 3 replicas on
// loopback ports, in a temporary directory, with a password (requirepass) and an ACL user.
// Every process it started is SIGKILLed and reaped when it is destroyed, whatever the test did.
// Admin commands go to one node by port over plain hiredis (the test's independent view of the
// cluster, not through the client under test).

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"

namespace memra::testing {

inline constexpr char kRedisServer[] = "/usr/bin/redis-server";
inline constexpr char kRedisCli[] = "/usr/bin/redis-cli";
inline constexpr char kRedisPassword[] = "cluster-pass\x01\xff";  // not printable: binary-safe AUTH
inline constexpr char kRedisAclUser[] = "tier";
inline constexpr char kRedisAclPassword[] = "tier-pass";

inline bool RedisInstalled() { return Exists(kRedisServer) && Exists(kRedisCli); }

// Binds 127.0.0.1:port (0: any free port) and closes it at once: the port bound, or -1. A
// port found this way is free now, and nothing listens on it until someone binds it again.
inline int BindLoopbackPort(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t length = sizeof(address);
  int bound = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    bound = ntohs(address.sin_port);
  }
  close(fd);
  return bound;
}

// Why a cluster test is skipped on a machine without Redis.
inline std::string RedisMissingMessage() {
  return absl::StrCat("SKIPPED: ", kRedisServer, " or ", kRedisCli,
                      " is missing (Debian packages redis-server, redis-tools)");
}

class LocalRedisCluster {
 public:
  static constexpr int kNodes = 6;  // 3 masters, 3 replicas
  static constexpr int kStartAttempts = 3;

  // Picks the directory and the ports without starting anything: NodeList and password files
  // work from here on (a test can point a daemon at a cluster that is not up yet), and Start
  // uses these ports. Idempotent; false (and a test failure) when it could not.
  bool Prepare() {
    if (!dir_.empty()) return true;
    const char* tmp = getenv("TEST_TMPDIR");
    std::string pattern = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/redis-cluster.XXXXXX");
    if (mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp " << pattern;
      return false;
    }
    dir_ = pattern;
    return PickPorts();
  }

  // Starts the nodes and creates the cluster; false (and a test failure naming what) when it
  // could not. REQUIRES: RedisInstalled(). A port picked free can be taken by another process
  // before redis-server binds it (tests run in parallel): when Start picked the ports itself, a
  // node that dies at start-up is retried on fresh ports (at most kStartAttempts times).
  bool Start() {
    const bool ports_were_fixed = !ports_.empty();
    for (int attempt = 1;; ++attempt) {
      if (!Prepare()) return false;
      const std::optional<std::string> failed = StartNodes();
      if (!failed.has_value()) break;
      if (ports_were_fixed || attempt == kStartAttempts) {
        ADD_FAILURE() << *failed;
        return false;
      }
      for (pid_t& pid : pids_) {
        KillAndReap(pid);
        pid = -1;
      }
      ports_.clear();
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
      dir_.clear();
    }
    std::vector<std::string> create = {kRedisCli, "--cluster", "create"};
    for (const int port : ports_) create.push_back(absl::StrCat("127.0.0.1:", port));
    for (const char* word : {"--cluster-replicas", "1", "--cluster-yes", "--no-auth-warning",
                             "-a"}) {
      create.push_back(word);
    }
    create.push_back(kRedisPassword);
    const std::string create_log = absl::StrCat(dir_, "/create.log");
    const int exit_code = WaitExit(Spawn(create, create_log, create_log), kPatience);
    if (exit_code != 0) {
      ADD_FAILURE() << "redis-cli --cluster create exited " << exit_code << "; see "
                    << create_log;
      return false;
    }
    return WaitHealthy();
  }

  ~LocalRedisCluster() {
    // A failed test's log carries each node's own view and log tail: the directory is gone
    // after this destructor, and a failover that did not happen is explained only there.
    if (::testing::UnitTest::GetInstance()->failed_test_count() > 0) DumpNodes();
    for (const pid_t pid : pids_) KillAndReap(pid);
    if (!dir_.empty()) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    }
  }

  // Healthy: every live node reports cluster_state:ok; in the first live node's view, three
  // masters that are running (a killed one counts only until the others flag it) own every
  // slot; and every running replica of each of them is in sync (INFO replication state=online),
  // so a master killed next can fail over (a replica that never synced refuses to, for good).
  bool WaitHealthy() {
    const bool healthy = PollUntil([&] {
      for (int i = 0; i < kNodes; ++i) {
        if (pids_[i] <= 0) continue;
        absl::StatusOr<std::string> info = Command(ports_[i], {"CLUSTER", "INFO"});
        if (!info.ok() || !absl::StrContains(*info, "cluster_state:ok")) return false;
      }
      return LiveMastersOwnEverySlotWithReplicasInSync();
    });
    if (!healthy) ADD_FAILURE() << "cluster not healthy within " << kPatience << "; see " << dir_;
    return healthy;
  }

  const std::vector<int>& ports() const { return ports_; }

  // "127.0.0.1:p1,127.0.0.1:p2,..." (all nodes).
  std::string NodeList() const {
    return absl::StrJoin(ports_, ",", [](std::string* out, int port) {
      absl::StrAppend(out, "127.0.0.1:", port);
    });
  }

  // The password file for requirepass (`wrong` writes a wrong one), or the ACL user's.
  std::string WritePasswordFile(absl::string_view name, absl::string_view password) const {
    const std::string path = absl::StrCat(dir_, "/", name);
    std::ofstream(path, std::ios::binary) << password << "\n";
    return path;
  }

  // One command on one node as the default user; the reply as text (arrays: one element a
  // line, nested arrays flattened), or the error reply / I/O failure as a Status.
  absl::StatusOr<std::string> Command(int port, const std::vector<std::string>& argv) const {
    const timeval timeout = absl::ToTimeval(absl::Seconds(5));
    std::unique_ptr<redisContext, void (*)(redisContext*)> context(
        redisConnectWithTimeout("127.0.0.1", port, timeout), redisFree);
    if (context == nullptr || context->err != 0) {
      return absl::UnavailableError(absl::StrCat("connect to ", port, ": ",
                                                 context ? context->errstr : "no memory"));
    }
    redisSetTimeout(context.get(), timeout);
    absl::StatusOr<std::string> auth = Run(context.get(), {"AUTH", kRedisPassword});
    if (!auth.ok()) return auth;
    return Run(context.get(), argv);
  }

  bool LiveMastersOwnEverySlotWithReplicasInSync() const {
    absl::StatusOr<std::string> nodes = ClusterNodes();
    if (!nodes.ok()) return false;
    struct Master {
      int port = 0;
      int replicas = 0;  // running, unflagged replicas
    };
    std::map<std::string, Master> masters;  // by node id
    std::vector<std::pair<std::string, int>> replica_of;  // (master id, replica port)
    int owned_slots = 0;
    for (absl::string_view line : absl::StrSplit(*nodes, '\n', absl::SkipEmpty())) {
      const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
      if (fields.size() < 8) return false;
      const int port = PortOf(fields[1]);
      if (!Running(port) || absl::StrContains(fields[2], "fail")) continue;
      if (absl::StrContains(fields[2], "slave")) {
        replica_of.emplace_back(std::string(fields[3]), port);
        continue;
      }
      if (fields.size() < 9) continue;  // a master without slots
      masters[std::string(fields[0])].port = port;
      for (size_t f = 8; f < fields.size(); ++f) {
        if (fields[f].front() == '[') continue;
        const std::vector<absl::string_view> range = absl::StrSplit(fields[f], '-');
        int first = 0;
        int last = 0;
        if (!absl::SimpleAtoi(range[0], &first)) return false;
        last = first;
        if (range.size() == 2 && !absl::SimpleAtoi(range[1], &last)) return false;
        owned_slots += last - first + 1;
      }
    }
    if (masters.size() != 3 || owned_slots != 16384) return false;
    for (const auto& [master_id, port] : replica_of) {
      auto it = masters.find(master_id);
      if (it != masters.end()) ++it->second.replicas;
    }
    for (const auto& [id, master] : masters) {
      absl::StatusOr<std::string> info = Command(master.port, {"INFO", "replication"});
      if (!info.ok()) return false;
      int online = 0;
      for (absl::string_view line : absl::StrSplit(*info, '\n')) {
        if (absl::StartsWith(line, "slave") && absl::StrContains(line, "state=online")) ++online;
      }
      if (online < master.replicas) return false;
    }
    return true;
  }

  // Masters with slots, by port, from CLUSTER NODES of the first live node.
  absl::StatusOr<std::vector<int>> MasterPorts() const {
    std::vector<int> masters;
    absl::StatusOr<std::string> nodes = ClusterNodes();
    if (!nodes.ok()) return nodes.status();
    for (absl::string_view line : absl::StrSplit(*nodes, '\n', absl::SkipEmpty())) {
      const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
      if (fields.size() < 9 || !absl::StrContains(fields[2], "master") ||
          absl::StrContains(fields[2], "fail")) {
        continue;
      }
      masters.push_back(PortOf(fields[1]));
    }
    return masters;
  }

  // The port of the master serving `slot`, from CLUSTER NODES (0 when none).
  int OwnerOf(uint16_t slot) const {
    absl::StatusOr<std::string> nodes = ClusterNodes();
    if (!nodes.ok()) return 0;
    for (absl::string_view line : absl::StrSplit(*nodes, '\n', absl::SkipEmpty())) {
      const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
      if (fields.size() < 9 || absl::StrContains(fields[2], "fail")) continue;
      for (size_t f = 8; f < fields.size(); ++f) {
        if (fields[f].front() == '[') continue;  // a migration marker, not ownership
        const std::vector<absl::string_view> range = absl::StrSplit(fields[f], '-');
        int first = 0;
        int last = 0;
        if (!absl::SimpleAtoi(range[0], &first)) continue;
        last = first;
        if (range.size() == 2 && !absl::SimpleAtoi(range[1], &last)) continue;
        if (slot >= first && slot <= last) return PortOf(fields[1]);
      }
    }
    return 0;
  }

  absl::StatusOr<std::string> NodeId(int port) const { return Command(port, {"CLUSTER", "MYID"}); }

  // The port of a running replica of the master on `port` (0 when it has none), from CLUSTER
  // NODES.
  int ReplicaOf(int master_port) const {
    absl::StatusOr<std::string> master_id = NodeId(master_port);
    absl::StatusOr<std::string> nodes = ClusterNodes();
    if (!master_id.ok() || !nodes.ok()) return 0;
    for (absl::string_view line : absl::StrSplit(*nodes, '\n', absl::SkipEmpty())) {
      const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ');
      if (fields.size() >= 4 && absl::StrContains(fields[2], "slave") &&
          fields[3] == *master_id && Running(PortOf(fields[1]))) {
        return PortOf(fields[1]);
      }
    }
    return 0;
  }

  // Starts moving `slot` from `from` to `to` (IMPORTING on `to`, MIGRATING on `from`) and
  // moves the given keys; `finish` then assigns the slot to `to` on every live node.
  absl::Status MigrateSlot(uint16_t slot, int from, int to, const std::vector<std::string>& keys,
                           bool finish) const {
    absl::StatusOr<std::string> from_id = NodeId(from);
    absl::StatusOr<std::string> to_id = NodeId(to);
    if (!from_id.ok()) return from_id.status();
    if (!to_id.ok()) return to_id.status();
    const std::string slot_text = absl::StrCat(slot);
    for (const auto& [port, argv] : std::vector<std::pair<int, std::vector<std::string>>>{
             {to, {"CLUSTER", "SETSLOT", slot_text, "IMPORTING", *from_id}},
             {from, {"CLUSTER", "SETSLOT", slot_text, "MIGRATING", *to_id}}}) {
      absl::StatusOr<std::string> reply = Command(port, argv);
      if (!reply.ok()) return reply.status();
    }
    if (!keys.empty()) {
      std::vector<std::string> migrate = {"MIGRATE", "127.0.0.1", absl::StrCat(to), "", "0",
                                          "5000",    "AUTH",      kRedisPassword,    "KEYS"};
      migrate.insert(migrate.end(), keys.begin(), keys.end());
      absl::StatusOr<std::string> reply = Command(from, migrate);
      if (!reply.ok()) return reply.status();
    }
    if (!finish) return absl::OkStatus();
    // The importing node first, then the migrating one, then the other masters (SETSLOT NODE
    // is for masters only; replicas follow their masters).
    absl::StatusOr<std::vector<int>> masters = MasterPorts();
    if (!masters.ok()) return masters.status();
    std::vector<int> order = {to, from};
    for (const int master : *masters) {
      if (master != to && master != from) order.push_back(master);
    }
    for (const int port : order) {
      absl::StatusOr<std::string> reply =
          Command(port, {"CLUSTER", "SETSLOT", slot_text, "NODE", *to_id});
      if (!reply.ok()) return reply.status();
    }
    return absl::OkStatus();
  }

  // Sends `signal` to the node on `port`; SIGKILL also reaps it.
  void Signal(int port, int signal) {
    for (int i = 0; i < kNodes; ++i) {
      if (ports_[i] != port || pids_[i] <= 0) continue;
      if (signal == SIGKILL) {
        KillAndReap(pids_[i]);
        pids_[i] = -1;
      } else {
        kill(pids_[i], signal);
      }
    }
  }

 private:
  bool Running(int port) const {
    for (int i = 0; i < static_cast<int>(ports_.size()); ++i) {
      if (ports_[i] == port) return pids_[i] > 0;
    }
    return false;
  }

  static int PortOf(absl::string_view address) {  // "127.0.0.1:7000@17000"
    address = address.substr(0, address.find('@'));
    int port = 0;
    (void)absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port);
    return port;
  }

  static std::string EscapedPassword() {  // redis.conf double-quoted string
    std::string escaped;
    for (const unsigned char c : absl::string_view(kRedisPassword)) {
      absl::StrAppend(&escaped, c >= 0x20 && c < 0x7f && c != '"' && c != '\\'
                                    ? std::string(1, static_cast<char>(c))
                                    : absl::StrCat("\\x", absl::Hex(c, absl::kZeroPad2)));
    }
    return escaped;
  }

  absl::StatusOr<std::string> ClusterNodes() const {
    for (int i = 0; i < kNodes; ++i) {
      if (pids_[i] <= 0) continue;
      absl::StatusOr<std::string> nodes = Command(ports_[i], {"CLUSTER", "NODES"});
      if (nodes.ok()) return nodes;
    }
    return absl::UnavailableError("no live node answered CLUSTER NODES");
  }

  static absl::StatusOr<std::string> Run(redisContext* context,
                                         const std::vector<std::string>& argv) {
    std::vector<const char*> words;
    std::vector<size_t> lengths;
    for (const std::string& word : argv) {
      words.push_back(word.data());
      lengths.push_back(word.size());
    }
    std::unique_ptr<redisReply, void (*)(void*)> reply(
        static_cast<redisReply*>(redisCommandArgv(context, static_cast<int>(words.size()),
                                                  words.data(), lengths.data())),
        freeReplyObject);
    if (reply == nullptr) return absl::UnavailableError(context->errstr);
    if (reply->type == REDIS_REPLY_ERROR) {
      return absl::FailedPreconditionError(absl::StrCat(argv[0], ": ", reply->str));
    }
    std::string text;
    Render(*reply, &text);
    return text;
  }

  static void Render(const redisReply& reply, std::string* out) {
    switch (reply.type) {
      case REDIS_REPLY_INTEGER:
        absl::StrAppend(out, reply.integer);
        break;
      case REDIS_REPLY_NIL:
        break;
      case REDIS_REPLY_ARRAY:
        for (size_t i = 0; i < reply.elements; ++i) {
          Render(*reply.element[i], out);
          out->push_back('\n');
        }
        break;
      default:
        out->append(reply.str, reply.len);
    }
  }

  // kNodes ports p with p and p + 10000 (the cluster bus) free on loopback, all distinct.
  // Spawns every node and waits for each to answer PING; what went wrong (with the node's own
  // log), or nullopt.
  std::optional<std::string> StartNodes() {
    for (int i = 0; i < kNodes; ++i) {
      const std::string node_dir = absl::StrCat(dir_, "/", ports_[i]);
      std::filesystem::create_directories(node_dir);
      const std::string conf = absl::StrCat(node_dir, "/redis.conf");
      std::ofstream(conf) << "port " << ports_[i] << "\nbind 127.0.0.1\n"
                          << "cluster-enabled yes\ncluster-config-file nodes.conf\n"
                          // Failover within ~2 s of a master's death; the other masters keep
                          // serving their slots meanwhile.
                          << "cluster-node-timeout 1000\ncluster-require-full-coverage no\n"
                          // A replica syncs at once: one killed before its first sync
                          // would never fail over (its data counts as infinitely old).
                          << "repl-diskless-sync-delay 0\n"
                          << "dir " << node_dir << "\nsave \"\"\nappendonly no\n"
                          << "requirepass \"" << EscapedPassword() << "\"\n"
                          << "masterauth \"" << EscapedPassword() << "\"\n"
                          << "user " << kRedisAclUser << " on >" << kRedisAclPassword
                          << " ~* &* +@all\n";
      pids_[i] = Spawn({kRedisServer, conf}, absl::StrCat(node_dir, "/stdout.log"),
                       absl::StrCat(node_dir, "/stderr.log"));
      if (pids_[i] <= 0) return absl::StrCat("could not spawn ", kRedisServer);
    }
    for (int i = 0; i < kNodes; ++i) {
      if (!PollUntil([&] { return Command(ports_[i], {"PING"}).ok(); }, pids_[i])) {
        const std::string node_dir = absl::StrCat(dir_, "/", ports_[i]);
        return absl::StrCat("redis-server on port ", ports_[i], " did not answer PING; its log: ",
                            FileTail(absl::StrCat(node_dir, "/stdout.log")),
                            FileTail(absl::StrCat(node_dir, "/stderr.log")));
      }
    }
    return std::nullopt;
  }

  // Each node's CLUSTER NODES (live ones) and the tail of its log, to stderr.
  void DumpNodes() const {
    for (int i = 0; i < static_cast<int>(ports_.size()); ++i) {
      const std::string node_dir = absl::StrCat(dir_, "/", ports_[i]);
      std::string view = "(not running)";
      if (i < static_cast<int>(pids_.size()) && pids_[i] > 0) {
        absl::StatusOr<std::string> nodes = Command(ports_[i], {"CLUSTER", "NODES"});
        view = nodes.ok() ? *nodes : nodes.status().ToString();
      }
      std::cerr << "---- redis node " << ports_[i] << ": CLUSTER NODES\n"
                << view << "\n---- its log (tail)\n"
                << FileTail(absl::StrCat(node_dir, "/stdout.log"))
                << FileTail(absl::StrCat(node_dir, "/stderr.log")) << "\n";
    }
  }

  // The last 2 KiB of a log file (empty when it cannot be read).
  static std::string FileTail(const std::string& path) {
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return text.size() > 2048 ? text.substr(text.size() - 2048) : text;
  }

  bool PickPorts() {
    for (int tries = 0; tries < 1000 && static_cast<int>(ports_.size()) < kNodes; ++tries) {
      const int port = BindLoopbackPort(0);
      if (port <= 0 || port + 10000 > 65535 || BindLoopbackPort(port + 10000) <= 0) continue;
      bool taken = false;
      for (const int chosen : ports_) taken |= chosen == port || chosen + 10000 == port;
      if (!taken) ports_.push_back(port);
    }
    if (static_cast<int>(ports_.size()) != kNodes) {
      ADD_FAILURE() << "found only " << ports_.size() << " free loopback port pairs";
      return false;
    }
    pids_.assign(kNodes, -1);
    return true;
  }

  std::string dir_;
  std::vector<int> ports_;
  std::vector<pid_t> pids_;
};

// A test fixture whose suite shares one LocalRedisCluster (cluster_), started before its first
// test and SIGKILLed after its last. SetUp skips the test where Redis is not installed, fails it
// where the cluster did not start, then runs Base::SetUp; a derived SetUp calls this one first
// and returns when it skipped or failed (IsSkipped() / HasFatalFailure()).
template <typename Base = ::testing::Test>
class WithRedisCluster : public Base {
 protected:
  static void SetUpTestSuite() {
    if (!RedisInstalled()) return;
    cluster_ = new LocalRedisCluster();
    if (!cluster_->Start()) {
      delete cluster_;
      cluster_ = nullptr;
    }
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override {
    if (!RedisInstalled()) GTEST_SKIP() << RedisMissingMessage();
    ASSERT_NE(cluster_, nullptr) << "the cluster did not start";
    Base::SetUp();
  }

  inline static LocalRedisCluster* cluster_ = nullptr;
};

}  // namespace memra::testing

#endif  // MEMRA_SERVER_TEST_REDIS_CLUSTER_H_
