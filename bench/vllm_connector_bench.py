#!/usr/bin/env python3
"""vLLM-shaped loads and saves through memra_kv.vllm's worker side (bench/README.md, "vLLM
connector"), run with the vLLM engine venv's interpreter (torch CPU tensors):

    VENV=$(python/engines/engine_venv.sh python/engines/vllm-requirements.txt)
    PYTHONPATH=<memra_kv installed with that venv> $VENV/bin/python bench/vllm_connector_bench.py \
        --kvd bazel-bin/server/memra-kvd [--tp 4] [--rounds 5] [--tokens 1024,32768]

The KV cache is Llama-3-8B's per-rank layout at tensor parallelism --tp (32 layers, 8 / tp KV
heads of 128, bf16, 16-token blocks), one torch CPU tensor per layer in vLLM 0.33's LBNHC view
(num_blocks, heads, block_size, K and V dims: NHD pages), as vLLM's allocate_kv_cache hands them
to register_kv_caches; a real memra-kvd (host backend) started by this script. Every round, in
this order on the same daemon and tensors:

  * save: MemraWorker.wait_for_save of the sequence's blocks (new keys every round: each
    store copies) through the registered staging pool (64 blocks), layer hooks off;
  * load: MemraWorker.start_load_kv of the same blocks into other pool blocks (synchronous),
    checked byte for byte once;
  * memcpy: one torch copy of the same number of bytes between two warm contiguous buffers;
  * forward: the forward-pass stand-in alone (torch matmuls on the calling thread, sized to
    take about as long as this round's sync load);
  * async: the load marked asynchronous beside the forward stand-in, until get_finished
    reports it (overlapped); against the sync load then the same forward (serial).

torch runs one thread (torch.set_num_threads(1)), so the forward stand-in and the loader thread
each have a core of a 2-core machine. Prints one JSON line per sequence length (medians over the
rounds after one warm-up) and the machine's load average."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from memra_kv import Client
from memra_kv.block_store import BlockStore
from memra_kv.vllm import LoadSpec, MemraConnectorMetadata, MemraWorker, SaveSpec

BLOCK = 16
LAYERS = 32
HEAD_DIM = 128


def start_daemon(kvd, directory, budget_bytes):
    socket = os.path.join(directory, "kvd.sock")
    log = open(os.path.join(directory, "kvd.log"), "w")
    process = subprocess.Popen(
        [kvd, "--socket_path=" + socket, "--socket_mode=0600", "--watchdog=false",
         "--metrics_address=", "--backend=host", "--budget_bytes=%d" % (budget_bytes + (1 << 28)),
         "--prefix_cache_budget_bytes=%d" % budget_bytes], stdout=log, stderr=subprocess.STDOUT)
    while not os.path.exists(socket):
        if process.poll() is not None:
            raise RuntimeError("memra-kvd exited: see %s/kvd.log" % directory)
        time.sleep(0.05)
    return process, socket


def caches(num_blocks, heads):
    """vLLM 0.33's per-layer LBNHC views: (num_blocks, heads, block, 2 * head_dim), NHD pages."""
    return {"model.layers.%d.self_attn.attn" % layer:
            torch.randint(-1000, 1000, (num_blocks, BLOCK, heads, 2 * HEAD_DIM),
                          dtype=torch.int16).view(torch.bfloat16).permute(0, 2, 1, 3)
            for layer in range(LAYERS)}


def forward_stand_in(seconds_target, calibration):
    """torch matmuls for about seconds_target (calibration: seconds per matmul)."""
    a = torch.ones(512, 512)
    for _ in range(max(1, int(seconds_target / calibration))):
        a = (a @ a) * 1e-3


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvd", required=True)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", default="1024,32768")
    args = parser.parse_args()
    torch.set_num_threads(1)
    heads = 8 // args.tp
    lengths = [int(t) for t in args.tokens.split(",")]
    blocks = max(lengths) // BLOCK
    block_bytes = LAYERS * heads * BLOCK * 2 * HEAD_DIM * 2  # every layer's page of a block
    directory = tempfile.mkdtemp(prefix="memra-vllm-bench-", dir="/tmp")
    # Room for one round's blocks and a quarter more: each round's new keys evict the last's.
    daemon, socket = start_daemon(args.kvd, directory, blocks * block_bytes * 5 // 4)
    try:
        kv = caches(2 * blocks, heads)  # saved blocks 0..blocks-1, loaded into blocks..2*blocks-1
        client = Client.connect(socket, timeout=60)
        client.attach("vllm-bench-worker")
        worker = MemraWorker(BlockStore(client), staging_blocks=64, layerwise=False)
        worker.register_kv_caches(kv, (), "meta-llama/Meta-Llama-3-8B", 0, args.tp)
        a = torch.ones(512, 512)
        calibration = timed(lambda: [a @ a for _ in range(50)]) / 50
        for tokens in lengths:
            n = tokens // BLOCK
            nbytes = n * block_bytes
            src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes,
                                                                           dtype=torch.uint8)
            src.fill_(1)
            dst.fill_(2)
            rows = {"save": [], "load": [], "memcpy": [], "forward": [], "serial": [],
                    "overlapped": [], "async_load_alone": []}
            for rnd in range(args.rounds + 1):
                keys = [b"r%d-t%d-b%d" % (rnd, tokens, i) for i in range(n)]
                saves = MemraConnectorMetadata([], [SaveSpec("s", keys, list(range(n)), b"",
                                                             [])])
                save = timed(lambda: worker.wait_for_save(saves))
                assert worker.get_block_ids_with_load_errors() == set()
                targets = list(range(blocks, blocks + n))
                loads = MemraConnectorMetadata([LoadSpec("l", keys, targets)], [])
                load = timed(lambda: worker.start_load_kv(loads))
                assert worker.get_block_ids_with_load_errors() == set(), "a block did not load"
                if rnd == 0:
                    for cache in kv.values():
                        assert torch.equal(cache[targets].view(torch.int16),
                                           cache[:n].view(torch.int16)), "loaded bytes differ"
                copy = timed(lambda: dst.copy_(src))
                forward = timed(lambda: forward_stand_in(load, calibration))
                # Serial: the sync load then the step's forward; overlapped: the async load
                # beside the forward, done when get_finished reports it.
                serial = timed(lambda: (worker.start_load_kv(loads),
                                        forward_stand_in(load, calibration)))
                async_loads = MemraConnectorMetadata([LoadSpec("a", keys, targets, True)], [])

                def overlapped():
                    worker.start_load_kv(async_loads)
                    forward_stand_in(load, calibration)
                    while worker.get_finished(set())[1] is None:
                        time.sleep(0.0005)  # polling as vLLM's step loop does, each step
                alone_start = time.perf_counter()
                worker.start_load_kv(async_loads)
                while worker.get_finished(set())[1] is None:
                    time.sleep(0.0005)
                alone = time.perf_counter() - alone_start
                together = timed(overlapped)
                assert worker.get_block_ids_with_load_errors() == set()
                if rnd == 0:
                    continue  # warm-up
                for name, value in (("save", save), ("load", load), ("memcpy", copy),
                                    ("forward", forward), ("serial", serial),
                                    ("overlapped", together),
                                    ("async_load_alone", alone)):
                    rows[name].append(value)
            med = {name: statistics.median(values) for name, values in rows.items()}
            gib = nbytes / (1 << 30)
            print(json.dumps({
                "tokens": tokens, "blocks": n, "bytes": nbytes, "tp": args.tp,
                "ms": {name: round(value * 1e3, 2) for name, value in med.items()},
                "GiB_s": {name: round(gib / med[name], 2) for name in ("save", "load", "memcpy")},
                "save_over_memcpy": round(med["save"] / med["memcpy"], 1),
                "load_over_memcpy": round(med["load"] / med["memcpy"], 1),
                # The step time the async load hides: serial - overlapped, as a fraction of the
                # load (1: all of it; the forward alone is the floor of the overlapped time).
                "hidden_fraction_of_load": round((med["serial"] - med["overlapped"])
                                                 / med["load"], 2)}), flush=True)
        worker.shutdown()
        client.close()
        print(json.dumps({"loadavg": open("/proc/loadavg").read().split()[:3],
                          "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                       time.gmtime())}))
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
