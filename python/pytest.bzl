"""memra_py_test: one pytest file as a Bazel test on Debian's /usr/bin/python3."""

def memra_py_test(name, src, deps = [], data = [], size = "small", **kwargs):
    """A py_test running pytest over `src` (tests/pytest_main.py is the entry point).

    pytest prints its summary ("N passed, M skipped in Ts") and the skip reasons (-rs) in the
    test log, where deploy/dev.sh counts the cases.
    """
    native.py_test(
        name = name,
        srcs = [src, "tests/pytest_main.py", "tests/conftest.py", "tests/kvtest.py"],
        main = "tests/pytest_main.py",
        args = ["$(rootpath %s)" % src],
        deps = deps + [":memra_kv"],
        data = data + ["//server:memra-kvd"],
        python_version = "PY3",
        size = size,
        **kwargs
    )
