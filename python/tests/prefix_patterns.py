"""The prefix-engine byte pattern over a session's live rows, as tests/e2e/prefix_engine.cc
writes and checks it (ForEachLiveRange), so a Python engine and the C++ prefix_engine can each
read what the other wrote."""

import numpy as np

import memra_kv
from memra_kv import plans
from kvtest import aligned_window_start, as_bytes, prefix_pattern


def plan_named(name):
    """prefix_engine.cc PlanNamed."""
    if name == "flat":
        return plans.model_plan([plans.kv_layer(i, 32, 1) for i in range(2)])
    if name == "hybrid":
        return plans.model_plan([plans.kv_layer(0, 32, 1), plans.recurrent_layer(1, 16, 4, 64)])
    if name == "swa":
        return plans.model_plan([plans.sliding_layer(0, 32, 1, 64), plans.kv_layer(1, 32, 1)],
                                swa_ring=True)
    if name == "latent":
        return plans.model_plan([plans.latent_layer(0, 16, 8, 4), plans.latent_layer(1, 16)],
                                index_ring_rows=32)
    raise ValueError(name)


def tokens(n):
    return [i * 5 + 7 for i in range(n)]


def live_ranges(session, state, aligned):
    """(layer, kind, rows view as uint8 rows, physical_first, first, end, seed) for every live
    range; `aligned`: ring layers from the aligned window start (the checker), else from the
    base (the writer)."""
    live = {layer.layer: layer for layer in state.layers}
    for layer in session.layout.layers:
        il = layer.layer
        # Recurrent layers have no length of their own: no LayerState.
        entry = live.get(il)
        length, base, ready = ((entry.length, entry.ring_base, entry.index_pools_ready)
                               if entry is not None else (0, 0, 0))
        if session.has_plane(il, memra_kv.CONV_STATE):
            for kind in (memra_kv.CONV_STATE, memra_kv.SSM_STATE):
                whole = session.plane_bytes(il, kind).reshape(1, -1)  # one row: the plane
                yield il, kind, whole, 0, 0, 1, state.committed_len
        elif session.has_plane(il, memra_kv.LATENT_ROWS):
            yield il, memra_kv.LATENT_ROWS, as_bytes(session.plane(il, memra_kv.LATENT_ROWS)), \
                0, 0, length, 0
            if layer.index_width == 0:
                continue
            yield il, memra_kv.POOL_KEYS, as_bytes(session.plane(il, memra_kv.POOL_KEYS)), \
                0, 0, ready, 0
            tail = ready * layer.index_pool
            ring_rows = layer.index_physical_rows if layer.index_ring else 0
            effective = ring_rows // layer.index_pool * layer.index_pool
            physical = tail % effective if ring_rows else tail
            yield il, memra_kv.INDEX_ROWS, as_bytes(session.plane(il, memra_kv.INDEX_ROWS)), \
                physical, tail, length, 0
        elif session.has_plane(il, memra_kv.KEYS):
            if layer.ring:
                first = aligned_window_start(length, layer.window) if aligned else base
            else:
                first = 0
            physical = first - base if layer.ring else 0
            for kind in (memra_kv.KEYS, memra_kv.VALUES):
                yield il, kind, session.plane(il, kind), physical, first, length, 0


def write_pattern(session, state):
    for layer, kind, rows, physical, first, end, seed in live_ranges(session, state, False):
        if end > first:
            rows[physical:physical + end - first] = prefix_pattern(layer, kind, first, end,
                                                                   rows.shape[1], seed)


def check_pattern(session, state):
    """Returns the bytes checked; raises AssertionError naming the first differing byte."""
    checked = 0
    for layer, kind, rows, physical, first, end, seed in live_ranges(session, state, True):
        if end <= first:
            continue
        held = rows[physical:physical + end - first]
        expected = prefix_pattern(layer, kind, first, end, rows.shape[1], seed)
        if not np.array_equal(held, expected):
            row, byte = np.argwhere(held != expected)[0]
            raise AssertionError("layer %d kind %d row %d byte %d differs from the source's" % (
                layer, kind, first + row, byte))
        checked += held.size
    return checked


def commit_rows(session, token_ids):
    """prefix_engine.cc CommitRows: chunks of at most 512 rows, each commit with its tokens."""
    done = 0
    while done < len(token_ids):
        chunk = min(len(token_ids) - done, 512)
        tx = session.begin()
        session.prepare_append(tx.generation, chunk)
        session.publish_append(tx.generation)
        session.commit(tx.generation, chunk, token_ids[done:done + chunk])
        done += chunk
