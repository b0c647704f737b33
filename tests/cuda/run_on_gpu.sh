#!/usr/bin/env bash
# Builds and runs every CUDA-tagged test and the CUDA benchmark on a machine with a GPU, in one
# call, and prints a summary: the device, each test case passed / skipped (with the reason) /
# failed, the measured copy bandwidths and the whole run's time.
#
#   tests/cuda/run_on_gpu.sh            # from anywhere in the repository; root on a fresh machine
#
# The tests (tests/cuda/README.md): the cuda backend (create/export/copy/free, engine event
# handles), the client mapper (a cross-process IPC mapping), //tests/cuda:cuda_e2e_test (the host
# end-to-end scenario against memra-kvd --backend=cuda with engine processes writing through
# CUDA copies ordered by interprocess events) and //tests/cuda:cuda_bandwidth_test, the benchmark,
# whose copy bandwidths (each against the bare CUDA runtime in the same run) and mirror-store
# costs (one batch per call against one copy per mirror) end the summary.
#
# Designed for under 5 minutes on one H200-class GPU from a fresh machine: deploy/dev.sh installs
# what is missing, only the CUDA tests and what they depend on are built (not //...), and the
# tests run one at a time (--local_test_jobs=1) so no test's copies share the GPU with another's
# and the bandwidths are the device's own.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
started=${SECONDS}

echo "---- device"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader || true
else
  echo "nvidia-smi not found"
fi

deploy/dev.sh bootstrap
# Every test tagged "cuda"; none where the toolkit is missing (cuda_cc_test declares nothing).
mapfile -t targets < <(bazel query --noshow_progress 'attr(tags, "\bcuda\b", tests(//...))' \
  2>/dev/null | sort)
if ((${#targets[@]} == 0)); then
  echo "no CUDA-tagged test is declared here (no CUDA toolkit under /usr/local/cuda or" \
    "\$CUDA_PATH): nothing to run"
  exit 1
fi
echo "---- ${#targets[@]} CUDA tests: ${targets[*]}"

# dev.sh ends with "N passed, N failed, N skipped" per test target, listing skipped ones with
# their reason (a CUDA test without a usable device skips, never passes).
status=0
deploy/dev.sh test --local_test_jobs=1 "${targets[@]}" || status=$?

testlogs="$(bazel info --nosandbox_debug bazel-testlogs 2>/dev/null || true)"
echo
echo "---- CUDA test cases"
for target in "${targets[@]}"; do
  dir="${testlogs}/${target#//}"
  log="${dir/://}/test.log"
  if [[ ! -f "${log}" ]]; then
    echo "${target}: no log (not run: see the build output above)"
    continue
  fi
  # GoogleTest's own verdict per case: OK, SKIPPED or FAILED, with its time.
  grep -hE '^\[ +(OK|SKIPPED|FAILED) +\] [^ ]+ \([0-9]+ ms\)$' "${log}" |
    sed -E 's/^\[ +OK +\]/passed: /; s/^\[ +SKIPPED +\]/skipped:/; s/^\[ +FAILED +\]/FAILED: /' |
    sed "s|^|${target} |" || true
  # pytest's verdict per case (the Python package's CUDA tests run with -v).
  grep -hoE '::[A-Za-z0-9_]+ (PASSED|SKIPPED|FAILED)' "${log}" |
    sed -E 's/^::([^ ]+) PASSED/passed:  \1/; s/^::([^ ]+) SKIPPED/skipped: \1/; s/^::([^ ]+) FAILED/FAILED:  \1/' |
    sed "s|^|${target} |" || true
  grep -qE '^\[ +(OK|SKIPPED|FAILED) +\] |::[A-Za-z0-9_]+ (PASSED|SKIPPED|FAILED)' "${log}" ||
    echo "${target}: no test case ran"
  grep -hE '^SKIPPED(: | \[)' "${log}" | sort -u | sed 's/^/    /' || true
  grep -h 'reclaimed .* after SIGKILL' "${log}" | sed 's/^/    /' || true
done

echo
echo "---- copy bandwidths (backend vs bare CUDA runtime, same process, same run)"
log="${testlogs}/tests/cuda/cuda_bandwidth_test/test.log"
if [[ -f "${log}" ]] && grep -q '^BANDWIDTH' "${log}"; then
  grep '^BANDWIDTH' "${log}"
else
  echo "none measured (no device, or the bandwidth test did not run)"
fi
echo
echo "---- mirror stores per session operation (one batch vs one copy per mirror, same run)"
if [[ -f "${log}" ]] && grep -q '^MIRRORS' "${log}"; then
  grep '^MIRRORS' "${log}"
else
  echo "none measured (no device, or the bandwidth test did not run)"
fi

# On a machine with a GPU a "no CUDA device" skip means the tests never touched it: not a pass.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU ' &&
  [[ -n "${testlogs}" ]] && grep -rqsE --include=test.log '^SKIPPED(: | \[[0-9]+\] [^ ]+ )no CUDA device' "${testlogs}"; then
  echo
  echo "failed: nvidia-smi lists a GPU but CUDA tests skipped for want of a device (driver," \
    "CUDA_VISIBLE_DEVICES or compute mode?)"
  status=1
fi

elapsed=$((SECONDS - started))
echo
echo "---- run_on_gpu.sh: ${elapsed} s in all (target: under 300 s on one H200-class GPU)," \
  "exit status ${status}"
exit "${status}"
