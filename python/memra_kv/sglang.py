"""memra_kv.sglang: memra-kvd as an SGLang HiCache storage backend (its "L3").

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-mem-layout layer_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "memra-kv",
            "module_path": "memra_kv.sglang", "class_name": "MemraHiCacheStorage",
            "memra_socket": "/run/memra-kv/gpu0.sock"}'

The interface is SGLang's HiCacheStorage (python/sglang/srt/mem_cache/hicache_storage.py, main
at commit 001067f, the 0.5 series; python/README.md): register_mem_pool_host, batch_exists
(leading pages stored), batch_get_v1 / batch_set_v1 (page keys and the host pool's token
indices, a bool per page), exists, and the deprecated get / batch_get / set / batch_set.

MemraHiCache holds the logic on plain values (page keys, numpy index arrays, HostPools) and
never imports SGLang; MemraHiCacheStorage, the HiCacheStorage subclass SGLang's dynamic loader
builds with (storage_config, kwargs), exists only where SGLang is importable.

The host pool is the registered pool: page p of every layer's K and V is block p (SGLang's
layer_first MHA layout, kv_buffer of shape (2, layer_num, size, head_num, head_dim)), so a get
copies stored pages straight into the host pool and a set straight out of it; pages are keyed by
SGLang's chained page hashes. On the host backend a pool in a memra HostPool (the daemon maps
its memfd) is copied straight; SGLang's own (torch) host pool through a staging HostPool.
"""

import logging
import threading
from typing import List, Optional, Sequence

import grpc
import numpy as np

from .block_store import (BlockStore, HostPool, KeptRegistration, PoolLayout, TensorLayout,
                          element_type_of, page_key)
from .errors import KvError

SGLANG_INTERFACE = "sglang main 001067f (0.5 series) HiCacheStorage"

log = logging.getLogger("memra_kv.sglang")


def host_pool_layout(kv_buffer, pool: HostPool, page_size, model, tp_rank=0, tp_size=1,
                     element_type=None):
    """The block store layout of SGLang's layer_first MHA host pool `kv_buffer` (a numpy array
    (2, layer_num, size, head_num, head_dim) inside `pool`): block p is page p of every layer's
    K and V. `element_type`: the block store's name of the elements when the array's dtype
    stands in for one numpy lacks (bf16 as int16). KvError INVALID_ARGUMENT naming the numbers for another shape, a size that is not
    whole pages or non-contiguous tokens; FAILED_PRECONDITION outside the pool."""
    if kv_buffer.ndim != 5 or kv_buffer.shape[0] != 2:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "host KV buffer of shape %s; the "
                      "backend takes layer_first (2, layer_num, size, head_num, head_dim)"
                      % (kv_buffer.shape,))
    _, layers, size, heads, head_dim = kv_buffer.shape
    if page_size <= 0 or size % page_size:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "a host pool of %d tokens is not whole "
                      "pages of %d" % (size, page_size))
    token_bytes = heads * head_dim * kv_buffer.itemsize
    if kv_buffer.strides[2:] != (token_bytes, head_dim * kv_buffer.itemsize, kv_buffer.itemsize):
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "host KV buffer strides %s: tokens "
                      "must be contiguous" % (kv_buffer.strides,))
    base = pool.array.ctypes.data
    offset = kv_buffer.ctypes.data - base
    if not 0 <= offset < pool.nbytes:
        raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "the host KV buffer at 0x%x is not "
                      "in the memra host pool (the daemon can map only memory it was handed)"
                      % kv_buffer.ctypes.data)
    block_bytes = page_size * token_bytes
    tensors = [TensorLayout(layer, kind, offset + plane * kv_buffer.strides[0]
                            + layer * kv_buffer.strides[1], block_bytes, block_bytes)
               for layer in range(layers) for kind, plane in (("K", 0), ("V", 1))]
    return PoolLayout(num_blocks=size // page_size, tokens_per_block=page_size,
                      element_type=element_type or element_type_of(kv_buffer.dtype),
                      num_kv_heads=heads,
                      head_dim=head_dim, model=model, tensors=tensors, tp_rank=tp_rank,
                      tp_size=tp_size)


class MemraHiCache:
    """HiCacheStorage's page interface on plain values, over an attached client's BlockStore.
    Every answer follows SGLang's contract: a refusal or an unreachable daemon is a miss
    (batch_exists 0, get False), never an exception into SGLang's prefetch / backup threads.

    A host pool that lies in a HostPool is registered itself (pages copy straight between it
    and the store); any other (SGLang's own torch memory) is served through a registered
    staging HostPool of `staging_pages` pages: one more copy a page, in chunks of that many.
    A registration the daemon lost is made again (KeptRegistration)."""

    def __init__(self, store: BlockStore, staging_pages=64):
        self._store = store
        self._staging_pages = staging_pages
        self._staging = None  # the staging pool's (2, layers, pages * page_size, heads, dim)
        self._host = None  # the engine's host pool, when staged
        # SGLang's prefetch (get) and backup (set) threads share the one staging pool: a chunk
        # holds it from its first copy in to its last copy out.
        self._staging_lock = threading.Lock()
        self._kept = None  # KeptRegistration once register_host_pool ran
        self.page_size = 0

    @property
    def registration(self):
        """The host pool's Registration now (None before register_host_pool)."""
        return self._kept.registration if self._kept is not None else None

    def register_host_pool(self, kv_buffer, pool: Optional[HostPool], page_size, model,
                           tp_rank=0, tp_size=1, element_type=None):
        """`pool`: the HostPool kv_buffer lies in, or None to stage through one."""
        registered = kv_buffer
        if pool is None:
            _, layers, _, heads, head_dim = kv_buffer.shape
            shape = (2, layers, self._staging_pages * page_size, heads, head_dim)
            pool = HostPool(int(np.prod(shape)) * kv_buffer.itemsize, "memra-kv-staging")
            self._staging = registered = pool.view(kv_buffer.dtype, shape)
            self._host = kv_buffer
        layout = host_pool_layout(registered, pool, page_size, model, tp_rank, tp_size,
                                  element_type)
        self._kept = KeptRegistration(self._store, [pool], layout)
        self.page_size = page_size
        return self.registration

    def _pages(self, keys, host_indices):
        """The host pool page of each key: host_indices holds page_size token indices a key."""
        indices = np.asarray(host_indices, dtype=np.int64).reshape(-1)
        if len(indices) != len(keys) * self.page_size:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "%d host indices for %d pages of %d "
                          "tokens" % (len(indices), len(keys), self.page_size))
        return [int(i) // self.page_size for i in indices[::self.page_size]]

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading pages are stored."""
        if not keys:
            return 0
        try:
            return self._registered("batch_exists").lookup(
                hashes=[page_key(k) for k in keys]).matched_blocks
        except KvError as error:
            log.warning("batch_exists of %d pages: %s", len(keys), error)
            return 0

    def batch_get_v1(self, keys: Sequence[str], host_indices) -> List[bool]:
        """Copies stored pages into the host pool pages of `host_indices`; True per page that
        arrived (a page no longer stored or corrupt is False, as is every page of a refusal)."""
        return self._transfer(True, keys, host_indices)

    def batch_set_v1(self, keys: Sequence[str], host_indices) -> List[bool]:
        """Copies host pool pages into the store; True per page stored (or already there)."""
        return self._transfer(False, keys, host_indices)

    def _registered(self, what):
        """The KeptRegistration; KvError FAILED_PRECONDITION before register_host_pool."""
        if self._kept is None:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "%s before "
                          "register_mem_pool_host: no host pool is registered" % what)
        return self._kept

    def _transfer(self, loading, keys, host_indices):
        what = "batch_get_v1" if loading else "batch_set_v1"
        if not keys:
            return []
        try:
            pages = self._pages(keys, host_indices)
            kept = self._registered(what)
            call = kept.load if loading else kept.store
            if self._staging is None:
                transfer = call(pages, hashes=[page_key(k) for k in keys])
                return [block.ok for block in transfer.blocks]
            results = []
            for start in range(0, len(keys), self._staging_pages):
                results += self._staged(call, loading, keys[start:start + self._staging_pages],
                                        pages[start:start + self._staging_pages])
            return results
        except KvError as error:
            log.warning("%s of %d pages: %s", what, len(keys), error)
            return [False] * len(keys)

    def _staged(self, call, loading, keys, pages):
        """One chunk through the staging pool: its pages 0..len(keys)-1."""
        with self._staging_lock:
            return self._staged_locked(call, loading, keys, pages)

    def _staged_locked(self, call, loading, keys, pages):
        size = self.page_size
        tokens = np.concatenate([np.arange(p * size, (p + 1) * size) for p in pages])
        staged = slice(0, len(tokens))
        if not loading:
            self._staging[:, :, staged] = self._host[:, :, tokens]
        transfer = call(list(range(len(keys))), hashes=[page_key(k) for k in keys])
        ok = [block.ok for block in transfer.blocks]
        if loading:
            arrived = [i for i, good in enumerate(ok) if good]
            if arrived:
                rows = np.concatenate([np.arange(i * size, (i + 1) * size) for i in arrived])
                self._host[:, :, tokens[rows]] = self._staging[:, :, rows]
        return ok

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1


_DEPRECATED = ("memra_kv.sglang serves HiCache's page interface (batch_exists, batch_get_v1, "
               "batch_set_v1); the per-tensor get / set calls copy through no host pool")

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:  # SGLang is not installed: the logic above is all there is
    HiCacheStorage = None

if HiCacheStorage is not None:
    from .client import Client

    class MemraHiCacheStorage(HiCacheStorage):
        """SGLang's view of MemraHiCache (extra config: memra_socket, memra_engine_name,
        memra_cache_scope, memra_staging_pages; memra_pool: the HostPool the host KV buffer lives
        in, for an engine that allocated it there, else pages are staged)."""

        def __init__(self, storage_config, kwargs=None):
            extra = storage_config.extra_config or {}
            self._extra = extra
            self._config = storage_config
            self._client = Client.connect(extra.get("memra_socket", "/run/memra-kv/gpu0.sock"))
            self._client.attach(extra.get("memra_engine_name",
                                          "sglang-tp%d" % storage_config.tp_rank),
                                cache_scope=extra.get("memra_cache_scope", ""))
            self._logic = MemraHiCache(BlockStore(self._client),
                                       int(extra.get("memra_staging_pages", 64)))

        def register_mem_pool_host(self, mem_pool_host):
            super().register_mem_pool_host(mem_pool_host)
            buffer = mem_pool_host.kv_buffer  # a CPU torch tensor: numpy views share its memory
            element_type = element_type_of(buffer.dtype)
            if element_type == "bf16":  # numpy has no bf16: the same bytes as int16
                import torch
                buffer = buffer.view(torch.int16)
            self._logic.register_host_pool(buffer.numpy(), self._extra.get("memra_pool"),
                                           mem_pool_host.page_size,
                                           self._config.model_name or "",
                                           self._config.tp_rank, self._config.tp_size,
                                           element_type)

        def batch_exists(self, keys, extra_info=None):
            return self._logic.batch_exists(keys)

        def batch_get_v1(self, keys, host_indices, extra_info=None):
            return self._logic.batch_get_v1(keys, host_indices.cpu().numpy())

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            return self._logic.batch_set_v1(keys, host_indices.cpu().numpy())

        def exists(self, key):
            return self._logic.exists(key)

        def get(self, key, target_location=None, target_sizes=None):
            raise NotImplementedError(_DEPRECATED)

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            raise NotImplementedError(_DEPRECATED)

        def set(self, key, value=None, target_location=None, target_sizes=None):
            raise NotImplementedError(_DEPRECATED)

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
            raise NotImplementedError(_DEPRECATED)
