"""LMCache 0.5.6 and memra-kvd's block store side by side, in one run (issue 29 item 3).

The workload, the same through both: one dense model's paged KV pool (vLLM's per-layer
(2, num_blocks, block_tokens, kv_heads, head_dim) tensors; by default Llama-3-8B's per-rank
geometry at TP 4: 32 layers, 2 of its 8 KV heads, head dim 128, bf16, 32 KiB per token) with
256-token pool blocks, so one block is one LMCache chunk. For each prefix size (1k and 32k
tokens by default):

  engine process A  stores the prefix (a new one each repetition: every store copies; the
                    cache at its budget evicts the oldest), then loads the last one it stored
                    back into its own pool;
  engine process B  (started after A exited, a pool of its own) loads what A stored: the first
                    load (verified byte for byte against A's pattern) and then the timed ones
                    (the last verified again).

Every timed store and load is followed by a memcpy of the same bytes in the same process
(the pool's per-layer tensors to or from a warm scratch buffer): the ratio is taken pair by
pair, under the same load. A load is what an engine does per request: the lookup (memra:
LookupBlocks with a pin; LMCache: LOOKUP, then WAIT_PREFETCH_STATUS for the hit count) and the
copy into the pool (memra: LoadBlocks; LMCache: RETRIEVE).

The two caches:
  memra    the real daemon binary (bazel-bin/server/memra-kvd), host backend, started here on
           a temp socket; the pool a sealed memfd (memra_kv.block_store.HostPool) the daemon
           maps; StoreBlocks / LoadBlocks copy with xxHash3 checksums, done at the reply.
  lmcache  LMCache's multiprocess cache server (`lmcache server`, ZMQ on loopback, L1 in host
           memory, LRU) driven through LMCache's own client classes, as `lmcache bench server
           --mode cpu --transfer-mode lmcache_driven` does: the engine's tensors re-pointed at
           POSIX shared memory the server maps (its CPU stand-in for CUDA IPC), STORE /
           RETRIEVE copied by the server. (Its engine-driven mode is not served by a default
           server here: it answers "No handler registered for operation
           register_kv_cache_engine_driven_context".)

Run it with bench/lmcache/run.sh (the LMCache venv, memra_kv installed beside it, memra-kvd
built -c opt). `--systems memra` needs neither torch nor LMCache (the suite's smoke test runs
it tiny). Prints a table; --json writes every sample.
"""

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

MIB = 1 << 20
GIB = 1 << 30
SLAB_BYTES = 128 * MIB  # memra-kvd's prefix_slab_bytes default
CHUNK_TOKENS = 256  # LMCache's default chunk; one pool block of the workload
PIN_TTL_MS = 30000
# The caches' budget, in prefixes: memra-kvd refuses a lookup that would pin more than a quarter
# of its budget (one engine must not lock the cache), and the loads pin the whole prefix.
BUDGET_PREFIXES = 4
PATIENCE_S = 120.0


# ---------------------------------------------------------------------------------------------
# The workload: geometry, bytes, pattern, keys (both systems, every process).

class Geometry:
    def __init__(self, layers, kv_heads, head_dim, element_bytes, block_tokens, tokens):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.element_bytes, self.block_tokens, self.tokens = element_bytes, block_tokens, tokens
        if tokens % block_tokens:
            raise ValueError("%d tokens is not whole %d-token blocks" % (tokens, block_tokens))
        self.num_blocks = tokens // block_tokens  # the prefix's blocks: pool blocks 1..num_blocks
        # Block 0 is vLLM's null block, which LMCache never stores (its --null-block-id).
        self.pool_blocks = self.num_blocks + 1
        self.block_bytes = block_tokens * kv_heads * head_dim * element_bytes  # one K or V block
        self.layer_bytes = 2 * self.pool_blocks * self.block_bytes
        self.total_bytes = layers * 2 * self.num_blocks * self.block_bytes  # what a call moves
        self.block_ids = list(range(1, self.pool_blocks))

    @classmethod
    def of(cls, args, tokens):
        return cls(args.layers, args.kv_heads, args.head_dim, 2, args.block_tokens, tokens)


def fill_pattern(layer_arrays, seed):
    """Writes a pattern every byte depends on (position, plane, seed) into the prefix's planes
    (uint8 arrays: each layer's K and V blocks 1..num_blocks)."""
    for layer, array in enumerate(layer_arrays):
        words = array.view(np.uint64)
        words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        words ^= np.uint64((seed << 32) | (layer + 1))


def pattern_mismatch(layer_arrays, seed):
    """None when every layer holds fill_pattern's bytes, else where the first difference is."""
    for layer, array in enumerate(layer_arrays):
        words = array.view(np.uint64)
        expected = np.arange(words.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        expected ^= np.uint64((seed << 32) | (layer + 1))
        wrong = np.flatnonzero(words != expected)
        if wrong.size:
            return "plane %d (layer %d %s): %d of %d words differ, the first at byte %d" % (
                layer, layer // 2, "KV"[layer % 2], wrong.size, words.size, int(wrong[0]) * 8)
    return None


def prefix_id(tag, repetition):
    """The id of the repetition-th prefix of a run (its keys and token ids derive from it)."""
    return int.from_bytes(hashlib.sha256(("%s/%d" % (tag, repetition)).encode()).digest()[:3],
                          "big") + 1


class PairedMemcpy:
    """The baseline: a memcpy of the prefix's bytes (plane by plane, as they lie in the pool) to or
    from a warm scratch buffer of the same size, in the process that made the call."""

    def __init__(self, layer_arrays):
        self.layers = layer_arrays
        self.scratch = [np.empty_like(a) for a in layer_arrays]
        self.timed(True)  # the scratch pages faulted in, untimed

    def timed(self, from_pool):
        started = time.perf_counter()
        for pool, scratch in zip(self.layers, self.scratch):
            if from_pool:
                np.copyto(scratch, pool)
            else:
                np.copyto(pool, scratch)
        return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------
# memra-kvd's block store (engine side).

class MemraEngine:
    def __init__(self, endpoint, geometry, name):
        from memra_kv import Client
        from memra_kv.block_store import BlockStore, HostPool, PoolLayout, TensorLayout
        g = geometry
        self.g = g
        self.pool = HostPool(g.layers * g.layer_bytes, name=name)
        tensors, self.layer_arrays = [], []
        for layer in range(g.layers):  # vLLM's (2, blocks, tokens, heads, head dim) per layer
            for kind, half in (("K", 0), ("V", 1)):
                plane = layer * g.layer_bytes + half * g.pool_blocks * g.block_bytes
                tensors.append(TensorLayout(layer, kind, plane, g.block_bytes, g.block_bytes))
                self.layer_arrays.append(
                    self.pool.array[plane + g.block_bytes:plane + g.pool_blocks * g.block_bytes])
        layout = PoolLayout(num_blocks=g.pool_blocks, tokens_per_block=g.block_tokens,
                            element_type="bf16", num_kv_heads=g.kv_heads, head_dim=g.head_dim,
                            model="lmcache-vs-memra-llama3-8b", tensors=tensors)
        self.client = Client.connect(endpoint, timeout=30)
        self.client.attach(name)
        self.store_api = BlockStore(self.client)
        started = time.perf_counter()
        self.registration = self.store_api.register([self.pool], layout, timeout=60)
        self.register_s = time.perf_counter() - started
        self.block_ids = g.block_ids

    def make_room(self):
        """Nothing: at its budget a store evicts the oldest blocks itself, inside the call."""

    def _hashes(self, prefix):
        root = b"memra-bench/%d" % prefix
        return [hashlib.sha256(root + b"/%d" % i).digest() for i in range(self.g.num_blocks)]

    def store(self, prefix):
        transfer = self.store_api.store(self.registration, self.block_ids,
                                        hashes=self._hashes(prefix), timeout=PATIENCE_S)
        if not transfer.ok:
            raise RuntimeError("memra store of prefix %d: blocks %s failed: %s" % (
                prefix, transfer.failed()[:4], transfer.blocks[transfer.failed()[0]].message))

    def load(self, prefix):
        """(seconds of the lookup, of the whole load)."""
        hashes = self._hashes(prefix)
        started = time.perf_counter()
        match = self.store_api.lookup(self.registration, hashes=hashes, pin_ttl_ms=PIN_TTL_MS,
                                      timeout=PATIENCE_S)
        looked_up = time.perf_counter()
        if match.matched_blocks != self.g.num_blocks:
            raise RuntimeError("memra lookup of prefix %d matched %d of %d blocks" % (
                prefix, match.matched_blocks, self.g.num_blocks))
        transfer = self.store_api.load(self.registration, self.block_ids, hashes=hashes,
                                       pin_id=match.pin_id, timeout=PATIENCE_S)
        done = time.perf_counter()
        if not transfer.ok:
            raise RuntimeError("memra load of prefix %d: blocks %s failed" % (
                prefix, transfer.failed()[:4]))
        return looked_up - started, done - started

    def close(self):
        self.client.close()
        self.layer_arrays = None
        self.pool.close()


# ---------------------------------------------------------------------------------------------
# LMCache's multiprocess cache server (engine side), through LMCache's own client classes.

class LmcacheEngine:
    HELLO_TOKEN = 9906  # what `lmcache bench server` repeats after the sequence's first token

    def __init__(self, endpoint, geometry, name, instance_id):
        import torch
        import zmq
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import create_transfer_context
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
        g = geometry
        self.g = g
        self.name = name
        self.instance_id = instance_id
        self.zmq = zmq.Context()
        self.zmq.setsockopt(zmq.LINGER, 0)
        self.client = RequestClientFactory.create(endpoint, context=self.zmq)
        chunk = self.client.get_chunk_size().result(timeout=PATIENCE_S)
        if chunk != CHUNK_TOKENS or g.block_tokens != CHUNK_TOKENS:
            raise RuntimeError("LMCache chunk %d, pool blocks %d: the workload wants both %d" % (
                chunk, g.block_tokens, CHUNK_TOKENS))
        self.kv_caches = {
            "model.layers.%d.self_attn" % layer: torch.zeros(
                (2, g.pool_blocks, g.block_tokens, g.kv_heads, g.head_dim),
                dtype=torch.bfloat16)
            for layer in range(g.layers)}
        self.transfer = create_transfer_context(self.kv_caches, mode="lmcache_driven",
                                                instance_id=instance_id, req_client=self.client)
        # Registration re-points every tensor at a POSIX shared-memory segment the server maps.
        started = time.perf_counter()
        self.transfer.register(
            self.kv_caches, "lmcache-vs-memra-llama3-8b", 1, 1, PATIENCE_S,
            layout_hints={"kv_layout": "NHD"},
            engine_group_infos=[EngineGroupInfo(engine_group_id=0,
                                                layer_indices=tuple(range(g.layers)),
                                                tokens_per_block=g.block_tokens)],
            engine_type=EngineType.VLLM)
        self.register_s = time.perf_counter() - started
        self.layer_arrays = [t[half, 1:].view(torch.uint8).reshape(-1).numpy()
                             for t in self.kv_caches.values() for half in (0, 1)]
        self.requests = 0

    def make_room(self):
        """CLEAR (untimed). At its L1 budget LMCache 0.5.6 evicts in the background only: a STORE
        whose allocation fails is dropped ("Failed to batched allocate ... short by N blocks")
        and still answers success, so back-to-back stores at the budget would store nothing."""
        self.client.clear(True).result(timeout=PATIENCE_S)

    def _new_request(self):
        self.requests += 1
        return "%s-%d" % (self.name, self.requests)

    def _key(self, prefix, worker_id, request_id):
        """The prefix's key as `lmcache bench server` builds it: the lookup's without a worker,
        a store's or retrieve's with its worker (rank 0 of world size 1)."""
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
        tokens = (prefix,) + (self.HELLO_TOKEN,) * (self.g.tokens - 1)
        return IPCCacheServerKey(model_name="lmcache-vs-memra-llama3-8b", world_size=1,
                                 worker_id=worker_id, token_ids=tokens, start=0,
                                 end=self.g.tokens, request_id=request_id, num_kv_readers=1)

    def _blocks(self):
        return [list(self.g.block_ids)]

    def store(self, prefix):
        key = self._key(prefix, 0, self._new_request())
        event = self.transfer.create_recorded_event()
        stored = self.transfer.submit_store(key.request_id, key, self.kv_caches, self._blocks(),
                                            event, 1).result(timeout=PATIENCE_S)
        self.client.end_session(key.request_id).result(timeout=PATIENCE_S)
        if not stored:
            raise RuntimeError("LMCache STORE of prefix %d answered %r" % (prefix, stored))

    def load(self, prefix):
        request = self._new_request()
        lookup_key = self._key(prefix, None, request)
        started = time.perf_counter()
        self.client.lookup(lookup_key, 1).result(timeout=PATIENCE_S)
        hit = self.client.wait_prefetch_status(request, PATIENCE_S).result(
            timeout=PATIENCE_S)
        looked_up = time.perf_counter()
        if hit != self.g.num_blocks:
            raise RuntimeError("LMCache LOOKUP of prefix %d hit %r of %d chunks" % (
                prefix, hit, self.g.num_blocks))
        key = self._key(prefix, 0, request)
        event = self.transfer.create_recorded_event()
        retrieved = self.transfer.submit_retrieve(request, key, self.kv_caches, self._blocks(),
                                                  event, 1).result(timeout=PATIENCE_S)
        done = time.perf_counter()
        self.client.end_session(request).result(timeout=PATIENCE_S)
        if not retrieved:
            raise RuntimeError("LMCache RETRIEVE of prefix %d answered %r" % (prefix, retrieved))
        return looked_up - started, done - started

    def close(self):
        with contextlib.suppress(Exception):
            self.transfer.flush_inflight_stores()
            self.transfer.unregister().result(timeout=PATIENCE_S)
        self.transfer.close()
        self.layer_arrays = None
        self.kv_caches.clear()
        self.client.close()
        self.zmq.term()


# ---------------------------------------------------------------------------------------------
# One engine process (a role): stores then loads (A), or loads what A stored (B).

def engine_process(args):
    geometry = Geometry.of(args, args.tokens)
    name = "%s-%s-%d" % (args.system, args.role, args.tokens)
    if args.system == "memra":
        engine = MemraEngine(args.endpoint, geometry, name)
    else:
        engine = LmcacheEngine(args.endpoint, geometry, name,
                               1000 + (0 if args.role == "store" else 1))
    out = {"system": args.system, "role": args.role, "tokens": args.tokens,
           "bytes": geometry.total_bytes, "register_s": engine.register_s}
    memcpy = None
    try:
        if args.role == "store":
            fill_pattern(engine.layer_arrays, args.seed)
            memcpy = PairedMemcpy(engine.layer_arrays)
            stores, store_memcpys = [], []
            # Untimed stores first fill the budget, so every timed store writes memory the cache
            # already touched (memra: slabs its evictions emptied), not fresh pages.
            for repetition in range(args.warm_up_stores + args.reps):
                engine.make_room()
                started = time.perf_counter()
                engine.store(prefix_id(args.tag, repetition))
                elapsed = time.perf_counter() - started
                if repetition >= args.warm_up_stores:
                    stores.append(elapsed)
                    store_memcpys.append(memcpy.timed(True))
            last = prefix_id(args.tag, args.warm_up_stores + args.reps - 1)
            out.update(store_s=stores, store_memcpy_s=store_memcpys)
            loads = timed_loads(engine, memcpy, last, args.reps)
            out.update(loads)
            mismatch = pattern_mismatch(engine.layer_arrays, args.seed)
        else:
            # A pool of its own, every page written before it is registered or loaded into.
            last = prefix_id(args.tag, args.warm_up_stores + args.reps - 1)
            memcpy = PairedMemcpy(engine.layer_arrays)
            for array in engine.layer_arrays:
                array.fill(0)
            lookup_s, first_s = engine.load(last)
            out.update(first_load_s=first_s, first_lookup_s=lookup_s)
            mismatch = pattern_mismatch(engine.layer_arrays, args.seed)
            if mismatch is None:
                for array in engine.layer_arrays:  # so the timed loads' last one is checked too
                    array.fill(0)
                for scratch in memcpy.scratch:
                    scratch.fill(0)
                out.update(timed_loads(engine, memcpy, last, args.reps))
                mismatch = pattern_mismatch(engine.layer_arrays, args.seed)
        out["verified"] = mismatch is None
        if mismatch is not None:
            out["mismatch"] = mismatch
    finally:
        engine.close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0 if out["verified"] else 1


def timed_loads(engine, memcpy, prefix, reps):
    """reps loads of `prefix`, each followed by a memcpy of the same bytes into the pool. The
    memcpy's source holds zeros or the pattern; the load that follows overwrites it all."""
    loads, lookups, load_memcpys = [], [], []
    for _ in range(reps):
        lookup_s, load_s = engine.load(prefix)
        lookups.append(lookup_s)
        loads.append(load_s)
        if len(loads) < reps:  # the last load's bytes stay for the check
            load_memcpys.append(memcpy.timed(False))
    load_memcpys.append(memcpy.timed(True))  # the last pair in the other direction: same bytes
    return {"load_s": loads, "lookup_s": lookups, "load_memcpy_s": load_memcpys}


# ---------------------------------------------------------------------------------------------
# The orchestrator: the two caches, the engine processes, the table.

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, process, what, log_path):
    deadline = time.monotonic() + PATIENCE_S
    while not predicate():
        if process.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as log:
                tail = log.read()[-3000:]
            raise RuntimeError("%s never came up (exit %s): %s" % (what, process.poll(), tail))
        time.sleep(0.05)


class Service:
    """A cache process this run started, stopped by its pid."""

    def __init__(self, command, directory, name, env=None):
        self.log_path = os.path.join(directory, name + ".log")
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def start_memra(args, directory, budget):
    socket_path = os.path.join(directory, "kvd.sock")
    # Whole 128 MiB slabs: the cache keeps emptied slabs for reuse only up to its budget.
    prefix_budget = (budget + SLAB_BYTES - 1) // SLAB_BYTES * SLAB_BYTES
    command = [args.kvd, "--backend=host", "--socket_path=" + socket_path,
               "--admin_socket_path=" + os.path.join(directory, "kvd.admin.sock"),
               "--budget_bytes=%d" % (prefix_budget + 256 * MIB),
               "--prefix_cache_budget_bytes=%d" % prefix_budget, "--socket_mode=0600",
               "--watchdog=false", "--metrics_address=", "--drain_grace_ms=1000"]
    service = Service(command, directory, "memra-kvd")
    wait_for(lambda: os.path.exists(socket_path), service.process, "memra-kvd", service.log_path)
    return service, socket_path, prefix_budget


def start_lmcache(args, directory, budget):
    port, http_port = free_port(), free_port()
    l1_gb = round(budget / GIB, 3)
    lmcache = os.path.join(os.path.dirname(sys.executable), "lmcache")
    command = [lmcache, "server", "--host", "127.0.0.1", "--port", str(port),
               "--chunk-size", str(CHUNK_TOKENS), "--l1-size-gb", str(l1_gb),
               "--eviction-policy", "LRU", "--http-host", "127.0.0.1",
               "--http-port", str(http_port), "--disable-observability"]
    env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", PYTHONWARNINGS="ignore")
    service = Service(command, directory, "lmcache-server", env)

    def listening():
        with open(service.log_path) as log:
            return "LMCache cache server is running..." in log.read()

    wait_for(listening, service.process, "lmcache server", service.log_path)
    return service, "tcp://127.0.0.1:%d" % port, int(l1_gb * GIB)


def run_engine(args, system, role, endpoint, tokens, tag):
    command = [sys.executable, os.path.abspath(__file__), "--engine", role, "--system", system,
               "--endpoint", endpoint, "--tokens", str(tokens), "--tag", tag,
               "--reps", str(args.reps), "--warm-up-stores", str(args.warm_up_stores),
               "--seed", str(tokens)] + geometry_flags(args)
    env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, timeout=1800)
    results = [line[len("RESULT "):] for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        raise RuntimeError("%s %s engine (%d tokens) exited %d: %s%s" % (
            system, role, tokens, done.returncode, done.stdout[-1500:], done.stderr[-3000:]))
    return json.loads(results[-1])


def geometry_flags(args):
    return ["--layers", str(args.layers), "--kv-heads", str(args.kv_heads),
            "--head-dim", str(args.head_dim), "--block-tokens", str(args.block_tokens)]


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def median(values):
    return statistics.median(values) if values else float("nan")


def summarize(store, load):
    """One row per (system, size): GB/s at the median and the paired ratios' medians."""
    nbytes = store["bytes"]
    def paired(calls, memcpys):
        return median([m / c for c, m in zip(calls, memcpys)])  # call GB/s over memcpy GB/s
    return {
        "bytes": nbytes,
        "store_gbps": gbps(nbytes, median(store["store_s"])),
        "store_vs_memcpy": paired(store["store_s"], store["store_memcpy_s"]),
        "own_load_gbps": gbps(nbytes, median(store["load_s"])),
        "own_load_vs_memcpy": paired(store["load_s"], store["load_memcpy_s"]),
        "second_first_load_gbps": gbps(nbytes, load["first_load_s"]),
        "second_load_gbps": gbps(nbytes, median(load["load_s"])),
        "second_load_vs_memcpy": paired(load["load_s"], load["load_memcpy_s"]),
        "second_lookup_ms": 1e3 * median(load["lookup_s"]),
        "second_register_ms": 1e3 * load["register_s"],
        "memcpy_gbps": gbps(nbytes, median(store["store_memcpy_s"] + load["load_memcpy_s"])),
        "verified": store["verified"] and load["verified"],
    }


def orchestrate(args):
    systems = args.systems.split(",")
    sizes = [int(t) for t in args.tokens_list.split(",")]
    started = time.time()
    load_before = os.getloadavg()
    rows, raw, budgets = {}, [], {}
    for tokens in sizes:  # both systems at one size before the next: the same load on both
        prefix_bytes = Geometry.of(args, tokens).total_bytes
        budget = BUDGET_PREFIXES * prefix_bytes + 64 * MIB
        args.warm_up_stores = budget // prefix_bytes  # they fill it; later stores evict
        for system in systems:
            directory = tempfile.mkdtemp(prefix="memra-lmc-", dir="/tmp")
            service = None
            try:
                if system == "memra":
                    service, endpoint, budgets[(system, tokens)] = start_memra(
                        args, directory, budget)
                else:
                    service, endpoint, budgets[(system, tokens)] = start_lmcache(
                        args, directory, budget)
                tag = "%s-%d-%d" % (system, tokens, os.getpid())
                log("%s, %d tokens: engine A stores %d prefixes, loads the last" % (
                    system, tokens, args.warm_up_stores + args.reps))
                store = run_engine(args, system, "store", endpoint, tokens, tag)
                log("%s, %d tokens: engine B loads what A stored" % (system, tokens))
                load = run_engine(args, system, "load", endpoint, tokens, tag)
            except BaseException:
                if service is not None:  # what the cache said about it
                    with open(service.log_path) as f:
                        said = [line for line in f if "ERROR" in line or "WARN" in line]
                    log("%s, its last warnings and errors:\n%s" % (
                        os.path.basename(service.log_path), "".join(said[-20:])))
                raise
            finally:
                if service is not None:
                    service.stop()
                shutil.rmtree(directory, ignore_errors=True)
            raw += [store, load]
            rows[(system, tokens)] = summarize(store, load)
    report = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "machine": "%s, %d CPUs, %s" % (platform.processor() or platform.machine(),
                                        os.cpu_count(), platform.platform()),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "geometry": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                     "dtype": "bf16", "block_tokens": args.block_tokens},
        "reps": args.reps, "warm_up_stores": args.warm_up_stores,
        "budget_bytes": {"%s/%d" % key: value for key, value in budgets.items()},
        "versions": versions(systems),
        "rows": [dict(system=s, tokens=t, **r) for (s, t), r in rows.items()],
        "raw": raw,
    }
    print_table(report, rows, systems, sizes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["verified"] for r in rows.values()) else 1


def versions(systems):
    out = {"python": platform.python_version(), "numpy": np.__version__}
    if "lmcache" in systems:
        import importlib.metadata as md
        out.update(lmcache=md.version("lmcache"), torch=md.version("torch"))
    return out


def print_table(report, rows, systems, sizes):
    print("\n%s UTC, %s; load average %.1f before, %.1f after; %s" % (
        report["date_utc"], report["machine"], report["load_average_before"][0],
        report["load_average_after"][0], json.dumps(report["versions"])))
    header = ["system", "prefix", "MiB", "store GB/s", "store/memcpy", "own load GB/s",
              "own load/memcpy", "2nd proc 1st load GB/s", "2nd proc load GB/s",
              "2nd proc load/memcpy", "lookup ms", "memcpy GB/s", "bytes equal"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for tokens in sizes:
        for system in systems:
            r = rows[(system, tokens)]
            print("| %s | %s | %.0f | %.2f | %.2fx | %.2f | %.2fx | %.2f | %.2f | %.2fx | %.1f | "
                  "%.2f | %s |" % (
                      system, tokens_label(tokens), r["bytes"] / MIB, r["store_gbps"],
                      r["store_vs_memcpy"], r["own_load_gbps"], r["own_load_vs_memcpy"],
                      r["second_first_load_gbps"], r["second_load_gbps"],
                      r["second_load_vs_memcpy"], r["second_lookup_ms"], r["memcpy_gbps"],
                      "yes" if r["verified"] else "NO"))
    if "memra" in systems and "lmcache" in systems:
        print("\nmemra / LMCache (GB/s over GB/s):")
        for tokens in sizes:
            m, l = rows[("memra", tokens)], rows[("lmcache", tokens)]
            print("  %s: store %.2fx, own load %.2fx, second-process load %.2fx "
                  "(first %.2fx)" % (
                      tokens_label(tokens), m["store_gbps"] / l["store_gbps"],
                      m["own_load_gbps"] / l["own_load_gbps"],
                      m["second_load_gbps"] / l["second_load_gbps"],
                      m["second_first_load_gbps"] / l["second_first_load_gbps"]))


def tokens_label(tokens):
    return "%dk" % (tokens // 1024) if tokens % 1024 == 0 else str(tokens)


def log(message):
    print("[%s] %s" % (time.strftime("%H:%M:%S"), message), file=sys.stderr, flush=True)


def default_kvd():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, "bazel-bin", "server", "memra-kvd")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default="memra,lmcache")
    parser.add_argument("--tokens_list", "--tokens-list", default="1024,32768")
    parser.add_argument("--reps", type=int, default=5, help="timed stores and loads per size")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=2, help="per rank (Llama-3-8B: 8 / TP)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-tokens", type=int, default=CHUNK_TOKENS)
    parser.add_argument("--kvd", default=default_kvd())
    parser.add_argument("--json", help="write every number here")
    # An engine process (internal).
    parser.add_argument("--engine", choices=["store", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--warm-up-stores", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        args.role = args.engine
        return engine_process(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
