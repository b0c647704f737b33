#ifndef MEMRA_TESTS_TEST_BLOCK_POOL_H_
#define MEMRA_TESTS_TEST_BLOCK_POOL_H_

// An engine's own paged KV pool as the block store tests, engines and bench use it: a memfd the
// "engine" creates, seals against shrinking and maps, and the layout (core/block_layout.h)
// describing it: `layers` layers of K and V tensors, one after another, `num_blocks` blocks
// each (group 0), optionally a hybrid group 1 (the second half of the layers and a STATE tensor
// after them).

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/mapped_region.h"
#include "core/block_layout.h"

namespace memra::testing {

struct TestPoolShape {
  uint32_t tokens_per_block = 16;
  uint32_t heads = 2;
  uint32_t head_dim = 8;
  uint32_t layers = 2;
  uint64_t num_blocks = 16;
  uint64_t state_bytes = 96;  // per state slot (hybrid only)
  bool hybrid = false;
  std::string model = "block-store-test@1";

  uint64_t kv_block_bytes() const { return uint64_t{tokens_per_block} * heads * head_dim * 2; }
  uint32_t tensors() const { return 2 * layers; }
  uint64_t tensor_bytes() const { return num_blocks * kv_block_bytes(); }
  uint64_t pool_bytes() const {
    return tensors() * tensor_bytes() + (hybrid ? num_blocks * state_bytes : 0);
  }
  // Stored bytes of one block of group 0 (all of it when not hybrid).
  uint64_t block_bytes() const { return (hybrid ? 2 : tensors()) * kv_block_bytes(); }

  BlockPoolSpec Spec() const {
    BlockPoolSpec spec;
    spec.num_blocks = num_blocks;
    spec.tokens_per_block = tokens_per_block;
    spec.element = static_cast<uint32_t>(BlockElement::kFp16);
    spec.order = static_cast<uint32_t>(BlockOrder::kNhd);
    spec.num_kv_heads = heads;
    spec.head_dim = head_dim;
    spec.tp_size = 1;
    spec.model = model;
    for (uint32_t i = 0; i < tensors(); ++i) {
      spec.tensors.push_back(
          {.layer = i / 2,
           .role = static_cast<uint32_t>(i % 2 == 0 ? BlockTensorRole::kK : BlockTensorRole::kV),
           .kv_group = hybrid && i >= 2 ? 1u : 0u,
           .buffer = 0,
           .offset = i * tensor_bytes(),
           .block_stride = kv_block_bytes(),
           .block_bytes = kv_block_bytes()});
    }
    if (hybrid) {
      spec.tensors.push_back({.layer = 1000,
                              .role = static_cast<uint32_t>(BlockTensorRole::kState),
                              .kv_group = 1,
                              .buffer = 0,
                              .offset = tensors() * tensor_bytes(),
                              .block_stride = state_bytes,
                              .block_bytes = state_bytes});
    }
    return spec;
  }
};

class TestBlockPool {
 public:
  // A pool of shape.pool_bytes(), sealed with F_SEAL_SHRINK unless `seal` is false.
  static absl::StatusOr<TestBlockPool> Create(const TestPoolShape& shape, bool seal = true) {
    ScopedFd fd(memfd_create("engine-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (fd.get() < 0) return absl::InternalError("memfd_create failed");
    const uint64_t bytes = shape.pool_bytes();
    if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
      return absl::InternalError(absl::StrCat("ftruncate to ", bytes, " failed"));
    }
    if (seal && fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
      return absl::InternalError("F_ADD_SEALS failed");
    }
    void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (at == MAP_FAILED) return absl::InternalError("mmap of the pool failed");
    return TestBlockPool(shape, std::move(fd), static_cast<uint8_t*>(at));
  }
  TestBlockPool(TestBlockPool&& other) noexcept
      : shape_(other.shape_), fd_(std::move(other.fd_)), data_(other.data_) {
    other.data_ = nullptr;
  }
  TestBlockPool& operator=(TestBlockPool&&) = delete;
  ~TestBlockPool() {
    if (data_ != nullptr) munmap(data_, shape_.pool_bytes());
  }

  int fd() const { return fd_.get(); }
  uint64_t bytes() const { return shape_.pool_bytes(); }
  uint8_t* data() const { return data_; }
  // Block `block` of tensor `tensor` (K and V alternate, layer by layer).
  uint8_t* TensorBlock(uint32_t tensor, uint64_t block) const {
    return data_ + tensor * shape_.tensor_bytes() + block * shape_.kv_block_bytes();
  }
  uint8_t* StateSlot(uint64_t block) const {
    return data_ + shape_.tensors() * shape_.tensor_bytes() + block * shape_.state_bytes;
  }

  // Fills every tensor of `block` with bytes derived from `seed`.
  void Fill(uint64_t block, uint64_t seed) const {
    for (uint32_t t = 0; t < shape_.tensors(); ++t) {
      uint8_t* at = TensorBlock(t, block);
      for (uint64_t i = 0; i < shape_.kv_block_bytes(); ++i) {
        at[i] = static_cast<uint8_t>(seed * 31 + t * 7 + i);
      }
    }
  }
  // Whether every tensor of `block` holds what Fill(_, seed) wrote.
  bool Holds(uint64_t block, uint64_t seed) const {
    for (uint32_t t = 0; t < shape_.tensors(); ++t) {
      const uint8_t* at = TensorBlock(t, block);
      for (uint64_t i = 0; i < shape_.kv_block_bytes(); ++i) {
        if (at[i] != static_cast<uint8_t>(seed * 31 + t * 7 + i)) return false;
      }
    }
    return true;
  }
  // Whether every tensor of `block` equals `other_block` of `other`.
  bool SameBlock(uint64_t block, const TestBlockPool& other, uint64_t other_block) const {
    for (uint32_t t = 0; t < shape_.tensors(); ++t) {
      if (std::memcmp(TensorBlock(t, block), other.TensorBlock(t, other_block),
                      shape_.kv_block_bytes()) != 0) {
        return false;
      }
    }
    return true;
  }

 private:
  TestBlockPool(const TestPoolShape& shape, ScopedFd fd, uint8_t* data)
      : shape_(shape), fd_(std::move(fd)), data_(data) {}

  TestPoolShape shape_;
  ScopedFd fd_;
  uint8_t* data_ = nullptr;
};

// "block-hash-<first>" .. "block-hash-<first + count - 1>": an engine's chained block hashes.
inline std::vector<std::string> TestBlockHashes(uint64_t first, uint64_t count) {
  std::vector<std::string> hashes;
  for (uint64_t i = first; i < first + count; ++i) hashes.push_back(absl::StrCat("block-hash-", i));
  return hashes;
}

}  // namespace memra::testing

#endif  // MEMRA_TESTS_TEST_BLOCK_POOL_H_
