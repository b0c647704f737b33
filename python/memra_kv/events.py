"""The KV-events bridge: memra-kvd's prefix events republished in vLLM's KV-event wire format, so
prefix-aware routers that read vLLM engines' events can route by what each memra-kvd holds.

    python3 -m memra_kv.events --socket /run/memra-kv/gpu0.admin.sock \\
        --endpoint 'tcp://*:5557' --replay-endpoint 'tcp://*:5558'

The wire (vLLM 0.33.0 vllm/distributed/kv_events.py, ZmqEventPublisher; checked by decoding
with vLLM's own KVEventBatch and its replay protocol, python/engines/vllm/test_vllm_events.py): a
ZMQ PUB socket sends multipart messages (topic, sequence, payload): the sequence an 8-byte
big-endian count from 0, the payload one KVEventBatch encoded by msgspec's msgpack encoder. The
batch is `array_like`, the events are tagged maps (`tag=True`, `omit_defaults=True`), so a batch
is the array [ts, events, data_parallel_rank] and each event a map led by its class name:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
     "block_size": n, "lora_id": nil, "medium": "CPU", "lora_name": nil}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "CPU"}
    {"type": "AllBlocksCleared"}

(hashes are msgpack bin, as vLLM's ExternalBlockHash bytes; absent values nil; the fields vLLM
gives defaults are omitted). The ROUTER replay endpoint answers a request (client, empty
delimiter, 8-byte big-endian start sequence) with every buffered (topic, sequence, payload)
from there, then (b"", -1, b"") (vLLM's END_SEQ): the frames vLLM's publisher sends.

Translation (one batch per daemon event):
  STORED            -> BlockStored (the blocks' hashes as their engine knows them: an engine
                       pool's own hashes, a memra session's block keys; parent, token ids,
                       block size as the daemon reports them)
  EVICTED, DROPPED  -> BlockRemoved
  MOVED             -> BlockStored in the new medium (the blocks are still held: a router keeps
                       them; the daemon does not say which tier they left)
  GAP               -> AllBlocksCleared, then (on the admin socket) one BlockStored per memra
                       session entry the daemon lists (ListPrefixes + InspectPrefix), by its
                       block keys; engine-pool blocks come back with their next events (the
                       listing does not carry the engines' hashes)
Media (vLLM's MEDIUM_GPU / MEDIUM_CPU / MEDIUM_STORAGE): the daemon's device tier is "GPU" on
the cuda backend and "CPU" on the host backend (its "device" memory is host memory: --backend,
default host), pinned host memory "CPU", disk "STORAGE".
"""

import argparse
import collections
import logging
import signal
import struct
import sys
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import msgpack
import zmq

from .client import Client
from .errors import ErrorCode, KvError

END_SEQUENCE = struct.pack(">q", -1)
MEDIA = {"pinned_host": "CPU", "disk": "STORAGE"}
DEVICE_MEDIA = {"cuda": "GPU", "host": "CPU"}  # the daemon's backend -> its device tier's medium

log = logging.getLogger("memra_kv.events")


# ---- the events (vLLM's KVCacheEvent structs as msgspec lays them out) ----

# One vLLM event as msgspec lays it out: a dict of its fields.
Event = Dict[str, Any]


def block_stored(block_hashes: Sequence[bytes], parent_block_hash: bytes,
                 token_ids: Sequence[int], block_size: int, medium: str) -> Event:
    """vLLM BlockStored: lora_id and lora_name are None (memra-kvd keys carry no LoRA)."""
    return {"type": "BlockStored", "block_hashes": list(block_hashes),
            "parent_block_hash": parent_block_hash or None, "token_ids": list(token_ids),
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None}


def block_removed(block_hashes: Sequence[bytes], medium: str) -> Event:
    """vLLM BlockRemoved."""
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}


def all_blocks_cleared() -> Event:
    """vLLM AllBlocksCleared."""
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: List[Event], data_parallel_rank: int) -> bytes:
    """A KVEventBatch as msgspec's msgpack encoder writes it (floats as float64)."""
    packed: bytes = msgpack.packb([float(ts), events, data_parallel_rank], use_bin_type=True)
    return packed


def medium_name(medium: str, backend: str = "host") -> str:
    """vLLM's medium of a daemon tier ("device" is the backend's memory: host memory on the
    host backend)."""
    if medium == "device":
        return DEVICE_MEDIA.get(backend, "GPU")
    return MEDIA.get(medium, medium.upper())


def translate(event: Any, backend: str = "host") -> List[Event]:
    """The vLLM events of one memra_kv.PrefixEvent (not GAP: the bridge resyncs those)."""
    hashes = event.block_hashes or event.block_keys
    if not hashes:
        return []  # a boundary state alone: routers index blocks, not states
    medium = medium_name(event.medium, backend)
    if event.kind == "stored":
        return [block_stored(hashes, event.parent_block_hash, event.token_ids,
                             event.block_tokens, medium)]
    if event.kind == "moved":
        return [block_stored(hashes, b"", (), event.block_tokens, medium)]
    if event.kind in ("evicted", "dropped"):
        return [block_removed(hashes, medium)]
    return []


# ---- the publisher ----

def _bind_or_connect(sock: Any, endpoint: str) -> None:
    """vLLM's rule: bind a wildcard, ipc:// or inproc:// endpoint, connect to any other."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class ZmqPublisher:
    """PUB socket (topic, sequence, payload) plus a ROUTER replay endpoint over the last
    `buffer_steps` batches. publish() is called from one thread; the replay endpoint is served
    on its own thread (its own socket; the buffer under a lock)."""

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = "",
                 buffer_steps: int = 10000, hwm: int = 100000, data_parallel_rank: int = 0,
                 context: Any = None) -> None:
        self._context = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._lock = threading.Lock()
        # (sequence, payload)
        self._buffer: Deque[Tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._next_sequence = 0
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        _bind_or_connect(self._pub, endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stopping = threading.Event()
        self._replay_thread = None
        self.replay_endpoint = None
        if replay_endpoint:
            replay = self._context.socket(zmq.ROUTER)
            replay.bind(replay_endpoint)
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(replay,),
                                                   name="memra-kv-events-replay", daemon=True)
            self._replay_thread.start()

    def publish(self, events: List[Event], ts: Optional[float] = None) -> int:
        """Sends one batch; returns its sequence."""
        payload = encode_batch(time.time() if ts is None else ts, events, self._rank)
        with self._lock:
            sequence = self._next_sequence
            self._next_sequence += 1
            self._buffer.append((sequence, payload))
        self._pub.send_multipart((self._topic, struct.pack(">Q", sequence), payload))
        return sequence

    def _serve_replay(self, replay: Any) -> None:
        try:
            while not self._stopping.is_set():
                if not replay.poll(100):
                    continue
                frames = replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    log.warning("replay request of %d frames ignored", len(frames))
                    continue
                client, _, start = frames
                start = struct.unpack(">Q", start)[0]
                with self._lock:
                    buffered = [entry for entry in self._buffer if entry[0] >= start]
                for sequence, payload in buffered:
                    replay.send_multipart((client, b"", self._topic,
                                           struct.pack(">Q", sequence), payload))
                replay.send_multipart((client, b"", b"", END_SEQUENCE, b""))
        finally:
            replay.close(linger=0)

    def close(self) -> None:
        """Stops the replay thread and closes the sockets."""
        self._stopping.set()
        if self._replay_thread is not None:
            self._replay_thread.join()
        self._pub.close(linger=0)


# ---- the bridge ----

class Bridge:
    """Reads a memra_kv.Client's prefix events and publishes them. On a GAP it publishes
    AllBlocksCleared and, when `resync` (the client is on the admin socket), re-announces every
    entry the daemon lists. The daemon's backend (GetStatus, served on both sockets) names its
    device tier's medium."""

    def __init__(self, client: Client, publisher: ZmqPublisher, resync: bool, epoch: int = 0,
                 last_sequence: int = 0) -> None:
        self._client = client
        self._publisher = publisher
        self._resync = resync
        self.backend = client.status().backend
        self.events = client.events(epoch, last_sequence)
        self.published = 0

    def run(self) -> None:
        """Until the event stream ends (stop(), or the daemon went away: KvError)."""
        for event in self.events:
            if event.gap:
                self._publish([all_blocks_cleared()])
                if self._resync:
                    self._republish_listing()
                continue
            translated = translate(event, self.backend)
            if translated:
                self._publish(translated)

    def _publish(self, events: List[Event]) -> None:
        self._publisher.publish(events)
        self.published += 1

    def _republish_listing(self) -> None:
        for entry in self._client.list_prefixes().entries:
            if entry.from_engine_pool:
                continue  # known by block keys only, not by the engine's hashes routers index
            try:
                inspected = self._client.inspect_prefix(entry.entry_id)
            except KvError as error:  # evicted since the listing: its event follows
                if error.code == ErrorCode.NOT_FOUND:
                    continue
                raise
            keys = list(inspected.block_keys)
            if keys:
                block_size = entry.boundary_tokens // len(keys)
                self._publish([block_stored(keys, b"", (), block_size,
                                            medium_name(entry.medium, self.backend))])

    def stop(self) -> None:
        """Ends run(): cancels the event stream (from any thread or a signal handler)."""
        self.events.cancel()



def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python3 -m memra_kv.events`: runs the bridge until a signal or the stream ends; the exit status."""
    parser = argparse.ArgumentParser(
        prog="python3 -m memra_kv.events",
        description="Republish memra-kvd's prefix events as vLLM KV events (ZMQ, msgpack).")
    parser.add_argument("--socket", required=True,
                        help="the daemon's admin socket (every scope's events; resync on a gap) "
                             "or its engine socket with --engine-name (that engine's scope)")
    parser.add_argument("--engine-name", default="",
                        help="attach as this engine (engine socket): events of its cache scope")
    parser.add_argument("--cache-scope", default="", help="with --engine-name: the scope")
    parser.add_argument("--endpoint", default="tcp://*:5557", help="ZMQ PUB endpoint")
    parser.add_argument("--replay-endpoint", default="",
                        help="ZMQ ROUTER endpoint answering replay requests (none if empty)")
    parser.add_argument("--topic", default="")
    parser.add_argument("--buffer-steps", type=int, default=10000,
                        help="batches kept for replay")
    parser.add_argument("--hwm", type=int, default=100000, help="PUB high-water mark")
    parser.add_argument("--data-parallel-rank", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=0,
                        help="resume after this daemon epoch's --last-sequence")
    parser.add_argument("--last-sequence", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0, help="connect timeout (s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="memra_kv.events: %(message)s")

    client = Client.connect(args.socket, timeout=args.timeout)
    if args.engine_name:
        client.attach(args.engine_name, cache_scope=args.cache_scope)
    publisher = ZmqPublisher(args.endpoint, args.replay_endpoint or None, args.topic,
                             args.buffer_steps, args.hwm, args.data_parallel_rank)
    bridge = Bridge(client, publisher, resync=not args.engine_name, epoch=args.epoch,
                    last_sequence=args.last_sequence)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: bridge.stop())
    log.info("publishing on %s%s", publisher.endpoint,
             ", replay on %s" % publisher.replay_endpoint if publisher.replay_endpoint else "")
    status = 0
    try:
        bridge.run()
    except KvError as error:
        log.error("the event stream ended: %s", error)
        status = 1
    finally:
        publisher.close()
        client.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
