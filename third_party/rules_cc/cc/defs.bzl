"""Forwards the rules_cc entry points to Bazel's native C++ rules.

Debian's bazel-rules-cc targets newer Bazel releases (it loads `use_cpp_toolchain`, which Bazel 4
lacks), so the project ships this minimal stand-in instead of downloading rules_cc.
"""

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def cc_proto_library(**kwargs):
    native.cc_proto_library(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)
