"""The Python engine's step channel (memra_kv/step_channel.py, docs/step-channel.md) against the
real memra-kvd: the same outcomes as the Step RPC for one scripted random workload (refusals
with their codes and numbers included), big batches window by window, bad numbers refused
before anything is sent, and a channel the daemon closed failing its step and handing the
engine back to gRPC."""

import os
import random
import signal
import threading

import grpc
import pytest

import memra_kv
from memra_kv import KvError, step_channel
from kvtest import FLAT_LAYER, hybrid_test_plan, poll_until

CAPACITY = 256  # as tests/e2e/step_channel_e2e_test.cc
DAEMON_FLAGS = ("--budget_bytes=256MiB", "--lease_timeout_ms=2000")


def connect(daemon, name, force_grpc):
    client = memra_kv.Client.connect(daemon.socket, timeout=10, force_grpc_step=force_grpc)
    client.attach(name)
    return client


def describe(outcome):
    """Every field of an outcome, as text (tests/e2e/step_channel_e2e_test.cc Describe)."""
    error = outcome.error
    text = "%s '%s'" % (error.code.name if error else "OK", error.message if error else "")
    begun = outcome.begun
    text += " begun %s staged %d committed %d published %s" % (
        "%d/%d" % (begun.generation, begun.base_len) if begun else "-", outcome.staged_len,
        outcome.committed_len, outcome.published)
    prepared = outcome.prepared
    if prepared is not None:
        text += " prepared %d/%d layers %s" % (prepared.generation, prepared.target, " ".join(
            "%d@%d%s%s" % (layer.layer, layer.write_row, "r" if layer.ring else "",
                           "b%d/%d/%d" % (layer.src_row, layer.keep_rows, layer.new_base)
                           if layer.rebase else "")
            for layer in prepared.layers))
    return text


def describe_state(state):
    return "%d %d %d %d %d %s %s" % (
        state.committed_len, state.staged_len, state.position, state.active_generation,
        state.next_generation, state.tainted, " ".join(
            "[%d %d %d]" % (layer.layer, layer.length, layer.ring_base) for layer in state.layers))


def run_workload(kvd, force_grpc):
    """The C++ equivalence run's workload in Python, against a fresh daemon: engine "subject"
    (over its channel unless force_grpc) steps four sessions at random, sometimes naming a
    neighbour engine's slot or a released one; every outcome and every session's state after
    each step, as text."""
    daemon = kvd(*DAEMON_FLAGS)
    subject = connect(daemon, "subject", force_grpc)
    neighbour = connect(daemon, "neighbour", True)
    try:
        assert subject.step_channel_active == (not force_grpc), subject.step_channel_status
        plan = subject.register_plan(hybrid_test_plan())
        sessions = [subject.create_session(plan, CAPACITY) for _ in range(4)]
        foreign = neighbour.create_session(neighbour.register_plan(hybrid_test_plan()), CAPACITY)
        gone = subject.create_session(plan, CAPACITY)
        gone.release()  # its slot stays empty: no session is created after it
        rng = random.Random(0x5CA1AB1E)
        generation = [0] * len(sessions)
        log = []
        batch = memra_kv.StepBatch(by_slot=True)
        for step in range(250):
            batch.clear()
            targets = []
            for _ in range(rng.randrange(1, 5)):
                which = rng.randrange(len(sessions))
                session = sessions[which]
                # Mostly the live transaction's generation; sometimes a stale or future one.
                gen = rng.randrange(6) if rng.randrange(5) == 0 else generation[which]
                rows = rng.randrange(4)
                tokens = [rng.randrange(50000) for _ in range(
                    rng.randrange(3) if rng.randrange(4) == 0 else rows)]
                targets.append(which)
                kind = rng.randrange(10)
                if kind == 0:
                    batch.begin(session)
                elif kind == 1:
                    batch.prepare(session, gen, 1 + rng.randrange(3))
                elif kind == 2:
                    batch.publish(session, gen)
                elif kind == 3:
                    batch.commit(session, gen, rng.randrange(5), tokens)  # often beyond staged
                elif kind == 4:
                    batch.abort(session, gen)
                elif kind == 5:
                    batch.advance(foreign, gen, rows, 1)  # another engine's slot
                    targets[-1] = None
                elif kind == 6:
                    batch.advance(gone, gen, rows, 1)  # a slot nobody holds
                    targets[-1] = None
                elif kind == 7:
                    batch.advance(session, gen, rows, CAPACITY * 2, tokens)  # beyond capacity
                else:
                    batch.advance(session, gen, rows, 1 + rng.randrange(2), tokens)
            outcomes = subject.step(batch)
            assert len(outcomes) == len(targets)
            for entry, (outcome, which) in enumerate(zip(outcomes, targets)):
                log.append("step %d entry %d: %s" % (step, entry, describe(outcome)))
                if outcome.ok and which is not None and outcome.begun is not None:
                    generation[which] = outcome.begun.generation
            for index, session in enumerate(sessions):
                state = session.state()
                log.append("step %d session %d: %s" % (step, index, describe_state(state)))
                # A session that filled up starts over (reset over gRPC, the same on both runs).
                if state.committed_len + 8 > CAPACITY:
                    session.reset()
                    generation[index] = 0
        # The channel stayed up the whole run (nothing fell back to gRPC on the way).
        assert subject.step_channel_active == (not force_grpc), subject.step_channel_status
        return log
    finally:
        subject.close()
        neighbour.close()


def test_the_channel_gives_the_step_rpcs_outcomes_word_for_word(kvd):
    over_channel = run_workload(kvd, force_grpc=False)
    over_grpc = run_workload(kvd, force_grpc=True)
    assert len(over_channel) == len(over_grpc)
    for channel_line, grpc_line in zip(over_channel, over_grpc):
        assert channel_line == grpc_line
    text = "\n".join(over_channel)
    # The workload reaches the refusals it means to, with their numbers (the same text on
    # both paths, checked line by line above).
    # Slots are dense over the daemon: the subject's four sessions hold 0-3, the neighbour's 4,
    # the released one's was 5.
    assert "NOT_FOUND 'slot 4 holds no session of engine 1'" in text
    assert "NOT_FOUND 'slot 5 holds no session of engine 1'" in text
    assert "INVALID_ARGUMENT 'KV append exceeds capacity: 515 > 256'" in text
    assert "FAILED_PRECONDITION 'stale KV transaction generation 8 (active: none)'" in text
    assert ("INVALID_ARGUMENT 'session 3: commit carries 2 token ids for 4 accepted rows (send "
            "all or none)'") in text
    assert "layers 0@" in text  # prepared plans came back, layer by layer


def test_a_batch_bigger_than_the_ring_goes_window_by_window(kvd):
    """640 entries through a 512-slot ring; the same results as over gRPC."""
    results = {}
    for force_grpc in (False, True):
        daemon = kvd(*DAEMON_FLAGS)
        with connect(daemon, "big", force_grpc) as client:
            assert client.step_channel_active == (not force_grpc)
            plan = client.register_plan(hybrid_test_plan())
            sessions = [client.create_session(plan, CAPACITY) for _ in range(160)]
            batch = memra_kv.StepBatch(by_slot=True)
            texts = []
            for step in range(3):
                batch.clear()
                for session in sessions:
                    generation = step + 1
                    batch.begin(session)
                    batch.prepare(session, generation, 2)
                    batch.publish(session, generation)
                    batch.commit(session, generation, 2, [step, step + 1])
                outcomes = client.step(batch)
                assert len(outcomes) == 640
                assert all(outcome.ok for outcome in outcomes), [
                    describe(o) for o in outcomes if not o.ok][:3]
                assert outcomes[-1].committed_len == 2 * (step + 1)
                texts.append([describe(outcome) for outcome in outcomes])
            assert client.step_channel_active == (not force_grpc)
            results[force_grpc] = texts
    assert results[False] == results[True]


def test_numbers_a_record_cannot_hold_are_refused_before_anything_is_sent(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    with connect(daemon, "bad", False) as client:
        plan = client.register_plan(hybrid_test_plan())
        session = client.create_session(plan, CAPACITY)
        before = session.state()
        batch = memra_kv.StepBatch(by_slot=True)
        batch.begin(session)
        batch.prepare(session, 1, 1 << 64)
        with pytest.raises(ValueError) as refused:
            client.step(batch)
        assert "step entry 1" in str(refused.value) and str(1 << 64) in str(refused.value)
        batch.clear()
        batch.advance(session, 0, 0, 1, token_ids=[1 << 31])
        with pytest.raises(ValueError) as token:
            client.step(batch)
        assert "step entry 0: a token id out of int32 range" in str(token.value)
        assert session.state() == before  # nothing ran
        # 600 entries (more than the ring's 512 slots), the last one bad: none of them ran.
        batch.clear()
        for _ in range(599):
            batch.begin(session)
        batch.abort(session, -1)
        with pytest.raises(ValueError) as late:
            client.step(batch)
        assert "step entry 599" in str(late.value)
        assert session.state() == before
        assert client.step_channel_active  # a refused batch leaves the channel up


def test_more_token_ids_than_a_record_carries_go_over_grpc(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    with connect(daemon, "tokens", False) as client:
        plan = client.register_plan(hybrid_test_plan())
        session = client.create_session(plan, 1024)
        batch = memra_kv.StepBatch(by_slot=True)
        batch.advance(session, 0, 0, 300)
        generation = client.step(batch)[0].begun.generation
        batch.clear()
        batch.advance(session, generation, 300, 0, token_ids=list(range(300)))
        assert not step_channel.StepChannel.carries(batch._entries)
        outcome = client.step(batch)[0]
        assert outcome.ok and outcome.committed_len == 300
        assert client.step_channel_active  # carried by gRPC, the channel untouched


def test_a_channel_the_daemon_closed_fails_its_step_and_later_steps_go_over_grpc(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    with connect(daemon, "replaced", False) as client:
        plan = client.register_plan(hybrid_test_plan())
        session = client.create_session(plan, CAPACITY)
        batch = memra_kv.StepBatch(by_slot=True)
        batch.advance(session, 0, 0, 1)
        first = client.step(batch)[0]
        assert first.ok and client.step_channel_active
        # The engine opens a second channel over its handoff connection: the daemon closes
        # the first (kReplaced), which the client's next step finds.
        region_fd, nbytes, wake_fd = client._lease.handoff.open_step_channel()
        second = step_channel.StepChannel(region_fd, nbytes, wake_fd)
        try:
            batch.clear()
            batch.advance(session, first.begun.generation, 1, 1)
            with pytest.raises(KvError) as closed:
                client.step(batch)
            assert closed.value.code == grpc.StatusCode.UNAVAILABLE
            assert "the daemon closed this engine's step channel (the engine opened another " \
                   "channel)" in closed.value.message
            assert not client.step_channel_active
            assert client.step_channel_status.code == grpc.StatusCode.UNAVAILABLE
            # The record never reached the daemon (it had closed the ring): the same step
            # over gRPC now succeeds.
            outcome = client.step(batch)[0]
            assert outcome.ok and outcome.committed_len == 1
            assert session.plane(FLAT_LAYER, memra_kv.LEN_MIRROR)[0] == 1
        finally:
            second.close()


def stop_process(pid):
    """SIGSTOP, then wait until every thread of `pid` is stopped (the signal is asynchronous:
    a thread running on another CPU goes on for a moment)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped():
        tasks = os.listdir("/proc/%d/task" % pid)
        for task in tasks:
            with open("/proc/%d/task/%s/stat" % (pid, task)) as f:
                # The state follows the command's closing parenthesis.
                if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                    return False
        return True

    assert poll_until(stopped)


def test_a_step_the_daemon_does_not_answer_fails_at_its_deadline_and_the_record_runs_later(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    with connect(daemon, "stalled", False) as client:
        plan = client.register_plan(hybrid_test_plan())
        session = client.create_session(plan, CAPACITY)
        batch = memra_kv.StepBatch(by_slot=True)
        batch.advance(session, 0, 0, 1)
        first = client.step(batch)[0]
        assert first.ok
        stop_process(daemon.process.pid)
        try:
            batch.clear()
            batch.advance(session, first.begun.generation, 1, 1)
            with pytest.raises(KvError) as late:
                client.step(batch, timeout=0.5)
            assert late.value.code == grpc.StatusCode.UNAVAILABLE
            assert ("the daemon answered no step channel record within the deadline (1 "
                    "completions read, 2 records written)") in late.value.message
            assert not client.step_channel_active
        finally:
            os.kill(daemon.process.pid, signal.SIGCONT)
        # The record was in the ring: the daemon runs it once it goes on.
        assert poll_until(lambda: session.state().committed_len == 1)
        second = session.state().active_generation
        assert second == first.begun.generation + 1
        # Later steps by slot go over gRPC, under the same rules.
        batch.clear()
        batch.advance(session, second, 1, 0)
        outcome = client.step(batch)[0]
        assert outcome.ok and outcome.committed_len == 2


def test_abandoning_the_channel_wakes_a_waiting_step_at_once(kvd):
    """What the lease thread does when the lease stream breaks: a step waiting in FUTEX_WAIT
    for a daemon that will never answer fails now, not at its deadline."""
    daemon = kvd(*DAEMON_FLAGS)
    with connect(daemon, "abandoned", False) as client:
        plan = client.register_plan(hybrid_test_plan())
        session = client.create_session(plan, CAPACITY)
        channel = client._lease.step_channel
        batch = memra_kv.StepBatch(by_slot=True)
        batch.advance(session, 0, 0, 1)
        failures = []

        def waiting_step():
            try:
                client.step(batch, timeout=600)
            except KvError as error:
                failures.append(error)

        stop_process(daemon.process.pid)
        try:
            stepper = threading.Thread(target=waiting_step)
            stepper.start()
            # Its record is published: the step now waits for its completion.
            assert poll_until(lambda: channel._sq_tail == 1)
            channel.abandon()
            stepper.join(60)
            assert not stepper.is_alive()
        finally:
            os.kill(daemon.process.pid, signal.SIGCONT)
        assert len(failures) == 1 and failures[0].code == grpc.StatusCode.UNAVAILABLE
        assert "this engine's step channel was abandoned" in failures[0].message
        assert "records in flight (1) may or may not have run" in failures[0].message


def test_a_region_of_another_layout_is_refused_with_both_numbers():
    _, _, _, _, region_bytes = step_channel.layout()
    region = bytearray(4096)
    # A version-1 daemon's region (its records embedded protobuf), met by this version-2 library.
    step_channel._HEADER.pack_into(region, 0, step_channel.MAGIC, 1, 512, 64, 96, 1024, 8192, 0,
                                   region_bytes, 4096, 36864, 86016, 610304)
    with pytest.raises(KvError) as version:
        step_channel.check_header(region, region_bytes)
    assert version.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "step channel header: version is 1; this library speaks 2" in version.value.message
    step_channel._HEADER.pack_into(region, 0, step_channel.MAGIC, 2, 512, 64, 96, 1024, 8192, 0,
                                   region_bytes, 4096, 36864, 86016, 610304)
    step_channel.check_header(region, region_bytes)  # the daemon's layout, docs/step-channel.md
    with pytest.raises(KvError) as small:
        step_channel.check_header(region, 4096)
    assert "step channel region of 4096 bytes; its layout needs 4804608" in small.value.message
