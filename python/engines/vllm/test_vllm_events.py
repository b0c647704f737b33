"""The KV-events bridge (`python -m memra_kv.events`, a real process) read the way vLLM 0.33's
own subscribers read vLLM's publisher: batches decoded by msgspec with vLLM's KVEventBatch,
replay frames as ZmqEventPublisher sends them (topic, sequence, payload; then END_SEQ). The
blocks come from a real vLLM instance's saves (instance.py), announced under vLLM's own block
hashes."""

import os
import subprocess
import sys
import time

import msgspec
import zmq
import zmq.utils.monitor
from vllm.distributed.kv_events import (MEDIUM_CPU, BlockStored, KVEventBatch,
                                        ZmqEventPublisher)

from kvtest import poll_until
from memra_kv.vllm import ContentKeys, request_salt
from test_vllm_connector import DAEMON_FLAGS, PROMPT, WHOLE_BLOCKS, instance

TOPIC = b"kv@vllm"


def test_stored_blocks_decode_with_vllms_event_classes_live_and_replayed(kvd, tmp_path):
    daemon = kvd(*DAEMON_FLAGS)
    endpoint, replay_endpoint = ("ipc://%s/pub" % tmp_path, "ipc://%s/replay" % tmp_path)
    log_path = str(tmp_path / "bridge.log")
    with open(log_path, "w") as log:
        bridge = subprocess.Popen(
            [sys.executable, "-m", "memra_kv.events", "--socket", daemon.admin_socket,
             "--endpoint", endpoint, "--replay-endpoint", replay_endpoint, "--topic",
             TOPIC.decode()], stdout=log, stderr=subprocess.STDOUT)
    context = zmq.Context()
    try:
        assert poll_until(lambda: "publishing on" in open(log_path).read(), pid=bridge.pid)
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(endpoint)
        assert monitor.poll(10000), "the subscriber never connected"
        zmq.utils.monitor.recv_monitor_message(monitor)
        sub.disable_monitor()
        time.sleep(0.2)  # the subscription reaches the publisher after the connection

        facts, _ = instance(daemon.socket, "LBNHC")
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        assert sub.poll(60000), "no KV event batch"
        topic, sequence, payload = sub.recv_multipart()
        assert (topic, int.from_bytes(sequence, "big")) == (TOPIC, 0)
        live = decoder.decode(payload)
        (event,) = live.events
        assert isinstance(event, BlockStored)
        # Routers key by vLLM's own block hashes: the events carry them, while the store keys
        # the blocks by the connector's content keys (which name nothing in the events).
        vllm_hashes = [bytes.fromhex(h) for h in facts["vllm_block_hashes"][:WHOLE_BLOCKS]]
        assert event.block_hashes == vllm_hashes
        keys = ContentKeys(16, request_salt(None, None)).extend(PROMPT)
        assert not set(keys) & set(event.block_hashes)
        assert event.parent_block_hash is None
        assert event.token_ids == PROMPT[:WHOLE_BLOCKS * 16] and event.block_size == 16
        assert event.medium == MEDIUM_CPU  # the host backend's device tier

        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        frames = []
        while True:
            assert dealer.poll(10000), "no replay answer"
            frame = dealer.recv_multipart()
            frames.append(frame)
            if frame[2] == ZmqEventPublisher.END_SEQ:
                break
        assert frames[-1] == [b"", b"", ZmqEventPublisher.END_SEQ, b""]
        assert [f[:3] for f in frames[:-1]] == [[b"", TOPIC, (0).to_bytes(8, "big")]]
        assert decoder.decode(frames[0][3]) == live
    finally:
        bridge.terminate()
        assert bridge.wait(20) == 0, open(log_path).read()
        context.destroy(linger=0)
