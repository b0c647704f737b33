#!/usr/bin/env bash
# The GPU run, from a bundle alone (tests/cuda/make_gpu_bundle.sh; tests/cuda/README.md): prints
# the GPU, driver and toolkit, starts memra-kvd --backend=cuda and asks it memra-kvctl status,
# runs each CUDA test one at a time under its own timeout (the cuda e2e scenario with real
# memra-kvd and engine processes among them), the Python CUDA planes on torch CUDA tensors, and
# the bandwidth benchmark (cuda_bandwidth_test, last), and writes one summary and the logs.
#
#   tests/cuda/run_on_gpu.sh [BUNDLE]     BUNDLE: default gpu-bundle/ at the repository root
#
# Output under $OUT (default: a fresh /tmp/memra-gpu-run.* folder), at most 8 files, one folder
# deep: summary.txt (also printed), logs/<test>.log per test, logs/daemon.log (the smoke start)
# and logs/scratch.tar.gz (the daemons' and engines' own logs the tests left behind).
#
# Needs no Bazel, compiler or network: the bundle's binaries carry every library but the C
# library; the Python step needs python3 with grpcio, protobuf, numpy and pytest (torch for its
# torch cases; $PYTHON picks another interpreter). Never hangs: every step has a timeout cut to
# what is left of RUN_BUDGET_S (420 s by default; with the kill graces and the archive the run
# ends within 8 minutes). Exits 1 when a test failed or timed out, or when nvidia-smi lists a GPU
# but a test skipped for want of a CUDA device.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bundle="$(cd "${1:-${repo}/gpu-bundle}" 2>/dev/null && pwd)" || {
  echo "run_on_gpu: no bundle at ${1:-${repo}/gpu-bundle} (build it with tests/cuda/make_gpu_bundle.sh)" >&2
  exit 2
}
[[ -f "${bundle}/MANIFEST" ]] || { echo "run_on_gpu: ${bundle} has no MANIFEST" >&2; exit 2; }
# In case a copy dropped the modes: every ELF file of the bundle's tree is a program or library.
while IFS= read -r -d '' file; do
  [[ "$(LC_ALL=C head -c 4 "${file}")" == $'\x7fELF' ]] && chmod u+x "${file}"
done < <(find "${bundle}/memra_kv" -type f -print0)
out="${OUT:-$(mktemp -d /tmp/memra-gpu-run.XXXXXX)}"
mkdir -p "${out}/logs"
scratch="$(mktemp -d /tmp/mg.XXXXXX)"  # short: Unix socket paths are < 108 bytes
: >"${scratch}/started"
budget=${RUN_BUDGET_S:-420}
started=${SECONDS}
summary="${out}/summary.txt"
: >"${summary}"
status=0

say() { echo "$*" | tee -a "${summary}"; }

# within SECONDS: the smaller of SECONDS and what is left of the budget (at least 1).
within() {
  local left=$((budget - (SECONDS - started) - 5))
  ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"
}

# Seconds each test may run (one at a time; the sum stays inside the budget).
test_timeout() {
  case "$1" in
    cuda_e2e_test) echo 150 ;;
    cuda_bandwidth_test) echo 100 ;;
    cuda_mapper_test) echo 45 ;;
    test_cuda.py) echo 75 ;;
    *) echo 75 ;;
  esac
}

say "---- memra-kv GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ), bundle ${bundle}"
sed -n '2,5p' "${bundle}/MANIFEST" | tee -a "${summary}"

say "---- device"
gpu_listed=0
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout -k 5 "$(within 20)" nvidia-smi \
    --query-gpu=name,memory.total,driver_version,compute_mode,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader 2>&1 | tee -a "${summary}"
  timeout -k 5 "$(within 20)" nvidia-smi 2>&1 | grep -oE 'CUDA Version: [0-9.]+' |
    sed 's/^/driver supports /' | tee -a "${summary}"
  timeout -k 5 "$(within 20)" nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && gpu_listed=1
else
  say "nvidia-smi not found"
fi
nvcc="$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)"
if [[ -n "${nvcc}" ]]; then
  say "toolkit: $(timeout -k 5 "$(within 20)" "${nvcc}" --version 2>&1 | grep -E 'release' | xargs)"
else
  say "toolkit: no nvcc (the bundle brings its own CUDA runtime)"
fi
# The C library is the one thing the bundle takes from this machine: too old a one fails every
# binary at load time, so say it once here.
glibc_here="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{ print $2 }')"
glibc_needed="$(sed -nE 's/^needs glibc >= ([0-9.]+) .*/\1/p' "${bundle}/MANIFEST")"
if [[ -n "${glibc_here}" && -n "${glibc_needed}" &&
  "$(printf '%s\n' "${glibc_needed}" "${glibc_here}" | sort -V | head -n 1)" != "${glibc_needed}" ]]; then
  say "FAILED: glibc ${glibc_here} here, the bundle needs ${glibc_needed}: its binaries will not load"
  status=1
else
  say "glibc ${glibc_here:-unknown} here (the bundle needs ${glibc_needed:-?})"
fi

# The daemon itself on the GPU, before any test: memra-kvd --backend=cuda answers kvctl status.
# smoke_daemon: prints kvctl's answer, or FAILED with the daemon's log.
smoke_daemon() {
  local kvd="${bundle}/memra_kv/server/memra-kvd" kvctl="${bundle}/memra_kv/tools/memra-kvctl"
  local kvd_pid answered=0 try
  timeout -k 5 "$(within 30)" "${kvd}" --backend=cuda "--socket_path=${scratch}/kvd.sock" \
    --socket_mode=0600 --watchdog=false --metrics_address= --budget_bytes=1GiB \
    >"${out}/logs/daemon.log" 2>&1 &
  kvd_pid=$!
  answered=0
  for ((try = 0; try < 300; try++)); do  # until the admin socket answers or the daemon is gone
    if timeout -k 2 10 "${kvctl}" "--socket=${scratch}/kvd.admin.sock" --timeout=5 status \
      >"${scratch}/kvctl.txt" 2>&1; then
      answered=1
      break
    fi
    kill -0 "${kvd_pid}" 2>/dev/null || break
    sleep 0.1
  done
  if ((answered)); then
    tee -a "${summary}" <"${scratch}/kvctl.txt"
  else
    say "FAILED: memra-kvd --backend=cuda did not answer memra-kvctl status:"
    tail -n 20 "${out}/logs/daemon.log" "${scratch}/kvctl.txt" 2>/dev/null | tee -a "${summary}"
    status=1
  fi
  kill -TERM "${kvd_pid}" 2>/dev/null
  wait "${kvd_pid}"
  say "memra-kvd exit $? after SIGTERM (0: drained)"
}
say "---- memra-kvd --backend=cuda, memra-kvctl status"
if ((gpu_listed)); then
  smoke_daemon
else
  say "skipped: nvidia-smi lists no GPU"
fi

# run_step NAME LOG COMMAND...: one test under its timeout; prints its verdict line.
run_step() {
  local name="$1" log="$2" limit rc
  shift 2
  limit="$(within "$(test_timeout "${name}")")"
  local t0=${SECONDS}
  mkdir -p "${scratch}/${name}"
  timeout -k 10 "${limit}" env TEST_SRCDIR="${bundle}" TEST_TMPDIR="${scratch}/${name}" \
    "$@" >"${log}" 2>&1
  rc=$?
  if ((rc == 124 || rc == 137)); then
    say "TIMEOUT: ${name} after ${limit} s (log: logs/$(basename "${log}"))"
    status=1
  elif ((rc != 0)); then
    say "FAILED: ${name} exit ${rc} in $((SECONDS - t0)) s"
    status=1
  else
    say "ran: ${name} exit 0 in $((SECONDS - t0)) s"
  fi
}

# cases LOG NAME: GoogleTest's and pytest's verdict per case, and the skip reasons.
cases() {
  local log="$1" name="$2"
  {
    grep -hE '^\[ +(OK|SKIPPED|FAILED) +\] [^ ]+ \([0-9]+ ms\)$' "${log}" |
      sed -E 's/^\[ +OK +\]/passed: /; s/^\[ +SKIPPED +\]/skipped:/; s/^\[ +FAILED +\]/FAILED: /'
    grep -hoE '::[A-Za-z0-9_]+ (PASSED|SKIPPED|FAILED|ERROR)' "${log}" |
      sed -E 's/^::([^ ]+) PASSED/passed:  \1/; s/^::([^ ]+) SKIPPED/skipped: \1/; s/^::([^ ]+) (FAILED|ERROR)/FAILED:  \1/'
  } | sed "s|^|  ${name} |" | tee -a "${summary}"
  grep -hE '^SKIPPED(: | \[)' "${log}" | sort -u | sed 's/^/    /' | tee -a "${summary}"
  grep -h 'reclaimed .* after SIGKILL' "${log}" | sed 's/^/    /' | tee -a "${summary}"
}

say "---- CUDA tests, one at a time"
mapfile -t gtests < <(sed -n 's/^gtest //p' "${bundle}/MANIFEST" | grep -v '/cuda_bandwidth_test$')
mapfile -t bandwidth < <(sed -n 's/^gtest //p' "${bundle}/MANIFEST" | grep '/cuda_bandwidth_test$')
for path in "${gtests[@]}"; do
  name="$(basename "${path}")"
  run_step "${name}" "${out}/logs/${name}.log" "${bundle}/${path}" --gtest_color=no
  cases "${out}/logs/${name}.log" "${name}"
done

say "---- Python CUDA planes (torch CUDA tensors through __cuda_array_interface__)"
python="${PYTHON:-$(command -v python3 || true)}"
export PYTHONPATH="${bundle}/memra_kv/python:${bundle}/memra_kv/python/tests"
export CUDA_PATH="${bundle}/cuda"
# The interpreter's versions, and whether the bundle's package imports there at all.
read -r -d '' versions_script <<'PY'
import sys, grpc, google.protobuf as pb, numpy
import memra_kv
try:
    import torch
    t = "torch %s (cuda %s, available %s)" % (torch.__version__, torch.version.cuda,
                                              torch.cuda.is_available())
except ImportError as e:
    t = "no torch (%s)" % e
print("python %s, grpcio %s, protobuf %s, numpy %s, %s" % (
    sys.version.split()[0], grpc.__version__, pb.__version__, numpy.__version__, t))
PY
versions_rc=127
versions="no python3"
if [[ -n "${python}" ]]; then
  versions="$(timeout -k 5 "$(within 60)" "${python}" -c "${versions_script}" 2>&1)"
  versions_rc=$?
fi
if ((versions_rc != 0)); then
  if ((versions_rc == 124 || versions_rc == 137)); then
    say "TIMEOUT: importing memra_kv, grpc and torch"
  else
    say "FAILED: memra_kv does not import on ${python:-python3} (its stubs need protobuf >= 3.20," \
      "and grpcio):"
  fi
  say "${versions}"
  status=1
else
  say "${versions}"
  while read -r path; do
    name="$(basename "${path}")"
    run_step "${name}" "${out}/logs/${name%.py}.log" "${python}" -m pytest -v -rs \
      -p no:cacheprovider "${bundle}/${path}"
    cases "${out}/logs/${name%.py}.log" "${name}"
  done < <(sed -n 's/^pytest //p' "${bundle}/MANIFEST")
fi

say "---- bandwidth benchmark (backend vs bare CUDA runtime, same process, same run)"
for path in "${bandwidth[@]}"; do
  name="$(basename "${path}")"
  run_step "${name}" "${out}/logs/${name}.log" "${bundle}/${path}" --gtest_color=no
  cases "${out}/logs/${name}.log" "${name}"
  grep -hE '^(BANDWIDTH|MIRRORS)' "${out}/logs/${name}.log" | tee -a "${summary}"
done

if ((gpu_listed)) && grep -qsE '^SKIPPED(: | \[[0-9]+\] [^ ]+ )no CUDA device' "${out}/logs/"*.log; then
  say "FAILED: nvidia-smi lists a GPU but tests skipped for want of a CUDA device (driver," \
    "CUDA_VISIBLE_DEVICES, compute mode, or the bundle's CUDA runtime newer than the driver?)"
  status=1
fi

# What the tests left in their scratch folders and, after a failure, in /tmp/memra-* (the
# daemons' and engines' logs of a failed case), one archive.
leftovers=()
if ((status != 0)); then
  mapfile -t leftovers < <(find /tmp -maxdepth 1 -name 'memra-*' -newer "${scratch}/started" \
    -not -name 'memra-gpu-run.*' 2>/dev/null)
fi
timeout -k 5 30 tar -czf "${out}/logs/scratch.tar.gz" "${scratch}" "${leftovers[@]}" 2>/dev/null
rm -rf "${scratch}"

say "---- run_on_gpu.sh: $((SECONDS - started)) s in all (budget ${budget} s), exit status ${status}," \
  "output in ${out}"
exit "${status}"
