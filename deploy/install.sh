#!/usr/bin/env bash
# Installs memra-kv: the binaries (memra-kvd, memra-kvctl and memra-kv-supervise, the
# fd-store supervisor for machines without systemd), the systemd template unit, sysusers.d/tmpfiles.d snippets, the
# example config and the Python package memra_kv. Idempotent: running it again rewrites the same
# files; it never touches an operator's /etc/memra-kv/gpu<N>.conf.
#
# Usage: bazel build //server:memra-kvd //server:memra-kv-supervise //tools:memra-kvctl \
#          //python:memra_kv && deploy/install.sh
#
# Environment:
#   DESTDIR     staging root (packaging, tests). When set, nothing is activated: no users are
#               created and systemctl is never run.
#   PREFIX      default /usr: binaries in $PREFIX/bin, unit in $PREFIX/lib/systemd/system,
#               snippets in $PREFIX/lib/{sysusers.d,tmpfiles.d}.
#   SYSCONFDIR  default /etc: example config in $SYSCONFDIR/memra-kv.
#   BIN_DIR     directory holding memra-kvd, memra-kv-supervise and memra-kvctl. Without it,
#               memra-kvd and memra-kv-supervise come from SERVER_BIN_DIR (default
#               bazel-bin/server) and memra-kvctl from TOOLS_BIN_DIR (default bazel-bin/tools);
#               those defaults are relative to the repository root.
#
#   PYTHON_DIR  where the Python package memra_kv goes (as $PYTHON_DIR/memra_kv): default Debian's
#               /usr/lib/python3/dist-packages with PREFIX=/usr, else
#               $PREFIX/lib/python3.<minor>/dist-packages of /usr/bin/python3. Empty: no Python
#               package. It runs on Debian's python3-grpcio, python3-protobuf and python3-numpy.
#   PYTHON_STUBS_DIR  memra_kv's stubs generated from proto/ (*_pb2.py, *_pb2_grpc.py): default
#               bazel-bin/python/memra_kv/_proto, else python/memra_kv/_proto (written by
#               python/tools/gen_protos.py).
#
# All three binaries (and, unless PYTHON_DIR is empty, the stubs) are required: a missing one is
# an error and nothing is installed.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "install.sh: $*" >&2; exit 1; }

for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$arg' (see --help)" ;;
  esac
done

# Not resolved through symlinks: under Bazel the deploy files are symlinks side by side.
deploy_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(dirname "$deploy_dir")"

DESTDIR="${DESTDIR:-}"
PREFIX="${PREFIX:-/usr}"
SYSCONFDIR="${SYSCONFDIR:-/etc}"
SERVER_BIN_DIR="${BIN_DIR:-${SERVER_BIN_DIR:-$repo_root/bazel-bin/server}}"
TOOLS_BIN_DIR="${BIN_DIR:-${TOOLS_BIN_DIR:-$repo_root/bazel-bin/tools}}"

for var in PREFIX SYSCONFDIR; do
  value="${!var}"
  [[ "$value" == /* ]] || die "$var='$value' must be an absolute path"
  [[ "$value" != *'|'* ]] || die "$var='$value' must not contain '|'"
done

# Check every input before writing anything, so a failure leaves no half-installed tree.
sources=(memra-kvd@.service sysusers.d/memra-kv.conf tmpfiles.d/memra-kv.conf memra-kv.conf.example)
for source in "${sources[@]}"; do
  [[ -f "$deploy_dir/$source" ]] || die "missing $deploy_dir/$source"
done
binaries=()
for pair in "memra-kvd:$SERVER_BIN_DIR" "memra-kvctl:$TOOLS_BIN_DIR" \
            "memra-kv-supervise:$SERVER_BIN_DIR"; do
  name="${pair%%:*}" dir="${pair#*:}"
  [[ -f "$dir/$name" && -x "$dir/$name" ]] ||
    die "no executable $dir/$name; build all three (bazel build //server:memra-kvd" \
        "//server:memra-kv-supervise //tools:memra-kvctl) or set BIN_DIR"
  binaries+=("$dir/$name")
done

python_package_dir="$repo_root/python/memra_kv"
python_files=()
if [[ -z "${PYTHON_DIR+set}" ]]; then
  if [[ "$PREFIX" == /usr ]]; then
    PYTHON_DIR=/usr/lib/python3/dist-packages
  else
    python_minor="$(/usr/bin/python3 -c 'import sys; print(sys.version_info[1])' 2>/dev/null)" ||
      die "PREFIX=$PREFIX: no /usr/bin/python3 to name its dist-packages; set PYTHON_DIR"
    PYTHON_DIR="$PREFIX/lib/python3.$python_minor/dist-packages"
  fi
fi
if [[ -n "$PYTHON_DIR" ]]; then
  [[ "$PYTHON_DIR" == /* ]] || die "PYTHON_DIR='$PYTHON_DIR' must be an absolute path"
  if [[ -z "${PYTHON_STUBS_DIR:-}" ]]; then
    PYTHON_STUBS_DIR="$repo_root/bazel-bin/python/memra_kv/_proto"
    [[ -d "$PYTHON_STUBS_DIR" ]] || PYTHON_STUBS_DIR="$python_package_dir/_proto"
  fi
  [[ -f "$python_package_dir/__init__.py" ]] || die "no Python package at $python_package_dir"
  for stub in __init__.py {admin,block_store,cache,group,model_plan,prefix}_pb2{,_grpc}.py; do
    [[ -f "$PYTHON_STUBS_DIR/$stub" ]] ||
      die "no $PYTHON_STUBS_DIR/$stub; generate memra_kv's stubs (bazel build //python:memra_kv," \
          "or python/tools/gen_protos.py), set PYTHON_STUBS_DIR, or set PYTHON_DIR= to skip" \
          "the Python package"
    python_files+=("$PYTHON_STUBS_DIR/$stub:_proto/$stub")
  done
  for source in "$python_package_dir"/*.py; do
    python_files+=("$source:$(basename "$source")")
  done
fi

root="$DESTDIR"
unit_dir="$PREFIX/lib/systemd/system"
sysusers_dir="$PREFIX/lib/sysusers.d"
tmpfiles_dir="$PREFIX/lib/tmpfiles.d"

for binary in "${binaries[@]}"; do
  install -D -m 0755 "$binary" "$root$PREFIX/bin/$(basename "$binary")"
done

# The unit names /usr/bin and /etc; follow PREFIX and SYSCONFDIR when they differ.
unit_tmp="$(mktemp)"
trap 'rm -f "$unit_tmp"' EXIT
sed -e "s|/usr/bin/memra-kvd|$PREFIX/bin/memra-kvd|g" \
    -e "s|/etc/memra-kv/|$SYSCONFDIR/memra-kv/|g" \
    "$deploy_dir/memra-kvd@.service" >"$unit_tmp"
install -D -m 0644 "$unit_tmp" "$root$unit_dir/memra-kvd@.service"
install -D -m 0644 "$deploy_dir/sysusers.d/memra-kv.conf" "$root$sysusers_dir/memra-kv.conf"
install -D -m 0644 "$deploy_dir/tmpfiles.d/memra-kv.conf" "$root$tmpfiles_dir/memra-kv.conf"
install -d -m 0755 "$root$SYSCONFDIR/memra-kv"
install -m 0644 "$deploy_dir/memra-kv.conf.example" "$root$SYSCONFDIR/memra-kv/gpu0.conf.example"
for pair in "${python_files[@]+"${python_files[@]}"}"; do
  install -D -m 0644 "${pair%%:*}" "$root$PYTHON_DIR/memra_kv/${pair#*:}"
done

echo "install.sh: installed into ${root:-/} (PREFIX=$PREFIX, SYSCONFDIR=$SYSCONFDIR," \
  "PYTHON_DIR=${PYTHON_DIR:-none})"

if [[ -n "$DESTDIR" ]]; then
  echo "install.sh: DESTDIR is set: not creating the memra-kv user or reloading systemd"
  exit 0
fi

systemd-sysusers "$sysusers_dir/memra-kv.conf"
systemd-tmpfiles --create "$tmpfiles_dir/memra-kv.conf"
if [[ -d /run/systemd/system ]]; then
  systemctl daemon-reload
else
  echo "install.sh: systemd is not running here: skipped systemctl daemon-reload"
fi
cat <<EOF
install.sh: next, for GPU 0:
  cp $SYSCONFDIR/memra-kv/gpu0.conf.example $SYSCONFDIR/memra-kv/gpu0.conf   # then edit
  systemctl enable --now memra-kvd@0
  sudo memra-kvctl --gpu=0 status   # the admin socket /run/memra-kv/gpu0.admin.sock is root's
EOF
