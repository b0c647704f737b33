#!/usr/bin/env bash
# Long local fuzzing with clang's libFuzzer (Debian 12: clang, libclang-rt-14-dev).
#
#   tests/fuzz/run_libfuzzer.sh decode|session [libFuzzer flags, e.g. -max_total_time=600]
#
# Builds the target with -fsanitize=fuzzer,address,undefined from the project's sources (Bazel
# builds with GCC, so this runs clang directly; the generated protobuf sources come from
# `bazel build //proto:kv_v1`), then fuzzes with a scratch corpus seeded from
# tests/fuzz/corpus/<target>. A crash is written as ./crash-<sha1>: copy it into
# tests/fuzz/corpus/<target>/ (a descriptive name) so that //tests/fuzz:fuzz_test replays it.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "${root}"
target="${1:?usage: $0 decode|session [libFuzzer flags]}"
shift
case "${target}" in
  decode) function_name=FuzzRequestDecoding ;;
  session) function_name=FuzzSessionOps ;;
  *) echo "$0: unknown target ${target} (decode or session)" >&2; exit 2 ;;
esac

bazel build --nosandbox_debug //proto:kv_v1 >&2
generated="$(bazel info --nosandbox_debug bazel-bin 2>/dev/null)"
work="$(mktemp -d /tmp/memra-fuzz.XXXXXX)"
cp -r "tests/fuzz/corpus/${target}" "${work}/corpus"

sources=(
  tests/fuzz/libfuzzer_main.cc tests/fuzz/fuzz_targets.cc common/codec.cc
  server/session/model_import.cc
)
for source in core/*.cc; do
  [[ "${source}" == *_test.cc ]] || sources+=("${source}")
done
for message in admin cache model_plan prefix; do
  sources+=("${generated}/proto/memra/kv/v1/${message}.pb.cc")
done

# Every abseil library Debian ships (shared: order does not matter; unused ones are dropped).
absl_libraries=()
for library in /usr/lib/x86_64-linux-gnu/libabsl_*.so; do
  name="$(basename "${library}" .so)"
  absl_libraries+=("-l${name#lib}")
done

clang++ -Wl,--as-needed -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -DMEMRA_FUZZ_TARGET="${function_name}" -I. -I"${generated}" "${sources[@]}" \
  -lprotobuf "${absl_libraries[@]}" -lpthread \
  -o "${work}/fuzz_${target}"
echo "run_libfuzzer.sh: fuzzing ${target} in ${work}" >&2
cd "${work}"
exec "./fuzz_${target}" -max_len=4096 "$@" corpus
