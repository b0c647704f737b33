// One engine process of the bench's hostile section (bench/README.md "Hostile engines"): either
// an honest engine stepping its sessions and recording each step's latency, or a hostile one
// keeping one of issue 31's behaviours up (tests/hostile_engines.h) until SIGTERM.
//
//   load_engine --socket=S --behaviour=honest --samples_file=F --ready_file=R
//   load_engine --socket=S --behaviour=unread_descriptors --ready_file=R [--pace_ms=10]
//
// The ready file appears (written whole, then renamed) once the engine is stepping or its
// behaviour has met the daemon's bound; its one line says what the daemon answered. An honest
// engine writes its samples ("<end ns, steady clock> <latency ns>" per step) at SIGTERM. Exit
// status 0 after SIGTERM; 1 with the error on stderr when the engine could not do its part.

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <deque>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "client/block_store_client.h"
#include "client/client.h"
#include "common/mapped_region.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"
#include "tests/hostile_engines.h"

ABSL_FLAG(std::string, socket, "", "the daemon's engine socket");
ABSL_FLAG(std::string, behaviour, "honest",
          "honest, unread_descriptors, config_bombs, idle_connections, event_streams, "
          "grow, offer_hog, kept_mappings, cpu_hog; or burn (a CPU burner, for comparison)");
ABSL_FLAG(std::string, ready_file, "", "written once stepping / once the bound is met");
ABSL_FLAG(std::string, samples_file, "", "honest: each step's end time and latency");
ABSL_FLAG(int, sessions, 8, "honest: sessions stepped together");
ABSL_FLAG(int, pace_ms, 10, "hostile: pause between two attempts");
ABSL_FLAG(int, as_uid, -1, "idle_connections: connect as this uid (when started as root)");
ABSL_FLAG(int, same_uid_max_held, 128,
          "idle_connections: connections held when it cannot switch to --as_uid");
ABSL_FLAG(int, event_streams, 4, "event_streams: the daemon's max_engine_event_streams");

namespace memra::bench {
namespace {

using testing::EndOf;
using testing::EventStream;
using testing::KeptArena;

std::atomic<bool> stop{false};

void OnTerm(int) { stop.store(true); }

// No SA_RESTART: a blocked send or read returns EINTR, so a hostile engine stops promptly.
void CatchTerm() {
  struct sigaction action {};
  action.sa_handler = OnTerm;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a socket the daemon closed is an error to handle, not death
}

void Pause() { absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_pace_ms))); }

absl::Status WriteReady(const std::string& line) {
  const std::string path = absl::GetFlag(FLAGS_ready_file);
  if (path.empty()) return absl::OkStatus();
  const std::string staged = path + ".tmp";
  {
    std::ofstream out(staged);
    out << line << "\n";
    if (!out) return absl::InternalError("cannot write " + staged);
  }
  if (rename(staged.c_str(), path.c_str()) != 0) {
    return absl::InternalError("cannot rename " + staged);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvClient>> Attach(const std::string& name) {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                   KvClient::Connect(absl::GetFlag(FLAGS_socket)));
  RETURN_IF_ERROR(client->Attach(name));
  return client;
}

absl::StatusOr<std::unique_ptr<Session>> NewSession(KvClient& client, uint64_t capacity) {
  ASSIGN_OR_RETURN(PlanFingerprint plan, client.RegisterPlan(test_plans::Llama3_8B()));
  SessionOptions options;
  options.capacity = capacity;
  options.spec_snapshot = false;
  return client.CreateSession(plan, options);
}

// Steps `sessions` sessions of Llama-3-8B together (one Step RPC per decode step, as the hot
// path's), 100 steps a round, resetting between rounds (not timed).
absl::Status Honest() {
  constexpr uint64_t kCapacity = 128;
  constexpr int kStepsPerRound = 100;
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, Attach("honest"));
  ASSIGN_OR_RETURN(PlanFingerprint plan, client->RegisterPlan(test_plans::Llama3_8B()));
  SessionOptions options;
  options.capacity = kCapacity;
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Session>> sessions,
                   CreateSessions(*client, plan, options, absl::GetFlag(FLAGS_sessions)));
  std::vector<Session*> batch;
  for (auto& session : sessions) batch.push_back(session.get());
  ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> stepper,
                   DecodeStepper::Create(*client, batch, /*accepted_rows=*/1));
  std::vector<std::pair<int64_t, int64_t>> samples;
  samples.reserve(1 << 20);
  RETURN_IF_ERROR(WriteReady(absl::StrCat("stepping ", batch.size(), " sessions")));
  while (!stop.load()) {
    RETURN_IF_ERROR(stepper->ResetAll());
    for (int i = 0; i < kStepsPerRound && !stop.load(); ++i) {
      const int64_t start = NowNs();
      RETURN_IF_ERROR(stepper->Step());
      const int64_t end = NowNs();
      samples.emplace_back(end, end - start);
    }
  }
  std::ofstream out(absl::GetFlag(FLAGS_samples_file));
  for (const auto& [end, latency] : samples) out << end << " " << latency << "\n";
  if (!out) return absl::InternalError("cannot write the samples");
  return stepper->ResetAll();
}

// Item 1: arena requests whose answers (descriptors) are never read.
absl::Status UnreadDescriptors() {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, Attach("hostile-unread-descriptors"));
  ASSIGN_OR_RETURN(std::unique_ptr<Session> session, NewSession(*client, 16));
  uint64_t sent = 0;
  while (!stop.load()) {
    if (!testing::SendUnreadArenaRequests(*client, *session, 1).ok()) break;  // stopped
    if (++sent == 32) {
      RETURN_IF_ERROR(WriteReady("32 arena requests sent, none read (16 carry descriptors)"));
    }
    Pause();
  }
  return absl::OkStatus();
}

// Item 2: over-size and over-deep config.json from two threads, each refused before parsing.
absl::Status ConfigBombs() {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                   KvClient::Connect(absl::GetFlag(FLAGS_socket)));
  const std::string oversize = testing::OversizeModelConfig();
  const std::string overdeep = testing::OverdeepModelConfig();
  absl::Status first = testing::GetCostOf(*client, oversize);
  if (first.ok()) return absl::InternalError("a 1 MiB config.json of '[' was accepted");
  RETURN_IF_ERROR(WriteReady(first.ToString()));
  auto bomb = [&] {
    while (!stop.load()) {
      (void)testing::GetCostOf(*client, oversize);
      (void)testing::ImportModelOf(*client, overdeep);
      Pause();
    }
  };
  std::thread second(bomb);
  bomb();
  second.join();
  return absl::OkStatus();
}

// Item 3: idle HTTP/2 connections until the daemon closes one at the door, then held.
absl::Status IdleConnections() {
  // Another uid's connections leave the honest engines' uid its own per-uid share. Where it
  // cannot switch (not root; a sandbox's user namespace), it stays below that share instead, or
  // the other engines of its uid could not connect.
  size_t max_held = 2000;
  const int uid = absl::GetFlag(FLAGS_as_uid);
  if (uid < 0 || setgid(uid) != 0 || setuid(uid) != 0) {
    max_held = absl::GetFlag(FLAGS_same_uid_max_held);
  }
  const std::string path = absl::GetFlag(FLAGS_socket);
  std::vector<ScopedFd> held;
  char outcome = 'S';
  while (!stop.load() && held.size() < max_held && outcome == 'S') {
    int fd = -1;
    outcome = testing::TryConnection(path.c_str(), &fd);
    ScopedFd connection(fd);
    if (outcome == 'S') held.push_back(std::move(connection));
  }
  if (outcome == 'E') return absl::InternalError("a local error connecting");
  RETURN_IF_ERROR(WriteReady(absl::StrCat(
      held.size(), " connections (uid ", geteuid(), ") served and held, ",
      outcome == 'C' ? "the next closed at the door" : "none refused (below the uid's share)")));
  while (!stop.load()) {  // one more knock now and then
    int fd = -1;
    (void)testing::TryConnection(path.c_str(), &fd);
    ScopedFd knock(fd);
    for (int i = 0; i < 10 && !stop.load(); ++i) Pause();
  }
  return absl::OkStatus();
}

// Item 5: every event stream the engine may hold (--event_streams: the daemon's
// max_engine_event_streams), and one more asked for again and again.
absl::Status EventStreams() {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, Attach("hostile-event-streams"));
  const absl::Duration lifetime = absl::Hours(1);
  std::vector<std::unique_ptr<EventStream>> open;
  for (int i = 0; i < absl::GetFlag(FLAGS_event_streams); ++i) {
    open.push_back(testing::SubscribeEvents(*client, lifetime));
  }
  const absl::Status refused = EndOf(*testing::SubscribeEvents(*client, lifetime));
  if (refused.ok()) return absl::InternalError("one event stream more than the share ended OK");
  RETURN_IF_ERROR(WriteReady(absl::StrCat(open.size(), " streams open; the next: ",
                                          refused.ToString())));
  while (!stop.load()) {
    (void)EndOf(*testing::SubscribeEvents(*client, lifetime));
    Pause();
  }
  for (auto& stream : open) stream->context.TryCancel();
  for (auto& stream : open) (void)EndOf(*stream);
  return absl::OkStatus();
}

// Item 6: a session grown to 16x its capacity (the daemon copies it under the session's lock)
// and released, again and again, while a second thread attaches new engines.
absl::Status Grow() {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, Attach("hostile-grow"));
  uint64_t grown = 0;
  std::atomic<uint64_t> attaches{0};
  std::thread attacher([&] {
    while (!stop.load()) {
      if (absl::StatusOr<std::unique_ptr<KvClient>> other = Attach("hostile-grow-attacher");
          other.ok()) {
        (*other)->Detach();
        attaches.fetch_add(1);
      }
      Pause();
    }
  });
  absl::Status failed;
  while (!stop.load()) {
    absl::StatusOr<std::unique_ptr<Session>> session = NewSession(*client, 128);
    if (!session.ok()) {
      failed = session.status();
      break;
    }
    absl::StatusOr<SessionSnapshot> snapshot = (*session)->Grow(2048);
    if (!snapshot.ok()) {
      failed = snapshot.status();
      break;
    }
    (void)(*session)->Release();
    if (++grown == 1) {
      failed = WriteReady("grew a session from 128 to 2048 rows (16 MiB -> 256 MiB)");
      if (!failed.ok()) break;
    }
    Pause();
  }
  stop.store(true);
  attacher.join();
  return failed;
}

// Item 7: buffer offers (a descriptor each) until the engine's share is used up, then more.
absl::Status OfferHog() {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, Attach("hostile-offer-hog"));
  ASSIGN_OR_RETURN(ScopedFd buffer, CreateSealedMemfd("hostile-offer", 4096));
  uint64_t offered = 0;
  absl::Status refused;
  while (!stop.load() && refused.ok() && offered < 100000) {
    absl::StatusOr<uint64_t> offer = client->block_store().OfferPoolBuffer(buffer.get(), 4096);
    if (offer.ok()) {
      ++offered;
    } else {
      refused = offer.status();
    }
  }
  RETURN_IF_ERROR(WriteReady(absl::StrCat(offered, " offers held; the next: ",
                                          refused.ToString())));
  while (!stop.load()) {
    (void)client->block_store().OfferPoolBuffer(buffer.get(), 4096);
    Pause();
  }
  return absl::OkStatus();
}

// Item 8: arenas (512 rows of Llama-3-8B) written, released and kept mapped (the 8 newest),
// round after round.
absl::Status KeptMappings() {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, Attach("hostile-kept-mappings"));
  std::deque<KeptArena> kept;
  uint64_t rounds = 0;
  while (!stop.load()) {
    ASSIGN_OR_RETURN(std::unique_ptr<Session> session, NewSession(*client, 512));
    ASSIGN_OR_RETURN(KeptArena arena, KeptArena::Keep(*client, *session, 0xa5));
    RETURN_IF_ERROR(session->Release().status());
    kept.push_back(std::move(arena));
    if (kept.size() > 8) kept.pop_front();
    if (++rounds == 8) {
      uint64_t held = 0;
      for (const KeptArena& one : kept) {
        ASSIGN_OR_RETURN(uint64_t bytes, one.AllocatedBytes());
        held += bytes;
      }
      RETURN_IF_ERROR(WriteReady(absl::StrCat("8 released arenas of ", kept.back().bytes(),
                                              " bytes kept mapped; they hold ", held, " bytes")));
    }
    Pause();
  }
  return absl::OkStatus();
}

// Issue 31, the daemon's time: four threads creating and releasing 512-row sessions (each a
// 29 MiB arena the daemon allocates and punches) back to back, so the daemon works for this
// engine on four threads at once; it goes on past its share's refusals.
absl::Status CpuHog() {
  constexpr int kThreads = 4;
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, Attach("hostile-cpu-hog"));
  absl::Mutex mu;
  std::optional<absl::Status> first_refusal;
  uint64_t created = 0;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      while (!stop.load()) {
        absl::StatusOr<std::unique_ptr<Session>> session = NewSession(*client, 512);
        if (session.ok()) (void)(*session)->Release();
        absl::MutexLock lock(&mu);
        if (session.ok()) {
          ++created;
        } else if (!first_refusal.has_value()) {
          first_refusal = session.status();
        }
      }
    });
  }
  absl::Status ready = absl::UnknownError("no refusal yet");
  bool written = false;
  while (!stop.load()) {  // until SIGTERM: the threads keep calling past the refusals
    if (!written) {
      absl::MutexLock lock(&mu);
      if (first_refusal.has_value()) {
        ready = WriteReady(absl::StrCat(created, " sessions created by ", kThreads,
                                        " threads; then: ", first_refusal->ToString()));
        written = true;
        if (!ready.ok()) stop.store(true);
      }
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  for (std::thread& thread : threads) thread.join();
  return written ? ready : absl::OkStatus();
}

// Not hostile: a CPU burner (the load a busy neighbour puts on the machine), for comparison.
absl::Status Burn() {
  RETURN_IF_ERROR(WriteReady("burning"));
  uint64_t spins = 0;
  while (!stop.load()) KeepAlive(++spins);
  return absl::OkStatus();
}

int Run() {
  CatchTerm();
  using Behaviour = absl::Status (*)();
  const std::pair<const char*, Behaviour> behaviours[] = {
      {"honest", Honest},           {"unread_descriptors", UnreadDescriptors},
      {"config_bombs", ConfigBombs}, {"idle_connections", IdleConnections},
      {"event_streams", EventStreams}, {"grow", Grow},
      {"offer_hog", OfferHog},       {"kept_mappings", KeptMappings},
      {"cpu_hog", CpuHog},           {"burn", Burn}};
  const std::string wanted = absl::GetFlag(FLAGS_behaviour);
  absl::Status status = absl::InvalidArgumentError("unknown --behaviour " + wanted);
  for (const auto& [name, run] : behaviours) {
    if (wanted == name) status = run();
  }
  if (!status.ok()) {
    std::fprintf(stderr, "load_engine %s: %s\n", wanted.c_str(), status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace memra::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return memra::bench::Run();
}
