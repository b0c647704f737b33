"""Typed planes through torch, in the engine venv (the one place the tests have torch): a Python
engine writes an imported Llama-3.1-8B's bf16 K/V rows through `Session.torch_plane` (a
torch.bfloat16 CPU tensor of shape (rows, heads, head_dim) over the mapped memory, no copy),
captures them, and a second engine process restores the prefix and reads them back
(python/tests/formats_reader.py); then python/tests/test_formats.py's own cases run here too, so
their torch branches run for real instead of their "torch missing" refusal."""

import numpy as np
import torch

import memra_kv
from test_formats import (  # noqa: F401 (the two test_ names run here too)
    DAEMON_FLAGS, LLAMA_CONFIG, TOKENS, assert_another_process_reads_the_rows_back, expected_rows,
    test_a_bf16_prefix_written_through_the_typed_view_is_read_back_by_another_process,
    test_typed_views_of_other_planes_and_the_refusals)


def test_bf16_rows_written_through_torch_are_read_back_by_another_process(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    writer = daemon.client("py-torch-writer")
    plan = writer.import_model(LLAMA_CONFIG).plan_fingerprint
    session = writer.create_session(plan, 16)
    keys = session.torch_plane(0, memra_kv.KEYS)
    assert keys.dtype == torch.bfloat16 and tuple(keys.shape) == (16, 8, 128)
    assert keys.device.type == "cpu"

    tx = session.begin()
    append = session.prepare_append(tx.generation, len(TOKENS))
    for layer in append.layers:
        for plane_index, kind in enumerate((memra_kv.KEYS, memra_kv.VALUES)):
            view = session.torch_plane(layer.layer, kind)
            rows = slice(layer.write_row, layer.write_row + len(TOKENS))
            view[rows] = torch.from_numpy(
                expected_rows(layer.layer, plane_index, len(TOKENS), 8, 128)).to(torch.bfloat16)
    # The tensor is the plane's memory: the raw bf16 bits show through the storage view.
    bits = session.typed_plane(0, memra_kv.KEYS, storage=True)[:len(TOKENS)]
    np.testing.assert_array_equal(memra_kv.float32_from_bf16_bits(bits),
                                  expected_rows(0, 0, len(TOKENS), 8, 128))
    session.publish_append(tx.generation)
    session.commit(tx.generation, len(TOKENS), TOKENS)
    writer.capture_prefix(session, TOKENS, len(TOKENS))

    assert_another_process_reads_the_rows_back(daemon)
    session.release()
    writer.close()
