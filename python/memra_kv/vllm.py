"""memra_kv.vllm: memra-kvd as vLLM's external KV tier through its KV-connector v1 interface.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MemraKVConnector",
        "kv_connector_module_path": "memra_kv.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"memra_socket": "/run/memra-kv/gpu0.sock"}}'

The method set is vLLM v0.15.0's KVConnectorBase_V1 (vllm/distributed/kv_transfer/kv_connector/
v1/base.py; python/README.md): scheduler side get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, request_finished; worker side
register_kv_caches, start_load_kv, wait_for_layer_load, save_kv_layer, wait_for_save,
get_finished, get_block_ids_with_load_errors.

The logic is in MemraScheduler and MemraWorker, which work on plain ints, lists and numpy arrays
and never import vLLM (the contract tests drive them in vLLM's call order); MemraKVConnector,
the KVConnectorBase_V1 subclass vLLM loads, exists only where vLLM is importable and only
translates vLLM's objects.

How it uses the block store:
  * Blocks are keyed by vLLM's own chained block hashes (Request.block_hashes), so every vLLM
    of one model, layout and cache scope shares them; a stored block is every layer's K and V
    of that block (the block store's unit), so loads and saves are whole blocks, once per step.
  * The scheduler attaches as its own engine and registers a one-block pool of the workers'
    layout (same layout fingerprint: offsets, strides and block counts are not part of it) to
    answer get_num_new_matched_tokens; it never pins (a pin is one engine's), so a block evicted
    between lookup and load is a load error the worker reports through
    get_block_ids_with_load_errors, and vLLM recomputes it (its KV-load-failure recovery).
  * Loads run in start_load_kv and are complete when it returns (host backend: the daemon's
    reply comes after the copies; cuda: the engine's stream waits on the reply's completion
    event), so wait_for_layer_load has nothing to wait for; saves of newly computed full blocks
    run in wait_for_save, after the forward pass wrote them.
  * Memory: caches that lie in memra HostPools are registered themselves (the daemon maps their
    memfds; blocks copy straight in and out). With a daemon on the cuda backend, caches that
    are CUDA tensors are registered themselves too: each distinct storage's CUDA IPC handle
    (torch's untyped_storage()._share_cuda_()), opened once by the daemon, which copies blocks
    on its own stream after waiting on the worker's interprocess event (recorded on the current
    stream before each call) and answers a completion event the worker's stream waits on. Any
    others (vLLM's GPU tensors with a host daemon, or CPU tensors) go through a registered
    staging HostPool, copied with torch (device <-> host): a daemon on the host backend is then
    the GPU's CPU-memory tier.
"""

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from .block_store import (ELEMENT_BYTES, BlockStore, CudaRegion, HostPool, KeptRegistration,
                          PoolLayout, TensorLayout, cuda_region_of, element_type_of, page_key)
from .errors import KvError

VLLM_VERSION = "0.15.0"  # the KVConnectorBase_V1 method set this module implements

log = logging.getLogger("memra_kv.vllm")


# ---- metadata: scheduler -> worker, once per step (plain, picklable) ----

@dataclass
class LoadSpec:
    request_id: str
    hashes: List[bytes]  # the stored blocks to load, in order
    block_ids: List[int]  # the pool blocks vLLM allocated for them


@dataclass
class SaveSpec:
    request_id: str
    hashes: List[bytes]
    block_ids: List[int]
    parent_hash: bytes  # the hash of the block before the first (b"" at the start)
    token_ids: List[int]  # the blocks' tokens (for routers' events)


@dataclass
class MemraConnectorMetadata:
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)


# ---- the pool's layout from vLLM's KV cache tensors ----

@dataclass
class KvCacheTensor:
    """One layer's KV cache as vLLM's FlashAttention backend allocates it: shape (2, num_blocks,
    block_size, num_kv_heads, head_dim), index 0 K and 1 V; strides in bytes."""
    name: str
    address: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int
    dtype: str

    @classmethod
    def of(cls, name, tensor):
        """From a numpy array or a torch tensor."""
        if isinstance(tensor, np.ndarray):
            return cls(name, tensor.ctypes.data, tuple(tensor.shape), tuple(tensor.strides),
                       tensor.itemsize, str(tensor.dtype))
        itemsize = tensor.element_size()
        return cls(name, tensor.data_ptr(), tuple(tensor.shape),
                   tuple(s * itemsize for s in tensor.stride()), itemsize, str(tensor.dtype))


_LAYER_NUMBER = re.compile(r"(\d+)(?!.*\d)")


def layer_index(name, position):
    """The layer number in a vLLM layer name ("model.layers.7.self_attn.attn" -> 7), else its
    position among the caches."""
    match = _LAYER_NUMBER.search(name)
    return int(match.group(1)) if match else position


def pool_layout(caches: Sequence[KvCacheTensor], pools: Sequence, model,
                tp_rank=0, tp_size=1, staging_blocks=0):
    """The block store layout of vLLM's per-layer caches lying in `pools` (HostPools, or
    CudaRegions: each buffer i is pools[i]); with
    staging_blocks instead, of a staging pool of that many blocks holding the caches' K and V
    planes one after the other (the caches themselves lie anywhere). KvError INVALID_ARGUMENT
    naming the layer and the numbers for a cache of another shape, a block whose tokens are
    not contiguous, or caches that disagree; FAILED_PRECONDITION for a cache outside every
    pool."""
    if not caches:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "no KV caches to register")
    first = caches[0]
    tensors = []
    for position, cache in enumerate(caches):
        if len(cache.shape) != 5 or cache.shape[0] != 2:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache %s of shape %s; the "
                          "connector takes (2, num_blocks, block_size, num_kv_heads, head_dim)"
                          % (cache.name, cache.shape))
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache %s is %s %s and %s is %s "
                          "%s: one layout for every layer" % (cache.name, cache.shape,
                                                              cache.dtype, first.name,
                                                              first.shape, first.dtype))
        _, num_blocks, block_size, heads, head_dim = cache.shape
        # A block's tokens, heads and dims contiguous (NHD): its bytes are one range.
        contiguous = (head_dim * cache.itemsize, cache.itemsize)
        if cache.strides[3:] != contiguous or cache.strides[2] != heads * head_dim * cache.itemsize:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache %s has strides %s: a "
                          "block's (block_size, heads, head_dim) must be contiguous"
                          % (cache.name, cache.strides))
        layer = layer_index(cache.name, position)
        block_bytes = block_size * heads * head_dim * cache.itemsize
        for kind, plane in (("K", 0), ("V", 1)):
            if staging_blocks:
                tensors.append(TensorLayout(layer, kind, len(tensors) * staging_blocks
                                            * block_bytes, block_bytes, block_bytes))
                continue
            buffer, offset = _locate(cache, pools)
            tensors.append(TensorLayout(layer, kind, offset + plane * cache.strides[0],
                                        cache.strides[1], block_bytes, buffer=buffer))
    _, num_blocks, block_size, heads, head_dim = first.shape
    return PoolLayout(num_blocks=staging_blocks or num_blocks, tokens_per_block=block_size,
                      element_type=element_type_of(first.dtype), num_kv_heads=heads,
                      head_dim=head_dim, model=model, tensors=tensors, order="NHD",
                      tp_rank=tp_rank, tp_size=tp_size)


def _bounds(pool):
    """(address, bytes) of a HostPool or a CudaRegion."""
    if isinstance(pool, CudaRegion):
        return pool.address, pool.buffer.nbytes
    return pool.array.ctypes.data, pool.nbytes


def _locate(cache, pools):
    for index, pool in enumerate(pools):
        base, nbytes = _bounds(pool)
        if base <= cache.address < base + nbytes:
            return index, cache.address - base
    raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "KV cache %s at 0x%x is not in a memra "
                  "host pool or a registered CUDA region: the daemon can map only memory it was "
                  "handed (memra_kv.block_store.HostPool, CudaRegion)"
                  % (cache.name, cache.address))


def cuda_regions(tensors):
    """One CudaRegion per distinct storage of `tensors` (CUDA torch tensors), in first-seen
    order: layers that share an allocation's storage share one buffer."""
    regions = {}
    for tensor in tensors:
        region = cuda_region_of(tensor)
        regions.setdefault(region.address, region)
    return list(regions.values())


class _CudaOrdering:
    """The worker's side of the daemon's device ordering (cuda backend): an interprocess event
    recorded on the current stream before each call (the daemon waits on it before touching the
    pool) and the reply's completion event, opened once, that the current stream waits on
    before anything uses the blocks. torch is imported here only (a CUDA pool means torch)."""

    def __init__(self, device):
        import torch
        self._torch = torch
        self._device = device
        self._before = torch.cuda.Event(interprocess=True)
        self._completions = {}

    def before(self):
        self._before.record(self._torch.cuda.current_stream(self._device))
        return bytes(self._before.ipc_handle())

    def after(self, completion_event):
        if not completion_event:
            return
        event = self._completions.get(completion_event)
        if event is None:
            event = self._torch.cuda.Event.from_ipc_handle(self._device, completion_event)
            self._completions[completion_event] = event
        self._torch.cuda.current_stream(self._device).wait_event(event)


def lookup_layout(layout):
    """`layout` with one block, its tensors packed back to back: the scheduler's lookup-only
    registration (the same layout fingerprint as the workers')."""
    tensors = []
    offset = 0
    for tensor in layout.tensors:
        tensors.append(TensorLayout(tensor.layer, tensor.kind, offset, tensor.block_bytes,
                                    tensor.block_bytes, tensor.kv_group, 0))
        offset += tensor.block_bytes
    return dataclasses.replace(layout, num_blocks=1, tensors=tensors), offset


def scheduler_layout(num_layers, block_size, num_kv_heads, head_dim, element_type, model,
                     tp_size=1):
    """The lookup layout the scheduler derives from the model's config alone: one block of
    layers 0..num_layers-1, K and V each, as rank 0's workers register them (pool_layout)."""
    block_bytes = block_size * num_kv_heads * head_dim * ELEMENT_BYTES[element_type]
    tensors = [TensorLayout(layer, kind, 0, block_bytes, block_bytes)
               for layer in range(num_layers) for kind in ("K", "V")]
    layout = PoolLayout(num_blocks=1, tokens_per_block=block_size, element_type=element_type,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, model=model,
                        tensors=tensors, tp_rank=0, tp_size=tp_size)
    return lookup_layout(layout)


# vLLM's cache_dtype -> the torch dtype it allocates the KV cache as (vllm/utils
# STR_DTYPE_TO_TORCH_DTYPE): fp8 caches are uint8 bytes, so the workers register "int8".
_CACHE_DTYPE_ALLOCATED = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                          "float": "float32", "float32": "float32", "fp8": "uint8",
                          "fp8_e4m3": "uint8", "fp8_e5m2": "uint8", "fp8_ds_mla": "uint8",
                          "int8": "int8", "fp8_inc": "float8_e4m3fn"}


def cache_element_type(cache_dtype, model_dtype):
    """The element type vLLM's workers register for cache_config.cache_dtype ("auto": the
    model's dtype), as the scheduler must name it for its lookups to match. KvError
    INVALID_ARGUMENT for a cache dtype vLLM does not allocate."""
    if str(cache_dtype) == "auto":
        return element_type_of(model_dtype)
    allocated = _CACHE_DTYPE_ALLOCATED.get(str(cache_dtype))
    if allocated is None:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache dtype %s: the connector "
                      "takes auto, %s" % (cache_dtype, ", ".join(sorted(_CACHE_DTYPE_ALLOCATED))))
    return element_type_of(allocated)


class LazyScheduler:
    """The scheduler's lookup registration, made on first use by `make()` (-> MemraScheduler):
    a refusal or an unreachable daemon leaves it unmade (get() is None: every request a miss)
    and it is tried again at the next call, never raising into vLLM's scheduler loop."""

    def __init__(self, make):
        self._make = make
        self._scheduler = None

    def get(self) -> Optional["MemraScheduler"]:
        if self._scheduler is None:
            try:
                self._scheduler = self._make()
            except (KvError, grpc.RpcError, OSError) as error:
                log.warning("the scheduler's lookup registration failed (retried at the next "
                            "request): %s", error)
        return self._scheduler


# ---- scheduler side ----

@dataclass
class _Tracked:
    hashes: List[bytes]
    token_ids: List[int]
    block_ids: List[int] = field(default_factory=list)
    computed_tokens: int = 0  # when get_num_new_matched_tokens was asked
    external_blocks: int = 0  # blocks the store can give beyond the computed ones
    done_blocks: int = 0  # leading blocks loaded or saved (never saved again)


class MemraScheduler:
    """The scheduler side on plain values. `registration`: the lookup registration
    (lookup_layout) of an attached client's BlockStore, made again when the daemon lost it."""

    def __init__(self, registration: KeptRegistration, block_size):
        self._registration = registration
        self.block_size = block_size
        self._requests: Dict[str, _Tracked] = {}
        self._loads: List[LoadSpec] = []

    def get_num_new_matched_tokens(self, request_id, block_hashes, token_ids,
                                   num_computed_tokens) -> Tuple[int, bool]:
        """Tokens beyond num_computed_tokens the store holds, in whole blocks, never the
        request's last token (vLLM computes at least one); loads are synchronous (False)."""
        hashes = [page_key(h) for h in block_hashes]
        tracked = self._requests.setdefault(request_id, _Tracked(hashes, list(token_ids)))
        tracked.hashes, tracked.token_ids = hashes, list(token_ids)
        tracked.computed_tokens = num_computed_tokens
        computed_blocks = num_computed_tokens // self.block_size
        loadable = min(len(hashes), max(0, (len(token_ids) - 1) // self.block_size))
        matched = 0
        if loadable > computed_blocks:
            try:
                matched = self._registration.lookup(hashes=hashes[:loadable]).matched_blocks
            except KvError as error:  # the store is a cache: unreachable means a miss
                log.warning("lookup of request %s: %s", request_id, error)
        tracked.external_blocks = max(0, min(matched, loadable) - computed_blocks)
        return tracked.external_blocks * self.block_size, False

    def update_state_after_alloc(self, request_id, block_ids, num_external_tokens):
        """`block_ids`: the request's blocks (KV group 0) after this allocation."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return
        first = tracked.computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        self._loads.append(LoadSpec(request_id, tracked.hashes[first:first + count],
                                    tracked.block_ids[first:first + count]))
        tracked.done_blocks = first + count

    def update_request(self, request_id, block_hashes, token_ids, block_ids):
        """What a running request has now (its hashes grow with its computed tokens)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = _Tracked([], [])
        tracked.hashes = [page_key(h) for h in block_hashes]
        tracked.token_ids = list(token_ids)
        tracked.block_ids = list(block_ids)

    def block_ids(self, request_id):
        tracked = self._requests.get(request_id)
        return list(tracked.block_ids) if tracked else []

    def build_connector_meta(self, computed_tokens: Dict[str, int]) -> MemraConnectorMetadata:
        """This step's loads (from update_state_after_alloc) and saves: per scheduled request
        (`computed_tokens`: request id -> tokens computed once this step ran), the full blocks
        with hashes not yet loaded or saved. Resets the step's state."""
        meta = MemraConnectorMetadata(self._loads, [])
        self._loads = []
        for request_id, tokens in computed_tokens.items():
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            full = min(tokens // self.block_size, len(tracked.hashes), len(tracked.block_ids))
            if full <= tracked.done_blocks:
                continue
            first = tracked.done_blocks
            meta.saves.append(SaveSpec(
                request_id, tracked.hashes[first:full], tracked.block_ids[first:full],
                tracked.hashes[first - 1] if first else b"",
                tracked.token_ids[first * self.block_size:full * self.block_size]))
            tracked.done_blocks = full
        return meta

    def request_finished(self, request_id) -> Tuple[bool, Optional[dict]]:
        """Saves are synchronous (wait_for_save): vLLM may free the blocks now."""
        self._requests.pop(request_id, None)
        return False, None


# ---- worker side ----

class _Staging:
    """A registered HostPool of `slots` blocks through which caches the daemon cannot map (a
    GPU's, an engine's own host memory) are stored and loaded: plane i (layer, K or V in layout
    order) of slot j is bytes [(i * slots + j) * block_bytes, +block_bytes). Copies go through
    the caches' own library (torch copy_, which moves device <-> host; numpy copyto)."""

    def __init__(self, pool, planes, block_bytes, slots):
        self.pool = pool
        self.planes = planes  # (cache tensor, 0 K | 1 V), layout order
        self.block_bytes = block_bytes
        self.slots = slots
        self._bytes = pool.array
        if planes and not isinstance(planes[0][0], np.ndarray):
            import torch
            self._bytes = torch.from_numpy(pool.array)

    def _slot(self, plane, slot):
        start = (plane * self.slots + slot) * self.block_bytes
        return self._bytes[start:start + self.block_bytes]

    def _block(self, plane, block_id):
        tensor, kind = self.planes[plane]
        block = tensor[kind, block_id].reshape(-1)
        if isinstance(block, np.ndarray):
            return block.view(np.uint8)
        import torch
        return block.view(torch.uint8)

    def gather(self, block_ids):
        """Cache blocks block_ids into slots 0.. (before a store)."""
        for plane in range(len(self.planes)):
            for slot, block_id in enumerate(block_ids):
                _copy(self._slot(plane, slot), self._block(plane, block_id))

    def scatter(self, block_ids, arrived):
        """Slots 0.. into cache blocks block_ids, where `arrived` (after a load)."""
        for plane in range(len(self.planes)):
            for slot, block_id in enumerate(block_ids):
                if arrived[slot]:
                    _copy(self._block(plane, block_id), self._slot(plane, slot))


def _copy(dst, src):
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


class MemraWorker:
    """The worker side on plain values: registers the pool, loads and saves whole blocks.
    Caches that lie in HostPools are registered themselves (blocks copy straight between them
    and the store); any others go through a staging HostPool of `staging_blocks` blocks. A
    registration the daemon lost is made again (KeptRegistration)."""

    def __init__(self, store: BlockStore, staging_blocks=64):
        self._store = store
        self._staging_blocks = staging_blocks
        self._staging = None
        self._cuda = None  # _CudaOrdering when the pool is registered by CUDA IPC handle
        self._kept = None  # KeptRegistration once register_kv_caches ran
        self._load_errors = set()
        self.saved_blocks = 0
        self.loaded_blocks = 0

    def register_kv_caches(self, kv_caches, pools: Sequence[HostPool], model, tp_rank=0,
                           tp_size=1):
        """`kv_caches`: layer name -> (2, num_blocks, block_size, heads, head_dim) numpy array
        or torch tensor, as vLLM passes them; `pools`: the HostPools they lie in, or none: CUDA
        tensors with a daemon on the cuda backend register by IPC handle, others are staged."""
        caches = [KvCacheTensor.of(name, tensor) for name, tensor in kv_caches.items()]
        if pools:
            layout = pool_layout(caches, pools, model, tp_rank, tp_size)
            self._kept = KeptRegistration(self._store, pools, layout)
            return self.registration
        tensors = list(kv_caches.values())
        if (self._store.backend == "cuda" and tensors
                and all(getattr(t, "is_cuda", False) for t in tensors)):
            regions = cuda_regions(tensors)
            layout = pool_layout(caches, regions, model, tp_rank, tp_size)
            self._kept = KeptRegistration(self._store, [r.buffer for r in regions], layout)
            self._cuda = _CudaOrdering(tensors[0].device)
            return self.registration
        layout = pool_layout(caches, (), model, tp_rank, tp_size, self._staging_blocks)
        block_bytes = layout.block_bytes
        pool = HostPool(len(layout.tensors) * self._staging_blocks * block_bytes,
                        "memra-kv-staging")
        planes = [(tensor, kind) for tensor in kv_caches.values() for kind in (0, 1)]
        self._staging = _Staging(pool, planes, block_bytes, self._staging_blocks)
        self._kept = KeptRegistration(self._store, [pool], layout)
        return self.registration

    @property
    def registration(self):
        """The pool's Registration now (None before register_kv_caches)."""
        return self._kept.registration if self._kept is not None else None

    def _transfer(self, loading, block_ids, hashes, parent_hash=b"", token_ids=()):
        """One outcome (True: done) per block; staged in chunks of the staging pool's size."""
        if self._kept is None:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "a %s before register_kv_caches: "
                          "no KV cache is registered" % ("load" if loading else "save"))
        if self._staging is None:
            wait_event = self._cuda.before() if self._cuda else b""
            if loading:
                transfer = self._kept.load(block_ids, hashes=hashes, wait_event=wait_event)
            else:
                transfer = self._kept.store(block_ids, hashes=hashes, parent_hash=parent_hash,
                                            event_token_ids=token_ids, wait_event=wait_event)
            if self._cuda:
                self._cuda.after(transfer.completion_event)
            return [block.ok for block in transfer.blocks]
        slots = self._staging.slots
        tokens_per_block = len(token_ids) // len(hashes) if token_ids else 0
        done = []
        for start in range(0, len(block_ids), slots):
            ids, chunk = block_ids[start:start + slots], hashes[start:start + slots]
            staged = list(range(len(ids)))
            if loading:
                transfer = self._kept.load(staged, hashes=chunk)
                ok = [block.ok for block in transfer.blocks]
                self._staging.scatter(ids, ok)
            else:
                self._staging.gather(ids)
                transfer = self._kept.store(
                    staged, hashes=chunk,
                    parent_hash=hashes[start - 1] if start else parent_hash,
                    event_token_ids=token_ids[start * tokens_per_block:
                                              (start + len(ids)) * tokens_per_block])
                ok = [block.ok for block in transfer.blocks]
            done += ok
        return done

    def start_load_kv(self, meta: MemraConnectorMetadata):
        """Every load of the step, done when this returns; failed blocks (no longer stored,
        corrupt, or the call refused) are kept for get_block_ids_with_load_errors."""
        for load in meta.loads:
            if not load.block_ids:
                continue
            try:
                arrived = self._transfer(True, load.block_ids, load.hashes)
            except KvError as error:
                log.warning("load of request %s: %s", load.request_id, error)
                self._load_errors.update(load.block_ids)
                continue
            self._load_errors.update(b for b, ok in zip(load.block_ids, arrived) if not ok)
            self.loaded_blocks += sum(arrived)

    def wait_for_layer_load(self, layer_name):
        """Loads are complete when start_load_kv returns."""

    def save_kv_layer(self, layer_name):
        """A stored block holds every layer: blocks are saved whole, in wait_for_save."""

    def wait_for_save(self, meta: MemraConnectorMetadata):
        """Stores the step's newly computed full blocks. A refusal (no room, the daemon gone)
        costs a later cache miss, nothing else."""
        for save in meta.saves:
            try:
                stored = self._transfer(False, save.block_ids, save.hashes, save.parent_hash,
                                        save.token_ids)
            except KvError as error:
                log.warning("save of request %s: %s", save.request_id, error)
                continue
            self.saved_blocks += sum(stored)

    def get_finished(self, finished_request_ids):
        """Nothing is asynchronous: no request waits on this connector."""
        return None, None

    def get_block_ids_with_load_errors(self):
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors


# ---- the vLLM class, where vLLM is importable ----

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
except ImportError:  # vLLM is not installed: the logic above is all there is
    KVConnectorBase_V1 = None

if KVConnectorBase_V1 is not None:
    from .client import Client

    class _Metadata(KVConnectorMetadata, MemraConnectorMetadata):
        pass

    class MemraKVConnector(KVConnectorBase_V1):
        """vLLM's view of MemraScheduler / MemraWorker (kv_connector_extra_config:
        memra_socket, memra_engine_name, memra_cache_scope; memra_pools: the HostPools the
        worker's caches live in, for an engine that allocated them there)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            except TypeError:  # before kv_cache_config was an argument
                super().__init__(vllm_config, role)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            self._extra = extra
            self._model = str(vllm_config.model_config.model)
            self._block_size = vllm_config.cache_config.block_size
            self._client = Client.connect(extra.get("memra_socket", "/run/memra-kv/gpu0.sock"))
            self._client.attach(extra.get("memra_engine_name", "vllm-%s" % role.name.lower()),
                                cache_scope=extra.get("memra_cache_scope", ""))
            self._store = BlockStore(self._client)
            self._scheduler = LazyScheduler(self._make_scheduler)
            self._requests = {}
            self._worker = (MemraWorker(self._store, int(extra.get("memra_staging_blocks", 64)))
                            if role == KVConnectorRole.WORKER else None)

        # -- worker side --

        def register_kv_caches(self, kv_caches):
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self._worker.register_kv_caches(
                kv_caches, self._extra.get("memra_pools", ()), self._model,
                get_tensor_model_parallel_rank(),
                self._vllm_config.parallel_config.tensor_parallel_size)

        def start_load_kv(self, forward_context, **kwargs):
            self._worker.start_load_kv(self._get_connector_metadata())

        def wait_for_layer_load(self, layer_name):
            self._worker.wait_for_layer_load(layer_name)

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            self._worker.save_kv_layer(layer_name)

        def wait_for_save(self):
            self._worker.wait_for_save(self._get_connector_metadata())

        def get_finished(self, finished_req_ids):
            return self._worker.get_finished(finished_req_ids)

        def get_block_ids_with_load_errors(self):
            return self._worker.get_block_ids_with_load_errors()

        # -- scheduler side --

        def _make_scheduler(self):
            model_config = self._vllm_config.model_config
            parallel = self._vllm_config.parallel_config
            packed, nbytes = scheduler_layout(
                model_config.get_num_layers(parallel), self._block_size,
                model_config.get_num_kv_heads(parallel), model_config.get_head_size(),
                cache_element_type(self._vllm_config.cache_config.cache_dtype,
                                   model_config.dtype),
                self._model, parallel.tensor_parallel_size)
            registration = KeptRegistration(self._store, [HostPool(nbytes, "memra-kv-lookup")],
                                            packed)
            return MemraScheduler(registration, self._block_size)

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            logic = self._scheduler.get()
            if logic is None:
                return 0, False
            self._requests[request.request_id] = request
            return logic.get_num_new_matched_tokens(
                request.request_id, request.block_hashes, request.all_token_ids,
                num_computed_tokens)

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            logic = self._scheduler.get()
            if logic is None:
                return
            logic.update_state_after_alloc(
                request.request_id, blocks.get_block_ids()[0], num_external_tokens)

        def build_connector_meta(self, scheduler_output):
            logic = self._scheduler.get()
            if logic is None:
                return _Metadata([], [])
            computed = {}
            for new in scheduler_output.scheduled_new_reqs:
                computed[new.req_id] = (new.num_computed_tokens
                                        + scheduler_output.num_scheduled_tokens[new.req_id])
                request = self._requests.get(new.req_id)
                if request is not None:
                    logic.update_request(new.req_id, request.block_hashes,
                                         request.all_token_ids, new.block_ids[0])
            cached = scheduler_output.scheduled_cached_reqs
            for i, request_id in enumerate(cached.req_ids):
                request = self._requests.get(request_id)
                if request is None:
                    continue
                computed[request_id] = (cached.num_computed_tokens[i]
                                        + scheduler_output.num_scheduled_tokens[request_id])
                new_blocks = list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else []
                # A request resumed after preemption has new blocks, not more blocks.
                resumed = request_id in getattr(cached, "resumed_req_ids", ())
                block_ids = new_blocks if resumed else logic.block_ids(request_id) + new_blocks
                logic.update_request(request_id, request.block_hashes, request.all_token_ids,
                                     block_ids)
            meta = logic.build_connector_meta(computed)
            return _Metadata(meta.loads, meta.saves)

        def request_finished(self, request, block_ids):
            self._requests.pop(request.request_id, None)
            logic = self._scheduler.get()
            return (False, None) if logic is None else logic.request_finished(request.request_id)
