#include "common/cuda_memmove.h"

#include <cstdint>

namespace memra {
namespace {

// Whether [a, a + bytes) and [b, b + bytes) share a byte.
bool Overlap(const void* a, const void* b, size_t bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return (x < y ? y - x : x - y) < bytes;
}

}  // namespace

cudaError_t MemmoveDeviceAsync(void* to, const void* from, size_t bytes, cudaStream_t stream) {
  if (!Overlap(to, from, bytes)) {
    return cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream);
  }
  void* scratch = nullptr;
  if (const cudaError_t err = cudaMallocAsync(&scratch, bytes, stream); err != cudaSuccess) {
    return err;
  }
  cudaError_t err = cudaMemcpyAsync(scratch, from, bytes, cudaMemcpyDeviceToDevice, stream);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(to, scratch, bytes, cudaMemcpyDeviceToDevice, stream);
  }
  const cudaError_t freed = cudaFreeAsync(scratch, stream);
  return err != cudaSuccess ? err : freed;
}

}  // namespace memra
