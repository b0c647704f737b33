"""Element formats end to end (docs/rules.md#formats): an imported Llama-3.1-8B is a bf16 plan;
a Python engine writes bf16 rows through the typed view (rows, heads, head_dim), captures them
into the prefix cache, and a second engine process restores and reads them back; a prefix
restores only into a session of the same formats, and every refusal names its numbers."""

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

import memra_kv
from memra_kv import KvError, plans
from kvtest import dense_plan, repo_root

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA_CONFIG = os.path.join(repo_root(), "tests", "data", "hf_configs", "llama-3.1-8b.json")
DAEMON_FLAGS = ("--budget_bytes=512MiB", "--prefix_cache_budget_bytes=64MiB",
                "--prefix_block_tokens=4")
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]


def expected_rows(layer, plane, rows, heads, head_dim):
    """Values every element of the test's rows holds: exact in bf16 (multiples of 1/8 below 32)."""
    r, h, i = np.meshgrid(np.arange(rows), np.arange(heads), np.arange(head_dim), indexing="ij")
    return ((layer * 7 + plane * 3 + r * 5 + h * 2 + i) % 256 / 8.0 - 16.0).astype(np.float32)


def assert_another_process_reads_the_rows_back(daemon):
    """formats_reader.py, in its own process, restores the captured TOKENS prefix of the
    imported Llama-3.1-8B into a fresh session and reads every layer's K/V rows: they must be
    expected_rows."""
    out = os.path.join(daemon.dir, "reader.npz")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    reader = subprocess.run([sys.executable, os.path.join(HERE, "formats_reader.py"),
                             daemon.socket, LLAMA_CONFIG, out, ",".join(map(str, TOKENS))],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=120)
    assert reader.returncode == 0, reader.stdout
    read = np.load(out)
    assert int(read["restored"]) == len(TOKENS)
    assert tuple(read["shape"]) == (16, 8, 128)
    for layer in range(32):
        np.testing.assert_array_equal(read["keys"][layer],
                                      expected_rows(layer, 0, len(TOKENS), 8, 128))
        np.testing.assert_array_equal(read["values"][layer],
                                      expected_rows(layer, 1, len(TOKENS), 8, 128))


def test_bf16_helpers_round_to_nearest_even():
    bits = memra_kv.bf16_bits(np.array([1.5, -0.3, 0.0, 3.0e38, np.inf], dtype=np.float32))
    assert [hex(b) for b in bits] == ["0x3fc0", "0xbe9a", "0x0", "0x7f62", "0x7f80"]
    back = memra_kv.float32_from_bf16_bits(bits)
    assert back[0] == 1.5 and back[1] == np.float32(-0.30078125)
    assert np.isnan(memra_kv.float32_from_bf16_bits(memra_kv.bf16_bits(np.float32("nan"))))


def test_a_bf16_prefix_written_through_the_typed_view_is_read_back_by_another_process(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    writer = daemon.client("py-bf16-writer")
    imported = writer.import_model(LLAMA_CONFIG)
    assert imported.kv_dtype == "bf16 from torch_dtype bfloat16"
    assert imported.kv_formats == "K/V bf16/bf16"
    plan = imported.plan_fingerprint
    session = writer.create_session(plan, 16)
    keys = session.typed_plane(0, memra_kv.KEYS, storage=True)
    assert keys.shape == (16, 8, 128) and keys.dtype == np.dtype("<u2")
    geometry = session.typed_geometry(31, memra_kv.VALUES)
    assert (geometry.element.name, geometry.strides) == ("bf16", (2048, 256, 2))
    # The raw byte view stays, over the same bytes.
    assert session.plane(0, memra_kv.KEYS).shape == (16, 2048)

    tx = session.begin()
    append = session.prepare_append(tx.generation, len(TOKENS))
    for layer in append.layers:
        for plane_index, kind in enumerate((memra_kv.KEYS, memra_kv.VALUES)):
            view = session.typed_plane(layer.layer, kind, storage=True)
            rows = slice(layer.write_row, layer.write_row + len(TOKENS))
            view[rows] = memra_kv.bf16_bits(
                expected_rows(layer.layer, plane_index, len(TOKENS), 8, 128))
    session.publish_append(tx.generation)
    session.commit(tx.generation, len(TOKENS), TOKENS)
    captured = writer.capture_prefix(session, TOKENS, len(TOKENS))

    assert_another_process_reads_the_rows_back(daemon)

    # The same model in fp8: another shape. A lookup misses; restoring the bf16 entry by id is
    # refused naming both formats.
    fp8 = writer.import_model(LLAMA_CONFIG, kv_dtype="fp8_e4m3")
    assert fp8.kv_formats == "K/V fp8_e4m3/fp8_e4m3"
    other = writer.create_session(fp8.plan_fingerprint, 16)
    assert writer.lookup_prefix(fp8.plan_fingerprint, TOKENS).entry_id == 0
    with pytest.raises(KvError) as refused:
        writer.restore_prefix(other, TOKENS, captured.entry_id)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefix entry %d was captured for shape" % captured.entry_id in refused.value.message
    assert "(K/V bf16/bf16); session %d has shape" % other.id in refused.value.message
    assert refused.value.message.endswith("(K/V fp8_e4m3/fp8_e4m3)")
    assert other.typed_plane(3, memra_kv.VALUES, storage=True).dtype == np.uint8
    other.release()
    session.release()
    writer.close()


def test_typed_views_of_other_planes_and_the_refusals(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    client = daemon.client("py-formats")
    blocks = client.register_plan(dense_plan(2, 32, 2))  # the defaults: q8_0 / q5_1
    session = client.create_session(blocks, 16)
    for kind, words in ((memra_kv.KEYS, "layer 1 keys are q8_0, a block format: no typed view"),
                        (memra_kv.VALUES, "layer 1 values are q5_1, a block format"),
                        (memra_kv.LEN_MIRROR, "layer 1 len_mirror is an i32 mirror")):
        with pytest.raises(KvError) as refused:
            session.typed_plane(1, kind)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert words in refused.value.message

    # A latent row in bf16 is (rows, 1, width); f16 K/V are native numpy.
    mixed = plans.model_plan([
        plans.kv_layer(0, 80, 2, formats=plans.element_formats("f16")),
        plans.latent_layer(1, 24, latent_format=memra_kv.model_plan_pb2.ELEMENT_FORMAT_BF16)])
    typed = client.create_session(client.register_plan(mixed), 16)
    half = typed.typed_plane(0, memra_kv.KEYS)
    assert half.shape == (16, 2, 80) and half.dtype == np.dtype("<f2")
    half[3, 1, 79] = 1.5
    assert bytes(typed.plane(0, memra_kv.KEYS)[3, 318:320]) == b"\x00\x3e"
    latent = typed.typed_plane(1, memra_kv.LATENT_ROWS, storage=True)
    assert latent.shape == (16, 1, 24)
    assert typed.plane(1, memra_kv.LATENT_ROWS).shape == (16, 48)  # its bytes, not f32
    try:
        import ml_dtypes  # noqa: F401
        assert typed.typed_plane(1, memra_kv.LATENT_ROWS).dtype.name == "bfloat16"
    except ImportError:
        with pytest.raises(KvError) as missing:
            typed.typed_plane(1, memra_kv.LATENT_ROWS)
        assert missing.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "bf16 planes as numpy need the ml_dtypes package" in missing.value.message
    try:
        import torch
        tensor = typed.torch_plane(0, memra_kv.KEYS)
        assert tensor.dtype == torch.float16 and tuple(tensor.shape) == (16, 2, 80)
        tensor[0, 0, 0] = 2.0
        assert half[0, 0, 0] == 2.0  # the same memory
    except ImportError:
        with pytest.raises(KvError) as no_torch:
            typed.torch_plane(0, memra_kv.KEYS)
        assert "torch_plane() needs torch" in no_torch.value.message

    # Plans a format cannot hold, and import options the daemon does not know.
    with pytest.raises(KvError) as refused:
        client.register_plan(plans.model_plan([plans.kv_layer(
            0, 80, 2, formats=plans.KvFormats(k=memra_kv.model_plan_pb2.K_FORMAT_BF16,
                                              v=memra_kv.model_plan_pb2.V_FORMAT_Q4_0))]))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ("layer 0 (kv): V format q4_0 stores 32-element blocks, which head_dim_v 80 cannot "
            "hold whole") in refused.value.message
    with pytest.raises(KvError) as unknown:
        client.import_model(LLAMA_CONFIG, kv_dtype="int4")
    assert unknown.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "--kv-dtype int4 unsupported (auto | reference | bf16 | fp16" in unknown.value.message
    with pytest.raises(KvError) as scaled:
        bad = plans.kv_layer(0, 64, 2, formats=plans.element_formats("bf16"))
        bad.k_scale.append(0.5)
        client.register_plan(plans.model_plan([bad]))
    assert ("layer 0 (kv): k_scale has 1 values but the format bf16 takes no scale"
            in scaled.value.message)
    typed.release()
    session.release()
    client.close()
