#!/usr/bin/env bash
# Developer entry points; run from anywhere inside the repository.
#
#   deploy/dev.sh run [--<key>=<value> ...]   install missing packages, build memra-kvd and run it
#                                            in the foreground on the host backend (Ctrl-C drains)
#   deploy/dev.sh test [<bazel test args>]    install missing packages, `bazel test //...` (or the
#                                            given targets), then with no targets (or the
#                                            target "engines") the tests under real engines
#                                            from PyPI (python/engines/run_engine_tests.sh),
#                                            then one closing line:
#                                            "N passed, N failed[, N skipped]"
#   deploy/dev.sh bootstrap                   only install missing packages (deploy/bootstrap.sh)
#
# `run` listens on /tmp/memra-kv/gpu0.sock with a 1 GiB budget; extra flags are config keys
# (server/config.h, `memra-kvd --help`) and win over these defaults.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${root}"

# Debian's /etc/bazel/bazelrc sets --sandbox_debug, which prints linux-sandbox's debug trace for
# every sandboxed action and keeps the sandbox directories. Turning it off changes no sandboxing.
BAZEL_FLAGS=(--nosandbox_debug)
out=""  # cmd_test's captured bazel output, removed on exit
engine_logs=""  # cmd_test's engine test logs (python/engines/run_engine_tests.sh)

readonly DAEMON_SOCKET=/tmp/memra-kv/gpu0.sock
readonly DAEMON_FLAGS=(--backend=host "--socket_path=${DAEMON_SOCKET}" --budget_bytes=1GiB)

usage() {
  sed -n '2,12s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
  exit 2
}

bootstrap() {
  "${root}/deploy/bootstrap.sh"
}

cmd_run() {
  bootstrap
  local query_err
  if ! query_err="$(bazel query //server:memra-kvd 2>&1 >/dev/null)"; then
    printf '%s\n' "${query_err}" | grep -E '^ERROR' >&2 || true
    echo "dev.sh run: the daemon target //server:memra-kvd is not available in this checkout" \
      "(server/BUILD.bazel does not define it or does not load); nothing to run." >&2
    exit 1
  fi
  bazel build "${BAZEL_FLAGS[@]}" //server:memra-kvd
  local binary=bazel-bin/server/memra-kvd
  [[ -x "${binary}" ]] || {
    echo "dev.sh run: ${binary} was not built" >&2
    exit 1
  }
  mkdir -p -m 0700 "$(dirname "${DAEMON_SOCKET}")"
  echo "dev.sh run: ${binary} ${DAEMON_FLAGS[*]} $*"
  exec "${binary}" "${DAEMON_FLAGS[@]}" "$@"
}

# count_cases LOG...: prints "<ran> <skipped>" over GoogleTest and pytest logs (0 0 for other
# tests). pytest's closing line reads "=== 3 passed, 1 skipped, 1 warning in 0.5s ===".
count_cases() {
  local ran=0 skipped=0 n log py_ran py_skipped
  for log in "$@"; do
    n="$(sed -n 's/^\[==========\] \([0-9][0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "${log}" |
      tail -n 1)"
    ran=$((ran + ${n:-0}))
    n="$(grep -cE '^\[  SKIPPED \] [^ ]+ \([0-9]+ ms\)$' "${log}" || true)"
    skipped=$((skipped + ${n:-0}))
    read -r py_ran py_skipped < <(awk '
      /^=+ .*[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed).* in [0-9.]+s.* =+$/ {
        line = $0
      }
      END {
        ran = 0; skipped = 0
        n = split(line, word, /[ ,]+/)
        for (i = 1; i < n; i++) {
          if (word[i] !~ /^[0-9]+$/) continue
          if (word[i + 1] ~ /^(passed|failed|skipped|errors?|xfailed|xpassed)$/) ran += word[i]
          if (word[i + 1] == "skipped") skipped += word[i]
        }
        print ran, skipped
      }' "${log}")
    ran=$((ran + py_ran))
    skipped=$((skipped + py_skipped))
  done
  echo "${ran} ${skipped}"
}

# skip_reasons LOG...: the distinct reasons the skipped tests printed: a "SKIPPED: ..." line of
# their own, the message streamed into GTEST_SKIP() (the line after "<file>:<line>: Skipped"), or
# pytest's -rs line "SKIPPED [1] <file>:<line>: <reason>".
skip_reasons() {
  awk '/^SKIPPED: / { print; next }
       /^SKIPPED \[[0-9]+\] / { sub(/^SKIPPED \[[0-9]+\] [^ ]+: /, "SKIPPED: "); print; next }
       found { if (NF) print; found = 0 } /: Skipped$/ { found = 1 }' \
    "$@" | sort -u | head -n 3
}

cmd_test() {
  bootstrap
  local targets=() engines=0 arg
  for arg in "$@"; do
    if [[ "${arg}" == engines ]]; then engines=1; else targets+=("${arg}"); fi
  done
  if (($# == 0)); then targets=(//...) engines=1; fi

  out="$(mktemp "${TMPDIR:-/tmp}/memra-kv-test.XXXXXX")"
  # Kept after the run (a failure's line names its log), replaced by the next engine run.
  engine_logs="${XDG_CACHE_HOME:-${HOME}/.cache}/memra-kv/engine-test-logs"
  trap 'rm -f "${out}"' EXIT
  local status=0
  if ((${#targets[@]} > 0)); then
    bazel test "${BAZEL_FLAGS[@]}" --keep_going --test_output=errors --test_summary=short \
      "${targets[@]}" 2>&1 | tee "${out}" || status="${PIPESTATUS[0]}"
  fi
  if ((engines)); then
    # Engine tests (real vLLM from PyPI, its own venv): lines "engine:<engine>/<file> RESULT".
    rm -rf "${engine_logs}"
    mkdir -p "${engine_logs}"
    bazel build "${BAZEL_FLAGS[@]}" //server:memra-kvd || status=$?
    python/engines/run_engine_tests.sh "${engine_logs}" 2>&1 | tee -a "${out}" ||
      status="${PIPESTATUS[0]}"
  fi

  local testlogs output_base
  testlogs="$(bazel info "${BAZEL_FLAGS[@]}" bazel-testlogs 2>/dev/null || true)"
  output_base="$(bazel info output_base 2>/dev/null || true)"

  local passed=0 failed=0 skipped=0 label result dir ran skips
  local -a logs notes=()
  # Summary lines: "//pkg:target   [(cached) ]STATUS[ in 1.2s]" (--test_summary=short).
  while read -r label result; do
    case "${result}" in
      PASSED* | FLAKY*)
        logs=()
        dir="${testlogs}/${label#//}"
        dir="${dir/://}"
        if [[ "${label}" == engine:* ]]; then
          logs=("${engine_logs}/${label#engine:}.log")
        elif [[ -n "${testlogs}" && -d "${dir}" ]]; then
          mapfile -t logs < <(find "${dir}" -maxdepth 2 -name test.log | sort)
        fi
        ran=0 skips=0
        if ((${#logs[@]} > 0)); then read -r ran skips < <(count_cases "${logs[@]}"); fi
        if ((skips > 0 && skips >= ran)); then
          skipped=$((skipped + 1))
          notes+=("skipped: ${label}: all ${ran} test cases skipped")
        else
          passed=$((passed + 1))
          ((skips == 0)) || notes+=("partly skipped: ${label}: ${skips} of ${ran} test cases skipped")
        fi
        if ((skips > 0)); then
          while IFS= read -r reason; do notes+=("    ${reason}"); done < <(skip_reasons "${logs[@]}")
        fi
        [[ "${result}" != FLAKY* ]] || notes+=("flaky (passed on a retry): ${label}")
        ;;
      *)
        failed=$((failed + 1))
        notes+=("failed: ${label}: ${result}")
        ;;
    esac
  done < <(sed -nE 's/^(\/\/[^ ]+|engine:[^ ]+) +(\(cached\) )?([A-Z].*)$/\1 \3/p' "${out}" |
    sort -u)

  echo
  echo "---- memra-kv test summary"
  local cuda_defs="${output_base}/external/local_cuda/defs.bzl"
  if [[ -f "${cuda_defs}" ]] && grep -q '^HAS_CUDA = False' "${cuda_defs}"; then
    echo "no CUDA toolkit (/usr/local/cuda or \$CUDA_PATH): CUDA backend targets and their tests" \
      "are not built here"
  fi
  local note
  for note in "${notes[@]+"${notes[@]}"}"; do echo "${note}"; done
  if ((passed + failed + skipped == 0)); then
    echo "failed: no test ran (bazel test exited with status ${status})"
  elif ((status != 0 && failed == 0)); then
    echo "failed: bazel test exited with status ${status} outside the test summary" \
      "(a build or analysis error above); counted as 1 failed"
    failed=1
  fi
  local line="${passed} passed, ${failed} failed"
  ((skipped == 0)) || line+=", ${skipped} skipped"
  echo "${line}"
  ((failed == 0 && passed + skipped > 0))
}

case "${1:-}" in
  run) shift; cmd_run "$@" ;;
  test) shift; cmd_test "$@" ;;
  bootstrap) shift; bootstrap "$@" ;;
  *) usage ;;
esac
