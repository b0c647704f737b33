"""Compiler options shared by every project target (never by generated code)."""

MEMRA_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
]
