"""The SGLang engine tests share python/tests' fixtures (the real memra-kvd): its conftest.py
is loaded under another module name (both files are named conftest)."""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "memra_kv_tests_conftest", os.path.join(_HERE, "..", "..", "tests", "conftest.py"))
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)  # puts python/tests on sys.path (kvtest)
kvd = _shared.kvd
sys.path.insert(0, _HERE)  # instance
