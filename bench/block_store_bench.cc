// Section 8: the block store (docs/block-store.md). An engine's own paged pool (a sealed memfd
// this process maps, tests/test_block_pool.h: 8 layers of K and V, 8 KV heads of 64, fp16,
// 16-token blocks of 256 KiB) is registered with memra-kvd (host backend); StoreBlocks and
// LoadBlocks of 1k- and 32k-token sequences (64 and 2,048 blocks) between the pool and the
// store are timed, the reply meaning the copies are done. Every store copies (each repetition
// stores under new hashes, after two untimed ones that fill the cache to its budget: the timed
// ones evict the oldest and reuse their storage), every load is checked byte for byte once.
// Baselines in the same run: memcpy of the same bytes between two warm buffers in this process,
// and Redis (the peer of section 3) SET / GET of the same blocks, one key per 16-token block.
// Each timed store and load is followed at once by a memcpy of the same bytes and by the
// daemon's own per-block work done in this process (xxHash3 of each 16 KiB piece, then its
// memcpy; server/device/host_backend.cc CopyHashed): the pair's ratios are taken under the same
// load (other tenants of this VM swing memcpy 2x between seconds, and a baseline timed apart then
// moves every ratio).

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/redis_peer.h"
#include "bench/sections.h"
#include "client/block_store_client.h"
#include "client/client.h"
#include "server/base/streaming_checksum.h"
#include "core/status_macros.h"
#include "tests/test_block_pool.h"

namespace memra::bench {
namespace {

using ::memra::testing::TestBlockPool;
using ::memra::testing::TestPoolShape;

struct SequenceSize {
  uint64_t tokens;
  int reps;
};

struct SequenceResult {
  uint64_t tokens = 0;
  uint64_t blocks = 0;
  uint64_t bytes = 0;
  Samples store, load, copy, redis_set, redis_get;
  // Bandwidth ratios of each timed store / load to the memcpy and the hashed copy run right
  // after it (PairedBaselines).
  Samples store_vs_memcpy, load_vs_memcpy, store_vs_hashed, load_vs_hashed;
};

// Warm buffers of one sequence's bytes, and the two baselines a timed call is paired with.
class PairedBaselines {
 public:
  PairedBaselines(uint64_t bytes, uint64_t block_bytes, uint64_t piece_bytes)
      : block_bytes_(block_bytes), piece_bytes_(piece_bytes), src_(bytes, 0x3c), dst_(bytes, 0) {
    std::memcpy(dst_.data(), src_.data(), bytes);
  }
  const std::vector<uint8_t>& src() const { return src_; }
  std::vector<uint8_t>& dst() { return dst_; }

  int64_t Memcpy() {
    const int64_t start = NowNs();
    std::memcpy(dst_.data(), src_.data(), src_.size());
    const int64_t ns = NowNs() - start;
    KeepAlive(dst_[dst_.size() - 1]);
    return ns;
  }
  // What the daemon's copier does per block, on one thread: one checksum per block, each piece
  // hashed, then copied while it is in cache.
  absl::StatusOr<int64_t> HashedCopy() {
    const int64_t start = NowNs();
    uint64_t digests = 0;
    for (uint64_t block = 0; block < src_.size(); block += block_bytes_) {
      ASSIGN_OR_RETURN(StreamingChecksum checksum, StreamingChecksum::Create());
      for (uint64_t piece = block; piece < block + block_bytes_; piece += piece_bytes_) {
        checksum.Update(src_.data() + piece, piece_bytes_);
        std::memcpy(dst_.data() + piece, src_.data() + piece, piece_bytes_);
      }
      digests ^= checksum.Digest();
    }
    const int64_t ns = NowNs() - start;
    KeepAlive(digests);
    return ns;
  }
  // Pairs a timed call of `call_ns` with both baselines: bandwidth ratios call/baseline.
  absl::Status Pair(int64_t call_ns, Samples& vs_memcpy, Samples& vs_hashed) {
    vs_memcpy.Add(static_cast<double>(Memcpy()) / static_cast<double>(call_ns));
    ASSIGN_OR_RETURN(const int64_t hashed_ns, HashedCopy());
    vs_hashed.Add(static_cast<double>(hashed_ns) / static_cast<double>(call_ns));
    return absl::OkStatus();
  }

 private:
  const uint64_t block_bytes_;
  const uint64_t piece_bytes_;
  std::vector<uint8_t> src_, dst_;
};

std::vector<std::string> SequenceHashes(uint64_t tokens, int rep, uint64_t blocks) {
  std::vector<std::string> hashes;
  hashes.reserve(blocks);
  for (uint64_t i = 0; i < blocks; ++i) hashes.push_back(absl::StrCat(tokens, ":", rep, ":", i));
  return hashes;
}

absl::Status CheckAll(const BlockStoreTransfer& transfer, absl::string_view what) {
  for (size_t i = 0; i < transfer.blocks.size(); ++i) {
    if (!transfer.blocks[i].status.ok()) {
      return absl::Status(transfer.blocks[i].status.code(),
                          absl::StrCat(what, " block ", i, ": ",
                                       transfer.blocks[i].status.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SequenceResult> MeasureSequence(KvClient& client, const RegisteredPool& pool,
                                               const TestBlockPool& memory,
                                               const TestPoolShape& shape, redisContext* redis,
                                               const SequenceSize& size, int reps) {
  SequenceResult result;
  result.tokens = size.tokens;
  result.blocks = size.tokens / shape.tokens_per_block;
  result.bytes = result.blocks * shape.block_bytes();
  // The pool's pieces: one K or V plane of one layer per block (tests/test_block_pool.h).
  PairedBaselines baselines(result.bytes, shape.block_bytes(),
                            shape.block_bytes() / (2 * shape.layers));
  const BlockStoreClient blocks = client.block_store();
  BlockStoreCall call;
  call.registration_id = pool.registration_id;
  for (uint64_t b = 0; b < result.blocks; ++b) call.block_ids.push_back(static_cast<uint32_t>(b));
  // Two untimed stores first fill the cache to its budget, so the timed ones copy into storage
  // an eviction just freed (a cache at its budget), not into slabs the kernel must first zero.
  const int warm_up = 2;
  for (int rep = -warm_up; rep < reps; ++rep) {
    call.keys.hashes = SequenceHashes(size.tokens, rep, result.blocks);
    const int64_t start = NowNs();
    ASSIGN_OR_RETURN(BlockStoreTransfer stored, blocks.Store(call));
    const int64_t store_ns = NowNs() - start;
    RETURN_IF_ERROR(CheckAll(stored, "store"));
    if (rep >= 0) {
      result.store.Add(store_ns);
      RETURN_IF_ERROR(baselines.Pair(store_ns, result.store_vs_memcpy, result.store_vs_hashed));
    }
    if (stored.copied_bytes != result.bytes) {
      return absl::InternalError(absl::StrCat("a store copied ", stored.copied_bytes,
                                              " bytes, not ", result.bytes));
    }
  }
  // Loads of the last stored sequence, each block into the mirror block id.
  call.block_ids.clear();
  for (uint64_t b = 0; b < result.blocks; ++b) {
    call.block_ids.push_back(static_cast<uint32_t>(shape.num_blocks - 1 - b));
  }
  for (int rep = 0; rep < reps; ++rep) {
    const int64_t start = NowNs();
    ASSIGN_OR_RETURN(BlockStoreTransfer loaded, blocks.Load(call));
    const int64_t load_ns = NowNs() - start;
    result.load.Add(load_ns);
    RETURN_IF_ERROR(CheckAll(loaded, "load"));
    RETURN_IF_ERROR(baselines.Pair(load_ns, result.load_vs_memcpy, result.load_vs_hashed));
    if (rep == 0) {
      for (uint64_t b = 0; b < result.blocks; ++b) {
        if (!memory.Holds(shape.num_blocks - 1 - b, b)) {
          return absl::DataLossError(absl::StrCat("loaded block ", b, " differs"));
        }
      }
    }
  }
  // The pool as it was, for the next sequence's stores.
  for (uint64_t b = 0; b < shape.num_blocks; ++b) memory.Fill(b, b);
  for (int rep = 0; rep < std::max(reps, 3); ++rep) result.copy.Add(baselines.Memcpy());
  const std::vector<uint8_t>& src = baselines.src();
  std::vector<uint8_t>& dst = baselines.dst();
  const uint64_t block_bytes = shape.block_bytes();
  for (int rep = 0; rep < reps; ++rep) {
    int64_t start = NowNs();
    for (uint64_t b = 0; b < result.blocks; ++b) {
      const std::string key = absl::StrCat("block:", size.tokens, ":", b);
      RETURN_IF_ERROR(Command(redis, "SET %b %b", key.data(), key.size(),
                              src.data() + b * block_bytes, static_cast<size_t>(block_bytes))
                          .status());
    }
    result.redis_set.Add(NowNs() - start);
    start = NowNs();
    for (uint64_t b = 0; b < result.blocks; ++b) {
      const std::string key = absl::StrCat("block:", size.tokens, ":", b);
      ASSIGN_OR_RETURN(Reply reply, Command(redis, "GET %b", key.data(), key.size()));
      if (reply->type != REDIS_REPLY_STRING || static_cast<uint64_t>(reply->len) != block_bytes) {
        return absl::InternalError(absl::StrCat("GET ", key, " answered type ", reply->type));
      }
      std::memcpy(dst.data() + b * block_bytes, reply->str, block_bytes);
    }
    result.redis_get.Add(NowNs() - start);
  }
  RETURN_IF_ERROR(Command(redis, "FLUSHALL").status());
  return result;
}

// Paired ratios (bandwidth of the call / of its baseline): median and range over the pairs.
Json RatioJson(const Samples& ratios) {
  return Json{{"n", ratios.count()},
              {"p50", ratios.P50()},
              {"min", ratios.Percentile(0)},
              {"max", ratios.Percentile(100)}};
}

}  // namespace

absl::StatusOr<Json> RunBlockStore(const BenchOptions& options) {
  TestPoolShape shape;
  shape.heads = 8;
  shape.head_dim = 64;
  shape.layers = 8;
  shape.num_blocks = options.quick ? 64 : 2048;
  shape.model = "bench-8x8x64";
  std::vector<SequenceSize> sizes = {{1024, 10}};
  if (!options.quick) sizes.push_back({32768, 8});
  const uint64_t largest = sizes.back().tokens / shape.tokens_per_block * shape.block_bytes();
  // Room for two of the largest sequences (later repetitions evict the oldest), in whole
  // 128 MiB slabs: the prefix cache keeps emptied slabs for reuse only up to its budget, so a
  // budget that ends inside a slab would zero a fresh slab for every store.
  constexpr uint64_t kSlabBytes = uint64_t{128} << 20;
  const uint64_t prefix_budget = (2 * largest + (uint64_t{64} << 20) + kSlabBytes - 1) /
                                 kSlabBytes * kSlabBytes;
  ASSIGN_OR_RETURN(std::unique_ptr<Kvd> kvd,
                   Kvd::Start(options, prefix_budget + (uint64_t{256} << 20),
                              {absl::StrCat("--prefix_cache_budget_bytes=", prefix_budget)}));
  ASSIGN_OR_RETURN(std::unique_ptr<RedisPeer> peer, RedisPeer::Start(options));
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, kvd->Attach("bench-block-store"));
  ASSIGN_OR_RETURN(TestBlockPool memory, TestBlockPool::Create(shape));
  for (uint64_t b = 0; b < shape.num_blocks; ++b) memory.Fill(b, b);
  const BlockStoreClient blocks = client->block_store();
  ASSIGN_OR_RETURN(uint64_t buffer, blocks.OfferPoolBuffer(memory.fd(), memory.bytes()));
  const PoolBufferRef ref{.handoff_buffer_id = buffer, .bytes = memory.bytes()};
  ASSIGN_OR_RETURN(RegisteredPool pool, blocks.RegisterPool(shape.Spec(), {&ref, 1}));

  Json rows = Json::array();
  Table table({"sequence", "bytes", "store GB/s", "load GB/s", "memcpy GB/s", "Redis SET GB/s",
               "Redis GET GB/s", "store/memcpy", "load/memcpy", "load/GET", "store/paired memcpy",
               "load/paired memcpy", "store/paired hashed", "load/paired hashed"});
  for (const SequenceSize& size : sizes) {
    const int reps = options.quick ? 1 : size.reps;
    ASSIGN_OR_RETURN(SequenceResult r, MeasureSequence(*client, pool, memory, shape,
                                                       peer->connection(), size, reps));
    const double store = GBps(r.bytes, r.store.P50());
    const double load = GBps(r.bytes, r.load.P50());
    const double copy = GBps(r.bytes, r.copy.P50());
    const double set = GBps(r.bytes, r.redis_set.P50());
    const double get = GBps(r.bytes, r.redis_get.P50());
    rows.push_back(Json{{"tokens", r.tokens},
                        {"blocks", r.blocks},
                        {"bytes", r.bytes},
                        {"store", r.store.ToJson()},
                        {"load", r.load.ToJson()},
                        {"memcpy", r.copy.ToJson()},
                        {"redis_set", r.redis_set.ToJson()},
                        {"redis_get", r.redis_get.ToJson()},
                        {"store_gbps_p50", store},
                        {"load_gbps_p50", load},
                        {"memcpy_gbps_p50", copy},
                        {"redis_get_gbps_p50", get},
                        {"ratio_store_memcpy", store / copy},
                        {"ratio_load_memcpy", load / copy},
                        {"ratio_load_redis_get", load / get},
                        {"ratio_store_paired_memcpy", RatioJson(r.store_vs_memcpy)},
                        {"ratio_load_paired_memcpy", RatioJson(r.load_vs_memcpy)},
                        {"ratio_store_paired_hashed_copy", RatioJson(r.store_vs_hashed)},
                        {"ratio_load_paired_hashed_copy", RatioJson(r.load_vs_hashed)}});
    table.Add({absl::StrCat(r.tokens / 1024, "k tokens"), absl::StrCat(r.bytes), Fixed(store, 2),
               Fixed(load, 2), Fixed(copy, 2), Fixed(set, 2), Fixed(get, 2), Ratio(store / copy),
               Ratio(load / copy), Ratio(load / get), Ratio(r.store_vs_memcpy.P50()),
               Ratio(r.load_vs_memcpy.P50()), Ratio(r.store_vs_hashed.P50()),
               Ratio(r.load_vs_hashed.P50())});
  }
  RETURN_IF_ERROR(client->block_store().UnregisterPool(pool.registration_id));
  client->Detach();
  table.Print(absl::StrCat("8. Block store: an engine pool's 16-token blocks (",
                           shape.block_bytes() / 1024,
                           " KiB) stored and loaded through memra-kvd vs memcpy and Redis ",
                           peer->version()));
  return Json{{"pool", Json{{"layers", shape.layers},
                            {"kv_heads", shape.heads},
                            {"head_dim", shape.head_dim},
                            {"element", "fp16"},
                            {"tokens_per_block", shape.tokens_per_block},
                            {"block_bytes", shape.block_bytes()},
                            {"num_blocks", shape.num_blocks}}},
              {"redis_version", peer->version()},
              {"sequences", rows}};
}

}  // namespace memra::bench
