"""The second engine of test_formats.py, its own process: imports the same config (so the same
bf16 plan), restores the prefix the first engine captured into a fresh session, reads the K/V
rows back through the typed view and writes what it read to OUT_FILE.

    formats_reader.py SOCKET CONFIG OUT_FILE TOKENS
"""

import sys

import numpy as np

import memra_kv


def main(socket_path, config, out, tokens):
    token_ids = [int(t) for t in tokens.split(",")]
    client = memra_kv.Client.connect(socket_path)
    client.attach("py-bf16-reader")
    imported = client.import_model(config)
    plan = imported.plan_fingerprint
    session = client.create_session(plan, 16)
    match = client.lookup_prefix(plan, token_ids)
    restored = client.restore_prefix(session, token_ids, match.entry_id)
    rows = restored.restored_tokens
    layers = [entry.layer for entry in session.layout.layers]
    keys = np.stack([memra_kv.float32_from_bf16_bits(
        session.typed_plane(layer, memra_kv.KEYS, storage=True)[:rows]) for layer in layers])
    values = np.stack([memra_kv.float32_from_bf16_bits(
        session.typed_plane(layer, memra_kv.VALUES, storage=True)[:rows]) for layer in layers])
    np.savez(out + ".tmp.npz", keys=keys, values=values, restored=rows,
             shape=np.array(session.typed_plane(0, memra_kv.KEYS, storage=True).shape))
    import os
    os.rename(out + ".tmp.npz", out)
    session.release()
    client.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
