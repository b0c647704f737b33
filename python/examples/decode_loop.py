"""A complete Python engine on memra-kvd: attach, a plan from a Hugging Face config.json, prefill
with a prefix-cache lookup / restore / capture, and a batched decode loop over StepBatch. The
"kernels" here are numpy writes of made-up rows into the mapped planes.

    deploy/dev.sh run --prefix_cache_budget_bytes=256MiB     # in another terminal
    PYTHONPATH=python /usr/bin/python3 python/examples/decode_loop.py
"""

import os

import numpy as np

import memra_kv

SOCKET = os.environ.get("MEMRA_KV_SOCKET", "/tmp/memra-kv/gpu0.sock")
CONFIG = os.environ.get("HF_CONFIG", "tests/data/hf_configs/llama-3.1-8b.json")
PROMPT = list(range(1000, 1256))  # token ids: one 256-token prefix block
STEPS = 32


def kernel_rows(layer, kind, first, rows, row_bytes):
    """Stand-in for the attention kernels: deterministic bytes for absolute rows [first, +rows)."""
    row = np.arange(first, first + rows, dtype=np.uint32)[:, None]
    byte = np.arange(row_bytes, dtype=np.uint32)[None, :]
    return ((row * 7 + byte * 3 + layer * 11 + kind) & 0xFF).astype(np.uint8)


def write_rows(session, append, first, rows):
    """What an engine's kernels do after PrepareAppend: write each K/V layer's new rows (after a
    ring layer's rebase copy) at the physical row the daemon chose."""
    for layer in append.layers:
        for kind in (memra_kv.KEYS, memra_kv.VALUES):
            plane = session.plane(layer.layer, kind)  # numpy (rows, row_bytes) over the arena
            if layer.rebase:
                plane[:layer.keep_rows] = plane[layer.src_row:layer.src_row + layer.keep_rows].copy()
            plane[layer.write_row:layer.write_row + rows] = kernel_rows(
                layer.layer, kind, first, rows, plane.shape[1])


def prefill(client, plan, session, tokens):
    """Restores the longest cached prefix, computes the rest, and caches the whole prompt."""
    match = client.lookup_prefix(plan, tokens)
    done = 0
    if match.outcome != "miss":
        done = client.restore_prefix(session, tokens, match.entry_id).restored_tokens
    if done < len(tokens):
        tx = session.begin()
        append = session.prepare_append(tx.generation, len(tokens) - done)
        write_rows(session, append, done, len(tokens) - done)
        session.publish_append(tx.generation)
        session.commit(tx.generation, len(tokens) - done, token_ids=tokens[done:])
        client.capture_prefix(session, tokens, len(tokens) // 256 * 256)
    return done


def main():
    with memra_kv.Client.connect(SOCKET, timeout=10) as client:
        client.attach("example-engine")  # the lease is kept alive on a daemon thread
        model = client.import_model(CONFIG)  # the daemon's importer; registered
        plan = model.plan_fingerprint
        print("model", model.architecture, "costs", client.cost(4096, fingerprint=plan).arena_bytes,
              "bytes a 4096-token session")

        sessions = [client.create_session(plan, capacity=4096) for _ in range(2)]
        restored = [prefill(client, plan, session, PROMPT) for session in sessions]
        print("prefill: restored tokens", restored)  # [0, 256]: the second hit the cache

        batch = memra_kv.StepBatch()  # one Step RPC per decode step for every session
        tokens = [list(PROMPT) for _ in sessions]
        for _ in range(STEPS):
            batch.clear()
            for session in sessions:
                batch.begin(session)
            begun = client.step(batch)
            batch.clear()
            for session, outcome in zip(sessions, begun):
                batch.prepare(session, outcome.begun.generation, 1)
            prepared = client.step(batch)
            batch.clear()
            for i, (session, outcome) in enumerate(zip(sessions, prepared)):
                write_rows(session, outcome.prepared, begun[i].begun.base_len, 1)
                batch.publish(session, begun[i].begun.generation)
            client.step(batch)
            batch.clear()
            for i, session in enumerate(sessions):
                next_token = 2000 + len(tokens[i])  # the sampler's choice
                tokens[i].append(next_token)
                batch.commit(session, begun[i].begun.generation, 1, token_ids=[next_token])
            committed = [outcome.committed_len for outcome in client.step(batch)]
        print("decoded: committed", committed)

        # Both sessions hold the same bytes: the second's prompt rows came from the cache.
        first_keys = sessions[0].plane(0, memra_kv.KEYS)
        second_keys = sessions[1].plane(0, memra_kv.KEYS)
        assert np.array_equal(first_keys[:committed[0]], second_keys[:committed[1]])
        for session in sessions:
            session.release()
        return restored, committed


if __name__ == "__main__":
    main()
