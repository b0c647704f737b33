"""Every call of the Python client against the real memra-kvd, and its refusals: each asserts the
gRPC code and the numbers in the message (and, for admission, the structured numbers)."""

import os

import grpc
import numpy as np
import pytest

import memra_kv
from memra_kv import KvError
from kvtest import FLAT_LAYER, dense_plan, hybrid_test_plan, repo_root

MiB = 1 << 20
LLAMA_CONFIG = os.path.join(repo_root(), "tests", "data", "hf_configs", "llama-3.1-8b.json")
# README.md's memra-kvctl example: the same config through the C++ tool.
# Imported as the engine keeps it, in its torch_dtype (bf16: docs/rules.md#formats): the
# documented fingerprint encoding with K/V formats 2 / 3, and 32 layers x (2 planes of
# 32768 x 2048 + 8, 256-aligned, + a 4-byte mirror), rounded to 4 KiB.
LLAMA_FINGERPRINT = "46260ee1cb42062730b9ebd75d00f9811fdce7f1b48bcc99ed513072449314ad"
LLAMA_32K_BYTES = 4294991872
# The same model in the reference's q8_0 / q5_1 (import_model(kv_dtype="reference")).
LLAMA_REFERENCE_FINGERPRINT = "e36a62053ac54b52cb17a4f866f528ca3e76c3efafeb014fc6cc219e5b7c5417"
LLAMA_REFERENCE_32K_BYTES = 1946181632


@pytest.fixture
def small(kvd):
    """A daemon with a 64 MiB budget and an attached client."""
    daemon = kvd("--budget_bytes=64MiB")
    client = daemon.client("py-calls")
    client.daemon = daemon  # the tests' operator calls: daemon.admin()
    yield client
    client.close()


def test_import_model_from_a_hf_config_and_its_cost(small):
    imported = small.import_model(LLAMA_CONFIG)
    assert imported.architecture == "LlamaForCausalLM" and imported.registered
    assert imported.plan_fingerprint.hex() == LLAMA_FINGERPRINT
    assert len(imported.plan.layers) == 32
    cost = small.cost(32768, fingerprint=imported.plan_fingerprint)
    assert cost.arena_bytes == LLAMA_32K_BYTES and cost.layers == 32
    assert small.cost(32768, hf_config=LLAMA_CONFIG).arena_bytes == LLAMA_32K_BYTES
    assert small.cost(32768, plan=imported.plan).arena_bytes == LLAMA_32K_BYTES
    # Registering the imported plan again answers the same fingerprint.
    assert small.register_plan(imported.plan) == imported.plan_fingerprint
    reference = small.import_model(LLAMA_CONFIG, kv_dtype="reference")
    assert reference.plan_fingerprint.hex() == LLAMA_REFERENCE_FINGERPRINT
    assert reference.kv_formats == "K/V q8_0/q5_1"
    assert small.cost(32768, fingerprint=reference.plan_fingerprint).arena_bytes == \
        LLAMA_REFERENCE_32K_BYTES


def test_admission_refusal_raises_with_its_numbers(small):
    plan = small.import_model(LLAMA_CONFIG).plan_fingerprint
    status = small.status()
    assert status.backend == "host" and status.admission.budget_bytes == 64 * MiB
    free = status.admission.free_bytes
    for call in (lambda: small.create_session(plan, 32768), lambda: small.reserve(plan, 32768)):
        with pytest.raises(KvError) as refused:
            call()
        error = refused.value
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.is_admission_refusal
        assert (error.needed, error.free, error.evictable, error.budget, error.bytes_to_evict) == (
            LLAMA_32K_BYTES, free, 0, 64 * MiB, 0)
        assert "needs %d bytes, %d free (0 evictable) of %d budget" % (
            LLAMA_32K_BYTES, free, 64 * MiB) in error.message
    with small.daemon.admin() as admin:
        assert admin.sessions() == []

    # Grow past the budget: the old arena stays allocated until the grow is acknowledged, so
    # the extra bytes the refusal names are the whole new arena.
    session = small.create_session(plan, 256)
    after = small.cost(32768, fingerprint=plan).arena_bytes
    free = small.status().admission.free_bytes
    with pytest.raises(KvError) as refused:
        session.grow(32768)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (refused.value.needed, refused.value.free, refused.value.budget) == (
        after, free, 64 * MiB)
    assert session.state().capacity == 256  # a refusal changes nothing
    # Not an admission refusal: no numbers.
    with pytest.raises(KvError) as stale:
        session.commit(77, 1)
    assert stale.value.needed is None and not stale.value.is_admission_refusal


def test_reservations_admit_ahead_and_cancel(small):
    plan = small.register_plan(dense_plan(2, 32, 1))
    cost = small.cost(1024, fingerprint=plan).arena_bytes
    held = small.reserve(plan, 1024)
    assert held.bytes == cost and held.ttl_ms > 0
    assert small.status().admission.reserved_bytes == cost
    session = small.create_session(plan, 1024, reservation=held)
    admission = small.status().admission
    assert (admission.reserved_bytes, admission.allocated_bytes) == (0, cost)
    other = small.reserve(plan, 1024)
    assert small.cancel_reservation(other.id) == cost
    with pytest.raises(KvError) as gone:
        small.cancel_reservation(other.id)
    assert gone.value.code == grpc.StatusCode.NOT_FOUND
    assert str(other.id) in gone.value.message
    assert session.release() == cost
    # The arena waits in this engine's pool, still charged and evictable.
    admission = small.status().admission
    assert (admission.allocated_bytes, admission.evictable_bytes) == (cost, cost)


def test_hydrate_reset_and_taint(small):
    plan = small.register_plan(dense_plan(2, 32, 1))
    session = small.create_session(plan, 512)
    keys = session.plane(FLAT_LAYER, memra_kv.KEYS)
    keys[:100] = np.arange(100, dtype=np.uint8)[:, None]
    state = session.hydrate(100)
    assert state.committed_len == 100
    assert session.plane(FLAT_LAYER, memra_kv.LEN_MIRROR)[0] == 100
    assert (keys[:100, 0] == np.arange(100)).all()
    with pytest.raises(KvError) as refused:
        session.hydrate(10)  # only a fresh session hydrates
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    opens = small.mapper.opens
    assert session.reset().committed_len == 0
    assert small.mapper.opens == opens, "reset re-mapped the arena"
    assert session.plane(FLAT_LAYER, memra_kv.LEN_MIRROR)[0] == 0
    assert session.taint("kernel failed").tainted
    with pytest.raises(KvError) as tainted:
        session.begin()
    assert tainted.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "taint" in tainted.value.message
    session.release()
    with pytest.raises(KvError) as twice:
        session.release()
    assert twice.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert twice.value.message == "session %d was released" % session.id


def test_session_refusals_name_the_session_and_generation(small):
    plan = small.register_plan(hybrid_test_plan())
    session = small.create_session(plan, 256)
    tx = session.begin()
    with pytest.raises(KvError) as stale:
        session.prepare_append(tx.generation + 5, 4)
    assert stale.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(tx.generation + 5) in stale.value.message
    assert session.abort(tx.generation) == 0
    with pytest.raises(KvError) as missing:
        session.plane(FLAT_LAYER, memra_kv.CONV_STATE)
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert missing.value.message == "layer 0 has no PLANE_KIND_CONV_STATE plane"
    forged = memra_kv.Session(small, session.id, b"x" * 16)
    with pytest.raises(KvError) as denied:
        forged.state()
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "wrong session token for session %d" % session.id in denied.value.message
    with pytest.raises(KvError) as unknown:
        memra_kv.Session(small, 987654, b"x" * 16).state()
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND
    assert "session 987654 does not exist" in unknown.value.message


def test_advance_is_one_entry_per_session_per_step_and_all_or_nothing(small):
    plan = small.register_plan(hybrid_test_plan())
    sessions = [small.create_session(plan, 256) for _ in range(2)]
    outcomes = small.advance_many([memra_kv.AdvanceStep(s, next_rows=4) for s in sessions])
    assert [o.ok for o in outcomes] == [True, True]
    assert outcomes[0].transaction.generation == 1 and outcomes[0].prepared.target == 4
    committed = 0
    for step in range(1, 6):
        accepted = 4 if step % 2 else 2
        outcomes = small.advance_many([memra_kv.AdvanceStep(s, accepted, 4, [step] * accepted)
                                       for s in sessions])
        committed += accepted
        for session, outcome in zip(sessions, outcomes):
            assert outcome.ok and outcome.published
            assert outcome.committed_len == committed
            assert outcome.transaction.base_len == committed
            assert outcome.prepared.target == committed + 4
            assert session.open_generation == outcome.transaction.generation
            assert session.plane(FLAT_LAYER, memra_kv.LEN_MIRROR)[0] == committed
    session = sessions[0]
    generation = session.open_generation
    before = session.state()
    # The commit alone would be accepted; the next prepare is not, so nothing is applied.
    with pytest.raises(memra_kv.InvalidArgument) as refused:
        session.advance(4, 256)
    assert refused.value.code == memra_kv.ErrorCode.INVALID_ARGUMENT
    assert "KV append exceeds capacity: %d > 256" % (committed + 4 + 256) in refused.value.message
    with pytest.raises(memra_kv.InvalidArgument) as tokens:
        session.advance(4, 1, token_ids=[1, 2])
    assert "commit carries 2 token ids for 4 accepted rows" in tokens.value.message
    assert session.state() == before and session.open_generation == generation
    # In a batch a refused entry is its own: the other session's step is applied.
    mixed = small.advance_many([memra_kv.AdvanceStep(session, 4, 256),
                                memra_kv.AdvanceStep(sessions[1], 4, 4)])
    assert isinstance(mixed[0].error, memra_kv.InvalidArgument) and mixed[1].ok
    assert "KV append exceeds capacity" in mixed[0].error.message
    assert session.state() == before and session.open_generation == generation
    assert sessions[1].state().committed_len == committed + 4
    done = session.advance(4)
    assert done.committed_len == committed + 4 and done.transaction is None
    assert done.prepared is None and session.open_generation == 0
    assert session.state().active_generation == 0
    with pytest.raises(memra_kv.InvalidArgument) as twice:
        small.advance_many([memra_kv.AdvanceStep(sessions[1], 4, 1)] * 2)
    assert "advance_many: session %d is named twice" % sessions[1].id in twice.value.message


def test_step_by_slot_is_for_the_owning_engine_only(small):
    plan = small.register_plan(hybrid_test_plan())
    sessions = [small.create_session(plan, 256) for _ in range(2)]
    assert sorted(s.slot for s in sessions) == [0, 1]
    batch = memra_kv.StepBatch(by_slot=True)
    for session in sessions:
        batch.advance(session, 0, 0, 2)
    assert all(o.ok for o in small.step(batch))
    other = small.daemon.client("py-other")
    try:
        before = sessions[1].state()
        outcome = other.step(batch)[1]
        assert outcome.error.code == grpc.StatusCode.NOT_FOUND
        assert "slot %d holds no session of engine %d" % (
            sessions[1].slot, other.engine_id) in outcome.error.message
        assert sessions[1].state() == before
    finally:
        other.close()


def test_a_steady_request_stream_reuses_the_pooled_arena_and_its_mapping(small):
    plan = small.register_plan(hybrid_test_plan())
    opens = small.mapper.opens
    handles = set()
    for request in range(6):
        session = small.create_session(plan, 256)
        handles.add(session.layout.arenas[0].handle)
        assert session.state().committed_len == 0
        assert session.plane(FLAT_LAYER, memra_kv.LEN_MIRROR)[0] == 0
        session.advance(next_rows=3)
        session.advance(3)
        session.release()
    assert len(handles) == 1, "every request got the pooled arena back"
    assert small.mapper.opens == opens + 1 and small.mapper.mapped_count == 1
    with small.daemon.admin() as admin:
        engine = [e for e in admin.engines() if e.engine_id == small.engine_id][0]
    assert (engine.new_arenas, engine.pool_hits) == (1, 5)


def test_admin_fit_max_context_and_drain(small):
    # The reference's q8_0 / q5_1: sessions small enough for the 64 MiB budget's arithmetic.
    plan = small.import_model(LLAMA_CONFIG, kv_dtype="reference").plan_fingerprint
    fit = small.fit(4096, fingerprint=plan)
    per_session = small.cost(4096, fingerprint=plan).arena_bytes
    assert fit.session_bytes == per_session and fit.budget_bytes == 64 * MiB
    assert fit.sessions_when_empty == 64 * MiB // per_session
    most = small.max_context(fingerprint=plan)
    assert 0 < most.max_context_now and most.session_bytes_now <= most.free_bytes
    assert small.cost(most.max_context_now + 256, fingerprint=plan).arena_bytes > most.free_bytes
    session = small.create_session(plan, 256)
    # The engine socket answers the queries above but not the operators' calls.
    with pytest.raises(KvError) as engine_socket:
        small.drain()
    assert engine_socket.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "KvAdmin.Drain" in engine_socket.value.message
    assert small.daemon.admin_socket in engine_socket.value.message
    assert len(small.status().engine_status) == 0  # the totals, not the other engines
    admin = small.daemon.admin()
    listed = admin.sessions()
    assert [(s.session_id, s.capacity) for s in listed] == [(session.id, 256)]
    assert admin.engines()[0].sessions == 1
    assert admin.drain() == 1
    with pytest.raises(KvError) as draining:
        small.create_session(plan, 256)
    assert draining.value.code == grpc.StatusCode.UNAVAILABLE
    admin.undrain()
    admin.close()
    small.create_session(plan, 256).release()
    session.release()


def test_host_mapper_maps_once_and_refuses_bad_handles():
    memfd = os.memfd_create("mapper-test", os.MFD_CLOEXEC)
    os.ftruncate(memfd, 8192)
    fetches = []

    def fetch(size=8192):
        fetches.append(size)
        return os.dup(memfd), size

    mapper = memra_kv.HostArenaMapper()
    first = mapper.map(b"arena", 8192, fetch)
    assert mapper.map(b"arena", 8192, fetch) is first and mapper.opens == 1
    assert len(fetches) == 1  # mapped once: not fetched again
    with pytest.raises(KvError) as resized:
        mapper.map(b"arena", 4096, fetch)
    assert resized.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert resized.value.message == "Map arena: already mapped with 8192 bytes, asked for 4096"
    with pytest.raises(KvError) as short:
        memra_kv.HostArenaMapper().map(b"arena", 16384, lambda: fetch(16384))
    assert short.value.message == ("Map host arena arena: the descriptor holds 8192 bytes (the "
                                   "daemon said 16384), asked for 16384")
    with pytest.raises(KvError) as no_source:
        memra_kv.HostArenaMapper().map(b"arena", 8192)
    assert no_source.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "handoff socket" in no_source.value.message
    for bad in (b"", b"h" * 257):
        with pytest.raises(KvError) as refused:
            mapper.map(bad, 8192, fetch)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    mapper.unmap(b"arena")
    assert mapper.mapped_count == 0
    os.close(memfd)


def test_block_store_buffer_offers_need_a_memfd_sealed_against_shrinking(kvd):
    """handoff.py's offer_buffer (docs/handoff.md kinds 16/17): the daemon answers a buffer id for
    a memfd sealed with F_SEAL_SHRINK and refuses one that is not, naming the seals."""
    import fcntl
    daemon = kvd("--budget_bytes=64MiB", "--prefix_cache_budget_bytes=16MiB")
    client = daemon.client("py-offers")
    try:
        handoff = client._lease.handoff
        fd = os.memfd_create("py-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 1 * MiB)
            with pytest.raises(KvError) as unsealed:
                handoff.offer_buffer(fd, 1 * MiB)
            assert unsealed.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "seals are 0x0" in unsealed.value.message
            assert "F_SEAL_SHRINK" in unsealed.value.message
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            with pytest.raises(KvError) as too_big:
                handoff.offer_buffer(fd, 2 * MiB)
            assert too_big.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "holds %d bytes; the offer says %d" % (MiB, 2 * MiB) in too_big.value.message
            first = handoff.offer_buffer(fd, 1 * MiB)
            second = handoff.offer_buffer(fd, 4096)
            assert 0 < first < second
        finally:
            os.close(fd)
    finally:
        client.close()
