#include "tests/e2e/engine_checks.h"

#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/engine_script.h"
#include "tests/status_matchers.h"

namespace memra::testing {

namespace pb = ::memra::kv::v1;

uint64_t Number(const Facts& facts, const std::string& key) {
  uint64_t value = 0;
  EXPECT_TRUE(facts.count(key) && absl::SimpleAtoi(facts.at(key), &value)) << key;
  return value;
}

const pb::EngineStatus* FindEngine(const pb::GetStatusResponse& status, const std::string& name) {
  for (const pb::EngineStatus& engine : status.engine_status()) {
    if (engine.engine_name() == name) return &engine;
  }
  return nullptr;
}

void ExpectScriptedSession(KvClient& checker, const Facts& facts, EngineDevice& device) {
  EXPECT_GT(Number(facts, "committed"), kE2eRingRows);
  EXPECT_GE(Number(facts, "rebases"), 1u);
  EXPECT_GE(Number(facts, "rewinds"), 1u);
  EXPECT_GE(Number(facts, "spec_rollbacks"), 1u);

  pb::GetSessionStateRequest request;
  request.mutable_session()->set_session_id(Number(facts, "session_id"));
  request.mutable_session()->set_session_token(absl::HexStringToBytes(facts.at("session_token")));
  request.set_include_layout(true);
  pb::SessionStateResponse view;
  ASSERT_THAT(FromGrpcStatus(ClientInternals::Cache(checker).GetSessionState(
                  ClientInternals::NewContext(checker).get(), request, &view)),
              IsOk());
  const SessionSnapshot state = SessionSnapshotFromProto(view.state());
  absl::StatusOr<SessionLayout> layout = SessionLayoutFromProto(view.layout());
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(state.committed_len, Number(facts, "committed"));
  bool ring_moved = false;
  for (const LayerSnapshot& layer : state.layers) ring_moved |= layer.ring_base > 0;
  EXPECT_TRUE(ring_moved);

  const std::string token = absl::HexStringToBytes(facts.at("session_token"));
  if (layout->arenas[0].backend == "host") {
    // A host arena's descriptor goes to its owning engine only: this process, attached as
    // another engine and holding the session's token, is refused it and maps nothing. (The
    // engine verified its bytes through its own mapping before publishing its facts.)
    if (checker.engine_id() == 0) {
      ASSERT_THAT(checker.Attach("e2e-checker"), IsOk());
    }
    for (const SessionArena& arena : layout->arenas) {
      EXPECT_THAT(device.mapper->Map(arena.backend, arena.handle, arena.bytes,
                                     [&] {
                                       return ClientInternals::FetchArenaFd(
                                           checker, Number(facts, "session_id"), token,
                                           arena.handle);
                                     }),
                  StatusIs(absl::StatusCode::kPermissionDenied,
                           HasSubstrs("belongs to engine", "this handoff connection is engine")));
    }
    return;
  }
  std::vector<uint8_t*> bases;
  bool mapped = true;
  for (const SessionArena& arena : layout->arenas) {
    absl::StatusOr<void*> base = device.mapper->Map(arena.backend, arena.handle, arena.bytes);
    EXPECT_THAT(base, IsOk());
    mapped &= base.ok();
    bases.push_back(static_cast<uint8_t*>(base.value_or(nullptr)));
  }
  if (mapped) {
    EXPECT_THAT(VerifySession(*layout, state, LayoutPlanes(*layout, bases), *device.memory,
                              static_cast<uint8_t>(Number(facts, "recurrent_fill"))),
                IsOk());
  }
  for (const SessionArena& arena : layout->arenas) {
    (void)device.mapper->Unmap(arena.handle);  // NOT_FOUND for one that failed to map
  }
}

}  // namespace memra::testing
