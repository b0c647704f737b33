"""Compiles .proto files with the system protoc and grpc_cpp_plugin.

Bazel 4's native cc_proto_library needs @com_google_protobuf, which cannot be fetched offline,
so this macro runs Debian's protoc in a genrule and wraps the generated sources in a
cc_library linked against the system protobuf and gRPC.
"""

def memra_cc_grpc_library(name, srcs, deps = [], visibility = None):
    """Generates `name` (a cc_library) from `srcs` (.proto files in this package).

    Messages and services are both generated; the library links protobuf and gRPC++.
    """
    outs = []
    for src in srcs:
        stem = src[:-len(".proto")]
        outs += [
            stem + ".pb.h",
            stem + ".pb.cc",
            stem + ".grpc.pb.h",
            stem + ".grpc.pb.cc",
        ]
    native.genrule(
        name = name + "_codegen",
        srcs = srcs,
        outs = outs,
        cmd = " ".join([
            "protoc",
            "--proto_path=.",
            "--cpp_out=$(GENDIR)",
            "--grpc_out=$(GENDIR)",
            "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin)",
        ] + ["$(location %s)" % src for src in srcs]),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + [
            "//third_party:grpc",
            "//third_party:protobuf",
        ],
        visibility = visibility,
    )
