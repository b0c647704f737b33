"""setuptools hook: generates memra_kv's stubs from ../proto into memra_kv/_proto before
setuptools looks at the packages (no generated code is checked in). pyproject.toml holds the
metadata."""

import os
import shutil
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_stubs():
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import gen_protos

    try:
        import grpc_tools  # noqa: F401  (pip's build requirement)
        protoc, plugin = "grpc_tools", None
    except ImportError:  # no isolated build env: Debian's protoc and plugin
        protoc = shutil.which("protoc") or "/usr/bin/protoc"
        plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    gen_protos.generate(os.path.dirname(HERE), os.path.join(HERE, "memra_kv", "_proto"),
                        protoc, plugin)


generate_stubs()
setup()
