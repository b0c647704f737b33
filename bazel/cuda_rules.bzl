"""C++ rules that exist only where the CUDA toolkit was found (@local_cuda HAS_CUDA).

Elsewhere they declare nothing, so `bazel build //...` and `bazel test //...` stay green on a
machine without CUDA and no source carries an #ifdef.
"""

load("@local_cuda//:defs.bzl", "HAS_CUDA")

def cuda_cc_library(**kwargs):
    if HAS_CUDA:
        native.cc_library(**kwargs)

def cuda_cc_test(**kwargs):
    if HAS_CUDA:
        native.cc_test(**kwargs)

def cuda_sh_test(**kwargs):
    if HAS_CUDA:
        native.sh_test(**kwargs)
