"""The scripted engine workload of tests/e2e/engine_script.cc, played by a Python engine against
the real memra-kvd: transactions with partial commits, rewinds (deep ones to an indexer pool
boundary, the unaligned target refused), the SWA ring wrapping and rebasing, speculative rounds
rolled back on the hybrid plan, then a grow; every row written through numpy arrays over the
mapped arena and every live byte verified."""

import grpc
import numpy as np
import pytest

import memra_kv
from memra_kv import KvError
from kvtest import (E2E_CAPACITY, FLAT_LAYER, INDEX_POOL, LATENT_LAYER, RECURRENT_LAYER,
                    SLIDING_LAYER, as_bytes, hybrid_test_plan, pattern_rows)

SPEC_ROWS = 12
SPEC_ACCEPTED = 5


def write_append(session, append, staged, rows):
    """Rows [staged, staged + rows) of every K/V layer (after its ring rebase copy) and of the
    latent layer. Returns how many rebases it performed."""
    rebases = 0
    for layer in append.layers:
        for kind in (memra_kv.KEYS, memra_kv.VALUES):
            plane = session.plane(layer.layer, kind)
            if layer.ring and layer.rebase:
                plane[:layer.keep_rows] = plane[layer.src_row:layer.src_row + layer.keep_rows].copy()
            plane[layer.write_row:layer.write_row + rows] = pattern_rows(
                layer.layer, kind, staged, rows, plane.shape[1])
        rebases += layer.ring and layer.rebase
    latent = as_bytes(session.plane(LATENT_LAYER, memra_kv.LATENT_ROWS))
    latent[staged:staged + rows] = pattern_rows(LATENT_LAYER, memra_kv.LATENT_ROWS, staged, rows,
                                                latent.shape[1])
    return rebases


def fill_recurrent(session, fill):
    for kind in (memra_kv.CONV_STATE, memra_kv.SSM_STATE):
        session.plane_bytes(RECURRENT_LAYER, kind)[:] = fill


def check_recurrent(session, fill):
    for kind in (memra_kv.CONV_STATE, memra_kv.SSM_STATE):
        held = session.plane_bytes(RECURRENT_LAYER, kind)
        assert (held == fill).all(), "layer %d kind %d: byte %d holds %d, expected %d" % (
            RECURRENT_LAYER, kind, int(np.argmax(held != fill)), held[held != fill][0], fill)


def check_rows(plane, layer, kind, physical_first, absolute_first, rows):
    held = plane[physical_first:physical_first + rows]
    expected = pattern_rows(layer, kind, absolute_first, rows, plane.shape[1])
    assert held.shape == expected.shape
    if not np.array_equal(held, expected):
        bad = np.argwhere(held != expected)[0]
        pytest.fail("layer %d kind %d absolute row %d (physical %d) byte %d holds %d, expected %d"
                    % (layer, kind, absolute_first + bad[0], physical_first + bad[0], bad[1],
                       held[tuple(bad)], expected[tuple(bad)]))


def verify_session(session, recurrent_fill):
    """tests/e2e/engine_script.cc VerifySession: lengths, mirrors and bytes of a quiescent
    session against the pattern."""
    state = session.state()
    committed = state.committed_len
    assert state.staged_len == committed and state.active_generation == 0
    bases = {}
    for layer in state.layers:
        assert session.plane(layer.layer, memra_kv.LEN_MIRROR)[0] == committed == layer.length
        if layer.ring:
            assert session.plane(layer.layer, memra_kv.BASE_MIRROR)[0] == layer.ring_base
            bases[layer.layer] = layer.ring_base
    for layer in session.layout.layers:
        if layer.kind in (memra_kv.model_plan_pb2.STATE_KIND_KV,
                          memra_kv.model_plan_pb2.STATE_KIND_SLIDING_KV):
            base = bases.get(layer.layer, 0)
            for kind in (memra_kv.KEYS, memra_kv.VALUES):
                check_rows(session.plane(layer.layer, kind), layer.layer, kind, 0, base,
                           committed - base)
        elif layer.kind == memra_kv.model_plan_pb2.STATE_KIND_LATENT:
            check_rows(as_bytes(session.plane(layer.layer, memra_kv.LATENT_ROWS)), layer.layer,
                       memra_kv.LATENT_ROWS, 0, 0, committed)
        elif layer.kind == memra_kv.model_plan_pb2.STATE_KIND_RECURRENT:
            check_recurrent(session, recurrent_fill)
    return state


def spec_round(session, fill):
    """Snapshot, a draft that overwrites the recurrent state and commits, a rollback keeping
    SPEC_ACCEPTED rows: the daemon puts the snapshot's recurrent bytes back."""
    base = session.spec_snapshot().committed_len
    tx = session.begin()
    append = session.prepare_append(tx.generation, SPEC_ROWS)
    rebases = write_append(session, append, tx.base_len, SPEC_ROWS)
    fill_recurrent(session, (~fill) & 0xFF)
    session.publish_append(tx.generation)
    session.commit(tx.generation, SPEC_ROWS)
    rolled = session.spec_rollback(SPEC_ACCEPTED)
    assert rolled.committed_len == base + SPEC_ACCEPTED
    check_recurrent(session, fill)
    return rolled.committed_len, rebases


def run_script(session, spec_rounds):
    """tests/e2e/engine_script.cc RunScript."""
    committed = rebases = rewinds = rollbacks = fill = 0
    step = 0
    while True:
        # A chunk longer than the indexer's 16-row tail ring starts at a pool boundary: from
        # inside a pool it would lap the tail an abort needs (docs/rules.md, "Indexer
        # residency"), so the engine fills the pool in a short transaction first.
        if committed % INDEX_POOL:
            fill_rows = INDEX_POOL - committed % INDEX_POOL
            if committed + fill_rows > E2E_CAPACITY:
                break
            tx = session.begin()
            append = session.prepare_append(tx.generation, fill_rows)
            rebases += write_append(session, append, tx.base_len, fill_rows)
            session.publish_append(tx.generation)
            committed = session.commit(tx.generation, fill_rows)
        rows = 240 + (step % 4) * 10
        if committed + rows > E2E_CAPACITY:
            break
        tx = session.begin()
        assert tx.base_len == committed
        append = session.prepare_append(tx.generation, rows)
        assert append.target == committed + rows
        assert [layer.layer for layer in append.layers] == [FLAT_LAYER, SLIDING_LAYER]
        rebases += write_append(session, append, tx.base_len, rows)
        assert session.publish_append(tx.generation) == committed + rows
        accepted = rows - 7 if step % 3 == 0 else rows  # the verifier rejects 7 draft rows
        committed = session.commit(tx.generation, accepted)
        assert committed == tx.base_len + accepted
        fill = (step * 13 + 1) & 0xFF
        fill_recurrent(session, fill)
        if step % 5 == 4:
            # The indexer's 16-row tail ring holds only the last rows of this append: 20 rows
            # back is reachable only at a pool boundary (docs/rules.md, "Indexer residency").
            deep = committed - 20
            target = deep // INDEX_POOL * INDEX_POOL
            if deep != target:
                assert not session.can_rewind(deep)
                with pytest.raises(KvError) as refused:
                    session.rewind(deep)
                assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert "would make indexer rows [" in refused.value.message
                assert session.state().committed_len == committed  # a refusal changes nothing
            assert session.can_rewind(target)
            committed = session.rewind(target).committed_len
            assert committed == target
            rewinds += 1
        if spec_rounds and step % 4 == 2 and committed + SPEC_ROWS <= E2E_CAPACITY:
            committed, spec_rebases = spec_round(session, fill)
            rebases += spec_rebases
            rollbacks += 1
        step += 1
    return committed, rebases, rewinds, rollbacks, fill


def test_python_engine_runs_the_e2e_script_and_every_byte_verifies(kvd):
    daemon = kvd("--budget_bytes=256MiB")
    with daemon.client("py-script") as client:
        plan = client.register_plan(hybrid_test_plan())
        assert len(plan) == 32
        with client.create_session(plan, E2E_CAPACITY, spec_snapshot=True) as session:
            sliding = session.layer_layout(SLIDING_LAYER)
            assert sliding.ring and sliding.physical_rows < E2E_CAPACITY  # the ring must wrap
            assert session.plane(FLAT_LAYER, memra_kv.KEYS).shape == (
                E2E_CAPACITY, session.layer_layout(FLAT_LAYER).k_token_bytes)
            latent = session.plane(LATENT_LAYER, memra_kv.LATENT_ROWS)
            assert latent.dtype == np.float32 and latent.shape == (E2E_CAPACITY, 8)
            committed, rebases, rewinds, rollbacks, fill = run_script(session, spec_rounds=True)
            assert committed > E2E_CAPACITY - 300
            assert rebases > 0, "the SWA ring never wrapped"
            assert rewinds >= 4 and rollbacks >= 4
            state = verify_session(session, fill)
            assert state.committed_len == committed

            # Grow: the committed rows move to a new arena; the old one is unmapped here.
            opens = client.mapper.opens
            old_handle = session.layout.arenas[0].handle
            grown = session.grow(E2E_CAPACITY + 2000)
            assert grown.capacity == E2E_CAPACITY + 2000 and not grown.grow_pending
            assert session.layout.layout_version == 2
            assert session.layout.arenas[0].handle != old_handle
            assert client.mapper.opens == opens + 1 and client.mapper.mapped_count == 1
            assert session.plane(FLAT_LAYER, memra_kv.KEYS).shape[0] == E2E_CAPACITY + 2000
            verify_session(session, fill)
            # More rows after the grow land in the new arena and verify too.
            tx = session.begin()
            append = session.prepare_append(tx.generation, 100)
            write_append(session, append, tx.base_len, 100)
            session.publish_append(tx.generation)
            assert session.commit(tx.generation, 100) == committed + 100
            verify_session(session, fill)


def test_step_batch_drives_many_sessions_in_one_rpc(kvd):
    daemon = kvd("--budget_bytes=256MiB")
    with daemon.client("py-batch") as client:
        plan = client.register_plan(hybrid_test_plan())
        sessions = [client.create_session(plan, 1024) for _ in range(4)]
        batch = memra_kv.StepBatch()
        fill = 7
        for step in range(6):
            rows = 1 + step % 3
            batch.clear()
            for session in sessions:
                batch.begin(session)
            begun = client.step(batch)
            assert all(outcome.ok for outcome in begun)
            batch.clear()
            for session, outcome in zip(sessions, begun):
                batch.prepare(session, outcome.begun.generation, rows)
            prepared = client.step(batch)
            batch.clear()
            for session, begin, outcome in zip(sessions, begun, prepared):
                assert outcome.ok and outcome.prepared.target == begin.begun.base_len + rows
                write_append(session, outcome.prepared, begin.begun.base_len, rows)
                fill_recurrent(session, fill)
                batch.publish(session, begin.begun.generation)
            assert [o.staged_len for o in client.step(batch)] == [
                b.begun.base_len + rows for b in begun]
            batch.clear()
            for i, (session, begin) in enumerate(zip(sessions, begun)):
                if i == 3:
                    batch.abort(session, begin.begun.generation)
                else:
                    batch.commit(session, begin.begun.generation, rows,
                                 token_ids=list(range(rows)))
            committed = client.step(batch)
            assert [o.committed_len for o in committed[:3]] == [
                b.begun.base_len + rows for b in begun[:3]]
            assert committed[3].committed_len == begun[3].begun.base_len  # aborted
            assert len(batch) == 4
        for session in sessions[:3]:
            assert verify_session(session, fill).committed_len == sum(
                1 + s % 3 for s in range(6))
        assert sessions[3].state().committed_len == 0

        # Entries fail independently, each with its code and message.
        batch.clear()
        batch.begin(sessions[0])
        batch.commit(sessions[1], 999, 1)
        outcomes = client.step(batch)
        assert outcomes[0].ok and outcomes[0].begun.generation > 0
        assert not outcomes[1].ok
        assert outcomes[1].error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "999" in outcomes[1].error.message
        for session in sessions:
            session.release()
