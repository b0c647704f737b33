#!/bin/bash
# server/ is layered (docs/architecture.md#layering): each package includes only itself, the
# packages below it and core/, common/, absl. This fails naming every file and line of server/
# that includes a server/ header of a layer above its own (or beside it, where no arrow runs), or
# generated protobuf (*.pb.h) below the doors (server/edge/ and the root), except the explicit
# allowlist below. Tests (*_test.cc) are users of their layer, not part of it: they may compose
# layers above (a restart test runs a Daemon), so the rules apply to production files only.
# Arguments: the files of //server/...:all_sources.
set -euo pipefail

# What each package may include besides itself. "root" is server/ itself (the process: main,
# Daemon, config); it may include every layer.
declare -A ALLOWED=(
  [base]=""
  [device]="base"
  [metrics]="base"
  [store/remote]="device base"
  [store]="store/remote device base"
  [session]="store store/remote device base"
  [restart]="session store store/remote device base"
  [edge]="restart session store store/remote device metrics base"
  [testing]="store/remote device base"
  [root]="edge restart session store store/remote device metrics testing base"
)
# Packages that may include generated protobuf: the doors and the process root.
readonly PROTO_DOORS=" edge root "

# Today's protobuf includes below the doors, each with why it is still there. This list only
# shrinks (server/session/ left it with issue 27 item 4: session operations return their own
# result types); a new entry needs a reason a reviewer accepts.
declare -A PROTO_ALLOWLIST=(
  [restart/restart_state.h]="restart_journal.proto is the journal's own on-disk record format, not the wire API"
  [restart/restart_state.cc]="journals a session's model plan as the wire's ModelPlan message (model_plan.proto)"
)

readonly INCLUDE='^[[:space:]]*#[[:space:]]*include[[:space:]]*"'

# The package of a server/ path ("root" for server/ itself); empty when not under server/.
package_of() {
  local path="$1"
  if [[ "$path" =~ (^|/)server/(.+)/[^/]+$ ]]; then
    echo "${BASH_REMATCH[2]}"
  elif [[ "$path" =~ (^|/)server/[^/]+$ ]]; then
    echo root
  fi
}

# Prints every offending include of the given files; succeeds only when there is none.
clean() {
  local file own included target line number text offenders=0
  for file in "$@"; do
    own="$(package_of "$file")"
    [[ -n "$own" ]] || { echo "$file: not under server/" >&2; offenders=1; continue; }
    [[ "$file" == *_test.cc ]] && continue
    if [[ -z "${ALLOWED[$own]+set}" ]]; then
      echo "$file: package server/$own has no entry in this test's layer table" >&2
      offenders=1
      continue
    fi
    while IFS=: read -r number text; do
      included="$(sed -E 's/^[^"]*"([^"]+)".*/\1/' <<<"$text")"
      if [[ "$included" == *.pb.h && "$PROTO_DOORS" != *" $own "* ]]; then
        local relative="${file##*server/}"
        if [[ -z "${PROTO_ALLOWLIST[$relative]+set}" ]]; then
          echo "$file:$number: generated protobuf below the doors: $text" >&2
          offenders=1
        fi
        continue
      fi
      [[ "$included" == server/* ]] || continue
      target="$(package_of "$included")"
      [[ "$target" == "$own" ]] && continue
      if [[ " ${ALLOWED[$own]} " != *" $target "* ]]; then
        echo "$file:$number: server/$own must not include server/$target: $text" >&2
        offenders=1
      fi
    done < <(grep -nE "$INCLUDE" "$file" || true)
  done
  return "$offenders"
}

# The check must catch an upward include, a sideways one and protobuf below the doors, and pass
# ordinary ones: a check that never matches would otherwise pass forever.
self_test() {
  local dir="${TEST_TMPDIR:-$(mktemp -d)}/layering_self_test/server"
  mkdir -p "$dir/base" "$dir/device" "$dir/store" "$dir/metrics" "$dir/edge" "$dir/session"
  local -a bad=(
    "base/up.h|server/session/daemon_session.h"
    "device/up.cc|server/store/prefix_cache.h"
    "store/up.h|server/session/daemon_session.h"
    "session/up.h|server/edge/step_entry.h"
    "metrics/beside.h|server/device/backend.h"
    "store/up.cc|server/daemon.h"
    "store/wire.h|proto/memra/kv/v1/cache.pb.h"
    "session/wire.cc|proto/memra/kv/v1/cache.grpc.pb.h"
  )
  local pair file header
  for pair in "${bad[@]}"; do
    file="$dir/${pair%%|*}"
    header="${pair##*|}"
    printf '#include <cstdint>\n  #  include "%s"  // why not\n' "$header" >"$file"
    if clean "$file" 2>/dev/null; then
      echo "self-test: the check missed server/${pair%%|*} including $header" >&2
      return 1
    fi
    rm "$file"
  done
  printf '%s\n' '#include <cstdint>' '#include "absl/status/status.h"' '#include "core/sizing.h"' \
    '#include "server/base/clock.h"' '#include "server/device/backend.h"' \
    '#include "server/store/remote/remote_tier.h"' '// #include "server/daemon.h" (a comment)' \
    >"$dir/store/good.h"
  printf '%s\n' '#include "server/daemon.h"' '#include "proto/memra/kv/v1/cache.pb.h"' \
    >"$dir/store/good_test.cc"
  printf '%s\n' '#include "server/session/session_registry.h"' \
    '#include "proto/memra/kv/v1/cache.grpc.pb.h"' >"$dir/edge/good.cc"
  if ! clean "$dir/store/good.h" "$dir/store/good_test.cc" "$dir/edge/good.cc"; then
    echo "self-test: the check refused ordinary includes" >&2
    return 1
  fi
}

main() {
  self_test
  if [[ $# -eq 0 ]]; then
    echo "no server/ sources were given (are the //server/...:all_sources data dependencies?)" >&2
    return 1
  fi
  local file own
  declare -A seen=()
  for file in "$@"; do
    own="$(package_of "$file")"
    [[ -n "$own" ]] && seen[$own]=1
  done
  for own in "${!ALLOWED[@]}"; do
    if [[ -z "${seen[$own]+set}" ]]; then
      echo "no file of server/$own is among the $# files checked: a source glob is missing" >&2
      return 1
    fi
  done
  if ! clean "$@"; then
    echo "server/ includes must point down the layers (docs/architecture.md#layering; lines above)" >&2
    return 1
  fi
  echo "checked $# server/ files in ${#seen[@]} packages: every include points down;" \
    "${#PROTO_ALLOWLIST[@]} allowlisted protobuf include(s) below the doors"
}

main "$@"
