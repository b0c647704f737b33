#!/usr/bin/env bash
# Installs the Debian 12 packages listed in deploy/packages.txt that are not installed yet.
#
#   deploy/bootstrap.sh
#
# Idempotent and offline-safe: it asks dpkg what is missing and, when nothing is, exits 0 without
# touching apt. Otherwise, as root, it runs `apt-get update` once and installs the missing
# packages (no recommends); as any other user it prints the command to run and exits 1.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
list="${here}/packages.txt"

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "bootstrap: dpkg-query not found; memra-kv builds on Debian 12 (see ${list})" >&2
  exit 1
fi

packages=()
while IFS= read -r line || [[ -n "${line}" ]]; do
  line="${line%%#*}"
  read -r -a words <<<"${line}"
  packages+=("${words[@]+"${words[@]}"}")
done <"${list}"
if ((${#packages[@]} == 0)); then
  echo "bootstrap: no packages in ${list}" >&2
  exit 1
fi

# missing_from PACKAGE...: prints those not "install ok installed", one per line (one dpkg call;
# dpkg-query prints nothing for a package it has never heard of).
missing_from() {
  local installed
  installed="$(dpkg-query -W -f='${Package} ${Status}\n' "$@" 2>/dev/null |
    awk '$2 == "install" && $3 == "ok" && $4 == "installed" { print $1 }' || true)"
  local package
  for package in "$@"; do
    grep -qxF "${package}" <<<"${installed}" || echo "${package}"
  done
}

mapfile -t missing < <(missing_from "${packages[@]}")
if ((${#missing[@]} == 0)); then
  echo "bootstrap: all ${#packages[@]} packages from deploy/packages.txt are installed"
  exit 0
fi

echo "bootstrap: missing ${#missing[@]} of ${#packages[@]} packages: ${missing[*]}"
install=(apt-get install -y --no-install-recommends "${missing[@]}")
if ((EUID != 0)); then
  echo "bootstrap: not root; run as root:" >&2
  echo "  apt-get update && ${install[*]}" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update
"${install[@]}"

# apt-get exits 0 in some partial cases; trust dpkg, not apt.
mapfile -t still_missing < <(missing_from "${missing[@]}")
if ((${#still_missing[@]} != 0)); then
  echo "bootstrap: still not installed after apt-get: ${still_missing[*]}" >&2
  exit 1
fi
echo "bootstrap: installed ${missing[*]}"
