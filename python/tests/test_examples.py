"""python/examples run as their own processes against the real daemon, each given --socket;
`python3 -m memra_kv` lists exactly those examples."""

import os
import subprocess
import sys

from kvtest import repo_root

EXAMPLES = os.path.join(repo_root(), "python", "examples")
# What the examples share, and the package marker Bazel's runfiles add: not examples.
NOT_EXAMPLES = ("example_engine.py", "__init__.py")


def example_names():
    return sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".py") and n not in NOT_EXAMPLES)


def run(*args, **kwargs):
    """`/usr/bin/python3 args...` with this interpreter's import path (memra_kv from the
    runfiles under Bazel): (exit status, stdout + stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120, **kwargs)
    return done.returncode, done.stdout


def run_example(name, daemon, *args):
    status, output = run(os.path.join(EXAMPLES, name), "--socket", daemon.socket, *args)
    assert status == 0, output
    return output


def assert_nothing_left(daemon):
    with daemon.admin() as admin:
        assert admin.sessions() == []


def test_decode_loop(kvd):
    daemon = kvd("--budget_bytes=64MiB")
    output = run_example("decode_loop.py", daemon)
    assert "decode_loop: 2 sessions, committed [80, 80], every row verified" in output
    assert_nothing_left(daemon)


def test_decode_loop_with_an_imported_config(kvd):
    daemon = kvd("--budget_bytes=2GiB")
    config = os.path.join(repo_root(), "tests", "data", "hf_configs", "llama-3.1-8b.json")
    output = run_example("decode_loop.py", daemon, "--hf-config", config)
    assert "committed [80, 80], every row verified" in output


def test_spec_decode_with_rollback(kvd):
    daemon = kvd("--budget_bytes=64MiB")
    output = run_example("spec_decode.py", daemon)
    assert "round 1: accepted 1 of 4, committed 21" in output
    assert "round 2: accepted 0 of 4, committed 21" in output
    assert "spec_decode: 6 rounds, 30 tokens, every row verified" in output
    assert_nothing_left(daemon)


def test_prefix_sharing_between_two_processes(kvd):
    daemon = kvd("--budget_bytes=64MiB", "--prefix_cache_budget_bytes=16MiB")
    output = run_example("prefix_share.py", daemon)
    assert "writer: captured 512 tokens" in output
    assert "reader: restored 512 of 552 prompt tokens (hit), every row verified" in output
    assert_nothing_left(daemon)
    with daemon.admin() as admin:
        stats = admin.list_prefixes().stats
        assert (stats.captures, stats.restores, stats.tokens_restored) == (1, 1, 512)


def test_prefix_sharing_reports_a_daemon_without_a_prefix_cache(kvd):
    daemon = kvd("--budget_bytes=64MiB", "--prefix_cache_budget_bytes=0")
    status, output = run(os.path.join(EXAMPLES, "prefix_share.py"), "--socket", daemon.socket)
    assert status != 0 and "the prefix cache is disabled on this daemon" in output, output


def test_admission_queue_waits_for_room(kvd):
    daemon = kvd("--budget_bytes=64MiB")
    output = run_example("admission_queue.py", daemon, "--requests", "5")
    lines = output.splitlines()
    # Two fit at once and every request is as long: 0 and 1 run, 2 waits for both to finish,
    # 2 and 3 run, 4 waits, 4 runs; nothing is admitted out of order.
    admitted = [int(line.split()[1]) for line in lines if " admitted " in line]
    refused = [line for line in lines if " refused: needs " in line]
    assert admitted == [0, 1, 2, 3, 4]
    assert "request 1 admitted (2 running)" in lines and "request 4 admitted (1 running)" in lines
    assert sorted({int(line.split()[1]) for line in refused}) == [2, 4]
    # The refusal's numbers: a session needs more than what is free.
    needed, free = _needed_and_free(refused[0])
    assert needed > free > 0
    assert "admission_queue: 5 requests served" in output
    assert_nothing_left(daemon)


def _needed_and_free(line):
    # "request N refused: needs B bytes, F free; waits"
    words = line.replace(",", " ").split()
    return int(words[words.index("needs") + 1]), int(words[words.index("free;") - 1])


def test_every_example_takes_socket(kvd):
    for name in example_names():
        status, output = run(os.path.join(EXAMPLES, name), "--help")
        assert status == 0 and "--socket" in output, (name, output)


def test_module_help_lists_the_examples():
    names = example_names()
    for args in ((), ("--help",)):
        status, output = run("-m", "memra_kv", *args)
        assert status == 0, output
        listed = sorted(line.split()[0] for line in output.splitlines()
                        if line.startswith("  ") and line.split()[0].endswith(".py"))
        assert listed == names
    status, output = run("-m", "memra_kv", "--bogus")
    assert status == 2 and "unknown argument --bogus" in output
