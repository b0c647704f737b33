#!/bin/bash
# Smoke test: the whole benchmark with --quick (tiny counts and sizes) against the real
# memra-kvd, checking that every section ran and the JSON holds them. It asserts no timing.
set -euo pipefail

runfiles="${TEST_SRCDIR}/memra_kv"
out="${TEST_TMPDIR}/smoke.json"
sections="hot_path,spec_decode,admission,scale,python_step,python_restore,hostile"
if [[ -x /usr/bin/redis-server ]]; then
  sections="${sections},prefix_redis,block_store"
else
  echo "smoke_test: /usr/bin/redis-server missing: the Redis and block store sections are SKIPPED"
fi

# The full run's populations (the defaults bench/run.sh uses) against the daemon's limits: a
# moved default that would stop a full run fails here, although --quick stays far below it.
"${runfiles}/bench/memra_bench" --check_limits \
  --kvd="${runfiles}/server/memra-kvd" --echo_server="${runfiles}/bench/echo_server"

"${runfiles}/bench/memra_bench" --quick \
  --kvd="${runfiles}/server/memra-kvd" --echo_server="${runfiles}/bench/echo_server" \
  --load_engine="${runfiles}/bench/load_engine" \
  --python_stepper="${runfiles}/bench/python_step.py" --python_path="${runfiles}/python" \
  --sections="${sections}" --scale_sessions=150 --prefix_blocks=1500 --redis_max_tokens=1024 \
  --json_out="${out}" --plot_data="${TEST_TMPDIR}/plot.dat"

for key in machine hot_path spec_decode admission scale ${sections//,/ }; do
  grep -q "\"${key}\"" "${out}" || { echo "smoke_test: ${key} missing from the JSON"; exit 1; }
done
if grep -q '"error"' "${out}"; then
  echo "smoke_test: a section failed:"; grep '"error"' "${out}"; exit 1
fi
[[ "$(grep -vc '^#' "${TEST_TMPDIR}/plot.dat")" -eq 4 ]] || { echo "smoke_test: plot data"; exit 1; }
echo "smoke_test: PASS"
