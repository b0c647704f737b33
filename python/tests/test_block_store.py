"""memra_kv.block_store and the adapters' layout rules: the host pool is a sealed memfd the
engine cannot resize; what the client refuses before any call (codes and numbers); the block
store calls refused before attach. The calls themselves are covered by the contract tests."""

import fcntl
import logging
import os

import grpc
import numpy as np
import pytest

from memra_kv import KvError
from memra_kv.block_store import (BlockStore, CudaBuffer, CudaRegion, HostPool, PoolLayout,
                                  TensorLayout, element_type_of, ipc_memory_handle, page_key)
from memra_kv.sglang import PageFormat, PageTier, model_identity
from memra_kv.vllm import (KvCacheTensor, LoadSpec, MemraConnectorMetadata, MemraWorker,
                           SaveSpec, cuda_regions, pool_layout)


def refused(code, call, *args, **kwargs):
    with pytest.raises(KvError) as error:
        call(*args, **kwargs)
    assert error.value.code == code
    return error.value.message


def test_a_host_pool_is_a_sealed_shared_mapping():
    pool = HostPool(8192)
    seals = fcntl.fcntl(pool.fd, fcntl.F_GET_SEALS)
    assert seals == fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    with pytest.raises(PermissionError):
        os.ftruncate(pool.fd, 4096)  # the daemon's mapping can never lose its pages
    pool.view(np.uint16, (4,), 8)[:] = 0x0102
    # The descriptor's pages are the mapping's: what another process maps, it sees.
    assert os.pread(pool.fd, 8, 8) == bytes([2, 1] * 4)
    assert pool.array.shape == (8192,)
    pool.close()


def test_host_pool_refusals_name_the_numbers():
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, HostPool, 0) == (
        "a host pool of 0 bytes; at least 1")
    pool = HostPool(4096)
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, pool.view, np.float16, (1024,), 2050) == (
        "a view of 2048 bytes at offset 2050 of a 4096-byte pool")
    pool.close()


def test_keys_and_element_types_are_checked_before_any_call(kvd):
    daemon = kvd()
    with daemon.client() as client:
        store = BlockStore(client)
        assert refused(grpc.StatusCode.FAILED_PRECONDITION, store.lookup, 1,
                       hashes=[b"x"]) == "lookup before attach: sessions need a lease"
        client.attach("py-block-store")
        for keys in ({}, {"hashes": [b"x"], "token_ids": [1]}):
            assert refused(grpc.StatusCode.INVALID_ARGUMENT, store.lookup, 1, **keys) == (
                "name the blocks by exactly one of hashes or token_ids")
    assert element_type_of("torch.bfloat16") == "bf16" and element_type_of("float16") == "fp16"
    message = refused(grpc.StatusCode.INVALID_ARGUMENT, element_type_of, "complex64")
    assert message.startswith("element type complex64: the block store takes bfloat16, ")
    assert page_key("ab" * 32) == b"ab" * 32  # SGLang's 64-hex-digit keys as they are
    assert len(page_key("x" * 65)) == 32 and page_key(-1) == b"\xff" * 16


def test_vllm_caches_must_be_paged_contiguous_and_in_a_pool():
    pool = HostPool(2 * 4 * 16 * 2 * 8 * 2)
    cache = pool.view(np.float16, (2, 4, 16, 2, 8))
    layout = pool_layout([KvCacheTensor.of("model.layers.3.attn", cache)], [pool], "m")
    assert [(t.layer, t.kind, t.offset, t.block_stride, t.block_bytes)
            for t in layout.tensors] == [(3, "K", 0, 512, 512), (3, "V", 2048, 512, 512)]
    assert (layout.num_blocks, layout.tokens_per_block, layout.element_type) == (4, 16, "fp16")
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, pool_layout,
                   [KvCacheTensor.of("l0", cache[0, 0])], [pool], "m") == (
        "KV cache l0 of shape (16, 2, 8); the connector takes (num_blocks, heads, block_size, "
        "content) or (2, num_blocks, block_size, num_kv_heads, head_dim)")
    strided = cache.transpose(0, 1, 3, 2, 4)  # HND view of NHD memory: tokens not contiguous
    assert "must be contiguous" in refused(grpc.StatusCode.INVALID_ARGUMENT, pool_layout,
                                           [KvCacheTensor.of("l0", strided)], [pool], "m")
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, pool_layout, [], [pool], "m") == (
        "no KV caches to register")
    half = pool.view(np.float16, (2, 2, 16, 2, 8))
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, pool_layout,
                   [KvCacheTensor.of("l0", cache), KvCacheTensor.of("l1", half)], [pool],
                   "m") == ("KV cache l1 is (2, 2, 16, 2, 8) float16 and l0 is (2, 4, 16, 2, 8) "
                            "float16: one layout for every layer")
    outside = np.zeros((2, 4, 16, 2, 8), dtype=np.float16)
    message = refused(grpc.StatusCode.FAILED_PRECONDITION, pool_layout,
                      [KvCacheTensor.of("l0", outside)], [pool], "m")
    assert message.startswith("KV cache l0 at 0x%x is not in a memra host pool"
                              % outside.ctypes.data)
    pool.close()


def test_vllm_033_pages_are_one_fused_tensor_per_layer_in_either_order():
    """vLLM 0.33's (num_blocks, heads, block_size, content) views: HND and NHD pages are one KV
    tensor each; a layout that scatters a page per head is refused, naming the strides."""
    pool = HostPool(4 * 2 * 16 * 16 * 2)
    hnd = pool.view(np.float16, (4, 2, 16, 16))
    layout = pool_layout([KvCacheTensor.of("model.layers.1.attn", hnd)], [pool], "m")
    assert layout.order == "HND" and (layout.num_kv_heads, layout.head_dim) == (2, 16)
    assert [(t.layer, t.kind, t.offset, t.block_stride, t.block_bytes)
            for t in layout.tensors] == [(1, "KV", 0, 1024, 1024)]
    nhd = pool.view(np.float16, (4, 16, 2, 16)).transpose(0, 2, 1, 3)  # tokens outer in memory
    assert pool_layout([KvCacheTensor.of("l0", nhd)], [pool], "m").order == "NHD"
    scattered = pool.view(np.float16, (2, 4, 16, 16)).transpose(1, 0, 2, 3)  # heads outermost
    message = refused(grpc.StatusCode.INVALID_ARGUMENT, pool_layout,
                      [KvCacheTensor.of("l0", scattered)], [pool], "m")
    assert message == ("KV cache l0 has strides (512, 2048, 32, 2) for shape (4, 2, 16, 16): a "
                       "block's page must be one dense run (KV cache layouts LBNHC, LBHNC, "
                       "BLNHC or BLHNC; set VLLM_KV_CACHE_LAYOUT)")
    mixed = [KvCacheTensor.of("l0", hnd), KvCacheTensor.of("l1", nhd)]
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, pool_layout, mixed, [pool], "m") == (
        "KV cache l1 is NHD and the first layer HND: one layout for every layer")
    pool.close()


class _FakeStorage:
    """What cuda_region_of reads of a CUDA tensor's storage (PyTorch's _share_cuda_ tuple)."""

    def __init__(self, address, handle, nbytes, offset):
        self._address, self._shared = address, (0, handle, nbytes, offset, b"", 0, b"", False)

    def data_ptr(self):
        return self._address

    def _share_cuda_(self):
        return self._shared


class _FakeCudaTensor:
    def __init__(self, storage):
        self._storage = storage

    def untyped_storage(self):
        return self._storage


def test_cuda_pools_register_each_storage_by_its_ipc_handle():
    raw = bytes(range(64))
    assert ipc_memory_handle(raw) == raw and ipc_memory_handle(b"c" + raw) == raw
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, ipc_memory_handle, b"e" + raw).startswith(
        "an expandable segment's handle: the cuda block store opens CUDA IPC memory handles "
        "(64 bytes)")
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, ipc_memory_handle, raw[:10]).startswith(
        "a 10-byte handle")
    # Two layers in one storage, a third in its own: two buffers, each at its allocation offset.
    shared = _FakeStorage(0x7f0000000000, b"c" + raw, 8192, 4096)
    alone = _FakeStorage(0x7f0000100000, raw[::-1], 4096, 0)
    regions = cuda_regions([_FakeCudaTensor(shared), _FakeCudaTensor(alone),
                            _FakeCudaTensor(shared)])
    assert regions == [CudaRegion(0x7f0000000000, CudaBuffer(raw, 8192, 4096)),
                       CudaRegion(0x7f0000100000, CudaBuffer(raw[::-1], 4096, 0))]
    shape, strides = (2, 4, 16, 2, 8), (2048, 512, 32, 16, 2)
    caches = [KvCacheTensor("model.layers.0.attn", 0x7f0000000000, shape, strides, 2, "float16"),
              KvCacheTensor("model.layers.1.attn", 0x7f0000100000, shape, strides, 2, "float16")]
    layout = pool_layout(caches, regions, "m")
    assert [(t.layer, t.kind, t.buffer, t.offset) for t in layout.tensors] == [
        (0, "K", 0, 0), (0, "V", 0, 2048), (1, "K", 1, 0), (1, "V", 1, 2048)]
    outside = KvCacheTensor("l9", 0x7f0000200000, shape, strides, 2, "float16")
    assert "not in a memra host pool or a registered CUDA region" in refused(
        grpc.StatusCode.FAILED_PRECONDITION, pool_layout, [outside], regions, "m")


def test_a_host_daemon_refuses_cuda_ipc_buffers(kvd):
    daemon = kvd("--prefix_cache_budget_bytes=4194304")
    with daemon.client() as client:
        client.attach("py-cuda-pool")
        store = BlockStore(client)
        assert store.backend == "host"
        layout = PoolLayout(num_blocks=4, tokens_per_block=16, element_type="fp16",
                            num_kv_heads=2, head_dim=8, model="m", order="NHD",
                            tensors=[TensorLayout(0, "K", 0, 512, 512),
                                     TensorLayout(0, "V", 2048, 512, 512)])
        message = refused(grpc.StatusCode.FAILED_PRECONDITION, store.register,
                          [CudaBuffer(bytes(64), 4096)], layout)
        assert "host backend: cannot map 1 engine buffers from CUDA IPC handles" in message


def sglang_page_format(page_bytes=2048, tokens=16, identity="m"):
    return PageFormat(page_bytes=page_bytes, tokens_per_page=tokens, element_type="fp16",
                      heads=2, head_dim=8, identity=identity)


def test_sglang_page_tiers_hold_whole_token_rows_and_a_bounded_identity(kvd):
    daemon = kvd()
    with daemon.client("py-hicache") as client:
        store = BlockStore(client)
        assert refused(grpc.StatusCode.INVALID_ARGUMENT, PageTier, store,
                       sglang_page_format(page_bytes=2050)) == (
            "a page of 2050 bytes is not whole rows of 16 tokens")
        assert refused(grpc.StatusCode.INVALID_ARGUMENT, PageTier, store,
                       sglang_page_format(), staging_pages=0) == "0 staging pages; at least 1"
    page_format = "sglang:kv:MHATokenToKVPoolHost:layer_first:bfloat16"
    assert model_identity("org/model", page_format) == page_format + "|org/model"
    long_name = "x" * 300  # past the block store's 256 bytes: bound by its SHA-256
    bound = model_identity(long_name, page_format)
    assert bound.startswith(page_format + "|sha256:") and len(bound) == len(page_format) + 72
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, model_identity, "m", "f" * 300) == (
        "a page format of 300 bytes (%s); the block store's model identity holds 256"
        % ("f" * 300))


def test_sglang_calls_answer_misses_instead_of_raising(kvd, caplog):
    """A refusal reaches SGLang's prefetch and backup threads as a miss, never an exception:
    here a daemon without a prefix cache refuses the tier's registration (at SGLang's attach),
    and a daemon gone mid-run makes every call a miss."""
    caplog.set_level(logging.WARNING, logger="memra_kv.sglang")
    no_cache = kvd("--prefix_cache_budget_bytes=0")
    with no_cache.client("py-hicache") as client:
        assert "no prefix cache" in refused(grpc.StatusCode.FAILED_PRECONDITION, PageTier,
                                            BlockStore(client), sglang_page_format())
    daemon = kvd("--prefix_cache_budget_bytes=32MiB")
    with daemon.client("py-hicache") as client:
        tier = PageTier(BlockStore(client), sglang_page_format(), staging_pages=2)
        copied = []
        assert tier.store(["a", "b", "c"], lambda i, slot: slot.fill(i + 1)) == [True] * 3
        assert tier.leading(["a", "b", "z", "c"]) == 2
        assert tier.present(["a", "z", "c"]) == [True, False, True]
        assert tier.load(["c", "z", "a"], lambda i, slot: copied.append((i, int(slot[0])))) \
            == [True, False, True]
        assert copied == [(0, 3), (2, 1)]  # copy_in only for the pages that arrived
        assert tier.load([], copied.append) == [] and tier.leading([]) == 0
        assert caplog.records == []
        daemon.kill()
        assert tier.leading(["a"]) == 0 and tier.present(["a"]) == [False]
        assert tier.load(["a", "b", "c"], copied.append) == [False] * 3
        assert tier.store(["d"], lambda i, slot: None) == [False]
        assert len(copied) == 2
        warnings = [r.getMessage().split(": ")[0] for r in caplog.records]
        assert warnings == ["kv", "kv", "kv", "kv", "kv"]  # two chunks of the load
        assert all(": UNAVAILABLE: " in r.getMessage() for r in caplog.records)
        daemon.start_again()


def test_vllm_worker_calls_before_registration_are_load_errors_not_exceptions(caplog):
    caplog.set_level(logging.WARNING, logger="memra_kv.vllm")
    worker = MemraWorker(store=None)
    meta = MemraConnectorMetadata([LoadSpec("r", [b"h"], [3])],
                                  [SaveSpec("r", [b"h"], [3], b"", [])])
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == {3}
    assert (worker.loaded_blocks, worker.saved_blocks) == (0, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "load of request r: FAILED_PRECONDITION: a load before register_kv_caches: no KV cache "
        "is registered",
        "save of request r: FAILED_PRECONDITION: a save before register_kv_caches: no KV cache "
        "is registered"]
