// An engine process with its own paged KV pool for the block store's end-to-end test
// (tests/e2e/block_store_e2e_test.cc). Attaches to memra-kvd (in --scope, default its uid's),
// creates its pool (a sealed memfd, tests/test_block_pool.h), offers and registers it, and by
// --mode:
//   store  fills pool blocks 0 .. --blocks-1 with the pattern of --seed and stores them under
//          the block hashes "block-hash-0" ..; writes engine_id and copied_bytes to --out;
//   load   looks the hashes up (pinned), requires --expect_matched leading blocks, loads them
//          into pool blocks in reverse order (block i into num_blocks-1-i) and checks every
//          byte against the pattern of --seed; writes matched to --out.
// Exit status 0 = every call and every check succeeded.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/block_store_client.h"
#include "client/client.h"
#include "core/status_macros.h"
#include "tests/e2e/facts.h"
#include "tests/engine_exit.h"
#include "tests/test_block_pool.h"

ABSL_FLAG(std::string, socket, "", "memra-kvd's Unix socket path");
ABSL_FLAG(std::string, mode, "store", "store or load");
ABSL_FLAG(std::string, scope, "", "cache scope to attach in (empty: the uid's)");
ABSL_FLAG(uint64_t, blocks, 4, "blocks stored / looked up");
ABSL_FLAG(uint64_t, seed, 1, "the pattern's seed");
ABSL_FLAG(uint64_t, expect_matched, 0, "load: leading blocks the lookup must find");
ABSL_FLAG(std::string, out, "", "facts file (key=value lines)");

namespace memra::testing {
namespace {

absl::Status Run() {
  ClientOptions options;
  options.cache_scope = absl::GetFlag(FLAGS_scope);
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                   KvClient::Connect(absl::GetFlag(FLAGS_socket), options));
  RETURN_IF_ERROR(client->Attach(absl::StrCat("block-engine-", absl::GetFlag(FLAGS_mode))));
  const TestPoolShape shape;
  ASSIGN_OR_RETURN(TestBlockPool pool, TestBlockPool::Create(shape));
  ASSIGN_OR_RETURN(uint64_t buffer, client->block_store().OfferPoolBuffer(pool.fd(), pool.bytes()));
  const PoolBufferRef ref{.handoff_buffer_id = buffer, .bytes = pool.bytes()};
  ASSIGN_OR_RETURN(RegisteredPool registered,
                   client->block_store().RegisterPool(shape.Spec(), {&ref, 1}));
  const uint64_t blocks = absl::GetFlag(FLAGS_blocks);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  BlockStoreCall call;
  call.registration_id = registered.registration_id;
  call.keys.hashes = TestBlockHashes(0, blocks);
  if (absl::GetFlag(FLAGS_mode) == "store") {
    for (uint64_t b = 0; b < blocks; ++b) {
      pool.Fill(b, seed + b);
      call.block_ids.push_back(static_cast<uint32_t>(b));
    }
    ASSIGN_OR_RETURN(BlockStoreTransfer stored, client->block_store().Store(call));
    for (size_t i = 0; i < stored.blocks.size(); ++i) {
      if (!stored.blocks[i].status.ok()) {
        return absl::Status(stored.blocks[i].status.code(),
                            absl::StrCat("block ", i, ": ", stored.blocks[i].status.message()));
      }
    }
    return WriteFacts(absl::GetFlag(FLAGS_out),
                      absl::StrCat("engine_id=", client->engine_id(),
                                   "\ncopied_bytes=", stored.copied_bytes, "\n"));
  }
  call.pin_ttl_ms = 10'000;
  ASSIGN_OR_RETURN(BlockStoreMatch match, client->block_store().Lookup(call));
  if (match.matched_blocks != absl::GetFlag(FLAGS_expect_matched)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the lookup matched ", match.matched_blocks, " blocks; expected ",
        absl::GetFlag(FLAGS_expect_matched)));
  }
  if (match.matched_blocks > 0) {
    call.keys.hashes.resize(match.matched_blocks);
    call.pin_id = match.pin_id;
    for (uint64_t b = 0; b < match.matched_blocks; ++b) {
      call.block_ids.push_back(static_cast<uint32_t>(shape.num_blocks - 1 - b));
    }
    ASSIGN_OR_RETURN(BlockStoreTransfer loaded, client->block_store().Load(call));
    for (uint64_t b = 0; b < match.matched_blocks; ++b) {
      if (!loaded.blocks[b].status.ok()) return loaded.blocks[b].status;
      if (!pool.Holds(shape.num_blocks - 1 - b, seed + b)) {
        return absl::DataLossError(absl::StrCat("loaded block ", b, " differs from the stored"));
      }
    }
  }
  return WriteFacts(absl::GetFlag(FLAGS_out), absl::StrCat("matched=", match.matched_blocks, "\n"));
}

}  // namespace
}  // namespace memra::testing

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return memra::testing::EngineExit(argv[0], absl::GetFlag(FLAGS_mode), memra::testing::Run());
}
