"""The Pythonic surface against the real daemon: the exception hierarchy, the context
managers, the typed results; and, through Python, the four behaviours issue 30 found the docs
disagreeing with (docs/rules.md now states each)."""

import dataclasses
import subprocess
import sys

import grpc
import pytest

import memra_kv
from memra_kv import plans
from kvtest import (FLAT_LAYER, SLIDING_LAYER, SLIDING_WINDOW, dense_plan, hybrid_test_plan)

RING_SLACK_ROWS = 4639  # docs/rules.md#swa-ring: a ring saves rows above window + this


@pytest.fixture
def engine(kvd):
    daemon = kvd("--budget_bytes=64MiB")
    client = daemon.client("py-api")
    client.daemon = daemon
    yield client
    client.close()


# ---- errors ----

def test_errors_import_without_grpc():
    code = ("import sys; sys.modules['grpc'] = None; sys.path[:0] = %r; "
            "import importlib.util as u; spec = u.spec_from_file_location('errors', %r); "
            "m = u.module_from_spec(spec); spec.loader.exec_module(m); "
            "e = m.MemraKvError(m.ErrorCode.NOT_FOUND, 'gone'); "
            "print(type(e).__name__, isinstance(e, m.KvError), e)"
            % (sys.path, memra_kv.errors.__file__))
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    assert out.returncode == 0, out.stdout
    assert out.stdout.strip() == "NotFound True NOT_FOUND: gone"


def test_codes_pick_their_class_and_equal_grpc_codes():
    for code in memra_kv.ErrorCode:
        if code is memra_kv.ErrorCode.OK:
            continue
        error = memra_kv.MemraKvError(code, "m")
        assert type(error).__name__.upper() == code.name.replace("_", ""), code
        assert error.code == getattr(grpc.StatusCode, code.name)
        assert getattr(grpc.StatusCode, code.name) == error.code
        assert {getattr(grpc.StatusCode, code.name): code}.get(error.code) is code
        assert error.code != grpc.StatusCode.OK
    # Constructed with a grpc code (code written before ErrorCode) it is the same.
    legacy = memra_kv.KvError(grpc.StatusCode.NOT_FOUND, "m")
    assert isinstance(legacy, memra_kv.NotFound) and legacy.code is memra_kv.ErrorCode.NOT_FOUND


def test_refusals_raise_their_class_with_their_numbers(engine):
    plan = engine.register_plan(dense_plan(4, 128, 8))
    with pytest.raises(memra_kv.NotFound) as unknown:
        memra_kv.Session(engine, 987654, b"x" * 16).state()
    assert unknown.value.code == memra_kv.ErrorCode.NOT_FOUND
    assert "session 987654 does not exist" in unknown.value.message
    with engine.create_session(plan, 64) as session:
        with pytest.raises(memra_kv.PermissionDenied) as denied:
            memra_kv.Session(engine, session.id, b"y" * len(session.token)).state()
        assert "wrong session token for session %d" % session.id in denied.value.message
        with pytest.raises(memra_kv.FailedPrecondition) as stale:
            session.commit(99, 0)
        assert "stale KV transaction generation 99" in stale.value.message
    huge = 1 << 20
    needed = engine.cost(huge, fingerprint=plan).arena_bytes
    with pytest.raises(memra_kv.AdmissionRefused) as refused:
        engine.create_session(plan, huge)
    error = refused.value
    assert isinstance(error, memra_kv.ResourceExhausted) and isinstance(error, memra_kv.KvError)
    # Admission evicted the released session's pooled arena before refusing: all is free.
    free = engine.status().admission.free_bytes
    assert (error.needed, error.free, error.budget) == (needed, free, 64 << 20)
    assert error.bytes_to_evict == 0 and error.evictable == 0
    assert error.is_admission_refusal and not error.is_daemon_restarted
    assert str(needed) in error.message


# ---- context managers ----

def test_a_session_context_releases_it_even_when_the_block_raises(engine):
    plan = engine.register_plan(dense_plan(2, 64, 2))
    with engine.create_session(plan, 64) as session:
        assert session.state().capacity == 64
    assert session.released
    with pytest.raises(ZeroDivisionError):
        with engine.create_session(plan, 64) as failing:
            1 / 0
    assert failing.released
    with engine.daemon.admin() as admin:
        assert admin.sessions() == []


def test_a_transaction_aborts_on_exception_and_commits_whole_otherwise(engine):
    plan = engine.register_plan(hybrid_test_plan())
    with engine.create_session(plan, 256) as session:
        before = session.state()
        with pytest.raises(RuntimeError):
            with session.transaction() as txn:
                txn.prepare(8)
                raise RuntimeError("the kernel failed")
        assert txn.committed_len == 0 and session.open_generation == 0
        after = session.state()
        assert (after.committed_len, after.staged_len, after.active_generation) == (0, 0, 0)
        assert after.next_generation == before.next_generation + 1
        with session.transaction() as txn:  # prepared, not published: published and committed
            assert txn.prepare(8).target == 8
        assert txn.committed_len == 8 and session.state().committed_len == 8
        with session.transaction() as txn:  # an explicit partial commit stays what it was
            txn.prepare(6)
            assert txn.publish() == 14
            assert txn.commit(2, token_ids=[5, 6]) == 10
        with session.transaction() as txn:  # nothing prepared: nothing to commit, aborted
            pass
        assert txn.committed_len == 10 and session.state().active_generation == 0


def test_a_refusal_inside_a_transaction_aborts_it(engine):
    plan = engine.register_plan(hybrid_test_plan())
    with engine.create_session(plan, 256) as session:
        with pytest.raises(memra_kv.InvalidArgument) as refused:
            with session.transaction():
                session.prepare_append(session.open_generation, 300)
        assert "KV append exceeds capacity: 300 > 256" in refused.value.message
        state = session.state()
        assert (state.active_generation, state.committed_len) == (0, 0)


# ---- typed results ----

def test_results_are_frozen_dataclasses(engine):
    plan = engine.register_plan(hybrid_test_plan())
    with engine.create_session(plan, 256) as session:
        state = session.state()
        assert isinstance(state, memra_kv.SessionState)
        assert isinstance(state.layers[0], memra_kv.LayerState)
        with pytest.raises(dataclasses.FrozenInstanceError):
            state.committed_len = 5
    status = engine.status()
    assert isinstance(status, memra_kv.Status) and status.backend == "host"
    assert status.restart_survival == "off" and status.prefix_remote_tier == "none"
    assert status.admission.budget_bytes == 64 << 20
    cost = engine.cost(256, fingerprint=plan)
    assert isinstance(cost, memra_kv.Cost) and cost.breakdown.total_plane_bytes > 0
    with engine.daemon.admin() as admin:
        assert admin.sessions() == [] and [e.engine_name for e in admin.engines()] == ["py-api"]
        assert isinstance(admin.engines()[0], memra_kv.EngineStatus)


# ---- the docs mismatches of issue 30, pinned through Python ----

def ring_plan():
    return plans.model_plan([plans.kv_layer(FLAT_LAYER, 32, 2),
                             plans.sliding_layer(SLIDING_LAYER, 32, 2, SLIDING_WINDOW)],
                            name="ring", swa_ring=True)


def test_a_ring_saves_rows_only_above_window_plus_4639(engine):
    plan = engine.register_plan(ring_plan())
    cap = SLIDING_WINDOW + RING_SLACK_ROWS
    assert engine.cost(8192, fingerprint=plan).breakdown.ring_row_cap == cap
    # At or below the cap the ring holds `capacity` rows (ring-addressed, never rebasing); one
    # row above, it holds `cap` rows: the layout says which (LayerLayout.physical_rows).
    for capacity, physical_rows in ((cap - 1, cap - 1), (cap, cap), (cap + 1, cap),
                                    (8192, cap)):
        with engine.create_session(plan, capacity) as session:
            layout = session.layer_layout(SLIDING_LAYER)
            assert layout.ring and layout.physical_rows == physical_rows, capacity
            assert session.layer_layout(FLAT_LAYER).physical_rows == capacity


def test_a_rewind_into_a_lapped_window_names_the_lap(engine):
    plan = engine.register_plan(ring_plan())
    with engine.create_session(plan, 8192) as session:
        while session.state().committed_len < 8000:
            with session.transaction() as txn:
                txn.prepare(1000)  # the rows' bytes do not matter to the lengths
        assert not session.can_rewind(100)
        with pytest.raises(memra_kv.FailedPrecondition) as lapped:
            session.rewind(100)
        assert "SWA ring rewind checkpoint has been lapped" in lapped.value.message
        assert "rewind target 100: layer %d window %d" % (
            SLIDING_LAYER, SLIDING_WINDOW) in lapped.value.message
        assert session.state().committed_len == 8000


def test_spec_snapshot_buffers_are_optional_at_create_and_refused_at_snapshot(engine):
    plan = engine.register_plan(hybrid_test_plan())
    with engine.create_session(plan, 256) as session:  # no spec_snapshot: created
        with session.transaction() as txn:
            txn.prepare(4)
        with pytest.raises(memra_kv.FailedPrecondition) as refused:
            session.spec_snapshot()
        assert ("the session was created without spec snapshot buffers (1 recurrent layers "
                "need them)") in refused.value.message
        assert not session.state().spec_snapshot_valid


def test_a_spec_snapshot_stays_valid_across_rollbacks(engine):
    plan = engine.register_plan(hybrid_test_plan())
    with engine.create_session(plan, 256, spec_snapshot=True) as session:
        with session.transaction() as txn:
            txn.prepare(8)
        assert session.spec_snapshot().spec_snapshot_valid
        for accepted in (3, 1, 4):
            with session.transaction() as txn:
                txn.prepare(4)
            state = session.spec_rollback(accepted)
            assert state.committed_len == 8 + accepted and state.spec_snapshot_valid
        assert not session.reset().spec_snapshot_valid


# ---- documentation ----

def test_every_public_name_has_a_docstring():
    import ast
    import os
    package = os.path.dirname(memra_kv.__file__)
    missing = []
    for name in sorted(os.listdir(package)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(package, name)).read())
        if ast.get_docstring(tree) is None:
            missing.append(name)
        scopes = [(tree, name + ":")]
        while scopes:
            scope, prefix = scopes.pop()
            for node in ast.iter_child_nodes(scope):
                if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    continue
                if node.name.startswith("_"):
                    continue
                if ast.get_docstring(node) is None:
                    missing.append(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    scopes.append((node, prefix + node.name + "."))
    assert missing == []


def test_a_released_session_steps_nowhere(engine):
    plan = engine.register_plan(dense_plan(2, 64, 2))
    session = engine.create_session(plan, 64)
    other = engine.create_session(plan, 64)
    session.release()
    with pytest.raises(memra_kv.FailedPrecondition) as released:
        session.advance(next_rows=1)
    assert "session %d was released" % session.id in released.value.message
    with pytest.raises(memra_kv.InvalidArgument) as batch:
        engine.advance_many([memra_kv.AdvanceStep(other, next_rows=1),
                             memra_kv.AdvanceStep(session, next_rows=1)])
    assert "advance_many: session %d is released" % session.id in batch.value.message
    assert other.state().active_generation == 0  # nothing was sent
    other.release()
