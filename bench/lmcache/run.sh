#!/usr/bin/env bash
# LMCache 0.5.6 and memra-kvd's block store side by side (bench/lmcache/lmcache_vs_memra.py):
#
#   bench/lmcache/run.sh                        # 1k and 32k tokens, both systems, 5 repetitions
#   bench/lmcache/run.sh --reps=3 --json=out.json
#
# Builds memra-kvd -c opt, the LMCache venv (python/engines/engine_venv.sh with
# bench/lmcache/lmcache-requirements.txt: the first time ~3 minutes and 6.3 GB, reused after),
# installs memra_kv from this checkout into a scratch directory with the venv's grpcio-tools,
# then runs the script with the venv's interpreter. Arguments pass through to the script.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$(dirname "${here}")")"
cd "${root}"
bazel build -c opt //server:memra-kvd
venv="$(python/engines/engine_venv.sh "${here}/lmcache-requirements.txt")"
scratch="$(mktemp -d "${TMPDIR:-/tmp}/memra-lmcache.XXXXXX")"
trap 'rm -rf "${scratch}"' EXIT
"${venv}/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
  --no-build-isolation --target "${scratch}/site" "${root}/python" >"${scratch}/install.log" 2>&1 || {
  cat "${scratch}/install.log" >&2
  exit 1
}
PYTHONPATH="${scratch}/site" "${venv}/bin/python" "${here}/lmcache_vs_memra.py" \
  --kvd "${root}/bazel-bin/server/memra-kvd" "$@"
