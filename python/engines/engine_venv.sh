#!/usr/bin/env bash
# Prints the path of the engine virtual environment for a pinned requirements file, creating it
# first when absent:
#
#   python/engines/engine_venv.sh python/engines/vllm-requirements.txt   -> ~/.cache/memra-kv/venv-<hash>
#
# The venv lives under ${XDG_CACHE_HOME:-~/.cache}/memra-kv/venv-<first 16 hex of the sha256 of the
# requirements file>, so a changed pin makes a new one and an unchanged one is reused. It is built
# with Debian's /usr/bin/python3 (3.11; python3-venv, deploy/packages.txt) or $MEMRA_KV_ENGINE_PYTHON.
# A venv counts as built once it holds .complete (written last); one without it is an interrupted
# install and is rebuilt from scratch. (Built in place: a venv's scripts name their own path, so it
# cannot be built elsewhere and renamed.) Progress goes to stderr, the path alone to stdout.
set -euo pipefail

requirements="${1:?usage: engine_venv.sh REQUIREMENTS_FILE}"
[[ -f "${requirements}" ]] || { echo "engine_venv.sh: no requirements file ${requirements}" >&2; exit 2; }
python="${MEMRA_KV_ENGINE_PYTHON:-/usr/bin/python3}"
cache="${XDG_CACHE_HOME:-${HOME}/.cache}/memra-kv"
hash="$(sha256sum "${requirements}" | cut -c1-16)"
venv="${cache}/venv-${hash}"

if [[ -x "${venv}/bin/python" && -f "${venv}/.complete" ]]; then
  echo "${venv}"
  exit 0
fi

mkdir -p "${cache}"
rm -rf "${venv}"
staging="${venv}"
started=${SECONDS}
echo "engine_venv.sh: creating ${venv} with ${python} ($("${python}" --version 2>&1)) from ${requirements}" >&2
if ! "${python}" -m venv "${staging}"; then
  echo "engine_venv.sh: '${python} -m venv' failed; on Debian install python3-venv (deploy/packages.txt)" >&2
  exit 1
fi
"${staging}/bin/python" -m pip install --quiet --upgrade pip >&2
# One line per package pip collects, so a first install of several GB shows it is moving.
"${staging}/bin/python" -m pip install --progress-bar off -r "${requirements}" 2>&1 |
  while IFS= read -r line; do
    case "${line}" in
      Collecting* | Installing* | Successfully* | ERROR* | error*)
        echo "engine_venv.sh [$((SECONDS - started))s] ${line}" >&2 ;;
    esac
  done
[[ "${PIPESTATUS[0]}" == 0 ]] || { echo "engine_venv.sh: pip install -r ${requirements} failed" >&2; exit 1; }
echo "engine_venv.sh: installed in $((SECONDS - started))s" >&2
touch "${staging}/.complete"
echo "${venv}"
