"""The lease: kept alive by the client's heartbeat thread, ended by detach, and a Python engine
killed with SIGKILL (a real process) is reclaimed with its sessions and bytes. A daemon killed
with SIGKILL: under memra-kv-supervise the engine re-attaches and carries on with its mapping;
without it, the engine gets the restart error."""

import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

import memra_kv
from memra_kv import KvError
import kvtest
from kvtest import dense_plan, poll_until
from prefix_patterns import check_pattern, commit_rows, plan_named, tokens, write_pattern

HERE = os.path.dirname(os.path.abspath(__file__))


def test_heartbeats_keep_an_idle_engine_alive_and_detach_frees_its_sessions(kvd):
    daemon = kvd("--lease_timeout_ms=600", "--lease_grace_ms=100")
    with daemon.admin() as admin, daemon.client() as engine:
        engine_id = engine.attach("py-idle")
        assert engine.lease_timeout_ms == 600 and engine.lease_alive
        plan = engine.register_plan(dense_plan(2, 32, 1))
        session = engine.create_session(plan, 256)
        time.sleep(2.0)  # over three lease timeouts: only the heartbeats keep it
        assert engine.lease_alive
        assert [e.engine_id for e in admin.engines()] == [engine_id]
        assert session.state().committed_len == 0
        engine.detach()
        assert not engine.lease_alive
        assert poll_until(lambda: admin.sessions() == [] and admin.engines() == [])
        assert admin.status().admission.allocated_bytes == 0


def test_attach_twice_and_sessions_before_attach_are_refused(kvd):
    daemon = kvd()
    with daemon.client() as client:
        with pytest.raises(KvError) as unregistered:
            client.register_plan(dense_plan(2, 32, 1))
        assert unregistered.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert unregistered.value.message == "register_plan before attach: sessions need a lease"
        with pytest.raises(KvError) as refused:
            client.create_session(bytes(32), 256)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.message == "create_session before attach: sessions need a lease"
        engine_id = client.attach("py-once")
        assert len(client.register_plan(dense_plan(2, 32, 1))) == 32
        with pytest.raises(KvError) as twice:
            client.attach("py-twice")
        assert twice.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert twice.value.message == "already attached as engine %d" % engine_id


def test_connect_to_a_socket_nobody_serves_is_unavailable(tmp_path):
    with pytest.raises(KvError) as refused:
        memra_kv.Client.connect(str(tmp_path / "nobody.sock"), timeout=0.2)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert "is not answering on unix:%s within 0.2s" % (tmp_path / "nobody.sock") in str(
        refused.value)


def test_a_python_engine_killed_with_sigkill_is_reclaimed(kvd):
    daemon = kvd("--lease_timeout_ms=2000", "--lease_grace_ms=100")
    out = os.path.join(daemon.dir, "engine.facts")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    engine = subprocess.Popen([sys.executable, os.path.join(HERE, "engine_proc.py"),
                               daemon.socket, out], env=env)
    try:
        assert poll_until(lambda: os.path.exists(out) or engine.poll() is not None)
        assert os.path.exists(out), "the engine exited %s before it was ready" % engine.poll()
        facts = dict(line.split("=") for line in open(out).read().split())
        with daemon.admin() as admin:
            sessions = admin.sessions()
            assert [(s.session_id, s.engine_id, s.logical_len) for s in sessions] == [
                (int(facts["session_id"]), int(facts["engine_id"]), 64)]
            assert admin.status().admission.allocated_bytes == sessions[0].arena_bytes > 0
            engine.send_signal(signal.SIGKILL)
            assert engine.wait(10) == -signal.SIGKILL
            # The lease ends with the stream; after the grace its session and bytes return.
            assert poll_until(lambda: admin.sessions() == [] and admin.engines() == [])
            status = admin.status()
            assert status.admission.allocated_bytes == 0 and status.sessions == 0
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def _restarted(admin, before):
    """A poll_until predicate: a daemon whose epoch is not `before` answers."""
    def answered():
        try:
            return admin.status().epoch != before
        except KvError:
            return False
    return answered


def _all_plane_bytes(session):
    return {(layer.layer, plane.kind): session.plane_bytes(layer.layer, plane.kind).copy()
            for layer in session.layout.layers for plane in layer.planes}


def test_an_engine_carries_on_after_a_daemon_sigkill_with_the_same_bytes(kvd):
    """Under memra-kv-supervise a SIGKILLed daemon comes back with the engine and its session:
    the engine notices its lease stream break at once (its heartbeats are 20 s apart here),
    re-attaches as the same engine, and its mapping holds the bytes it wrote, which the
    restarted daemon reads too (a grow copies them into a new arena); steps go on."""
    daemon = kvd("--lease_timeout_ms=60000", supervised=True)
    with daemon.admin() as admin, daemon.client() as engine:
        engine_id = engine.attach("py-carry-on")
        before = admin.status().epoch
        assert engine.epoch == before and engine.reattaches == 0
        plan = engine.register_plan(plan_named("flat"))
        session = engine.create_session(plan, 256)
        commit_rows(session, tokens(64))
        write_pattern(session, session.state())
        written = _all_plane_bytes(session)
        assert engine.step_channel_active, engine.step_channel_status
        old_channel = engine._lease.step_channel

        killed = time.monotonic()
        os.kill(daemon.daemon_pid(), signal.SIGKILL)
        assert poll_until(lambda: engine.reattaches == 1), engine.lease_lost
        noticed_s = time.monotonic() - killed
        assert noticed_s < 10.0, "re-attached %.1fs after the SIGKILL: at a heartbeat" % noticed_s
        assert _restarted(admin, before)()
        assert admin.status().epoch == before + 1
        assert (engine.engine_id, engine.epoch) == (engine_id, before + 1)
        assert engine.lease_alive and engine.lease_lost is None

        assert session.state().committed_len == 64
        before_grow = session.layout
        after = _all_plane_bytes(session)
        assert after.keys() == written.keys()
        for key, plane in written.items():
            assert np.array_equal(after[key], plane), "plane %s changed across the restart" % (
                key,)
        # The daemon copies the committed rows out of the arena it re-adopted.
        assert session.grow(512).committed_len == 64
        assert session.layout.arenas[0].handle not in {a.handle for a in before_grow.arenas}
        assert check_pattern(session, session.state()) > 0
        commit_rows(session, tokens(128)[64:])
        assert session.state().committed_len == 128
        # The broken stream abandoned the old step channel; the re-attach opened a new one
        # with the restarted daemon, and steps by slot go over it.
        assert old_channel.broken
        assert engine.step_channel_active and engine._lease.step_channel is not old_channel
        batch = memra_kv.StepBatch(by_slot=True)
        batch.advance(session, 0, 0, 1)
        stepped = engine.step(batch)[0]
        assert stepped.ok and stepped.begun.base_len == 128 and stepped.prepared.target == 129
        session.release()
        engine.detach()
        assert poll_until(lambda: admin.sessions() == [] and admin.engines() == [])
        assert admin.status().admission.allocated_bytes == 0


def _kept_and_lost_sessions(engine):
    """Two sessions of the hybrid plan: one holding 4 committed rows (a restart keeps it), one
    with a transaction open on its recurrent layer (a restart cannot keep it)."""
    plan = engine.register_plan(kvtest.hybrid_test_plan())
    kept = engine.create_session(plan, 256)
    transaction = kept.begin()
    kept.prepare_append(transaction.generation, 4)
    kept.publish_append(transaction.generation)
    assert kept.commit(transaction.generation, 4) == 4
    lost = engine.create_session(plan, 256)
    lost.prepare_append(lost.begin().generation, 2)
    return kept, lost


def test_after_a_daemon_restart_sessions_come_back_or_say_why_not(kvd):
    """Under memra-kv-supervise a SIGKILLed daemon comes back with the sessions it could keep;
    one that could not come back (a transaction was open on a recurrent layer, which the engine
    updates in place) answers with the restart error naming both epochs."""
    daemon = kvd("--lease_timeout_ms=2000", supervised=True)
    with daemon.admin() as admin, daemon.client() as engine:
        engine.attach("py-restart")
        before = admin.status().epoch
        kept, lost = _kept_and_lost_sessions(engine)

        os.kill(daemon.daemon_pid(), signal.SIGKILL)

        assert poll_until(_restarted(admin, before))
        assert admin.status().epoch == before + 1
        assert poll_until(lambda: engine.reattaches == 1), engine.lease_lost
        assert kept.state().committed_len == 4
        with pytest.raises(KvError) as refused:
            lost.state()
        error = refused.value
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION and error.is_daemon_restarted
        assert (error.previous_epoch, error.epoch) == (before, before + 1)
        assert error.message.startswith(
            "memra-kvd restarted (epoch %d -> %d); session %d was not re-adopted: a transaction "
            "was open on recurrent layer 2" % (before, before + 1, lost.id))
        time.sleep(3.0)  # over the lease timeout: the heartbeats on the new stream keep it
        assert engine.lease_alive and kept.state().committed_len == 4
        kept.release()


def test_why_a_session_was_not_re_adopted_survives_a_second_restart(kvd):
    """Issue 26: a session lost at one restart is still answered with the restart error, and
    why, by the daemon after the next restart (the reason is journaled again), never a bare
    NOT_FOUND; the engine keeps its lease and its other session through both."""
    daemon = kvd("--lease_timeout_ms=5000", supervised=True)
    with daemon.admin() as admin, daemon.client() as engine:
        engine.attach("py-twice")
        before = admin.status().epoch
        kept, lost = _kept_and_lost_sessions(engine)

        os.kill(daemon.daemon_pid(), signal.SIGKILL)
        assert poll_until(_restarted(admin, before))
        os.kill(daemon.daemon_pid(), signal.SIGKILL)  # before the engine asked about `lost`
        assert poll_until(_restarted(admin, before + 1))
        assert admin.status().epoch == before + 2
        assert poll_until(lambda: engine.epoch == before + 2), engine.lease_lost
        assert engine.lease_alive and engine.lease_lost is None
        assert kept.state().committed_len == 4
        with pytest.raises(KvError) as refused:
            lost.state()
        error = refused.value
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION and error.is_daemon_restarted
        assert (error.previous_epoch, error.epoch) == (before + 1, before + 2)
        assert error.message == (
            "memra-kvd restarted (epoch %d -> %d); session %d was not re-adopted: a transaction "
            "was open on recurrent layer 2, whose state the engine updates in place (at the "
            "restart from epoch %d to %d)" % (
                before + 1, before + 2, lost.id, before, before + 1)), error.message
        kept.release()


def test_an_engine_whose_daemon_restarted_without_a_supervisor_gets_the_restart_error(kvd):
    """Without a service manager nothing of the daemon survives its SIGKILL: the engine's
    re-attach is refused with the restart error naming both epochs (lease_lost), and its
    session calls answer with the restart error, never the bare NOT_FOUND."""
    daemon = kvd("--lease_timeout_ms=60000")
    with daemon.client() as engine:
        engine_id = engine.attach("py-orphan")
        first = engine.epoch
        session = engine.create_session(engine.register_plan(dense_plan(2, 32, 1)), 256)
        daemon.kill_and_start_again()
        assert poll_until(lambda: engine.lease_lost is not None)
        with daemon.admin() as admin:
            now = admin.status().epoch
        assert now != first and not engine.lease_alive and engine.reattaches == 0
        lost = engine.lease_lost
        assert isinstance(lost, memra_kv.DaemonRestarted)  # a FailedPrecondition
        assert lost.code == grpc.StatusCode.FAILED_PRECONDITION and lost.is_daemon_restarted
        assert (lost.previous_epoch, lost.epoch) == (first, now)
        # Issue 26: the words docs/failure-model.md promises, not "engine 1 was reclaimed".
        assert lost.message == (
            "memra-kvd restarted (epoch %d -> %d); this engine attached to epoch %d and the daemon "
            "answering does not have it: it kept nothing of an earlier daemon (no service manager "
            "kept its state, or keep_kv_across_restarts = false); attach as a new engine"
            % (first, now, first)), lost.message
        assert "engine %d" % engine_id not in lost.message
        with pytest.raises(memra_kv.DaemonRestarted) as refused:
            session.state()
        error = refused.value
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION and error.is_daemon_restarted
        assert (error.previous_epoch, error.epoch) == (first, now)
        assert error.message.startswith(
            "memra-kvd restarted (epoch %d -> %d); this engine attached to epoch %d and the "
            "daemon answering does not have it: " % (first, now, first)), error.message
        assert "session %d" % session.id in error.message
        batch = memra_kv.StepBatch()
        batch.begin(session)
        [outcome] = engine.step(batch)
        assert isinstance(outcome.error, memra_kv.DaemonRestarted)
        assert (outcome.error.previous_epoch, outcome.error.epoch) == (first, now)


def test_attach_binds_the_peer_credentials_and_the_cache_scope(kvd):
    daemon = kvd("--cache_scope_allow=team:%d" % os.getuid())
    with daemon.admin() as admin, daemon.client() as engine, daemon.client() as other:
        engine.attach("py-own-scope")
        assert engine.cache_scope == "uid:%d" % os.getuid()
        [status] = admin.status().engine_status
        assert (status.pid, status.uid, status.gid) == (os.getpid(), os.getuid(), os.getgid())
        assert status.cache_scope == engine.cache_scope
        other.attach("py-team", cache_scope="team")
        assert other.cache_scope == "team"
    with daemon.client() as refused:
        with pytest.raises(KvError) as not_allowed:
            refused.attach("py-elsewhere", cache_scope="elsewhere")
        assert not_allowed.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert ('cache scope "elsewhere" is not allowed to uid %d' % os.getuid()
                in not_allowed.value.message)


def test_attach_anew_replaces_an_engine_the_daemon_no_longer_knows(kvd):
    """A lease lost for good (the daemon restarted without a supervisor) is replaced by a new
    engine of the same name and cache scope; a live lease is kept; before attach, refused."""
    daemon = kvd("--lease_timeout_ms=60000", "--cache_scope_allow=team:%d" % os.getuid())
    with daemon.client() as engine:
        with pytest.raises(KvError) as refused:
            engine.attach_anew()
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.message == "attach_anew before attach: there is no engine to replace"
        first = engine.attach("py-anew", cache_scope="team")
        assert engine.attach_anew() == first and engine.reattaches == 0  # live: kept
        daemon.kill_and_start_again()
        assert poll_until(lambda: engine.lease_lost is not None)
        again = engine.attach_anew()
        assert engine.engine_id == again and engine.lease_alive and engine.lease_lost is None
        assert engine.cache_scope == "team"
        with daemon.admin() as admin:
            assert [(e.engine_id, e.engine_name, e.lease_live) for e in admin.engines()] == [
                (again, "py-anew", True)]
        assert engine.attach_anew() == again  # live again: kept
