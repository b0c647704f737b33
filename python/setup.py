"""setuptools hooks (pyproject.toml holds the metadata): memra_kv's gRPC stubs are generated
from the .proto files while the package is built, never checked in.

  * build_py writes them into the build directory (memra_kv/_proto) with grpc_tools.protoc
    (grpcio-tools: a build requirement). In an editable install (`pip install -e`) setuptools
    asks build subcommands to build in place, as build_ext --inplace does: they are written to
    python/memra_kv/_proto (ignored by git).
  * The .proto files are read from ../proto in a checkout; an sdist carries a copy in proto/.
  * setuptools' own intermediates (build/, *.egg-info) go to a temporary directory, removed on
    exit: building leaves the checkout as it was.
  * The runtime requirements are computed from the generator: its stubs refuse a grpcio older
    than the grpcio-tools that wrote them, and a protobuf older than the one it bundles.
"""

import atexit
import os
import shutil
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "tools"))
import gen_protos  # noqa: E402


def proto_root():
    """The directory holding proto/memra/kv/v1: the sdist's copy, else the checkout's root."""
    for root in (HERE, os.path.dirname(HERE)):
        if os.path.isdir(os.path.join(root, gen_protos.PROTO_PACKAGE_DIR)):
            return root
    raise SystemExit("memra-kv: no %s beside %s or above it: build from a checkout of the "
                     "repository or from the sdist" % (gen_protos.PROTO_PACKAGE_DIR, HERE))


def generator_versions():
    """(grpcio-tools version, protobuf version) of the build environment."""
    from importlib.metadata import version
    try:
        return version("grpcio-tools"), version("protobuf")
    except Exception as error:  # noqa: BLE001  (PackageNotFoundError and kin)
        raise SystemExit("memra-kv: building needs grpcio-tools (a build requirement in "
                         "pyproject.toml; with --no-build-isolation install it first: pip "
                         "install grpcio-tools): %s" % error)


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        package = os.path.join("memra_kv", "_proto")
        out = (os.path.join(HERE, package) if self.editable_mode
               else os.path.join(self.build_lib, package))
        gen_protos.generate(proto_root(), out, "grpc_tools", None)

    def get_outputs(self, include_bytecode=1):
        package = os.path.join(self.build_lib, "memra_kv", "_proto")
        return super().get_outputs(include_bytecode) + [
            os.path.join(package, name) for name in gen_protos.outputs()]


class SdistWithProtos(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        source = os.path.join(proto_root(), gen_protos.PROTO_PACKAGE_DIR)
        target = os.path.join(base_dir, gen_protos.PROTO_PACKAGE_DIR)
        os.makedirs(target, exist_ok=True)
        for stem in gen_protos.PROTOS:
            self.copy_file(os.path.join(source, stem + ".proto"), target)


tools_version, protobuf_version = generator_versions()
scratch = tempfile.mkdtemp(prefix="memra-kv-build-")
atexit.register(shutil.rmtree, scratch, True)
setup(
    options={"build": {"build_base": os.path.join(scratch, "build")},
             "egg_info": {"egg_base": scratch}},
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos},
    install_requires=["grpcio>=%s,<2" % tools_version, "protobuf>=%s" % protobuf_version,
                      "numpy>=1.24,<3"],
)
