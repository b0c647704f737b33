#!/usr/bin/env bash
# Builds and runs every CUDA-tagged test on a machine with a GPU, in one call, and prints a
# summary: device, what passed, what skipped (with the reason) and what failed.
#
#   tests/cuda/run_on_gpu.sh            # from the repository root, as root on a fresh machine
#
# It runs what exists today: //server:cuda_backend_test and //client:cuda_mapper_test (backend
# create/export/copy/free, and a cross-process IPC mapping). The CUDA end-to-end scenario and the
# CUDA copy-bandwidth benchmarks are still to be written (issues 6 and 8).
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
deploy/dev.sh test --test_tag_filters=cuda //...
