"""The KV-events bridge (`python3 -m memra_kv.events`, a real process) against the real daemon,
read by a real ZMQ subscriber that decodes vLLM's wire format: a memra session's capture arrives
as BlockStored and an operator's eviction as BlockRemoved, both with the hashes the daemon's own
events carry; the replay endpoint returns every buffered batch from a sequence, then the end
marker; a bridge resuming from an epoch the daemon never had publishes AllBlocksCleared and
re-announces the memra-session entries the daemon lists."""

import os
import struct
import subprocess
import sys
import time

import msgpack
import zmq
import zmq.utils.monitor

from adapter_engine import BLOCK, PROMPT, vllm_hashes
from contract import run_engine
from kvtest import poll_until
from prefix_patterns import commit_rows, plan_named, tokens

DAEMON_FLAGS = ("--budget_bytes=512MiB", "--prefix_cache_budget_bytes=128MiB",
                "--prefix_block_tokens=16")
END = struct.pack(">q", -1)


class BridgeProcess:
    def __init__(self, daemon, name, *flags):
        self.endpoint = "ipc://%s/%s.pub" % (daemon.dir, name)
        self.replay_endpoint = "ipc://%s/%s.replay" % (daemon.dir, name)
        self.log_path = os.path.join(daemon.dir, name + ".log")
        self.topic = ("kv@" + name).encode()
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "memra_kv.events", "--socket", daemon.admin_socket,
             "--endpoint", self.endpoint, "--replay-endpoint", self.replay_endpoint,
             "--topic", "kv@" + name] + list(flags),
            env=env, stdout=self._log, stderr=subprocess.STDOUT)
        assert poll_until(lambda: "publishing on" in self.log(), pid=self.process.pid), self.log()

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def replay(self, context, start):
        """Every (sequence, batch) the replay endpoint answers from `start`, up to the end
        marker (a DEALER: the ROUTER answers one request with many messages)."""
        dealer = context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", struct.pack(">Q", start)))
        answered = []
        while True:
            assert dealer.poll(10000), "no replay answer within 10 s"
            delimiter, topic, sequence, payload = dealer.recv_multipart()
            assert delimiter == b""
            if sequence == END:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == self.topic
            answered.append((struct.unpack(">Q", sequence)[0], msgpack.unpackb(payload)))
        dealer.close(linger=0)
        return answered

    def stop(self):
        self.process.terminate()
        status = self.process.wait(20)
        self._log.close()
        return status


def subscriber(context, endpoint, topic):
    """A SUB socket connected to `endpoint`, returned once the connection is up."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
    sub.connect(endpoint)
    assert monitor.poll(10000), "the subscriber never connected"
    assert zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
    sub.disable_monitor()
    monitor.close(linger=0)
    time.sleep(0.2)  # the subscription reaches the publisher after the connection
    return sub


def receive(sub, topic):
    assert sub.poll(10000), "no KV event batch within 10 s"
    got_topic, sequence, payload = sub.recv_multipart()
    assert got_topic == topic.encode()
    assert len(sequence) == 8
    return struct.unpack(">Q", sequence)[0], msgpack.unpackb(payload)


def daemon_events(client, count):
    events = client.events()
    seen = [next(events) for _ in range(count)]
    events.cancel()
    return seen


def stored(block_hashes, parent, token_ids, block_size, medium="CPU"):
    """vLLM 0.33's BlockStored as msgspec encodes it (a tagged map, defaults omitted); "CPU":
    the host backend's device tier is host memory."""
    return {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None}


def expected_stored(event):
    return stored(event.block_hashes or event.block_keys, event.parent_block_hash or None,
                  event.token_ids, event.block_tokens)


def test_a_capture_and_an_eviction_reach_a_zmq_subscriber_as_vllm_events(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    context = zmq.Context()
    bridge = BridgeProcess(daemon, "live")
    try:
        sub = subscriber(context, bridge.endpoint, "kv@live")
        with daemon.client("py-events") as client:
            plan = client.register_plan(plan_named("flat"))
            session = client.create_session(plan, 256)
            commit_rows(session, tokens(64))
            client.capture_prefix(session, tokens(64), 32)
            sequence, batch = receive(sub, "kv@live")
            assert sequence == 0
            ts, events, rank = batch
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
            (stored_event,) = daemon_events(client, 1)
            assert events == [expected_stored(stored_event)]
            hashes = events[0]["block_hashes"]
            assert len(hashes) == 2 and all(isinstance(h, bytes) for h in hashes)
            # A memra session's blocks: hashes are its block keys, with their tokens.
            assert hashes == stored_event.block_keys and events[0]["parent_block_hash"] is None
            assert events[0]["token_ids"] == tokens(32) and events[0]["block_size"] == 16

            with daemon.admin() as admin:
                (entry,) = admin.list_prefixes().entries
                admin.evict_prefix(entry.entry_id)
            sequence, (_, events, _) = receive(sub, "kv@live")
            assert sequence == 1
            assert events == [{"type": "BlockRemoved", "block_hashes": hashes, "medium": "CPU"}]

            replayed = bridge.replay(context, 0)
            assert [s for s, _ in replayed] == [0, 1]
            assert replayed[1][1][1] == [{"type": "BlockRemoved", "block_hashes": hashes, "medium": "CPU"}]
            assert [s for s, _ in bridge.replay(context, 1)] == [1]
            assert bridge.replay(context, 2) == []
            session.release()
        sub.close(linger=0)
    finally:
        assert bridge.stop() == 0, bridge.log()
        context.destroy(linger=0)


def test_a_gap_clears_every_block_and_reannounces_the_sessions_listing(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    context = zmq.Context()
    with daemon.client("py-gap") as client:
        plan = client.register_plan(plan_named("flat"))
        session = client.create_session(plan, 256)
        commit_rows(session, tokens(64))
        client.capture_prefix(session, tokens(64), 64)
        (stored_event,) = daemon_events(client, 1)
        run_engine(daemon, "vllm", "store")  # engine-pool blocks, listed by keys only
        # A bridge resuming from an epoch this daemon never had missed everything: a GAP.
        bridge = BridgeProcess(daemon, "gap", "--epoch", str(stored_event.epoch + 1),
                               "--last-sequence", "1")
        try:
            assert poll_until(lambda: len(bridge.replay(context, 0)) >= 2)
            batches = [events for _, (_, events, _) in bridge.replay(context, 0)]
            # The GAP clears everything, then the listing's memra-session entry is re-announced
            # by its block keys (the daemon resumes the stream after the gap: the STORED event
            # is not resent; the engine-pool blocks are not in terms routers index).
            assert batches == [[{"type": "AllBlocksCleared"}],
                               [stored(stored_event.block_keys, None, [], 16)]]
        finally:
            assert bridge.stop() == 0, bridge.log()
        session.release()
    context.destroy(linger=0)


def test_blocks_a_vllm_engine_stored_reach_routers_under_vllms_hashes(kvd):
    """The router's whole path: a vLLM engine process stores a prompt's blocks through
    memra_kv.vllm; the bridge publishes them as BlockStored with vLLM's own block hashes,
    chained parents and tokens, as vLLM itself would."""
    daemon = kvd(*DAEMON_FLAGS)
    context = zmq.Context()
    bridge = BridgeProcess(daemon, "pool")
    try:
        run_engine(daemon, "vllm", "store")
        hashes = vllm_hashes(PROMPT)
        # One store call, one BlockStored carrying the whole run (as vLLM batches them).
        assert poll_until(lambda: len(bridge.replay(context, 0)) >= 1)
        batches = [events for _, (_, events, _) in bridge.replay(context, 0)]
        assert batches == [[stored(hashes, None, PROMPT[:len(hashes) * BLOCK], BLOCK)]]
    finally:
        assert bridge.stop() == 0, bridge.log()
        context.destroy(linger=0)
