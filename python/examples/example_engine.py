"""What the examples share: the command line, a small model plan, and the stand-in "kernels"
(deterministic rows written into, and checked in, the mapped planes). Not part of memra_kv."""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

import numpy as np

import memra_kv
from memra_kv import plans

DEFAULT_SOCKET = "/tmp/memra-kv/gpu0.sock"  # where `deploy/dev.sh run` listens
KV_LAYERS = 4


def parse_args(description: str, argv: Optional[Sequence[str]] = None,
               parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """--socket (the daemon's engine socket) and --hf-config (a config.json: the model plan
    the daemon imports from it instead of the small built-in plan)."""
    parser = parser or argparse.ArgumentParser(description=description)
    parser.add_argument("--socket", default=DEFAULT_SOCKET,
                        help="memra-kvd's engine socket (default %(default)s)")
    parser.add_argument("--hf-config", default=None,
                        help="a Hugging Face config.json to import the plan from (default: a "
                        "small %d-layer bf16 plan built with memra_kv.plans)" % KV_LAYERS)
    return parser.parse_args(argv)


def register_model(client: memra_kv.Client, hf_config: Optional[str],
                   recurrent: bool = False) -> bytes:
    """The fingerprint of the model plan sessions are created with: imported from hf_config,
    or built here (KV_LAYERS full-attention layers, plus one linear-attention layer when
    `recurrent`)."""
    if hf_config is not None:
        return client.import_model(hf_config).plan_fingerprint
    layers = [plans.kv_layer(i, head_dim=64, n_head_kv=2, formats=plans.element_formats("bf16"))
              for i in range(KV_LAYERS)]
    if recurrent:
        layers.append(plans.recurrent_layer(KV_LAYERS, conv_width=64, conv_kernel=4,
                                            state_width=256))
    return client.register_plan(plans.model_plan(layers, name="example"))


def kernel_rows(layer: int, kind: int, first: int, rows: int, row_bytes: int,
                tokens: Sequence[int]) -> np.ndarray:
    """Stand-in for the attention kernels: the bytes of absolute rows [first, first + rows), a
    function of each row's token id, so equal prefixes have equal rows."""
    token = np.asarray(tokens[first:first + rows], dtype=np.uint32)[:, None]
    byte = np.arange(row_bytes, dtype=np.uint32)[None, :]
    return ((token * 7 + byte * 3 + layer * 11 + kind) & 0xFF).astype(np.uint8)


def write_rows(session: memra_kv.Session, append: memra_kv.PreparedAppend, first: int,
               tokens: Sequence[int]) -> None:
    """What an engine's kernels do after a prepare: write each K/V layer's new rows (after a
    ring layer's rebase copy) at the physical row the daemon chose. `tokens`: every token id
    of the sequence; the rows are [first, append.target)."""
    rows = append.target - first
    for layer in append.layers:
        for kind in (memra_kv.KEYS, memra_kv.VALUES):
            plane = session.plane(layer.layer, kind)  # numpy (rows, row_bytes) over the arena
            if layer.rebase:
                kept = plane[layer.src_row:layer.src_row + layer.keep_rows].copy()
                plane[:layer.keep_rows] = kept
            plane[layer.write_row:layer.write_row + rows] = kernel_rows(
                layer.layer, kind, first, rows, plane.shape[1], tokens)


def check_rows(session: memra_kv.Session, tokens: Sequence[int]) -> int:
    """Verifies every committed row of every full-attention layer against the kernels' bytes;
    returns the rows checked. Raises AssertionError naming the first wrong row."""
    committed = session.state().committed_len
    for layer in range(KV_LAYERS):
        for kind in (memra_kv.KEYS, memra_kv.VALUES):
            plane = session.plane(layer, kind)
            want = kernel_rows(layer, kind, 0, committed, plane.shape[1], tokens)
            wrong = np.nonzero((plane[:committed] != want).any(axis=1))[0]
            assert wrong.size == 0, "layer %d plane %d: row %d differs" % (layer, kind, wrong[0])
    return committed


def token_stream(start: int, count: int) -> List[int]:
    """Made-up token ids (the sampler's choices)."""
    return [(start * 31 + i * 17) % 32000 for i in range(count)]
