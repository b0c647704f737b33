"""Keeps bench/lmcache/lmcache_vs_memra.py from rotting without the LMCache venv: its memra half
(the real memra-kvd, two engine processes) on a tiny pool, under Debian's Python. Asserts what
the run did (every store and load made, the second process's bytes equal to the first's), never
how fast."""

import json
import os
import sys
import tempfile

import lmcache_vs_memra as bench

REPS = 2
SIZES = (512, 1024)
GEOMETRY = ["--layers", "2", "--kv-heads", "1", "--head-dim", "64"]


def kvd_binary():
    srcdir = os.environ["TEST_SRCDIR"]
    return os.path.join(srcdir, os.environ.get("TEST_WORKSPACE", "memra_kv"), "server",
                        "memra-kvd")


def main():
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "report.json")
        status = bench.main(["--systems", "memra", "--tokens-list", ",".join(map(str, SIZES)),
                             "--reps", str(REPS), "--kvd", kvd_binary(), "--json", out]
                            + GEOMETRY)
        assert status == 0, "the bench exited %d" % status
        with open(out) as f:
            report = json.load(f)
    rows = {row["tokens"]: row for row in report["rows"]}
    assert sorted(rows) == list(SIZES), rows.keys()
    for tokens, row in rows.items():
        assert row["system"] == "memra" and row["verified"], row
        # 2 layers x K,V x (tokens / 256) blocks x 256 tokens x 1 head x 64 x 2 bytes.
        assert row["bytes"] == 2 * 2 * tokens * 64 * 2, (tokens, row["bytes"])
    for process in report["raw"]:
        counts = {k: len(v) for k, v in process.items() if k.endswith("_s") and
                  isinstance(v, list)}
        expected = {"store": {"store_s": REPS, "store_memcpy_s": REPS, "load_s": REPS,
                              "lookup_s": REPS, "load_memcpy_s": REPS},
                    "load": {"load_s": REPS, "lookup_s": REPS, "load_memcpy_s": REPS}}
        assert counts == expected[process["role"]], (process["role"], counts)
        assert process["verified"], process
    print("lmcache_vs_memra.py --systems memra: %d sizes, %d processes, bytes equal" % (
        len(rows), len(report["raw"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
