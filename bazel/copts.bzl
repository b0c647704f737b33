"""Compiler options shared by every project target (never by generated code)."""

MEMRA_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
    # GCC 12 at -O2 (-c opt, the benchmarks) reports -Wmaybe-uninitialized through moved
    # std::optional members (core/session.cc: SessionState::pending_append_), a known false
    # positive; it stays a visible warning, not an error.
    "-Wno-error=maybe-uninitialized",
]
