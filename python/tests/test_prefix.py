"""The prefix cache across languages and processes: the C++ //tests/e2e:prefix_engine captures
and a Python engine restores into its own session and reads the same bytes; a Python engine
captures and the C++ engine restores and checks every byte. Then the events iterator: resuming
from the last sequence, and a GAP surfaced."""

import os
import subprocess

import grpc
import pytest

from memra_kv import KvError
from kvtest import aligned_window_start, binary
from prefix_patterns import check_pattern, commit_rows, plan_named, tokens, write_pattern

# prefix_e2e_test.cc's kinds: swa's 4800 rows wrap its 4703-row ring before the capture.
KINDS = [("flat", 96), ("hybrid", 64), ("swa", 4800), ("latent", 80)]
CAPACITY = 6000  # prefix_engine's default --capacity
DAEMON_FLAGS = ("--budget_bytes=512MiB", "--prefix_cache_budget_bytes=128MiB",
                "--prefix_block_tokens=16")


def prefix_engine(daemon, mode, plan, n, out):
    return subprocess.run(
        [binary("tests/e2e/prefix_engine"), "--socket=" + daemon.socket, "--mode=" + mode,
         "--plan=" + plan, "--tokens=%d" % n, "--out=" + out],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)


def facts(path):
    return dict(line.split("=", 1) for line in open(path).read().split())


@pytest.mark.parametrize("kind,n", KINDS)
def test_python_restores_what_the_cpp_engine_captured(kvd, kind, n):
    daemon = kvd(*DAEMON_FLAGS)
    out = os.path.join(daemon.dir, "captured")
    captured = prefix_engine(daemon, "capture", kind, n, out)
    assert captured.returncode == 0, captured.stdout
    entry_id = int(facts(out)["entry_id"])
    with daemon.client("py-restore") as client:
        plan = client.register_plan(plan_named(kind))
        session = client.create_session(plan, CAPACITY)
        found = client.lookup_prefix(plan, tokens(n))
        assert (found.outcome, found.entry_id, found.matched_tokens, found.block_tokens) == (
            "hit", entry_id, n, 16)
        restored = client.restore_prefix(session, tokens(n), found.entry_id)
        assert restored.restored_tokens == n and restored.state.committed_len == n
        for layer in restored.state.layers:
            if layer.ring:
                assert layer.ring_base == aligned_window_start(n, 64)
        assert check_pattern(session, restored.state) > 0
        with daemon.admin() as admin:
            stats = admin.list_prefixes().stats
        assert (stats.restores, stats.tokens_restored, stats.dropped_entries) == (1, n, 0)
        session.release()


@pytest.mark.parametrize("kind,n", KINDS)
def test_the_cpp_engine_restores_what_python_captured(kvd, kind, n):
    daemon = kvd(*DAEMON_FLAGS)
    with daemon.client("py-capture") as client:
        plan = client.register_plan(plan_named(kind))
        session = client.create_session(plan, CAPACITY)
        commit_rows(session, tokens(n))
        state = session.state()
        write_pattern(session, state)
        captured = client.capture_prefix(session, tokens(n), n)
        assert captured.boundary_tokens == n and not captured.already_present
        assert captured.added_bytes > 0 and captured.shape_fingerprint == plan
        session.release()
    out = os.path.join(daemon.dir, "restored")
    restored = prefix_engine(daemon, "restore", kind, n, out)
    assert restored.returncode == 0, restored.stdout
    assert facts(out)["restored"] == str(n)
    assert "restored bytes checked" in restored.stdout


def test_events_resume_from_the_last_sequence_and_surface_a_gap(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    with daemon.client("py-events") as client:
        plan = client.register_plan(plan_named("flat"))
        session = client.create_session(plan, 256)
        commit_rows(session, tokens(64))
        client.capture_prefix(session, tokens(64), 32)
        events = client.events()
        first = next(events)
        assert (first.sequence, first.kind, first.gap) == (1, "stored", False)
        assert first.shape_fingerprint == plan and len(first.block_keys) == 2
        assert all(len(key) == 32 for key in first.block_keys)
        epoch = first.epoch
        events.cancel()
        with pytest.raises(StopIteration):
            next(events)
        # Another capture while nobody listens: iterating again resumes after sequence 1.
        client.capture_prefix(session, tokens(64), 64)
        second = next(events)
        assert (second.sequence, second.epoch, second.kind) == (2, epoch, "stored")
        assert len(second.block_keys) == 2  # only the blocks this capture added
        events.cancel()
        assert (events.epoch, events.last_sequence) == (epoch, 2)

        # A subscriber that names another epoch missed everything: a GAP first.
        stale = client.events(epoch=epoch + 1, last_sequence=1)
        gap = next(stale)
        assert gap.gap and gap.kind == "gap" and gap.epoch == epoch and gap.block_keys == []
        stale.cancel()

        # Refusals of the prefix calls keep the daemon's codes and numbers.
        fresh = client.create_session(plan, 256)
        with pytest.raises(KvError) as unaligned:
            client.capture_prefix(session, tokens(64), 40)
        assert unaligned.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "40" in unaligned.value.message and "16" in unaligned.value.message
        with pytest.raises(KvError) as not_fresh:
            client.restore_prefix(session, tokens(64))
        assert not_fresh.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert client.lookup_prefix(plan, [1, 2, 3] * 16).outcome == "miss"
        assert client.restore_prefix(fresh, tokens(64)).restored_tokens == 64
        # Listing, inspecting and evicting are operators' calls: the admin socket.
        with pytest.raises(KvError) as engine_socket:
            client.list_prefixes()
        assert engine_socket.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert daemon.admin_socket in engine_socket.value.message
        admin = daemon.admin()
        entries = admin.list_prefixes().entries
        assert sorted(e.boundary_tokens for e in entries) == [32, 64]
        assert admin.inspect_prefix(entries[0].entry_id).entry_id == entries[0].entry_id
        freed = admin.evict_prefix(entries[0].entry_id)
        assert freed.stats.entries == 1
