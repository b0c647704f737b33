#!/usr/bin/env bash
# //tests/cuda:gpu_bundle_test: builds a GPU bundle from this test's runfiles (the suite's
# binaries, in its compilation mode $1), checks that it needs nothing from this machine
# (make_gpu_bundle.sh's self-check), then runs tests/cuda/run_on_gpu.sh over it: with no GPU here
# every CUDA case must skip and the run must end with exit status 0 and its summary written.
set -euo pipefail
runfiles="${TEST_SRCDIR}/memra_kv"
bundle="${TEST_TMPDIR}/bundle"

"${runfiles}/tests/cuda/make_gpu_bundle.sh" "--from=${runfiles}" "--out=${bundle}" \
  "--mode=${1:-unknown}"

echo "---- run_on_gpu.sh over the bundle (no GPU here: every CUDA case skips)"
export OUT="${TEST_TMPDIR}/out"
mkdir -p "${OUT}"
"${runfiles}/tests/cuda/run_on_gpu.sh" "${bundle}"

summary="${OUT}/summary.txt"
fail() {
  echo "gpu_bundle_test: $*" >&2
  exit 1
}
grep -q '^---- run_on_gpu.sh: .* exit status 0,' "${summary}" || fail "no closing line in ${summary}"
while read -r name; do
  grep -qE "^ran: ${name} exit 0 in " "${summary}" || fail "${name} did not run from the bundle"
  grep -qE "^  ${name} skipped:" "${summary}" || fail "${name}: no case reported skipped"
done < <(sed -n 's|^gtest .*/||p; s|^pytest .*/||p' "${bundle}/MANIFEST")
files="$(find "${OUT}" -type f | wc -l)"
((files <= 8)) || fail "${files} files under \$OUT: the device tool brings back at most 8"
echo "gpu_bundle_test: the bundle runs on its own; run_on_gpu.sh wrote ${files} files"
