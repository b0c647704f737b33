"""The lease: kept alive by the client's heartbeat thread, ended by detach, and a Python engine
killed with SIGKILL (a real process) is reclaimed with its sessions and bytes."""

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

import memra_kv
from memra_kv import KvError
from kvtest import dense_plan, poll_until

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
