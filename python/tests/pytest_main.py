"""Runs pytest over the files named on the command line (the entry point of memra_py_test)."""

import os
import sys

import pytest

if __name__ == "__main__":
    args = ["-v", "-rs", "-p", "no:cacheprovider"]
    # Bazel names a file for a JUnit report; pytest writes one there.
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    sys.exit(pytest.main(args + sys.argv[1:]))
