# Shared by the deploy tests (sourced). Each test works in its own mktemp directory.

# The deploy files as Bazel's runfiles lay them out (symlinks into the source tree).
DEPLOY_DIR="${TEST_SRCDIR:?run under bazel test}/memra_kv/deploy"

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# A fresh directory under the test's temporary directory, removed when the test exits.
TEST_DIR="$(mktemp -d "${TEST_TMPDIR:-/tmp}/deploy-test.XXXXXX")"
trap 'rm -rf "$TEST_DIR"' EXIT

# make_fake_binaries DIR: stand-ins named memra-kvd, memra-kvctl and memra-kv-supervise, for
# tests that need files
# with those names and never run them (the real daemon is built and tested elsewhere).
make_fake_binaries() {
  mkdir -p "$1"
  local name
  for name in memra-kvd memra-kvctl memra-kv-supervise; do
    printf '#!/bin/sh\necho "FAKE %s: a stand-in for deploy tests, not the real binary" >&2\nexit 1\n' \
      "$name" >"$1/$name"
    chmod 0755 "$1/$name"
  done
}

# install_into ROOT [install.sh args...]: runs install.sh with DESTDIR=ROOT and the fakes.
install_into() {
  local root="$1"
  shift
  DESTDIR="$root" BIN_DIR="$TEST_DIR/fake-bin" bash "$DEPLOY_DIR/install.sh" "$@"
}

make_fake_binaries "$TEST_DIR/fake-bin"
