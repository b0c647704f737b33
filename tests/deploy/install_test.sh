#!/usr/bin/env bash
# deploy/install.sh into temporary roots: the installed tree (the Python package too, which
# imports), file modes, idempotence, PREFIX, PYTHON_DIR, missing binaries and stubs, the real
# built binaries found in bazel-bin by default, that nothing is activated under DESTDIR, and that
# the sysusers/tmpfiles snippets do what they say when systemd's tools apply them to the
# temporary root.
set -euo pipefail
source "${TEST_SRCDIR}/memra_kv/tests/deploy/lib.sh"
REAL_KVD="${TEST_SRCDIR}/memra_kv/server/memra-kvd"
REAL_KVCTL="${TEST_SRCDIR}/memra_kv/tools/memra-kvctl"
REAL_SUPERVISE="${TEST_SRCDIR}/memra_kv/server/memra-kv-supervise"
# The Python package and its generated stubs, as //python:memra_kv lays them out in runfiles.
PYTHON_PACKAGE="${TEST_SRCDIR}/memra_kv/python/memra_kv"

# Spies for the activation commands: with DESTDIR set, install.sh must call none of them.
real_sysusers="$(command -v systemd-sysusers)" || fail "systemd-sysusers not installed"
real_tmpfiles="$(command -v systemd-tmpfiles)" || fail "systemd-tmpfiles not installed"
mkdir -p "$TEST_DIR/spy"
for cmd in systemctl systemd-sysusers systemd-tmpfiles; do
  printf '#!/bin/sh\necho "%s $*" >>"%s/calls"\n' "$cmd" "$TEST_DIR" >"$TEST_DIR/spy/$cmd"
  chmod 0755 "$TEST_DIR/spy/$cmd"
done
export PATH="$TEST_DIR/spy:$PATH"

# "<mode> <path>" for every file and directory under $1, sorted.
tree() { (cd "$1" && find . -mindepth 1 -printf '%m %y %p\n' | sort); }
expect_mode() { # ROOT PATH MODE
  [[ -f "$1/$2" ]] || fail "$2 not installed"
  local mode
  mode="$(stat -c %a "$1/$2")"
  [[ "$mode" == "$3" ]] || fail "$2 has mode $mode, want $3"
}

echo "--- default PREFIX: the installed tree"
root="$TEST_DIR/root"
install_into "$root" >"$TEST_DIR/out" || fail "install.sh failed: $(cat "$TEST_DIR/out")"
grep -q "DESTDIR is set: not creating" "$TEST_DIR/out" || fail "no DESTDIR notice"
python_files=()
for module in __init__ __main__ block_store client errors events group handoff planes plans results \
    sglang step_channel vllm; do
  python_files+=("./usr/lib/python3/dist-packages/memra_kv/$module.py")
done
for stub in __init__.py {admin,block_store,cache,group,model_plan,prefix}_pb2{,_grpc}.py; do
  python_files+=("./usr/lib/python3/dist-packages/memra_kv/_proto/$stub")
done
expected_files="$(printf '%s\n' \
  ./etc/memra-kv/gpu0.conf.example \
  ./usr/bin/memra-kv-supervise \
  ./usr/bin/memra-kvctl \
  ./usr/bin/memra-kvd \
  ./usr/lib/systemd/system/memra-kvd@.service \
  ./usr/lib/sysusers.d/memra-kv.conf \
  ./usr/lib/tmpfiles.d/memra-kv.conf \
  "${python_files[@]}" | LC_ALL=C sort)"
actual_files="$(cd "$root" && find . -type f | LC_ALL=C sort)"
[[ "$actual_files" == "$expected_files" ]] ||
  fail "installed files differ: got"$'\n'"$actual_files"
expect_mode "$root" usr/bin/memra-kvd 755
expect_mode "$root" usr/bin/memra-kvctl 755
expect_mode "$root" usr/bin/memra-kv-supervise 755
cmp -s "$root/usr/bin/memra-kvd" "$TEST_DIR/fake-bin/memra-kvd" || fail "memra-kvd not copied"
cmp -s "$root/usr/bin/memra-kv-supervise" "$TEST_DIR/fake-bin/memra-kv-supervise" ||
  fail "memra-kv-supervise not copied"
for pair in usr/lib/systemd/system/memra-kvd@.service:memra-kvd@.service \
            usr/lib/sysusers.d/memra-kv.conf:sysusers.d/memra-kv.conf \
            usr/lib/tmpfiles.d/memra-kv.conf:tmpfiles.d/memra-kv.conf \
            etc/memra-kv/gpu0.conf.example:memra-kv.conf.example; do
  installed="${pair%%:*}" source="${pair#*:}"
  expect_mode "$root" "$installed" 644
  # With the default PREFIX and SYSCONFDIR the unit is installed unchanged.
  cmp -s "$root/$installed" "$DEPLOY_DIR/$source" || fail "$installed differs from deploy/$source"
done

expect_mode "$root" usr/lib/python3/dist-packages/memra_kv/client.py 644
cmp -s "$root/usr/lib/python3/dist-packages/memra_kv/client.py" "$PYTHON_PACKAGE/client.py" ||
  fail "memra_kv/client.py not copied"
# The installed package imports on Debian's python3 (its stubs included).
PYTHONPATH="$root/usr/lib/python3/dist-packages" /usr/bin/python3 -c \
  'import memra_kv, sys; assert memra_kv.__file__.startswith(sys.argv[1]); memra_kv.StepBatch()' \
  "$root/usr/lib/python3/dist-packages/memra_kv/" >"$TEST_DIR/out" 2>&1 ||
  fail "the installed memra_kv does not import: $(cat "$TEST_DIR/out")"

echo "--- idempotent, and an operator's config survives"
printf 'budget_bytes = "2GiB"\n' >"$root/etc/memra-kv/gpu0.conf"
before="$(tree "$root"; cd "$root" && find . -type f -exec sha256sum {} + | sort)"
install_into "$root" >/dev/null || fail "second install failed"
after="$(tree "$root"; cd "$root" && find . -type f -exec sha256sum {} + | sort)"
[[ "$before" == "$after" ]] ||
  fail "second install changed the tree:"$'\n'"$(diff <(echo "$before") <(echo "$after"))"

echo "--- nothing activated under DESTDIR"
[[ ! -e "$TEST_DIR/calls" ]] ||
  fail "activation commands ran with DESTDIR set: $(cat "$TEST_DIR/calls")"

echo "--- PREFIX and SYSCONFDIR follow into the unit"
local_root="$TEST_DIR/local-root"
PREFIX=/usr/local SYSCONFDIR=/opt/memra/etc install_into "$local_root" >/dev/null ||
  fail "install with PREFIX=/usr/local failed"
unit="$local_root/usr/local/lib/systemd/system/memra-kvd@.service"
[[ -f "$local_root/usr/local/bin/memra-kvd" ]] || fail "no /usr/local/bin/memra-kvd"
[[ -f "$local_root/opt/memra/etc/memra-kv/gpu0.conf.example" ]] || fail "example not in SYSCONFDIR"
grep -qx 'ExecStart=/usr/local/bin/memra-kvd --config=/opt/memra/etc/memra-kv/gpu%i.conf --device=%i' \
  "$unit" || fail "ExecStart not rewritten: $(grep ExecStart= "$unit")"
! grep -q '/usr/bin/memra-kvd' "$unit" || fail "unit still names /usr/bin/memra-kvd"
python_minor="$(/usr/bin/python3 -c 'import sys; print(sys.version_info[1])')"
[[ -f "$local_root/usr/local/lib/python3.$python_minor/dist-packages/memra_kv/client.py" ]] ||
  fail "memra_kv not in /usr/local's dist-packages: $(cd "$local_root" && find . -name client.py)"

echo "--- PYTHON_DIR empty: no Python package; missing stubs stop the install"
PYTHON_DIR= install_into "$TEST_DIR/no-python-root" >/dev/null || fail "PYTHON_DIR= install failed"
[[ ! -e "$TEST_DIR/no-python-root/usr/lib/python3" ]] || fail "PYTHON_DIR= installed Python"
mkdir -p "$TEST_DIR/no-stubs"
if PYTHON_STUBS_DIR="$TEST_DIR/no-stubs" install_into "$TEST_DIR/stubless-root" \
    >"$TEST_DIR/out" 2>&1; then
  fail "install without stubs succeeded"
fi
grep -qF "no $TEST_DIR/no-stubs/__init__.py; generate memra_kv's stubs" "$TEST_DIR/out" ||
  fail "message does not name the missing stubs: $(cat "$TEST_DIR/out")"
[[ ! -e "$TEST_DIR/stubless-root" ]] || fail "a failed install wrote files"

echo "--- a missing binary stops the install before anything is written"
mkdir -p "$TEST_DIR/empty-bin" "$TEST_DIR/kvd-only-bin" "$TEST_DIR/no-supervise-bin"
cp "$TEST_DIR/fake-bin/memra-kvd" "$TEST_DIR/kvd-only-bin/"
cp "$TEST_DIR/fake-bin/memra-kvd" "$TEST_DIR/fake-bin/memra-kvctl" "$TEST_DIR/no-supervise-bin/"
missing_root="$TEST_DIR/missing-root"
for bin_dir in empty-bin kvd-only-bin no-supervise-bin; do
  if DESTDIR="$missing_root" BIN_DIR="$TEST_DIR/$bin_dir" bash "$DEPLOY_DIR/install.sh" \
      >"$TEST_DIR/out" 2>&1; then
    fail "install from $bin_dir succeeded"
  fi
  missing=memra-kvd
  [[ "$bin_dir" == kvd-only-bin ]] && missing=memra-kvctl
  [[ "$bin_dir" == no-supervise-bin ]] && missing=memra-kv-supervise
  want="no executable $TEST_DIR/$bin_dir/$missing; build all three"
  want+=" (bazel build //server:memra-kvd //server:memra-kv-supervise //tools:memra-kvctl)"
  want+=" or set BIN_DIR"
  grep -qF "$want" "$TEST_DIR/out" || fail "message does not name the missing $missing: $(cat "$TEST_DIR/out")"
  [[ ! -e "$missing_root" ]] || fail "a failed install wrote files: $(find "$missing_root")"
done

echo "--- by default, the real binaries from bazel-bin/server and bazel-bin/tools"
# A checkout's layout: deploy/ beside bazel-bin/, holding what bazel build made.
repo="$TEST_DIR/repo"
mkdir -p "$repo/deploy" "$repo/bazel-bin/server" "$repo/bazel-bin/tools"
cp -RL "$DEPLOY_DIR/." "$repo/deploy/"
cp -L "$REAL_KVD" "$repo/bazel-bin/server/memra-kvd"
cp -L "$REAL_KVCTL" "$repo/bazel-bin/tools/memra-kvctl"
cp -L "$REAL_SUPERVISE" "$repo/bazel-bin/server/memra-kv-supervise"
mkdir -p "$repo/python/memra_kv" "$repo/bazel-bin/python/memra_kv/_proto"
cp -L "$PYTHON_PACKAGE"/*.py "$repo/python/memra_kv/"
cp -L "$PYTHON_PACKAGE"/_proto/*.py "$repo/bazel-bin/python/memra_kv/_proto/"
real_root="$TEST_DIR/real-root"
DESTDIR="$real_root" bash "$repo/deploy/install.sh" >"$TEST_DIR/out" 2>&1 ||
  fail "install from bazel-bin failed: $(cat "$TEST_DIR/out")"
cmp -s "$real_root/usr/bin/memra-kvd" "$REAL_KVD" || fail "memra-kvd is not the built daemon"
cmp -s "$real_root/usr/bin/memra-kvctl" "$REAL_KVCTL" || fail "memra-kvctl is not the built CLI"
cmp -s "$real_root/usr/bin/memra-kv-supervise" "$REAL_SUPERVISE" ||
  fail "memra-kv-supervise is not the built supervisor"
expect_mode "$real_root" usr/bin/memra-kv-supervise 755
# The installed supervisor runs its command with the notify socket it serves, and ends with the
# command's exit status (0: not restarted).
"$real_root/usr/bin/memra-kv-supervise" -- /bin/sh -c 'test -S "$NOTIFY_SOCKET"' \
  >"$TEST_DIR/out" 2>&1 || fail "installed memra-kv-supervise: $(cat "$TEST_DIR/out")"
expect_mode "$real_root" usr/bin/memra-kvctl 755
# The installed CLI runs: it teaches, and names an absent daemon's socket with exit code 3.
"$real_root/usr/bin/memra-kvctl" help | grep -q "^Exit codes:" || fail "installed memra-kvctl help"
set +e
"$real_root/usr/bin/memra-kvctl" status --socket="$TEST_DIR/absent.sock" 2>"$TEST_DIR/out"
code=$?
set -e
[[ "$code" == 3 ]] || fail "memra-kvctl on an absent socket exited $code, want 3: $(cat "$TEST_DIR/out")"
grep -q "cannot reach memra-kvd at unix:$TEST_DIR/absent.sock" "$TEST_DIR/out" ||
  fail "$(cat "$TEST_DIR/out")"

echo "--- bad arguments"
if install_into "$TEST_DIR/bad" --frobnicate >"$TEST_DIR/out" 2>&1; then fail "unknown flag accepted"; fi
grep -q "unknown argument '--frobnicate'" "$TEST_DIR/out" || fail "$(cat "$TEST_DIR/out")"
if PREFIX=usr install_into "$TEST_DIR/bad" >"$TEST_DIR/out" 2>&1; then fail "relative PREFIX accepted"; fi
grep -q "PREFIX='usr' must be an absolute path" "$TEST_DIR/out" || fail "$(cat "$TEST_DIR/out")"
bash "$DEPLOY_DIR/install.sh" --help | grep -q "DESTDIR" || fail "--help does not document DESTDIR"

echo "--- the snippets, applied by systemd's tools to the temporary root"
# --root makes both tools read and write only inside the root (its own /etc/passwd).
"$real_sysusers" --root="$root" >"$TEST_DIR/out" 2>&1 || fail "systemd-sysusers: $(cat "$TEST_DIR/out")"
grep -q '^memra-kv:x:[0-9]*:[0-9]*:memra-kv KV-cache daemon:' "$root/etc/passwd" ||
  fail "no memra-kv user: $(cat "$root/etc/passwd")"
grep -q '^memra-kv:x:[0-9]*:' "$root/etc/group" || fail "no memra-kv group"
# Re-map memra-kv to this process's own uid/gid before tmpfiles chowns to it: a sandbox's user
# namespace (or a non-root developer) cannot chown to the system uid sysusers picked. tmpfiles
# still has to resolve the names from the root and apply the mode.
uid="$(id -u)" gid="$(id -g)"
sed -i "s/^memra-kv:x:[0-9]*:[0-9]*:/memra-kv:x:$uid:$gid:/" "$root/etc/passwd"
sed -i "s/^memra-kv:x:[0-9]*:/memra-kv:x:$gid:/" "$root/etc/group"
"$real_tmpfiles" --root="$root" --create >"$TEST_DIR/out" 2>&1 ||
  fail "systemd-tmpfiles: $(cat "$TEST_DIR/out")"
[[ -d "$root/run/memra-kv" ]] || fail "tmpfiles did not create /run/memra-kv"
owner="$(stat -c '%a %u %g' "$root/run/memra-kv")"
[[ "$owner" == "750 $uid $gid" ]] || fail "/run/memra-kv is '$owner', want '750 $uid $gid'"

echo "PASS"
