#!/bin/bash
# core/ is the pure rules library (docs/architecture.md#layering): no gRPC, protobuf, CUDA or
# I/O. This fails naming every file and line under core/ that includes one of those headers.
# Arguments: the files of //core:all_sources.
set -euo pipefail

readonly RPC_AND_DEVICE='(grpc|grpcpp|google/protobuf|cuda|cublas|nccl)[^>"]*'
readonly IO='fstream|iostream|cstdio|stdio\.h|fcntl\.h|unistd\.h|sys/[^>"]*'
readonly INCLUDE='^[[:space:]]*#[[:space:]]*include[[:space:]]*'
readonly FORBIDDEN="${INCLUDE}[<\"](${RPC_AND_DEVICE}|${IO})[>\"]"

# Prints the offending lines of the given files; succeeds only when there are none.
clean() {
  ! grep -HnE "$FORBIDDEN" "$@"
}

# The check must catch each forbidden include and pass ordinary ones: a regex that never
# matches would otherwise pass forever.
self_test() {
  local dir="${TEST_TMPDIR:-$(mktemp -d)}/purity_self_test"
  mkdir -p "$dir"
  local bad
  for bad in '<grpcpp/grpcpp.h>' '"grpc/grpc.h"' '<google/protobuf/message.h>' \
      '<cuda_runtime.h>' '<cuda.h>' '<fstream>' '<iostream>' '<cstdio>' '<stdio.h>' \
      '<unistd.h>' '<sys/mman.h>' '<fcntl.h>'; do
    printf '#include <cstdint>\n  #  include %s  // why not\n' "$bad" >"$dir/bad.h"
    if clean "$dir/bad.h" >/dev/null; then
      echo "self-test: the check missed #include $bad" >&2
      return 1
    fi
  done
  printf '%s\n' '#include <cstdint>' '#include <string_view>' '#include "absl/status/status.h"' \
    '#include "core/sizing.h"' '// #include <iostream> (a comment)' >"$dir/good.h"
  if ! clean "$dir/good.h"; then
    echo "self-test: the check refused ordinary includes" >&2
    return 1
  fi
}

main() {
  self_test
  if [[ $# -eq 0 ]]; then
    echo "no core/ sources were given (is //core:all_sources a data dependency?)" >&2
    return 1
  fi
  local file found_sizing=0
  for file in "$@"; do
    [[ "$file" == */core/sizing.cc || "$file" == core/sizing.cc ]] && found_sizing=1
  done
  if [[ $found_sizing -eq 0 ]]; then
    echo "core/sizing.cc is not among the $# files checked: the source glob is broken" >&2
    return 1
  fi
  if ! clean "$@"; then
    echo "core/ must stay free of gRPC, protobuf, CUDA and I/O headers (lines above)" >&2
    return 1
  fi
  echo "checked $# core/ files: pure"
}

main "$@"
