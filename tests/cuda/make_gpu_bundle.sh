#!/usr/bin/env bash
# Gathers everything the GPU run (tests/cuda/run_on_gpu.sh) needs into one folder that needs
# nothing from the machine it runs on but the C library: the GPU machine has no Bazel, no Debian
# -dev libraries and no network (tests/cuda/README.md).
#
#   tests/cuda/make_gpu_bundle.sh [--out=DIR]         build //tests/cuda:gpu_bundle_test's data
#                                                     with -c opt, gather it into DIR (default
#                                                     gpu-bundle/ at the repository root), check it
#   tests/cuda/make_gpu_bundle.sh --from=RUNFILES --out=DIR [--mode=MODE]
#                                                     gather prebuilt binaries from a runfiles tree
#                                                     (what //tests/cuda:gpu_bundle_test does), check
#   tests/cuda/make_gpu_bundle.sh --check=DIR         only the self-check
#
# What travels is //tests/cuda:gpu_bundle_test's runfiles (tests/cuda/BUILD.bazel lists the GPU
# run's targets once: every cuda-tagged test, the e2e engines and memra-kvd through
# cuda_e2e_test, memra-kvctl). The bundle:
#   DIR/memra_kv/    that runfiles tree (TEST_SRCDIR=DIR finds every binary where Bazel would)
#   DIR/lib/         every shared library they load but the C library set below (Bazel's own
#                    _solib_k8 libraries, gRPC, protobuf, Abseil, spdlog, fmt, libstdc++, the CUDA
#                    runtime ...), RPATH $ORIGIN; binaries get RPATH $ORIGIN/<up>/lib (DT_RPATH,
#                    not RUNPATH: it wins over an LD_LIBRARY_PATH the GPU machine may set, and
#                    LD_LIBRARY_PATH still finds the driver's libcuda.so.1 there)
#   DIR/cuda/lib64/libcudart.so   CUDA_PATH=DIR/cuda for the Python package's ctypes runtime
#   DIR/MANIFEST     provenance, the glibc it needs, and the tests: "gtest PATH" / "pytest PATH"
# Everything is stripped (what travels is capped): an -c opt bundle must stay under 60 MiB.
#
# The self-check: (1) every ELF file's libraries resolve (ldd, with no LD_LIBRARY_PATH and with
# one naming this machine's library and CUDA folders) inside DIR or to the C library set; (2) in
# a user + mount namespace whose /usr/lib/x86_64-linux-gnu holds only the C library and whose
# /usr/local/lib and CUDA toolkit are empty (a system binary that needs one of the hidden
# libraries must then fail to start: the hiding is real), every executable's
# libraries resolve, each GoogleTest binary starts and skips for want of a CUDA device, and a
# host-backend memra-kvd answers memra-kvctl status; (3) the Python CUDA test runs from DIR with
# the bundle's CUDA runtime and skips its device cases.
set -euo pipefail

readonly C_LIBRARY='^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1|libresolv\.so\.2|libutil\.so\.1)$'
readonly SYSTEM_LIB_DIR=/usr/lib/x86_64-linux-gnu
readonly MAX_BYTES=$((60 * 1024 * 1024))

die() {
  echo "make_gpu_bundle: $*" >&2
  exit 1
}

is_elf() { [[ -f "$1" && ! -L "$1" && "$(LC_ALL=C head -c 4 "$1" 2>/dev/null)" == $'\x7fELF' ]]; }

# ldd_pairs FILE [LIBRARY_PATH]: "NAME PATH" per library FILE loads, with LD_LIBRARY_PATH empty
# or LIBRARY_PATH ("NAME -" when it is not found; the loader and the vDSO print their own path or
# none).
ldd_pairs() {
  env -i PATH=/usr/bin:/bin ${2:+"LD_LIBRARY_PATH=$2"} ldd "$1" | awk '
    $1 == "statically" { next }
    $2 == "=>" && $3 == "not" { print $1, "-"; next }
    $2 == "=>" { print $1, $3; next }
    $1 ~ /^\// { n = split($1, part, "/"); print part[n], $1; next }
    { print $1, "vdso" }'
}

gather() {
  local from="$1" out="$2" mode="$3"
  [[ -d "${from}" ]] || die "no runfiles tree at ${from}"
  [[ -n "${out}" && "${out}" != / ]] || die "--out must name a folder"
  command -v patchelf >/dev/null || die "patchelf is missing (deploy/dev.sh bootstrap installs it)"
  rm -rf "${out}"
  mkdir -p "${out}/lib" "${out}/memra_kv" "${out}/cuda/lib64"
  out="$(cd "${out}" && pwd)"

  # The tree, symlinks followed, without Bazel's _solib_* folders (their libraries go to lib/).
  cp -rL "${from}/." "${out}/memra_kv/"
  rm -rf "${out}/memra_kv"/_solib_*

  local file rel name path
  local -a elves=()
  while IFS= read -r -d '' file; do
    if is_elf "${file}"; then elves+=("${file}"); fi
  done < <(find "${out}/memra_kv" -type f -print0 | sort -z)
  ((${#elves[@]} > 0)) || die "no binary in ${from}"

  # Libraries as the built binaries resolve them (through Bazel's RUNPATHs, from the source tree).
  for file in "${elves[@]}"; do
    rel="${file#"${out}/memra_kv/"}"
    while read -r name path; do
      [[ "${name}" =~ ${C_LIBRARY} ]] && continue
      [[ "${path}" != - ]] || die "${rel}: ${name} not found (ldd ${from}/${rel})"
      [[ -e "${out}/lib/${name}" ]] || cp -L "${path}" "${out}/lib/${name}"
    done < <(ldd_pairs "$(readlink -f "${from}/${rel}")")
  done
  chmod u+w "${out}/lib"/* "${elves[@]}"

  for file in "${out}/lib"/*; do
    strip --strip-unneeded "${file}"
    patchelf --force-rpath --set-rpath '$ORIGIN' "${file}"
  done
  for file in "${elves[@]}"; do
    strip --strip-all "${file}"
    patchelf --force-rpath --set-rpath "\$ORIGIN/$(realpath --relative-to="$(dirname "${file}")" "${out}/lib")" \
      "${file}"
  done
  local cudart
  cudart="$(cd "${out}/lib" && ls libcudart.so.* 2>/dev/null | head -n 1)"
  [[ -n "${cudart}" ]] || die "no libcudart among the libraries: nothing here is a CUDA binary"
  ln -s "../../lib/${cudart}" "${out}/cuda/lib64/libcudart.so"

  write_manifest "${out}" "${mode}" "${elves[@]}"
}

write_manifest() {
  local out="$1" mode="$2"
  shift 2
  local glibc commit file toolkit
  # CUDART_VERSION 13000 is CUDA 13.0 (the toolkit the binaries were built against).
  toolkit="$(sed -nE 's/^#define CUDART_VERSION +([0-9]+)$/\1/p' \
    "${CUDA_PATH:-/usr/local/cuda}/include/cuda_runtime_api.h" 2>/dev/null | head -n 1)"
  toolkit="$((${toolkit:-0} / 1000)).$((${toolkit:-0} % 1000 / 10))"
  glibc="$(for file in "$@" "${out}/lib"/*; do objdump -T "${file}"; done 2>/dev/null |
    grep -oE 'GLIBC_[0-9]+(\.[0-9]+)+' | sort -uV | tail -n 1)"
  commit="$(git -C "$(dirname "${BASH_SOURCE[0]}")" describe --always --dirty 2>/dev/null ||
    echo unknown)"
  {
    echo "# memra-kv GPU bundle (tests/cuda/make_gpu_bundle.sh); run: tests/cuda/run_on_gpu.sh DIR"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), commit ${commit}, compilation mode ${mode}"
    echo "needs glibc >= ${glibc#GLIBC_} (the only libraries taken from the machine: the C library set)"
    echo "cuda runtime $(cd "${out}/lib" && ls libcudart.so.*) from toolkit ${toolkit} (the driver" \
      "must support CUDA ${toolkit}: nvidia-smi's \"CUDA Version\"; 580 drivers do 13.0)"
    echo "python stubs by $(protoc --version 2>/dev/null || echo 'an unknown protoc') (protobuf" \
      "runtime >= 3.20 and grpcio; ran with protobuf 4.25.8 + grpcio 1.62.3 and" \
      "protobuf 7.36.2 + grpcio 1.85.4 on Python 3.12)"
    for file in "$@"; do
      if [[ "${file}" == *_test ]]; then echo "gtest ${file#"${out}/"}"; fi
    done
    for file in "${out}"/memra_kv/python/tests/test_*.py; do
      if [[ -f "${file}" ]]; then echo "pytest ${file#"${out}/"}"; fi
    done
  } >"${out}/MANIFEST"
}

# check_ldd DIR: every ELF file's libraries resolve inside DIR or to the C library set, with no
# LD_LIBRARY_PATH and with the system's copies first on it.
check_ldd() {
  local dir="$1" file name path bad=0 files=0 library_path
  local hostile="${SYSTEM_LIB_DIR}:/usr/local/lib:${CUDA_PATH:-/usr/local/cuda}/lib64"
  while IFS= read -r -d '' file; do
    is_elf "${file}" || continue
    files=$((files + 1))
    for library_path in "" "${hostile}"; do
      while read -r name path; do
        [[ "${name}" =~ ${C_LIBRARY} ]] && continue
        case "${path}" in
          "${dir}"/*) ;;
          -) echo "  ${file#"${dir}/"}: ${name} not found"; bad=1 ;;
          *) echo "  ${file#"${dir}/"}: ${name} from outside the bundle: ${path}" \
            "(LD_LIBRARY_PATH=${library_path})"; bad=1 ;;
        esac
      done < <(ldd_pairs "${file}" "${library_path}")
    done
  done < <(find "${dir}" -type f -print0)
  ((bad == 0)) || return 1
  echo "ldd: ${files} ELF files, every library inside the bundle or the C library set (with no" \
    "LD_LIBRARY_PATH and with LD_LIBRARY_PATH=${hostile})"
}

# The part of the check that runs with the system's libraries hidden (inside unshare; $1 = DIR,
# $2 = a scratch folder). Only bash builtins, `timeout` and the bundle's own programs run here.
hidden_check() {
  local dir="$1" scratch="$2" file bin log status rc
  local keep="${scratch}/keep" empty="${scratch}/empty"
  mkdir -p "${keep}" "${empty}"
  # find(1) and cp(1) need hidden libraries: list and copy before hiding.
  local -a programs=()
  while IFS= read -r -d '' file; do
    [[ -x "${file}" ]] && is_elf "${file}" && programs+=("${file}")
  done < <(find "${dir}/memra_kv" -type f -print0)
  for file in "${SYSTEM_LIB_DIR}"/*; do
    [[ "${file##*/}" =~ ${C_LIBRARY} ]] && cp -L "${file}" "${keep}/"
  done
  mkdir -p "${scratch}/tmp"
  local toolkit
  toolkit="$(readlink -f "${CUDA_PATH:-/usr/local/cuda}" 2>/dev/null || true)"
  [[ -d "${toolkit}" ]] && mount --bind "${empty}" "${toolkit}"
  [[ -d /usr/local/lib ]] && mount --bind "${empty}" /usr/local/lib
  # Last (mount(8) itself needs hidden libraries). timeout(1), head(1) and sleep(1) need only the
  # C library; nothing else is kept.
  mount --bind "${keep}" "${SYSTEM_LIB_DIR}"

  # The control: a system program that needs a hidden library must not start.
  local control=/usr/bin/protoc
  [[ -x "${control}" ]] || control=/usr/bin/grpc_cpp_plugin
  if "${control}" --version >"${scratch}/control.log" 2>&1; then
    echo "hidden: ${control} still starts: the system's libraries are not hidden"
    return 1
  fi
  echo "hidden: ${SYSTEM_LIB_DIR} holds only the C library, /usr/local/lib and ${toolkit:-(no toolkit)}" \
    "are empty; ${control} no longer starts ($(<"${scratch}/control.log"))"

  status=0
  for file in "${programs[@]}"; do
    if ! LD_TRACE_LOADED_OBJECTS=1 "${file}" >"${scratch}/trace.log" 2>&1 ||
      [[ "$(<"${scratch}/trace.log")" == *"not found"* ]]; then
      echo "hidden: ${file#"${dir}/"} cannot load its libraries:"
      echo "$(<"${scratch}/trace.log")"
      status=1
    fi
  done
  echo "hidden: the ${#programs[@]} programs' libraries all resolve"

  local kind path
  while read -r kind path; do
    [[ "${kind}" == gtest ]] || continue
    bin="${dir}/${path}"
    log="${scratch}/${bin##*/}.log"
    rc=0
    TEST_SRCDIR="${dir}" TEST_TMPDIR="${scratch}/tmp" timeout -k 5 120 "${bin}" >"${log}" 2>&1 ||
      rc=$?
    local out
    out="$(<"${log}")"
    if ((rc != 0)) || [[ "${out}" != *"no CUDA device"* || "${out}" == *"[  FAILED  ]"* ]]; then
      echo "hidden: ${path} exit ${rc}, expected exit 0 skipping for want of a CUDA device:"
      echo "${out}"
      status=1
    else
      local skipped=0 line
      while IFS= read -r line; do
        [[ "${line}" == "[  SKIPPED ] "*" ms)" ]] && skipped=$((skipped + 1))
      done <<<"${out}"
      echo "hidden: ${path} started and skipped (${skipped} cases: no CUDA device)"
    fi
  done <"${dir}/MANIFEST"

  # memra-kvd on the host backend answers memra-kvctl over gRPC: both run on the bundle's gRPC.
  local kvd="${dir}/memra_kv/server/memra-kvd" kvctl="${dir}/memra_kv/tools/memra-kvctl"
  local sock="${scratch}/kvd.sock" pid tries
  "${kvd}" --backend=host "--socket_path=${sock}" --socket_mode=0600 --watchdog=false \
    --metrics_address= --budget_bytes=64MiB >"${scratch}/kvd.log" 2>&1 &
  pid=$!
  rc=1
  # Until the admin socket answers (kvctl bounds each try; a dead daemon ends the wait).
  for ((tries = 0; tries < 200; tries++)); do
    rc=0
    timeout -k 5 20 "${kvctl}" "--socket=${scratch}/kvd.admin.sock" --timeout=5 status \
      >"${scratch}/kvctl.log" 2>&1 || rc=$?
    if ((rc != 3)) || ! kill -0 "${pid}" 2>/dev/null; then break; fi
    sleep 0.05
  done
  kill -TERM "${pid}" 2>/dev/null || true
  local kvd_rc=0
  wait "${pid}" || kvd_rc=$?
  if ((rc != 0)) || [[ "$(<"${scratch}/kvctl.log")" != *host* ]] || ((kvd_rc != 0)); then
    echo "hidden: memra-kvctl status exit ${rc}, memra-kvd exit ${kvd_rc}:"
    echo "$(<"${scratch}/kvctl.log")"
    echo "$(<"${scratch}/kvd.log")"
    status=1
  else
    echo "hidden: memra-kvd (host backend) answered memra-kvctl status and drained (exit 0)"
  fi
  return "${status}"
}

# check_python DIR SCRATCH: the Python CUDA test from the bundle, on this machine's Python.
check_python() {
  local dir="$1" scratch="$2" kind path python=/usr/bin/python3 rc out
  [[ -x "${python}" ]] || python=python3
  while read -r kind path; do
    [[ "${kind}" == pytest ]] || continue
    rc=0
    out="$(cd "${scratch}" && PYTHONPATH="${dir}/memra_kv/python:${dir}/memra_kv/python/tests" \
      CUDA_PATH="${dir}/cuda" TEST_SRCDIR="${dir}" timeout -k 5 120 "${python}" -m pytest -v -rs \
      -p no:cacheprovider "${dir}/${path}" 2>&1)" || rc=$?
    if ((rc != 0)) || [[ "${out}" != *"no CUDA device"* ]]; then
      echo "python: ${path} exit ${rc}, expected a pass skipping for want of a CUDA device:"
      echo "${out}"
      return 1
    fi
    echo "python: ${path}: $(grep -E '^=+ .* in [0-9.]+s' <<<"${out}" | tr -d '=' | xargs)"
  done <"${dir}/MANIFEST"
}

check() {
  local dir
  dir="$(cd "$1" && pwd)" || die "no bundle at $1"
  [[ -f "${dir}/MANIFEST" ]] || die "${dir} is not a bundle (no MANIFEST)"
  local bytes
  bytes="$(du -sb "${dir}" | cut -f1)"
  if grep -q '^built .* compilation mode opt$' "${dir}/MANIFEST"; then
    echo "size: $((bytes / 1024 / 1024)) MiB (${bytes} bytes, at most ${MAX_BYTES})"
    ((bytes <= MAX_BYTES)) || die "the bundle is over 60 MiB"
  else
    # Only the -c opt bundle travels; the suite's (fastbuild) code is larger.
    echo "size: $((bytes / 1024 / 1024)) MiB (not -c opt: the 60 MiB limit is for what travels)"
  fi
  check_ldd "${dir}" || die "libraries resolve outside the bundle (above)"

  unshare --user --map-root-user --mount true 2>/dev/null ||
    die "unshare --user --map-root-user --mount is refused here (user namespaces off?): the" \
      "check cannot hide the system's libraries"
  local scratch
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/memra-bundle-check.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '${scratch}'" RETURN
  unshare --user --map-root-user --mount --propagation private \
    bash -c "$(declare -p C_LIBRARY SYSTEM_LIB_DIR; declare -f is_elf hidden_check); \
      hidden_check \"\$1\" \"\$2\"" hidden_check "${dir}" "${scratch}" ||
    die "the bundle does not run on its own (above)"
  check_python "${dir}" "${scratch}" || die "the Python CUDA test does not run from the bundle"
  echo "make_gpu_bundle: ${dir} needs nothing from this machine but the C library"
}

# build_and_gather OUT: -c opt build of //tests/cuda:gpu_bundle_test, then gather its runfiles.
build_and_gather() {
  local out="$1" root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  cd "${root}"
  local missing
  # Every cuda-tagged test must be in the bundle's data (tests/cuda/BUILD.bazel GPU_RUN).
  missing="$(bazel query --noshow_progress \
    'attr(tags, "\bcuda\b", tests(//...)) except deps(//tests/cuda:gpu_bundle_test)' 2>/dev/null)" ||
    die "bazel query failed (is the CUDA toolkit here? //tests/cuda:gpu_bundle_test exists only with it)"
  [[ -z "${missing}" ]] || die "cuda-tagged tests missing from tests/cuda/BUILD.bazel GPU_RUN: ${missing}"
  bazel build --nosandbox_debug -c opt //tests/cuda:gpu_bundle_test
  gather "$(bazel info -c opt bazel-bin 2>/dev/null)/tests/cuda/gpu_bundle_test.runfiles/memra_kv" \
    "${out}" opt
}

from="" out="" only_check="" mode="opt"
for arg in "$@"; do
  case "${arg}" in
    --from=*) from="${arg#--from=}" ;;
    --out=*) out="${arg#--out=}" ;;
    --mode=*) mode="${arg#--mode=}" ;;
    --check=*) only_check="${arg#--check=}" ;;
    *) sed -n '2,13s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
  esac
done
if [[ -n "${only_check}" ]]; then
  check "${only_check}"
  exit
fi
if [[ -n "${from}" ]]; then
  [[ -n "${out}" ]] || die "--from needs --out"
  gather "${from}" "${out}" "${mode}"
else
  out="${out:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/gpu-bundle}"
  build_and_gather "${out}"
fi
cat "${out}/MANIFEST"
check "${out}"
