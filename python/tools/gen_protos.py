#!/usr/bin/python3
"""Generates memra_kv's wire stubs from proto/ (never checked in).

    python/tools/gen_protos.py [--proto_root DIR] [--out DIR] [--protoc P] [--plugin P]

Runs protoc with --python_out and grpc_python_plugin (Debian's /usr/bin ones by default; with
--protoc=grpc_tools it runs the grpcio-tools module instead, for `pip install` where those are
missing) over proto/memra/kv/v1/*.proto, and writes a flat package, default
python/memra_kv/_proto/: {admin,block_store,cache,model_plan,prefix}_pb2.py, *_pb2_grpc.py, __init__.py.

The .proto files import each other as "proto/memra/kv/v1/x.proto", which protoc turns into
`from proto.memra.kv.v1 import x_pb2`; those imports are rewritten to relative ones so the
stubs live inside memra_kv and never claim a top-level `proto` package.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

PROTOS = ("admin", "block_store", "cache", "group", "model_plan", "prefix")
PROTO_PACKAGE_DIR = os.path.join("proto", "memra", "kv", "v1")
IMPORT = re.compile(r"^from proto\.memra\.kv\.v1 import (\w+)", re.MULTILINE)


def outputs():
    """The files generate() writes, relative to --out."""
    names = ["__init__.py"]
    for stem in PROTOS:
        names += [stem + "_pb2.py", stem + "_pb2_grpc.py"]
    return names


def run_protoc(protoc, plugin, proto_root, staging, sources):
    if protoc == "grpc_tools":
        from grpc_tools import protoc as grpc_protoc  # pip's grpcio-tools

        args = ["protoc", "--proto_path=" + proto_root, "--python_out=" + staging,
                "--grpc_python_out=" + staging] + sources
        if grpc_protoc.main(args) != 0:
            raise SystemExit("gen_protos: grpc_tools.protoc failed")
        return
    subprocess.run([protoc, "--proto_path=" + proto_root, "--python_out=" + staging,
                    "--grpc_python_out=" + staging,
                    "--plugin=protoc-gen-grpc_python=" + plugin] + sources, check=True)


def generate(proto_root, out, protoc, plugin):
    sources = [os.path.join(proto_root, PROTO_PACKAGE_DIR, stem + ".proto") for stem in PROTOS]
    for source in sources:
        if not os.path.isfile(source):
            raise SystemExit("gen_protos: missing " + source)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as staging:
        run_protoc(protoc, plugin, proto_root, staging, sources)
        generated = os.path.join(staging, PROTO_PACKAGE_DIR)
        for stem in PROTOS:
            for suffix in ("_pb2.py", "_pb2_grpc.py"):
                with open(os.path.join(generated, stem + suffix)) as f:
                    text = f.read()
                text = IMPORT.sub(r"from . import \1", text)
                with open(os.path.join(out, stem + suffix), "w") as f:
                    f.write(text)
    with open(os.path.join(out, "__init__.py"), "w") as f:
        f.write('"""memra.kv.v1 stubs generated from proto/ by python/tools/gen_protos.py."""\n')


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proto_root", default=os.path.dirname(os.path.dirname(here)),
                        help="directory holding proto/ (default: the repository root)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(here), "memra_kv", "_proto"))
    parser.add_argument("--protoc", default=shutil.which("protoc") or "/usr/bin/protoc",
                        help='protoc binary, or "grpc_tools" for the grpcio-tools module')
    parser.add_argument("--plugin", default=shutil.which("grpc_python_plugin")
                        or "/usr/bin/grpc_python_plugin")
    args = parser.parse_args(argv)
    generate(args.proto_root, args.out, args.protoc, args.plugin)


if __name__ == "__main__":
    main(sys.argv[1:])
