#!/usr/bin/env bash
# //python:mypy_test: mypy --strict (python/mypy.ini) over the memra_kv package as Bazel stages
# it (the generated _proto stubs beside it are skipped: mypy.ini says why).
set -euo pipefail
cd "${TEST_SRCDIR:?}/${TEST_WORKSPACE:?}/python"
if ! /usr/bin/python3 -m mypy --version >/dev/null 2>&1; then
  echo "mypy_test: /usr/bin/python3 has no mypy: deploy/bootstrap.sh installs python3-mypy" >&2
  exit 1
fi
# A cache outside the read-only runfiles; the package's own files only.
exec /usr/bin/python3 -m mypy --config-file mypy.ini --cache-dir "${TEST_TMPDIR:?}/mypy" \
  memra_kv
