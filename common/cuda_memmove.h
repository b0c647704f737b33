#ifndef MEMRA_COMMON_CUDA_MEMMOVE_H_
#define MEMRA_COMMON_CUDA_MEMMOVE_H_

// memmove for device memory, shared by the daemon's cuda backend and the CUDA test engines.

#include <cuda_runtime_api.h>

#include <cstddef>

namespace memra {

// Enqueues a device-to-device copy of `bytes` on `stream` with memmove semantics. cudaMemcpy
// leaves overlapping ranges undefined (a ring rebase that keeps more rows than it shifts
// overlaps), so those are staged through stream-ordered scratch (cudaMallocAsync / cudaFreeAsync).
// Returns the first error; the caller synchronizes or orders on the stream as it needs.
cudaError_t MemmoveDeviceAsync(void* to, const void* from, size_t bytes, cudaStream_t stream);

}  // namespace memra

#endif  // MEMRA_COMMON_CUDA_MEMMOVE_H_
