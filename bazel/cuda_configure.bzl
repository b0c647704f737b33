"""Repository rule that finds the CUDA toolkit, or records that there is none.

Generates @local_cuda with:
  //:defs.bzl  HAS_CUDA (bool) for BUILD files to include or leave out CUDA targets.
  //:cudart    the CUDA runtime (headers + -lcudart), only when HAS_CUDA.
"""

_BUILD_WITH_CUDA = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cudart",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp"]),
    includes = ["include"],
    linkopts = [
        "-L{lib}",
        "-Wl,-rpath,{lib}",
        "-lcudart",
    ],
)
"""

_BUILD_WITHOUT_CUDA = """
package(default_visibility = ["//visibility:public"])
"""

def _cuda_configure_impl(ctx):
    root = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    header = ctx.path(root + "/include/cuda_runtime_api.h")
    has_cuda = header.exists
    if has_cuda:
        ctx.symlink(root + "/include", "include")
        lib = root + "/lib64"
        ctx.file("BUILD.bazel", _BUILD_WITH_CUDA.format(lib = lib))
    else:
        ctx.file("BUILD.bazel", _BUILD_WITHOUT_CUDA)
    ctx.file("defs.bzl", "HAS_CUDA = %s\nCUDA_ROOT = %r\n" % (has_cuda, root))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
)
