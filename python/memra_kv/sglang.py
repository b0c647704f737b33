"""memra_kv.sglang: memra-kvd as an SGLang HiCache storage backend (its "L3"), written and
tested against SGLang 0.5.23 from PyPI (python/engines/sglang-requirements.txt).

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "memra-kv",
            "module_path": "memra_kv.sglang", "class_name": "MemraHiCacheStorage",
            "interface_v1": 1, "memra_socket": "/run/memra-kv/gpu0.sock"}'

SGLang's StorageBackendFactory imports module_path and builds class_name with
(storage_config, kwargs). Every HiCacheStorage call SGLang 0.5.23 makes is served: the page
API its controller uses with "interface_v1" (batch_get_v1 / batch_set_v1 on host indices), the
older per-page calls it uses without it (batch_get / batch_set on flat page tensors, get, set),
exists / batch_exists, and the v2 calls of hybrid models (register_mem_host_pool_v2,
batch_exists_v2, batch_get_v2, batch_set_v2: one tier per named host pool).

Pages move through SGLang's own host pool page API (get_data_page / set_from_flat_data_page),
so every host pool class and layout SGLang has (MHA, MLA's 3-D latent rows, Mamba states,
layer_first, page_first, page_first_direct, page_head) is stored as the bytes of its flat page,
whatever the dtype (bf16, fp16, fp8 through torch views). SGLang allocates its host pools itself
(torch memory the daemon cannot map), so each tier copies pages through a registered staging
HostPool: one memcpy a page each way.

PageTier holds the logic on plain values (keys, numpy byte views, callables) and never imports
SGLang or torch; MemraHiCacheStorage, the HiCacheStorage subclass, exists only where SGLang is
importable.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, cast

import grpc
import numpy as np

from .block_store import (BlockStore, HostPool, KeptRegistration, PoolLayout, Registration,
                          TensorLayout, element_type_of, page_key)
from .errors import KvError

SGLANG_INTERFACE = "sglang 0.5.23 HiCacheStorage (v1 page API, per-page calls, v2 pools)"
MODEL_IDENTITY_LIMIT = 256  # bytes: the block store's limit (docs/block-store.md)

log = logging.getLogger("memra_kv.sglang")

# copy(i, page_bytes): moves page i of a call between the engine's pool and page_bytes, a
# writable uint8 numpy view of one staging slot.
PageCopy = Callable[[int, "np.ndarray[Any, np.dtype[np.uint8]]"], None]


@dataclass(frozen=True)
class PageFormat:
    """What one stored page of a tier is. Every field enters the block store's layout
    fingerprint, so pages of another format (pool class, layout, dtype, shard) never meet."""
    page_bytes: int
    tokens_per_page: int
    element_type: str  # a key of block_store.ELEMENT_TYPES
    heads: int
    head_dim: int
    identity: str  # the model and the page format, 1 .. 256 bytes
    tp_rank: int = 0
    tp_size: int = 1


def model_identity(model: str, page_format: str) -> str:
    """`model` and the page format as one block-store model identity of at most 256 bytes (a
    model name that would not fit is replaced by its SHA-256, which still binds it)."""
    identity = "%s|%s" % (page_format, model)
    if len(identity.encode()) > MODEL_IDENTITY_LIMIT:
        identity = "%s|sha256:%s" % (page_format, hashlib.sha256(model.encode()).hexdigest())
    if len(identity.encode()) > MODEL_IDENTITY_LIMIT:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "a page format of %d bytes (%s); the "
                      "block store's model identity holds %d" % (len(page_format.encode()),
                                                                 page_format,
                                                                 MODEL_IDENTITY_LIMIT))
    return identity


class PageTier:
    """One host pool's pages in the block store, over an attached client's BlockStore.

    Each page is one block of a registered staging HostPool: `staging_pages` slots for loads
    and as many for stores, so SGLang's prefetch and backup threads never wait for each other,
    and each direction's slots are held from the first copy in to the last copy out. A call of
    more pages goes in chunks of `staging_pages`. Every answer follows SGLang's contract: a
    refusal or an unreachable daemon is a miss (0 pages, False), logged, never an exception
    into SGLang's threads. A registration the daemon lost is made again (KeptRegistration)."""

    def __init__(self, store: BlockStore, page_format: PageFormat, staging_pages: int = 64,
                 name: str = "kv") -> None:
        if staging_pages <= 0:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "%d staging pages; at least 1"
                          % staging_pages)
        if page_format.page_bytes <= 0 or page_format.page_bytes % page_format.tokens_per_page:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "a page of %d bytes is not whole "
                          "rows of %d tokens" % (page_format.page_bytes,
                                                 page_format.tokens_per_page))
        self.name = name
        self.format = page_format
        self.staging_pages = staging_pages
        nbytes = 2 * staging_pages * page_format.page_bytes
        self._staging = HostPool(nbytes, "memra-kv-sglang-%s" % name)
        layout = PoolLayout(
            num_blocks=2 * staging_pages, tokens_per_block=page_format.tokens_per_page,
            element_type=page_format.element_type, num_kv_heads=page_format.heads,
            head_dim=page_format.head_dim, model=page_format.identity,
            tensors=[TensorLayout(0, "KV", 0, page_format.page_bytes, page_format.page_bytes)],
            tp_rank=page_format.tp_rank, tp_size=page_format.tp_size)
        try:
            self._kept = KeptRegistration(store, [self._staging], layout)
        except BaseException:
            self._staging.close()
            raise
        # Slots [0, staging_pages) serve loads, [staging_pages, 2 * staging_pages) stores.
        self._load_lock = threading.Lock()
        self._store_lock = threading.Lock()

    @property
    def registration(self) -> Registration:
        """The staging pool's live registration (made again when the daemon lost it)."""
        return self._kept.registration

    def slot(self, block: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Staging block `block` as a writable uint8 view."""
        size = self.format.page_bytes
        # The staging pool is open while the tier lives (array is None only once closed).
        array = cast("np.ndarray[Any, np.dtype[np.uint8]]", self._staging.array)
        return array[block * size:(block + 1) * size]

    def leading(self, keys: Sequence[str]) -> int:
        """How many leading pages of `keys` are stored (0 on any refusal)."""
        if not keys:
            return 0
        try:
            return self._kept.lookup(hashes=[page_key(k) for k in keys]).matched_blocks
        except KvError as error:
            log.warning("%s: lookup of %d pages: %s", self.name, len(keys), error)
            return 0

    def present(self, keys: Sequence[str]) -> List[bool]:
        """Whether each page is stored, on its own (a lookup a key: for pools whose pages stand
        alone, such as a Mamba state at a page boundary)."""
        return [self.leading([key]) == 1 for key in keys]

    def store(self, keys: Sequence[str], copy_out: PageCopy) -> List[bool]:
        """Stores page i of `keys` from what copy_out(i, slot) writes; True per page stored (or
        already stored)."""
        return self._chunks(False, keys, copy_out)

    def load(self, keys: Sequence[str], copy_in: PageCopy) -> List[bool]:
        """Loads the stored pages of `keys`, handing each that arrived to copy_in(i, slot);
        True per page that arrived (a page no longer stored, corrupt or refused is False and
        copy_in is not called for it)."""
        return self._chunks(True, keys, copy_in)

    def _chunks(self, loading: bool, keys: Sequence[str], copy: PageCopy) -> List[bool]:
        results: List[bool] = []
        for start in range(0, len(keys), self.staging_pages):
            chunk = keys[start:start + self.staging_pages]
            try:
                results += self._chunk(loading, start, chunk, copy)
            except KvError as error:
                log.warning("%s: %s of %d pages: %s", self.name,
                            "load" if loading else "store", len(chunk), error)
                results += [False] * len(chunk)
        return results

    def _chunk(self, loading: bool, start: int, keys: Sequence[str],
               copy: PageCopy) -> List[bool]:
        base = 0 if loading else self.staging_pages
        blocks = list(range(base, base + len(keys)))
        hashes = [page_key(k) for k in keys]
        with self._load_lock if loading else self._store_lock:
            if loading:
                transfer = self._kept.load(blocks, hashes=hashes)
                ok = [outcome.ok for outcome in transfer.blocks]
                for i, arrived in enumerate(ok):
                    if arrived:
                        copy(start + i, self.slot(blocks[i]))
                return ok
            for i, block in enumerate(blocks):
                copy(start + i, self.slot(block))
            transfer = self._kept.store(blocks, hashes=hashes)
            return [outcome.ok for outcome in transfer.blocks]


def pool_page_format(pool: Any, storage_config: Any, name: str, model: str) -> PageFormat:
    """The PageFormat of SGLang host pool `pool` (a HostKVCache) registered under `name`.
    KvError INVALID_ARGUMENT for a pool without host pages (an allocator-only MLA pool)."""
    if getattr(pool, "kv_buffer", True) is None:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "%s host pool %s holds no pages "
                      "(kv_buffer is None: an allocator-only pool); the L3 backend stores "
                      "pages a host pool holds" % (name, type(pool).__name__))
    dummy = pool.get_dummy_flat_data_page()
    page_bytes = dummy.numel() * dummy.element_size()
    tokens = int(pool.page_size)
    dtype = str(getattr(pool, "dtype", dummy.dtype)).replace("torch.", "")
    try:
        element_type = element_type_of(dtype)
    except KvError:  # a pool of other elements (int32 state, say): stored as its bytes
        element_type = "int8"
    replicated = bool(storage_config.is_mla_model) and name == "kv"
    shard: List[str] = []
    if storage_config.pp_size > 1:
        shard.append("pp%d/%d" % (storage_config.pp_rank, storage_config.pp_size))
    if storage_config.attn_cp_size > 1:
        shard.append("cp%d/%d" % (storage_config.attn_cp_rank, storage_config.attn_cp_size))
    if getattr(storage_config, "dcp_size", 1) > 1:
        shard.append("dcp%d/%d" % (storage_config.dcp_rank, storage_config.dcp_size))
    tag = getattr(pool, "storage_format_tag", None)
    described = "sglang:%s:%s:%s:%s%s%s" % (
        name, type(pool).__name__, getattr(pool, "layout", ""), dtype,
        ":" + tag if tag else "", ":" + ",".join(shard) if shard else "")
    return PageFormat(
        page_bytes=page_bytes, tokens_per_page=tokens, element_type=element_type,
        heads=int(getattr(pool, "head_num", 1) or 1),
        head_dim=int(getattr(pool, "head_dim", 0) or getattr(pool, "kv_cache_dim", 0)
                     or page_bytes // tokens),
        identity=model_identity(model, described),
        # MLA's latent rows are the same on every TP rank: one copy serves them all.
        tp_rank=0 if replicated else storage_config.tp_rank,
        tp_size=1 if replicated else storage_config.tp_size)


try:
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, PoolHitPolicy, PoolName,
                                                      PoolTransferResult)
except ImportError:  # SGLang is not installed: PageTier is all there is
    HiCacheStorage = None

if HiCacheStorage is not None:
    import torch

    from .client import Client

    def _slot_tensor(slot: np.ndarray[Any, np.dtype[np.uint8]], dtype: Any) -> Any:
        """A staging slot (uint8 numpy view) as a flat torch tensor of `dtype`, same memory."""
        return torch.from_numpy(slot).view(dtype)

    # HiCacheStorage is SGLang's, untyped here (Any): the subclass is checked, its base not.
    class MemraHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
        """SGLang's L3 over memra-kvd. Extra config keys (beside SGLang's backend_name,
        module_path, class_name, interface_v1): memra_socket, memra_engine_name,
        memra_cache_scope, memra_staging_pages, memra_timeout_s."""

        def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
            extra = storage_config.extra_config or {}
            self._config = storage_config
            self._staging_pages = int(extra.get("memra_staging_pages", 64))
            self._model = storage_config.model_name or "unnamed"
            socket = extra.get("memra_socket", "/run/memra-kv/gpu0.sock")
            if not extra.get("interface_v1"):
                log.info("interface_v1 is not set: SGLang copies pages through its per-page "
                         "calls (batch_get / batch_set), one more copy a page than "
                         "batch_get_v1 / batch_set_v1")
            self._client = Client.connect(socket, timeout=float(extra.get("memra_timeout_s",
                                                                          10)))
            name = extra.get("memra_engine_name") or "sglang-tp%d-pp%d-dp%d" % (
                storage_config.tp_rank, storage_config.pp_rank, storage_config.dp_rank)
            self._client.attach(name, cache_scope=extra.get("memra_cache_scope", ""))
            self._store = BlockStore(self._client)
            self._tiers: Dict[str, PageTier] = {}  # pool name -> its tier
            self._pools: Dict[str, Any] = {}  # pool name -> SGLang host pool

        # ---- host pools ----

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """SGLang's KV host pool: its pages become the KV tier."""
            super().register_mem_pool_host(mem_pool_host)
            self._register(str(PoolName.KV), mem_pool_host)

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            """A named host pool of a hybrid model: its pages become one more tier."""
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            name = str(host_pool_name)
            if self._pools.get(name) is not host_pool:
                self._register(name, host_pool)

        def _register(self, name: str, pool: Any) -> None:
            page_format = pool_page_format(pool, self._config, name, self._model)
            self._tiers[name] = PageTier(self._store, page_format, self._staging_pages, name)
            self._pools[name] = pool
            log.info("registered SGLang's %s host pool (%s, %s): %d-byte pages of %d tokens",
                     name, type(pool).__name__, getattr(pool, "layout", ""),
                     page_format.page_bytes, page_format.tokens_per_page)

        def _tier(self, name: Any, what: str) -> Optional[PageTier]:
            tier = self._tiers.get(str(name))
            if tier is None:
                log.warning("%s for host pool %s, which was never registered (registered: %s)",
                            what, name, ", ".join(sorted(self._tiers)) or "none")
            return tier

        @staticmethod
        def _page_starts(what: str, keys: Sequence[str], host_indices: Any,
                         page_size: int) -> Optional[List[int]]:
            """The host index where each key's page starts, or None (logged) when host_indices
            does not hold page_size indices a key."""
            count = 0 if host_indices is None else int(host_indices.numel())
            if count != len(keys) * page_size:
                log.warning("%s: %d host indices for %d pages of %d tokens", what, count,
                            len(keys), page_size)
                return None
            return cast(List[int], host_indices.reshape(-1)[::page_size].tolist())

        def _pages(self, loading: bool, name: Any, keys: Sequence[str],
                   host_indices: Any) -> List[bool]:
            what = "batch_get" if loading else "batch_set"
            tier = self._tier(name, what)
            pool: Any = self._pools.get(str(name))
            if not keys:
                return []
            starts = None if tier is None else self._page_starts(
                "%s of %s" % (what, name), keys, host_indices, pool.page_size)
            if starts is None:
                return [False] * len(keys)
            # From here tier and starts are set (starts is None whenever tier is); the casts
            # say so where mypy cannot see it (in the closures, and tier through starts).
            if loading:
                dtype = pool.get_dummy_flat_data_page().dtype

                def copy_in(i: int, slot: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
                    pool.set_from_flat_data_page(cast(List[int], starts)[i],
                                                 _slot_tensor(slot, dtype))
                return cast(PageTier, tier).load(keys, copy_in)

            def copy_out(i: int, slot: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
                page = pool.get_data_page(cast(List[int], starts)[i], flat=False)
                _slot_tensor(slot, page.dtype).view(page.shape).copy_(page)
            return cast(PageTier, tier).store(keys, copy_out)

        # ---- the v1 page API (interface_v1) ----

        def batch_get_v1(self, keys: List[str], host_indices: Any,
                         extra_info: Any = None) -> List[bool]:
            """Loads each stored page into the KV pool at its host indices: True per page."""
            return self._pages(True, PoolName.KV, keys, host_indices)

        def batch_set_v1(self, keys: List[str], host_indices: Any,
                         extra_info: Any = None) -> List[bool]:
            """Stores each page of the KV pool at its host indices: True per page stored."""
            return self._pages(False, PoolName.KV, keys, host_indices)

        # ---- lookups ----

        def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
            """How many leading pages of `keys` are stored."""
            tier = self._tier(PoolName.KV, "batch_exists")
            return 0 if tier is None else tier.leading(keys)

        def exists(self, key: str) -> bool:
            """Whether page `key` is stored."""
            return self.batch_exists([key]) == 1

        # ---- the per-page calls (SGLang's controller without interface_v1) ----

        def batch_get(self, keys: List[str], target_locations: Any = None,
                      target_sizes: Any = None) -> List[Any]:
            """Each stored page's bytes into its target (a flat page tensor, as SGLang's
            get_dummy_flat_data_page makes): the target per page that arrived, else None."""
            tier = self._tier(PoolName.KV, "batch_get")
            if tier is None or not keys:
                return [None] * len(keys)
            pool = self._pools[str(PoolName.KV)]
            targets = list(target_locations) if target_locations is not None else [
                pool.get_dummy_flat_data_page() for _ in keys]
            if len(targets) != len(keys) or any(
                    t.numel() * t.element_size() != tier.format.page_bytes for t in targets):
                log.warning("batch_get: %d targets of %s bytes for %d pages of %d bytes",
                            len(targets), sorted({t.numel() * t.element_size()
                                                  for t in targets}), len(keys),
                            tier.format.page_bytes)
                return [None] * len(keys)

            def copy_in(i: int, slot: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
                targets[i].view(-1).view(torch.uint8).copy_(torch.from_numpy(slot))
            ok = tier.load(keys, copy_in)
            return [target if arrived else None for target, arrived in zip(targets, ok)]

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
            """One page's bytes into target_location (or a new flat page): it, or None."""
            return self.batch_get([key], None if target_location is None
                                  else [target_location])[0]

        def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:
            """Stores each page's bytes (flat page tensors, as get_data_page gives them): True
            when every page is stored."""
            tier = self._tier(PoolName.KV, "batch_set")
            if tier is None or values is None or len(values) != len(keys):
                return False
            sizes = {v.numel() * v.element_size() for v in values}
            if keys and sizes != {tier.format.page_bytes}:
                log.warning("batch_set: pages of %s bytes; this pool's are %d", sorted(sizes),
                            tier.format.page_bytes)
                return False

            def copy_out(i: int, slot: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
                value = values[i].reshape(-1)
                _slot_tensor(slot, value.dtype).copy_(value)
            return all(tier.store(keys, copy_out))

        def set(self, key: str, value: Any = None, target_location: Any = None,
                target_sizes: Any = None) -> bool:
            """Stores one page's bytes: True when stored."""
            return self.batch_set([key], [value])

        # ---- the v2 calls (hybrid models: one tier per host pool) ----

        def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None,
                            extra_info: Any = None) -> Any:
            """The longest KV prefix whose every extra pool also holds what its hit policy asks
            (SGLang's HiCacheFile semantics): ALL_PAGES every page up to it, TRAILING_PAGES the
            last len(transfer.keys) pages before it. BLOCK_GROUPS is not served: such a pool
            reports no hit."""
            tier = self._tier(PoolName.KV, "batch_exists_v2")
            kv_pages = 0 if tier is None else tier.leading(keys)
            hits = {PoolName.KV: kv_pages} if kv_pages else {}
            restorable = set(range(1, kv_pages + 1))
            for transfer in pool_transfers or []:
                if not restorable:
                    break
                pool_tier = self._tier(transfer.name, "batch_exists_v2")
                if pool_tier is None:
                    restorable = set()
                    break
                if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = pool_tier.leading(keys[:kv_pages])
                    pool_restorable = set(range(1, boundary + 1))
                elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(transfer.keys or []))
                    present = pool_tier.present(keys[:kv_pages])
                    pool_restorable = {n for n in range(1, kv_pages + 1)
                                       if all(present[max(0, n - trailing):n])}
                    boundary = max(pool_restorable, default=0)
                else:
                    log.warning("batch_exists_v2: pool %s's hit policy %s is not served: no "
                                "hit", transfer.name, transfer.hit_policy)
                    pool_restorable, boundary = set(), 0
                if boundary:
                    hits[transfer.name] = boundary
                restorable &= pool_restorable
            ordered = sorted(restorable)
            return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

        def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
            """Loads each transfer's pages into its named host pool: True per page, by pool."""
            return {t.name: self._pages(True, t.name, t.keys or [], t.host_indices)
                    for t in transfers}

        def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
            """Stores each transfer's pages of its named host pool: True per page, by pool."""
            return {t.name: self._pages(False, t.name, t.keys or [], t.host_indices)
                    for t in transfers}

        # ---- lifetime ----

        def close(self) -> None:
            """SGLang's detach: ends the lease (the daemon drops the registrations with it)."""
            self._client.close()
