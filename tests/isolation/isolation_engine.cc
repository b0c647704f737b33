// An engine of the multi-user isolation test (multi_user_test.cc), run as a throwaway user. It
// attaches, fills a session's K plane with its own bytes, commits its prompt with the token ids
// and captures it into the prefix cache, subscribes to the cache's events and publishes
// <dir>/facts. Once the test hands it the other engine's facts (<dir>/peer) it tries every way
// to that engine's memory and prefix entries and writes what happened to <dir>/results, then
// holds its lease (so the peer's probes meet a live session) until <dir>/done exists.
//
// Results (key=value): arena_code / arena_message (the peer's arena over this engine's handoff
// connection, with the peer's session token), shm_entries / shm_opened / shm_naming_peer
// (/dev/shm), lookup_matched (the peer's prompt in this engine's scope), restore_code (the
// peer's entry by id), own_events / foreign_events (event scopes), drain_code (an operator call
// on the engine socket), admin_socket (connecting to the admin socket), own_map (this engine's
// own arena mapped and holding its bytes), cache_scope.

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/internal.h"
#include "client/prefix_client.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"
#include "tests/engine_exit.h"
#include "tests/e2e/facts.h"

ABSL_FLAG(std::string, socket, "", "the daemon's engine socket");
ABSL_FLAG(std::string, name, "isolation-engine", "engine name");
ABSL_FLAG(std::string, dir, "", "this engine's directory (facts, peer, results, done)");
ABSL_FLAG(int32_t, first_token, 1000, "token id of the prompt's first position");

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr uint64_t kPromptTokens = 32;  // two 16-token blocks
constexpr uint8_t kFill = 0x5c;

std::vector<int32_t> Prompt(int32_t first) {
  std::vector<int32_t> ids;
  for (uint64_t i = 0; i < kPromptTokens; ++i) ids.push_back(first + static_cast<int32_t>(i));
  return ids;
}

std::string Join(const std::vector<int32_t>& ids) { return absl::StrJoin(ids, ","); }

std::vector<int32_t> Split(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int32_t id = 0;
    if (absl::SimpleAtoi(part, &id)) ids.push_back(id);
  }
  return ids;
}

uint64_t Number(const std::map<std::string, std::string>& facts, const std::string& key) {
  uint64_t value = 0;
  auto it = facts.find(key);
  if (it != facts.end()) (void)absl::SimpleAtoi(it->second, &value);
  return value;
}

bool WaitFor(const std::string& path, absl::Duration patience) {
  const absl::Time give_up = absl::Now() + patience;
  while (absl::Now() < give_up) {
    if (access(path.c_str(), F_OK) == 0) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  const std::vector<int32_t> prompt = Prompt(absl::GetFlag(FLAGS_first_token));
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                   KvClient::Connect(absl::GetFlag(FLAGS_socket)));
  RETURN_IF_ERROR(client->Attach(absl::GetFlag(FLAGS_name)));
  ASSIGN_OR_RETURN(PlanFingerprint plan, client->RegisterPlan(test_plans::DenseModel(2, 64, 2)));
  SessionOptions options;
  options.capacity = 64;
  ASSIGN_OR_RETURN(std::unique_ptr<Session> session, client->CreateSession(plan, options));
  ASSIGN_OR_RETURN(PlaneView keys, session->Plane(0, PlaneKind::kKeys));
  std::memset(keys.data, kFill, keys.bytes);  // this engine's "KV": what the peer must not see
  ASSIGN_OR_RETURN(Transaction transaction, session->Begin());
  RETURN_IF_ERROR(session->PrepareAppend(transaction.generation, kPromptTokens).status());
  RETURN_IF_ERROR(session->PublishAppend(transaction.generation).status());
  RETURN_IF_ERROR(session->Commit(transaction.generation, kPromptTokens, prompt).status());
  ASSIGN_OR_RETURN(PrefixCaptured captured,
                   client->prefixes().Capture(*session, prompt, kPromptTokens));
  std::unique_ptr<PrefixEventStream> events = client->prefixes().SubscribeEvents();

  const std::string token = ClientInternals::Ref(*session).session_token();
  RETURN_IF_ERROR(WriteFacts(
      dir + "/facts",
      absl::StrCat("engine_id=", client->engine_id(), "\n", "session_id=", session->id(), "\n",
                   "session_token=", absl::BytesToHexString(token), "\n", "arena_handle_hex=",
                   absl::BytesToHexString(session->layout().arenas[0].handle), "\n",
                   "entry_id=", captured.entry_id, "\n", "prompt=", Join(prompt), "\n")));
  if (!WaitFor(dir + "/peer", absl::Seconds(60))) {
    return absl::DeadlineExceededError("the test never handed over the peer's facts");
  }
  const std::map<std::string, std::string> peer = ReadFacts(dir + "/peer");
  std::string results = absl::StrCat("cache_scope=", client->cache_scope(), "\n");

  // The peer's arena, asked for with the peer's own session token over this engine's handoff
  // connection.
  absl::StatusOr<ArenaFd> arena = ClientInternals::FetchArenaFd(
      *client, Number(peer, "session_id"), absl::HexStringToBytes(peer.at("session_token")),
      absl::HexStringToBytes(peer.at("arena_handle_hex")));
  absl::StrAppend(&results, "arena_code=", static_cast<int>(arena.status().code()), "\n",
                  "arena_message=", arena.status().message(), "\n");

  // Anything in /dev/shm at all, and anything naming the peer's arena.
  const std::string peer_handle = absl::HexStringToBytes(peer.at("arena_handle_hex"));
  int entries = 0, opened = 0, naming_peer = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
    ++entries;
    const std::string name = entry.path().filename().string();
    if (name.find(peer_handle) != std::string::npos) ++naming_peer;
    const int fd = open(entry.path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd >= 0 && name.find("memra") != std::string::npos) ++opened;
    if (fd >= 0) close(fd);
  }
  absl::StrAppend(&results, "shm_entries=", entries, "\n", "shm_opened=", opened, "\n",
                  "shm_naming_peer=", naming_peer, "\n");

  // The peer's prompt and entry, from this engine's scope.
  absl::StatusOr<PrefixMatch> match =
      client->prefixes().Lookup(plan, options, Split(peer.at("prompt")));
  absl::StrAppend(&results, "lookup_code=", static_cast<int>(match.status().code()), "\n",
                  "lookup_matched=", match.ok() ? match->matched_tokens : 999999, "\n");
  ASSIGN_OR_RETURN(std::unique_ptr<Session> fresh, client->CreateSession(plan, options));
  absl::StatusOr<PrefixRestored> restored =
      client->prefixes().Restore(*fresh, Split(peer.at("prompt")), Number(peer, "entry_id"));
  absl::StrAppend(&results, "restore_code=", static_cast<int>(restored.status().code()), "\n");

  // The events this engine hears (its subscription is from the start): its scope's only.
  std::thread canceller([&] {
    absl::SleepFor(absl::Seconds(1));
    events->Cancel();
  });
  int own_events = 0, foreign_events = 0;
  while (true) {
    absl::StatusOr<std::optional<PrefixCacheEvent>> event = events->Next();
    if (!event.ok() || !event->has_value()) break;
    if ((*event)->gap) continue;
    ((*event)->cache_scope == client->cache_scope() ? own_events : foreign_events) += 1;
  }
  canceller.join();
  absl::StrAppend(&results, "own_events=", own_events, "\n", "foreign_events=", foreign_events,
                  "\n");

  // Operator calls: refused on the engine socket; the admin socket is not this user's.
  pb::DrainRequest drain;
  pb::DrainResponse drained;
  const absl::Status drain_status = FromGrpcStatus(ClientInternals::Admin(*client).Drain(
      ClientInternals::NewContext(*client).get(), drain, &drained));
  absl::StrAppend(&results, "drain_code=", static_cast<int>(drain_status.code()), "\n");
  std::string admin_socket = absl::GetFlag(FLAGS_socket);
  admin_socket = admin_socket.substr(0, admin_socket.size() - 5) + ".admin.sock";
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::snprintf(address.sun_path, sizeof(address.sun_path), "%s", admin_socket.c_str());
  const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool admin_connected =
      connect(probe, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  const int connect_errno = errno;
  close(probe);
  absl::StrAppend(&results, "admin_socket=",
                  admin_connected ? "connected" : absl::StrCat("refused:", strerror(connect_errno)),
                  "\n");

  // This engine's own memory is still its own.
  ASSIGN_OR_RETURN(PlaneView mine, session->Plane(0, PlaneKind::kKeys));
  absl::StrAppend(&results, "own_map=", mine.data[0] == kFill ? "ok" : "changed", "\n");
  RETURN_IF_ERROR(WriteFacts(dir + "/results", results));
  if (!WaitFor(dir + "/done", absl::Seconds(60))) {
    return absl::DeadlineExceededError("the test never said done");
  }
  RETURN_IF_ERROR(fresh->Release().status());
  return session->Release().status();
}

}  // namespace
}  // namespace memra::testing

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return memra::testing::EngineExit("isolation_engine", absl::GetFlag(FLAGS_name),
                                     memra::testing::Run());
}
