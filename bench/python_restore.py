#!/usr/bin/python3
"""Restore throughput from Python, for memra_bench's python_restore section (bench/README.md).

    python_restore.py --socket=S --python_path=P --out=FILE --tokens=2048 --load_blocks=256 \
        --repetitions=20

Attaches to memra-kvd with memra_kv and measures, each against a numpy copy of the same bytes in
the same process, paired repetition by repetition:
- a prefix restore (Client.restore_prefix: one Restore RPC, the daemon copies) of a dense
  model's `tokens`-token entry (Llama-3.2-1B's K/V geometry: 16 layers of 8 heads of 64, in bf16
  as an engine keeps them: 32 KiB a token; 256-token blocks) into a RECYCLED session (reset
  between restores, after two warm-up restores), against a copy between two warm buffers;
- the same restore into a FRESH session (created just before, untimed, released after; its
  arena comes from the daemon's pool once one was released), against a copy into a fresh
  memfd mapping (first touch, as the daemon's copy into never-touched arena pages pays);
- a block-store load (BlockStore.load: one LoadBlocks RPC) of `load_blocks` blocks of an engine
  pool of section 8's geometry (8 layers of K and V, 8 heads of 64, fp16, 16-token blocks: 256
  KiB a block) into pool blocks the engine has written before, against a copy between warm
  buffers;
- what Python itself adds per call: building the request (the token ids into protobuf) and the
  round trip of a call that copies nothing (GetSessionState).
Writes the figures (ms, p50 over the repetitions; ratios: p50 of each repetition's memcpy time
over its call's, the pair run back to back) as JSON to FILE.
"""

import argparse
import json
import mmap
import os
import sys
import time


def p50(samples):
    return sorted(samples)[len(samples) // 2]


def paired_ratio(copies, calls):
    """p50 over repetitions of memcpy time / call time: the pair saw the same neighbours."""
    return p50([copy / call for copy, call in zip(copies, calls)])


def timed(call):
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def main():
    parser = argparse.ArgumentParser()
    for flag in ("socket", "python_path", "out"):
        parser.add_argument("--" + flag, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--load_blocks", type=int, required=True)
    parser.add_argument("--repetitions", type=int, required=True)
    args = parser.parse_args()
    sys.path.insert(0, args.python_path)
    import numpy as np
    import memra_kv
    from memra_kv import plans
    from memra_kv._proto import prefix_pb2
    from memra_kv.block_store import BlockStore, HostPool, PoolLayout, TensorLayout

    figures = {}
    reps = args.repetitions
    with memra_kv.Client.connect(args.socket) as client:
        client.attach("bench-python-restore")
        # ---- prefix restore ----
        plan = client.register_plan(plans.in_element_format(plans.model_plan(
            [plans.kv_layer(i, 64, 8) for i in range(16)], name="llama-3.2-1b-kv"), "bf16"))
        tokens = [7 + 5 * i for i in range(args.tokens)]
        source = client.create_session(plan, args.tokens)
        source.advance(next_rows=args.tokens)
        source.advance(args.tokens, token_ids=tokens)
        captured = client.capture_prefix(source, tokens, args.tokens)
        source.release()
        nbytes = captured.stored_bytes
        warm_from = np.ones(nbytes, np.uint8)
        warm_to = np.ones(nbytes, np.uint8)
        recycled = client.create_session(plan, args.tokens)
        restore, copy, build, floor = [], [], [], []
        for rep in range(reps + 2):
            recycled.reset()
            took, restored = timed(lambda: client.restore_prefix(recycled, tokens,
                                                                 captured.entry_id))
            if restored.restored_tokens != args.tokens:
                raise SystemExit("restored %d tokens of %d" % (restored.restored_tokens,
                                                               args.tokens))
            copied, _ = timed(lambda: np.copyto(warm_to, warm_from))
            built, _ = timed(lambda: prefix_pb2.RestorePrefixRequest(
                session=recycled.ref, entry_id=captured.entry_id, token_ids=tokens))
            round_trip, _ = timed(recycled.state)
            if rep >= 2:  # two warm-ups
                restore.append(took)
                copy.append(copied)
                build.append(built)
                floor.append(round_trip)
        recycled.release()
        fresh_restore, fresh_copy = [], []
        for _ in range(reps):
            fresh = client.create_session(plan, args.tokens)
            took, _ = timed(lambda: client.restore_prefix(fresh, tokens, captured.entry_id))
            fresh.release()
            fd = os.memfd_create("bench-first-touch")
            os.ftruncate(fd, nbytes)
            with mmap.mmap(fd, nbytes, mmap.MAP_SHARED) as region:
                target = np.frombuffer(region, np.uint8)
                copied, _ = timed(lambda: np.copyto(target, warm_from))
                del target
            os.close(fd)
            fresh_restore.append(took)
            fresh_copy.append(copied)
        figures["restore"] = {
            "bytes": nbytes, "tokens": args.tokens,
            "recycled_ms": p50(restore) * 1e3, "memcpy_warm_ms": p50(copy) * 1e3,
            "fresh_ms": p50(fresh_restore) * 1e3,
            "memcpy_first_touch_ms": p50(fresh_copy) * 1e3,
            "request_build_ms": p50(build) * 1e3, "rpc_floor_ms": p50(floor) * 1e3,
            "ratio_recycled_memcpy": paired_ratio(copy, restore),
            "ratio_fresh_first_touch_memcpy": paired_ratio(fresh_copy, fresh_restore)}

        # ---- block store load ----
        loaded = args.load_blocks
        layers, heads, head_dim, block_tokens, blocks = 8, 8, 64, 16, 2 * loaded
        block_bytes = block_tokens * heads * head_dim * 2
        tensors = []
        for layer in range(layers):
            for kind in ("K", "V"):
                tensors.append(TensorLayout(layer, kind, len(tensors) * block_bytes * blocks,
                                            block_bytes, block_bytes))
        layout = PoolLayout(blocks, block_tokens, "fp16", heads, head_dim, "bench-pool", tensors)
        pool = HostPool(len(tensors) * block_bytes * blocks)
        pool.array[:] = 1  # the engine's pool, written before (as an engine's forward pass does)
        store = BlockStore(client)
        registration = store.register([pool], layout)
        hashes = [os.urandom(16) for _ in range(loaded)]
        stored = store.store(registration, list(range(loaded)), hashes=hashes)
        if not stored.ok:
            raise SystemExit("store failed: %s" % stored.failed)
        load_bytes = loaded * block_bytes * len(tensors)
        load_from = np.ones(load_bytes, np.uint8)
        load_to = np.ones(load_bytes, np.uint8)
        into = list(range(loaded, 2 * loaded))
        load, load_copy = [], []
        for rep in range(reps + 2):
            took, transfer = timed(lambda: store.load(registration, into, hashes=hashes))
            if not transfer.ok or transfer.copied_bytes != load_bytes:
                raise SystemExit("load failed: %s, %d bytes" % (transfer.failed,
                                                                transfer.copied_bytes))
            copied, _ = timed(lambda: np.copyto(load_to, load_from))
            if rep >= 2:
                load.append(took)
                load_copy.append(copied)
        store.unregister(registration)
        pool.close()
        figures["block_load"] = {"bytes": load_bytes, "blocks": loaded,
                                 "load_ms": p50(load) * 1e3,
                                 "memcpy_warm_ms": p50(load_copy) * 1e3,
                                 "ratio_load_memcpy": paired_ratio(load_copy, load)}
    with open(args.out + ".tmp", "w") as f:
        json.dump(figures, f)
    os.rename(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
