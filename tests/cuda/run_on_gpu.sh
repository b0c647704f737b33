#!/usr/bin/env bash
# Builds and runs every CUDA-tagged test on a machine with a GPU, in one call, and prints a
# summary: device, what passed, what skipped (with the reason) and what failed.
#
#   tests/cuda/run_on_gpu.sh            # from the repository root, as root on a fresh machine
#
# It runs every test tagged "cuda": the backend (create/export/copy/free, engine event handles),
# the client mapper (a cross-process IPC mapping), and //tests/cuda:cuda_bandwidth_test, whose
# measured copy bandwidths (each against the bare CUDA runtime in the same run) end the summary.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

echo "---- device"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
  echo "nvidia-smi not found"
fi

# dev.sh installs what is missing, runs the tests and ends with "N passed, N failed, N skipped",
# listing skipped cases with their reason (a CUDA test without a usable device skips, never passes).
status=0
deploy/dev.sh test --test_tag_filters=cuda //... || status=$?

echo "---- copy bandwidths (backend vs bare CUDA runtime, same process, same run)"
log="$(bazel info bazel-testlogs 2>/dev/null)/tests/cuda/cuda_bandwidth_test/test.log"
if [[ -f "${log}" ]] && grep -q '^BANDWIDTH' "${log}"; then
  grep '^BANDWIDTH' "${log}"
else
  echo "none measured (no device, or the bandwidth test did not run)"
fi
exit "${status}"
