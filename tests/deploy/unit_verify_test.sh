#!/usr/bin/env bash
# `systemd-analyze verify` on memra-kvd@.service exactly as install.sh installs it.
#
# How: install into a temporary root (stand-in binaries), then `verify --root=<root>`. With
# --root, systemd 252 loads units from the root's unit directories and checks that ExecStart=
# and ExecReload= binaries exist and are executable inside the root, so the unit is verified
# unchanged (real /usr/bin/memra-kvd path, no rewriting) without touching the host. The root
# also needs the units the default dependencies name (sysinit.target, basic.target, ...): they
# are copied from the host's systemd. verify exits 0 on unknown or misspelt keys (it only
# warns), so the test also fails on any message that names our unit; two broken copies prove
# that check catches both kinds of problem. Finally `systemd-analyze security` guards the
# hardening from regressing.
set -euo pipefail
source "${TEST_SRCDIR}/memra_kv/tests/deploy/lib.sh"

command -v systemd-analyze >/dev/null || fail "systemd-analyze not installed (package systemd)"
host_units=/lib/systemd/system
[[ -f "$host_units/sysinit.target" ]] || fail "no $host_units/sysinit.target to copy"

root="$TEST_DIR/root"
unit_dir="$root/usr/lib/systemd/system"
mkdir -p "$unit_dir" "$root/bin"
cp -a "$host_units/." "$unit_dir/"
# The unit is all this test reads: no Python package (PYTHON_DIR empty).
PYTHON_DIR= install_into "$root" >/dev/null || fail "install.sh failed"
# ExecReload=/bin/kill: a stand-in, like the daemon (verify checks only that it is executable).
cp "$TEST_DIR/fake-bin/memra-kvd" "$root/bin/kill"

# verify_unit UNIT: prints verify's messages; fails on a nonzero exit or a message naming it.
verify_unit() {
  local out status=0
  out="$(systemd-analyze verify --root="$root" "$1" 2>&1)" || status=$?
  if [[ -n "$out" ]]; then echo "$out"; fi
  if (( status != 0 )); then return 1; fi
  if grep -q "memra-kvd" <<<"$out"; then return 1; fi
  return 0
}

echo "--- the installed unit, for two instances"
for instance in 0 3; do
  verify_unit "memra-kvd@$instance.service" || fail "verify memra-kvd@$instance.service"
done

echo "--- the check catches a misspelt key (verify only warns about it)"
sed 's/^KillMode=mixed$/KillMod=mixed/' "$unit_dir/memra-kvd@.service" \
  >"$unit_dir/memra-kvd-misspelt@.service"
grep -q '^KillMod=mixed$' "$unit_dir/memra-kvd-misspelt@.service" || fail "sed did not apply"
out="$(verify_unit memra-kvd-misspelt@0.service)" && fail "misspelt key passed"
grep -q "Unknown key 'KillMod'" <<<"$out" || fail "unexpected verify output: $out"
rm "$unit_dir/memra-kvd-misspelt@.service"

echo "--- the check catches a missing daemon binary"
mv "$root/usr/bin/memra-kvd" "$TEST_DIR/memra-kvd.aside"
out="$(verify_unit memra-kvd@0.service)" && fail "missing ExecStart binary passed"
grep -q "/usr/bin/memra-kvd is not executable" <<<"$out" || fail "unexpected verify output: $out"
mv "$TEST_DIR/memra-kvd.aside" "$root/usr/bin/memra-kvd"

echo "--- hardening exposure stays at most 4.0 (systemd-analyze security, 0 = locked down)"
# --threshold is the exposure level times ten; the command fails above it.
systemd-analyze security --offline=yes --root="$root" --threshold=40 memra-kvd@0.service \
  >"$TEST_DIR/security" 2>&1 || fail "exposure above 4.0: $(tail -n 30 "$TEST_DIR/security")"
grep "Overall exposure level" "$TEST_DIR/security"

echo "PASS"
