"""memra_kv.vllm: memra-kvd as vLLM's external KV tier through its KV-connector v1 interface.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MemraKVConnector",
        "kv_connector_module_path": "memra_kv.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"memra_socket": "/run/memra-kv/gpu0.sock"}}'

MemraKVConnector subclasses the installed vLLM's KVConnectorBase_V1 (and SupportsHMA); it is
written and tested against vLLM 0.33.0 from PyPI (docs/engine-adapters.md lists every member of
that base class and what the connector does with it). The logic is in MemraScheduler and
MemraWorker, which work on plain ints, lists, numpy arrays and torch tensors and never import
vLLM; MemraKVConnector exists only where vLLM is importable and translates vLLM's objects.

How it uses the block store:
  * Blocks are keyed by content (ContentKeys): SHA-256 chained over each whole block's token
    ids from a root binding the request's cache_salt and LoRA adapter; the daemon scopes every
    key by the pool's layout fingerprint (model, element type, page order, block size, heads,
    TP) and the cache scope. vLLM's own block hashes are not used: they are seeded per process
    unless PYTHONHASHSEED is set (non-cryptographic algorithms), and change with
    prefix_caching_hash_algo and across vLLM versions. A stored block is every layer's page of
    that block (the block store's unit), so loads and saves are whole blocks, once per step.
  * vLLM 0.33 hands each layer's cache as a (num_blocks, heads, block_size, content) view in the
    resolved KVCacheLayout; every block-compact layout (LBNHC, BLNHC: NHD pages; LBHNC, BLHNC:
    HND pages) is registered as one fused KV tensor per layer. The scheduler derives the same
    layout from its KVCacheConfig and registers a one-block lookup pool of it (same layout
    fingerprint) to answer get_num_new_matched_tokens. Its lookup pins what it found until the
    request finishes (a TTL'd block-store pin: memra_lookup_pin_ms), so our own eviction never
    fails a load; a block gone anyway (the pin refused or expired) is a load error the worker
    reports through get_block_ids_with_load_errors (vLLM's kv_load_failure_policy decides:
    "recompute" or "fail").
  * A load of at least memra_async_load_min_tokens tokens is asynchronous: vLLM parks the
    request until get_finished reports it, and the worker's loader thread makes the load
    meanwhile (its own staging pool), beside the forward passes of other requests. Smaller
    loads run in start_load_kv, before the forward (host backend: the daemon's reply comes
    after the copies; cuda: the engine's stream waits on the reply's completion event).
  * Layer hooks: the block store's calls are whole blocks (every layer), so the layer-wise part
    is the staging copies: a sync load's last staged chunk goes into each layer's cache at
    wait_for_layer_load, and the step's first saved blocks come out of each layer at
    save_kv_layer; the StoreBlocks call is made in wait_for_save, after the forward pass.
  * The daemon is a cache: down, unreachable or refusing the pool, vLLM runs on without it
    (one warning per process) and the connector tries again, at most every RETRY_S seconds.
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

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple,
                    Union, cast)

import grpc
import numpy as np

from .block_store import (ELEMENT_BYTES, BlockMatch, BlockStore, CudaRegion, HostPool,
                          KeptRegistration, PoolLayout, Registration, TensorLayout,
                          cuda_region_of, element_type_of, page_key)
from .errors import KvError

VLLM_VERSION = "0.33.0"  # the KVConnectorBase_V1 this module is written and tested against

log = logging.getLogger("memra_kv.vllm")


# ---- metadata: scheduler -> worker, once per step (plain, picklable) ----

@dataclass
class LoadSpec:
    """One request's blocks to load this step."""
    request_id: str
    hashes: List[bytes]  # the stored blocks to load, in order
    block_ids: List[int]  # the pool blocks vLLM allocated for them
    asynchronous: bool = False  # off the forward path, reported done by get_finished


@dataclass
class SaveSpec:
    """One request's newly computed full blocks to store this step."""
    request_id: str
    hashes: List[bytes]
    block_ids: List[int]
    parent_hash: bytes  # routers' hash of the block before the first (b"" at the start)
    token_ids: List[int]  # the blocks' tokens (for routers' events)
    # vLLM's own block hashes of the blocks, for routers' events (empty: the events carry
    # `hashes`); parent_hash is then vLLM's too.
    event_hashes: List[bytes] = field(default_factory=list)


@dataclass
class MemraConnectorMetadata:
    """One step's loads and saves, from the scheduler to the workers."""
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)


# ---- the pool's layout from vLLM's KV cache tensors ----

@dataclass
class KvCacheTensor:
    """One layer's KV cache as vLLM hands it to register_kv_caches, strides in bytes. Two shapes:

    * vLLM >= 0.33 (kv_cache_interface.create_kv_cache_views): (num_blocks, heads, block_size,
      content) per layer, content = K's and V's head dims of one (head, token) cell, in the
      strides of the resolved KVCacheLayout. A block's page ([H, N, C] in its physical order) is
      one run of bytes in every block-compact layout (LBNHC, LBHNC, BLNHC, BLHNC): it is stored
      as the layer's one fused "KV" tensor, ordered NHD (tokens outer) or HND (heads outer).
    * vLLM 0.15's FlashAttention shape (2, num_blocks, block_size, heads, head_dim), index 0 K
      and 1 V: stored as the layer's "K" and "V" tensors."""
    name: str
    address: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int
    dtype: str

    @classmethod
    def of(cls, name: str, tensor: Any) -> KvCacheTensor:
        """From a numpy array or a torch tensor."""
        if isinstance(tensor, np.ndarray):
            return cls(name, tensor.ctypes.data, tuple(tensor.shape), tuple(tensor.strides),
                       tensor.itemsize, str(tensor.dtype))
        itemsize = tensor.element_size()
        return cls(name, tensor.data_ptr(), tuple(tensor.shape),
                   tuple(s * itemsize for s in tensor.stride()), itemsize, str(tensor.dtype))

    @property
    def fused(self) -> bool:
        """vLLM >= 0.33's per-layer (blocks, heads, tokens, content) page view."""
        return len(self.shape) == 4

    def page_order(self) -> str:
        """A fused cache's page order: "NHD" or "HND". KvError INVALID_ARGUMENT naming the layer
        and the strides when a block's page is not one dense run with the content innermost
        (the layouts BHLNC and LHBNC scatter a page per head)."""
        _, heads, tokens, content = self.shape
        cell = content * self.itemsize
        _, head_stride, token_stride, content_stride = self.strides
        if content_stride == self.itemsize:
            if token_stride == cell and head_stride == tokens * cell:
                return "HND"
            if head_stride == cell and token_stride == heads * cell:
                return "NHD"
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache %s has strides %s for shape %s:"
                      " a block's page must be one dense run (KV cache layouts LBNHC, LBHNC, "
                      "BLNHC or BLHNC; set VLLM_KV_CACHE_LAYOUT)" % (self.name, self.strides,
                                                                    self.shape))


_LAYER_NUMBER = re.compile(r"(\d+)(?!.*\d)")


def layer_index(name: str, position: int) -> int:
    """The layer number in a vLLM layer name ("model.layers.7.self_attn.attn" -> 7), else its
    position among the caches."""
    match = _LAYER_NUMBER.search(name)
    return int(match.group(1)) if match else position


def pool_layout(caches: Sequence[KvCacheTensor], pools: Sequence[Union[HostPool, CudaRegion]],
                model: str, tp_rank: int = 0, tp_size: int = 1,
                staging_blocks: int = 0) -> PoolLayout:
    """The block store layout of vLLM's per-layer caches lying in `pools` (HostPools, or
    CudaRegions: each buffer i is pools[i]); with staging_blocks instead, of a staging pool of
    that many blocks holding the caches' planes (a layer's KV page, or its K and V blocks) one
    after the other (the caches themselves lie anywhere). KvError INVALID_ARGUMENT naming the
    layer and the numbers for a cache of another shape, a block whose bytes are not one run, or
    caches that disagree; FAILED_PRECONDITION for a cache outside every pool."""
    if not caches:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "no KV caches to register")
    first = caches[0]
    order = first.page_order() if first.fused else "NHD"
    tensors: List[TensorLayout] = []
    for position, cache in enumerate(caches):
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache %s is %s %s and %s is %s "
                          "%s: one layout for every layer" % (cache.name, cache.shape,
                                                              cache.dtype, first.name,
                                                              first.shape, first.dtype))
        layer = layer_index(cache.name, position)
        for kind, plane_offset, block_stride, block_bytes in _planes(cache, order):
            if staging_blocks:
                tensors.append(TensorLayout(layer, kind, len(tensors) * staging_blocks
                                            * block_bytes, block_bytes, block_bytes))
                continue
            buffer, offset = _locate(cache, pools)
            tensors.append(TensorLayout(layer, kind, offset + plane_offset, block_stride,
                                        block_bytes, buffer=buffer))
    if first.fused:
        num_blocks, heads, block_size, head_dim = first.shape
    else:
        _, num_blocks, block_size, heads, head_dim = first.shape
    return PoolLayout(num_blocks=staging_blocks or num_blocks, tokens_per_block=block_size,
                      element_type=element_type_of(first.dtype), num_kv_heads=heads,
                      head_dim=head_dim, model=model, tensors=tensors, order=order,
                      tp_rank=tp_rank, tp_size=tp_size)


def _planes(cache: KvCacheTensor, order: str) -> List[Tuple[str, int, int, int]]:
    """(kind, byte offset of block 0, block stride, block bytes) of each stored plane of one
    layer's cache."""
    if cache.fused:
        if cache.page_order() != order:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache %s is %s and the first "
                          "layer %s: one layout for every layer" % (cache.name,
                                                                    cache.page_order(), order))
        num_blocks, heads, tokens, content = cache.shape
        return [("KV", 0, cache.strides[0], heads * tokens * content * cache.itemsize)]
    if len(cache.shape) != 5 or cache.shape[0] != 2:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache %s of shape %s; the connector "
                      "takes (num_blocks, heads, block_size, content) or (2, num_blocks, "
                      "block_size, num_kv_heads, head_dim)" % (cache.name, cache.shape))
    _, num_blocks, block_size, heads, head_dim = cache.shape
    # A block's tokens, heads and dims contiguous (NHD): its bytes are one range.
    contiguous = (head_dim * cache.itemsize, cache.itemsize)
    if cache.strides[3:] != contiguous or cache.strides[2] != heads * head_dim * cache.itemsize:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "KV cache %s has strides %s: a block's "
                      "(block_size, heads, head_dim) must be contiguous"
                      % (cache.name, cache.strides))
    block_bytes = block_size * heads * head_dim * cache.itemsize
    return [(kind, plane * cache.strides[0], cache.strides[1], block_bytes)
            for kind, plane in (("K", 0), ("V", 1))]


def _bounds(pool: Union[HostPool, CudaRegion]) -> Tuple[int, int]:
    """(address, bytes) of a HostPool or a CudaRegion."""
    if isinstance(pool, CudaRegion):
        return pool.address, pool.buffer.nbytes
    # An open pool (array is None only once closed).
    return cast("np.ndarray[Any, np.dtype[np.uint8]]", pool.array).ctypes.data, pool.nbytes


def _locate(cache: KvCacheTensor,
            pools: Sequence[Union[HostPool, CudaRegion]]) -> Tuple[int, int]:
    for index, pool in enumerate(pools):
        base, nbytes = _bounds(pool)
        if base <= cache.address < base + nbytes:
            return index, cache.address - base
    raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "KV cache %s at 0x%x is not in a memra "
                  "host pool or a registered CUDA region: the daemon can map only memory it was "
                  "handed (memra_kv.block_store.HostPool, CudaRegion)"
                  % (cache.name, cache.address))


def cuda_regions(tensors: Iterable[Any]) -> List[CudaRegion]:
    """One CudaRegion per distinct storage of `tensors` (CUDA torch tensors), in first-seen
    order: layers that share an allocation's storage share one buffer."""
    regions: Dict[int, CudaRegion] = {}
    for tensor in tensors:
        region = cuda_region_of(tensor)
        regions.setdefault(region.address, region)
    return list(regions.values())


class _CudaOrdering:
    """The worker's side of the daemon's device ordering (cuda backend): an interprocess event
    recorded on the current stream before each call (the daemon waits on it before touching the
    pool) and the reply's completion event, opened once, that the current stream waits on
    before anything uses the blocks. torch is imported here only (a CUDA pool means torch)."""

    def __init__(self, device: Any) -> None:
        import torch
        self._torch = torch
        self._device = device
        self._before = torch.cuda.Event(interprocess=True)
        self._lock = threading.Lock()  # the worker's and the loader thread's calls
        self._completions: Dict[bytes, Any] = {}  # guarded by _lock

    def before(self) -> bytes:
        """Records the event the daemon waits on; its IPC handle for the request."""
        self._before.record(self._torch.cuda.current_stream(self._device))
        return bytes(self._before.ipc_handle())

    def _opened(self, completion_event: bytes) -> Any:
        with self._lock:
            event = self._completions.get(completion_event)
            if event is None:
                event = self._torch.cuda.Event.from_ipc_handle(self._device, completion_event)
                self._completions[completion_event] = event
            return event

    def after(self, completion_event: bytes) -> None:
        """Makes the current stream wait on the daemon's completion event, if any."""
        if completion_event:
            self._torch.cuda.current_stream(self._device).wait_event(
                self._opened(completion_event))

    def settle(self, completion_event: bytes) -> None:
        """Blocks the calling (loader) thread until the daemon's copies are done: an
        asynchronous load is reported only then, so any stream may use the blocks."""
        if completion_event:
            self._opened(completion_event).synchronize()


def lookup_layout(layout: PoolLayout) -> Tuple[PoolLayout, int]:
    """`layout` with one block, its tensors packed back to back: the scheduler's lookup-only
    registration (the same layout fingerprint as the workers')."""
    tensors: List[TensorLayout] = []
    offset = 0
    for tensor in layout.tensors:
        tensors.append(TensorLayout(tensor.layer, tensor.kind, offset, tensor.block_bytes,
                                    tensor.block_bytes, tensor.kv_group, 0))
        offset += tensor.block_bytes
    return dataclasses.replace(layout, num_blocks=1, tensors=tensors), offset


def scheduler_layout(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                     element_type: str, model: str,
                     tp_size: int = 1) -> Tuple[PoolLayout, int]:
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


def cache_element_type(cache_dtype: Any, model_dtype: Any) -> str:
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
    and it is tried again at the next call, never raising into vLLM's scheduler loop. The first
    failure is a warning (quiet: a debug line, where the caller warns itself), later ones are
    debug lines (the connector paces the tries)."""

    def __init__(self, make: Callable[[], MemraScheduler], quiet: bool = False) -> None:
        self._make = make
        self._scheduler: Optional[MemraScheduler] = None
        self._warned = quiet

    def get(self) -> Optional[MemraScheduler]:
        """The scheduler, made now if it is not yet (None while it cannot be)."""
        if self._scheduler is None:
            try:
                self._scheduler = self._make()
            except (KvError, grpc.RpcError, OSError) as error:
                (log.debug if self._warned else log.warning)(
                    "the scheduler's lookup registration failed (retried at the next "
                    "request): %s", error)
                self._warned = True
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
    pin_id: int = 0  # the lookup's pin until the request ends (0: none)
    load_async: bool = False  # what get_num_new_matched_tokens answered
    event_hashes: List[bytes] = field(default_factory=list)  # vLLM's own, per whole block


class MemraScheduler:
    """The scheduler side on plain values. `registration`: the lookup registration
    (lookup_layout) of an attached client's BlockStore, made again when the daemon lost it.

    With `pin_ttl_ms` > 0 a lookup holds what it found until the load: the matched blocks are
    pinned (the block store's pins: they keep entries from eviction, expire after the TTL,
    at most 60 s, and are bounded per engine) and released when the request finishes, when vLLM
    loads nothing for it, or when it is looked up again. A lookup the pin limits refuse
    (RESOURCE_EXHAUSTED) is made again without a pin: a block evicted before its load is then
    a load error, as without the lease.

    A load of at least `async_load_min_tokens` tokens (0: none) is asynchronous: vLLM parks the
    request (WAITING_FOR_REMOTE_KVS) and schedules it once the worker reports the load done,
    so the load runs beside other requests' forward passes instead of before them."""

    def __init__(self, registration: KeptRegistration, block_size: int, pin_ttl_ms: int = 0,
                 async_load_min_tokens: int = 0) -> None:
        self._registration = registration
        self.block_size = block_size
        self.pin_ttl_ms = pin_ttl_ms
        self.async_load_min_tokens = async_load_min_tokens
        self._requests: Dict[str, _Tracked] = {}
        self._loads: List[LoadSpec] = []

    def get_num_new_matched_tokens(self, request_id: str, block_hashes: Iterable[Any],
                                   token_ids: Sequence[int], num_computed_tokens: int,
                                   event_hashes: Iterable[Any] = ()) -> Tuple[int, bool]:
        """(Tokens beyond num_computed_tokens the store holds, in whole blocks, never the
        request's last token (vLLM computes at least one); whether their load is asynchronous).
        `event_hashes`: vLLM's own hashes of the whole blocks, for routers' events."""
        hashes = [page_key(h) for h in block_hashes]
        tracked = self._requests.setdefault(request_id, _Tracked(hashes, list(token_ids)))
        tracked.hashes, tracked.token_ids = hashes, list(token_ids)
        tracked.event_hashes = [bytes(h) for h in event_hashes]
        tracked.computed_tokens = num_computed_tokens
        self._unpin(tracked)
        computed_blocks = num_computed_tokens // self.block_size
        loadable = min(len(hashes), max(0, (len(token_ids) - 1) // self.block_size))
        matched = 0
        if loadable > computed_blocks:
            try:
                match = self._lookup(hashes[:loadable])
                matched, tracked.pin_id = match.matched_blocks, match.pin_id
            except KvError as error:  # the store is a cache: unreachable means a miss
                log.warning("lookup of request %s: %s", request_id, error)
        tracked.external_blocks = max(0, min(matched, loadable) - computed_blocks)
        tokens = tracked.external_blocks * self.block_size
        tracked.load_async = 0 < self.async_load_min_tokens <= tokens
        return tokens, tracked.load_async

    def _lookup(self, hashes: List[bytes]) -> BlockMatch:
        if self.pin_ttl_ms > 0:
            try:
                return self._registration.lookup(hashes=hashes, pin_ttl_ms=self.pin_ttl_ms)
            except KvError as error:
                if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                log.debug("a pinned lookup refused (%s): looked up unpinned", error)
        return self._registration.lookup(hashes=hashes)

    def _unpin(self, tracked: _Tracked) -> None:
        """Releases the request's lookup pin, if any (a failure: the TTL releases it)."""
        pin_id, tracked.pin_id = tracked.pin_id, 0
        if pin_id:
            try:
                self._registration.unpin(pin_id)
            except KvError as error:
                log.debug("unpin %d: %s", pin_id, error)

    def update_state_after_alloc(self, request_id: str, block_ids: Iterable[int],
                                 num_external_tokens: int) -> None:
        """`block_ids`: the request's blocks (KV group 0) after this allocation."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        tracked.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            self._unpin(tracked)  # vLLM loads nothing of what the lookup held
            return
        first = tracked.computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        self._loads.append(LoadSpec(request_id, tracked.hashes[first:first + count],
                                    tracked.block_ids[first:first + count],
                                    tracked.load_async))
        tracked.done_blocks = first + count

    def update_request(self, request_id: str, block_hashes: Iterable[Any],
                       token_ids: Iterable[int], block_ids: Iterable[int],
                       event_hashes: Iterable[Any] = (),
                       computed_tokens: Optional[int] = None) -> None:
        """What a running request has now (its hashes grow with its computed tokens).
        `computed_tokens`, for a request scheduled anew: what vLLM holds computed, less than
        the loaded blocks after a failed load (those are saved again once recomputed)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            tracked = self._requests[request_id] = _Tracked([], [])
        tracked.hashes = [page_key(h) for h in block_hashes]
        tracked.token_ids = list(token_ids)
        tracked.block_ids = list(block_ids)
        tracked.event_hashes = [bytes(h) for h in event_hashes]
        if computed_tokens is not None:
            tracked.done_blocks = min(tracked.done_blocks, computed_tokens // self.block_size)

    def block_ids(self, request_id: str) -> List[int]:
        """The request's blocks (KV group 0) as last told; [] for an unknown request."""
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
            # Routers key by vLLM's own hashes: the events carry them where vLLM gave them.
            routed = tracked.event_hashes if len(tracked.event_hashes) >= full else []
            meta.saves.append(SaveSpec(
                request_id, tracked.hashes[first:full], tracked.block_ids[first:full],
                (routed or tracked.hashes)[first - 1] if first else b"",
                tracked.token_ids[first * self.block_size:full * self.block_size],
                routed[first:full]))
            tracked.done_blocks = full
        return meta

    def request_finished(self, request_id: str) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Saves are synchronous (wait_for_save): vLLM may free the blocks now (a request
        finished while its asynchronous load runs: vLLM itself keeps the blocks until the worker
        reports the load). Its lookup pin is released."""
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            self._unpin(tracked)
        return False, None


# ---- worker side ----

# A staging plane: (cache tensor, 0 K | 1 V) or (fused cache tensor, its page order "NHD" |
# "HND"); the tensor a numpy array or a torch tensor.
Plane = Tuple[Any, Union[int, str]]

class _Staging:
    """A registered HostPool of `slots` blocks through which caches the daemon cannot map (a
    GPU's, an engine's own host memory) are stored and loaded: plane i (layer, K or V in layout
    order) of slot j is bytes [(i * slots + j) * block_bytes, +block_bytes). Copies go through
    the caches' own library (torch copy_, which moves device <-> host; numpy copyto). `planes`
    may be a subset (a layer's planes, for the layer hooks): None is every plane."""

    def __init__(self, pool: HostPool, planes: List[Plane], block_bytes: int,
                 slots: int) -> None:
        self.pool = pool
        # (cache tensor, 0 K | 1 V) or (fused cache tensor, its page order), layout order
        self.planes = planes
        self.block_bytes = block_bytes
        self.slots = slots
        self._bytes: Any = pool.array  # a numpy byte vector, or torch's view of it
        self._cuda = False
        if planes and not isinstance(planes[0][0], np.ndarray):
            import torch
            self._bytes = torch.from_numpy(pool.array)
            self._cuda = bool(getattr(planes[0][0], "is_cuda", False))

    def _paged(self, plane: int, count: int) -> Tuple[Any, Any]:
        """(the plane's cache as (num_blocks, page...) with each block's page in memory order,
        slots 0..count-1 of the plane as (count, page...) of the cache's dtype)."""
        tensor, kind = self.planes[plane]
        numpy = isinstance(tensor, np.ndarray)
        if kind == "NHD":  # a fused (blocks, heads, tokens, content) view, tokens outer in memory
            base = tensor.transpose(0, 2, 1, 3) if numpy else tensor.permute(0, 2, 1, 3)
        elif kind == "HND":
            base = tensor
        else:  # (2, blocks, tokens, heads, head_dim): K or V
            base = tensor[kind]
        start = plane * self.slots * self.block_bytes
        raw = self._bytes[start:start + count * self.block_bytes]
        staged = raw.view(tensor.dtype).reshape((count,) + tuple(base.shape[1:]))
        return base, staged

    def gather(self, block_ids: Sequence[int], planes: Optional[Iterable[int]] = None) -> None:
        """Cache blocks block_ids into slots 0.. (before a store): one indexed copy a plane."""
        if not block_ids:
            return
        for plane in range(len(self.planes)) if planes is None else sorted(planes):
            base, staged = self._paged(plane, len(block_ids))
            if isinstance(base, np.ndarray):
                np.take(base, block_ids, axis=0, out=staged)
            else:
                import torch
                index = torch.as_tensor(block_ids, device=base.device)
                if base.device.type == "cpu":
                    torch.index_select(base, 0, index, out=staged)
                else:  # gathered on the device, then one copy to host
                    staged.copy_(base.index_select(0, index))

    def scatter(self, block_ids: Sequence[int], arrived: Sequence[bool],
                planes: Optional[Iterable[int]] = None) -> None:
        """Slots 0.. into cache blocks block_ids, where `arrived` (after a load): one indexed
        copy a plane."""
        slots = [slot for slot, ok in enumerate(arrived) if ok]
        if not slots:
            return
        targets = [block_ids[slot] for slot in slots]
        for plane in range(len(self.planes)) if planes is None else sorted(planes):
            base, staged = self._paged(plane, len(block_ids))
            if len(slots) < len(block_ids):
                staged = staged[slots]
            if isinstance(base, np.ndarray):
                base[targets] = staged
            else:
                import torch
                base.index_copy_(0, torch.as_tensor(targets, device=base.device),
                                 staged.to(base.device))

    def settle(self) -> None:
        """Waits for this thread's copies into a CUDA cache (its current stream): called before
        an asynchronous load says it is done, so the blocks are there for any stream."""
        if self._cuda:
            import torch
            torch.cuda.current_stream(self.planes[0][0].device).synchronize()


@dataclass
class _HeldLoad:
    """A sync load's last staged chunk, scattered into the cache layer by layer as vLLM's
    forward reaches each layer (wait_for_layer_load)."""
    block_ids: List[int]
    arrived: List[bool]
    planes_left: Set[int]


@dataclass
class _GatheredSaves:
    """The step's first saved blocks (at most the staging pool's slots, in the order of the
    step's SaveSpecs), gathered into the staging slots 0.. layer by layer as vLLM's forward
    finishes each layer (save_kv_layer)."""
    block_ids: List[int]
    planes_done: Set[int]


class MemraWorker:
    """The worker side on plain values: registers the pool, loads and saves whole blocks.
    Caches that lie in HostPools are registered themselves (blocks copy straight between them
    and the store); any others go through a staging HostPool of `staging_blocks` blocks. A
    registration the daemon lost is made again (KeptRegistration).

    Loads marked asynchronous (LoadSpec.asynchronous) run one after another on one loader
    thread, through the loader's own staging pool (registered at the first one), and are
    reported done, failed blocks included, by get_finished. With `layerwise` on the staging path, a sync load's last chunk
    is copied into each layer's cache at wait_for_layer_load, and the step's first saved blocks
    are copied out of each layer at save_kv_layer; the block store's calls stay whole blocks
    (every layer), once a step.

    Thread-safety: every method is called by vLLM's worker thread; the loader thread only runs
    _load_async and hands its outcomes over through _finished (guarded by _lock)."""

    def __init__(self, store: BlockStore, staging_blocks: int = 64,
                 layerwise: bool = True) -> None:
        self._store = store
        self._staging_blocks = staging_blocks
        self._layerwise = layerwise
        self._staging: Optional[_Staging] = None
        # _CudaOrdering when the pool is registered by CUDA IPC handle
        self._cuda: Optional[_CudaOrdering] = None
        self._kept: Optional[KeptRegistration] = None  # once register_kv_caches ran
        self._layout: Optional[PoolLayout] = None
        self._planes_of_layer: Dict[str, List[int]] = {}  # layer name -> staging planes
        self._load_errors: Set[int] = set()
        self.saved_blocks = 0
        # Staging planes (a layer's K, V or fused page of a chunk) copied by the layer hooks.
        self.planes_loaded_by_layer_hooks = 0
        self.planes_saved_by_layer_hooks = 0
        # The step's layer-wise state (staging path): bound by bind() or start_load_kv.
        self._meta: Optional[MemraConnectorMetadata] = None
        self._held: Optional[_HeldLoad] = None
        self._gathered: Optional[_GatheredSaves] = None
        # Asynchronous loads.
        # A ThreadPoolExecutor of one thread, on the first async load.
        self._loader: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # The loader's staging registration.
        self._async_kept: Optional[KeptRegistration] = None
        self._async_staging: Optional[_Staging] = None
        self._lock = threading.Lock()
        self._finished: Dict[str, Set[int]] = {}  # request id -> failed block ids; guarded by _lock
        self._loaded_blocks = 0  # guarded by _lock

    @property
    def loaded_blocks(self) -> int:
        """Blocks loaded into the caches so far (sync and asynchronous loads)."""
        with self._lock:
            return self._loaded_blocks

    def _count_loaded(self, count: int) -> None:
        with self._lock:
            self._loaded_blocks += count

    def register_kv_caches(self, kv_caches: Dict[str, Any], pools: Sequence[HostPool],
                           model: str, tp_rank: int = 0,
                           tp_size: int = 1) -> Optional[Registration]:
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
        kinds = cast(Tuple[Union[int, str], ...],
                     (layout.order,) if caches[0].fused else (0, 1))
        planes: List[Plane] = []
        for name, tensor in kv_caches.items():
            self._planes_of_layer[name] = list(range(len(planes), len(planes) + len(kinds)))
            planes += [(tensor, kind) for kind in kinds]
        self._layout, self._planes = layout, planes
        self._staging, self._kept = self._staging_pool("memra-kv-staging")
        return self.registration

    def _staging_pool(self, name: str) -> Tuple[_Staging, KeptRegistration]:
        """A new registered staging pool of the caches' layout: (_Staging, KeptRegistration)."""
        layout = cast(PoolLayout, self._layout)  # set before any staging pool is made
        pool = HostPool(len(layout.tensors) * self._staging_blocks * layout.block_bytes, name)
        staging = _Staging(pool, self._planes, layout.block_bytes, self._staging_blocks)
        return staging, KeptRegistration(self._store, [pool], layout)

    @property
    def registration(self) -> Optional[Registration]:
        """The pool's Registration now (None before register_kv_caches)."""
        return self._kept.registration if self._kept is not None else None

    def _require_registered(self, what: str) -> None:
        if self._kept is None:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "a %s before register_kv_caches: "
                          "no KV cache is registered" % what)

    # -- loads --

    def _load_direct(self, kept: KeptRegistration, block_ids: List[int], hashes: List[bytes],
                     wait_event: bytes) -> Tuple[List[bool], bytes]:
        """A load straight into caches the daemon maps: one outcome (True: arrived) per block."""
        transfer = kept.load(block_ids, hashes=hashes, wait_event=wait_event)
        return [block.ok for block in transfer.blocks], transfer.completion_event

    def _load_staged(self, kept: KeptRegistration, staging: _Staging, block_ids: List[int],
                     hashes: List[bytes],
                     hold_last: bool = False) -> Tuple[List[bool], Optional[_HeldLoad]]:
        """A load through `staging` in chunks of its slots: one outcome per block. With
        hold_last, the last chunk stays staged (returned as a _HeldLoad) for the layer hooks."""
        slots = staging.slots
        arrived: List[bool] = []
        held: Optional[_HeldLoad] = None
        for start in range(0, len(block_ids), slots):
            ids, chunk = block_ids[start:start + slots], hashes[start:start + slots]
            transfer = kept.load(list(range(len(ids))), hashes=chunk)
            ok = [block.ok for block in transfer.blocks]
            if hold_last and start + slots >= len(block_ids):
                held = _HeldLoad(ids, ok, set(range(len(staging.planes))))
            else:
                staging.scatter(ids, ok)
            arrived += ok
        return arrived, held

    def bind(self, meta: MemraConnectorMetadata) -> None:
        """The step's metadata, before its forward (vLLM's bind_connector_metadata): the layer
        hooks work on it."""
        if self._staging is not None:  # a held chunk the last step's hooks left: never lost
            self._scatter_held(range(len(self._staging.planes)))
        self._meta = meta
        self._held = self._gathered = None

    def start_load_kv(self, meta: MemraConnectorMetadata) -> None:
        """The step's synchronous loads, done when this returns (on the staging path with the
        layer hooks: but for the last chunk's copies into the cache, made per layer); its
        asynchronous ones handed to the loader thread. Failed blocks (no longer stored,
        corrupt, or the call refused) are kept for get_block_ids_with_load_errors; an
        asynchronous load's, once get_finished reports its request."""
        if meta is not self._meta:
            self.bind(meta)
        sync_loads = [load for load in meta.loads if load.block_ids and not load.asynchronous]
        for load in meta.loads:
            if load.block_ids and load.asynchronous:
                self._submit_async(load)
        for index, load in enumerate(sync_loads):
            try:
                self._require_registered("load")
                if self._staging is None:
                    wait_event = self._cuda.before() if self._cuda else b""
                    # Registered (checked above): _kept is set from here on.
                    arrived, completion = self._load_direct(
                        cast(KeptRegistration, self._kept), load.block_ids, load.hashes,
                        wait_event)
                    if self._cuda:
                        self._cuda.after(completion)
                else:
                    last = self._layerwise and index == len(sync_loads) - 1
                    arrived, self._held = self._load_staged(
                        cast(KeptRegistration, self._kept), self._staging, load.block_ids,
                        load.hashes, last)
            except KvError as error:
                log.warning("load of request %s: %s", load.request_id, error)
                self._load_errors.update(load.block_ids)
                continue
            self._load_errors.update(b for b, ok in zip(load.block_ids, arrived) if not ok)
            self._count_loaded(sum(arrived))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The held chunk's pages of this layer into the cache (staging path); otherwise the
        loads were complete when start_load_kv returned."""
        self._scatter_held(self._planes_of_layer.get(layer_name, ()), in_hook=True)

    def _scatter_held(self, planes: Iterable[int], in_hook: bool = False) -> None:
        held = self._held
        if held is None:
            return
        planes = held.planes_left.intersection(planes)
        if planes:
            # A held chunk is a staged load's: the staging pool exists.
            cast(_Staging, self._staging).scatter(held.block_ids, held.arrived, planes)
            held.planes_left -= planes
            if in_hook:
                self.planes_loaded_by_layer_hooks += len(planes)
        if not held.planes_left:
            self._held = None

    # -- asynchronous loads --

    def _submit_async(self, load: LoadSpec) -> None:
        """Hands one load to the loader thread; on the staging path through the loader's own
        staging pool, registered here on the first one. A refusal to start it is that load's
        failure, reported as any other (get_finished)."""
        try:
            self._require_registered("load")
            if self._staging is not None and self._async_staging is None:
                self._async_staging, self._async_kept = self._staging_pool(
                    "memra-kv-async-staging")
            wait_event = self._cuda.before() if self._cuda else b""
        except (KvError, grpc.RpcError, OSError) as error:
            log.warning("asynchronous load of request %s: %s", load.request_id, error)
            self._finish_async(load.request_id, set(load.block_ids), 0)
            return
        if self._loader is None:
            self._loader = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="memra-kv-loader")
        self._loader.submit(self._load_async, load, wait_event)

    def _load_async(self, load: LoadSpec, wait_event: bytes) -> None:
        """On the loader thread: the whole load, the blocks in the cache before it is reported.
        Whatever goes wrong fails its blocks, never the report: vLLM waits for it."""
        try:
            if self._async_staging is None:
                # _submit_async checked the registration (and made the loader's staging).
                arrived, completion = self._load_direct(
                    cast(KeptRegistration, self._kept), load.block_ids, load.hashes, wait_event)
                if self._cuda and completion:
                    self._cuda.settle(completion)
            else:
                arrived, _ = self._load_staged(cast(KeptRegistration, self._async_kept),
                                               self._async_staging,
                                               load.block_ids, load.hashes)
                self._async_staging.settle()
        except Exception as error:  # noqa: BLE001  (reported as the load's failure)
            log.warning("asynchronous load of request %s: %s", load.request_id, error)
            arrived = [False] * len(load.block_ids)
        self._finish_async(load.request_id,
                           {b for b, ok in zip(load.block_ids, arrived) if not ok}, sum(arrived))

    def _finish_async(self, request_id: str, failed: Set[int], loaded: int) -> None:
        with self._lock:
            self._finished.setdefault(request_id, set()).update(failed)
            self._loaded_blocks += loaded

    def get_finished(self, finished_request_ids: Any) -> Tuple[None, Optional[Set[str]]]:
        """(None, the requests whose asynchronous loads ended since the last call, or None).
        Their failed blocks join get_block_ids_with_load_errors' answer of the same step, as
        vLLM requires (no later than the step that reports the request)."""
        with self._lock:
            finished, self._finished = self._finished, {}
        for failed in finished.values():
            self._load_errors |= failed
        return None, (set(finished) or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves --

    def save_kv_layer(self, layer_name: str) -> None:
        """Staging path with the layer hooks: this layer's pages of the step's first saved
        blocks (up to the staging pool's slots) copied into the staging pool now, while the
        forward goes on; the store call itself is whole blocks, in wait_for_save."""
        planes = self._planes_of_layer.get(layer_name, ())
        # The slots of these planes are free once their load is out.
        self._scatter_held(planes, in_hook=True)
        if not self._layerwise or self._staging is None or self._meta is None or not planes:
            return
        if self._gathered is None:
            self._gathered = _GatheredSaves(
                [b for save in self._meta.saves for b in save.block_ids][:self._staging.slots],
                set())
        todo = set(planes) - self._gathered.planes_done
        if todo and self._gathered.block_ids:
            self._staging.gather(self._gathered.block_ids, todo)
            self.planes_saved_by_layer_hooks += len(todo)
        self._gathered.planes_done |= todo

    def _store_args(self, save: SaveSpec, start: int, end: int) -> Dict[str, Any]:
        """The router fields of blocks [start, end) of a SaveSpec: the parent (of vLLM's own
        hashes when the spec carries them), the tokens, vLLM's hashes."""
        routed = save.event_hashes or save.hashes
        tokens_per_block = len(save.token_ids) // len(save.hashes) if save.token_ids else 0
        return dict(parent_hash=routed[start - 1] if start else save.parent_hash,
                    event_token_ids=save.token_ids[start * tokens_per_block:
                                                   end * tokens_per_block],
                    event_hashes=save.event_hashes[start:end])

    def wait_for_save(self, meta: MemraConnectorMetadata) -> None:
        """Stores the step's newly computed full blocks (what the layer hooks did not copy out
        yet first). A refusal (no room, the daemon gone) costs a later cache miss, nothing
        else."""
        if meta is not self._meta:
            self.bind(meta)
        self._scatter_held(range(len(self._staging.planes)) if self._staging else ())
        gathered = self._gathered
        if self._staging is not None and gathered is not None and gathered.block_ids:
            rest = set(range(len(self._staging.planes))) - gathered.planes_done
            if rest:
                self._staging.gather(gathered.block_ids, rest)
        pregathered = len(gathered.block_ids) if gathered is not None else 0
        slot = 0
        for save in meta.saves:
            try:
                self._require_registered("save")
                if self._staging is None:
                    wait_event = self._cuda.before() if self._cuda else b""
                    transfer = cast(KeptRegistration, self._kept).store(
                        save.block_ids, hashes=save.hashes, wait_event=wait_event,
                        **self._store_args(save, 0, len(save.hashes)))
                    if self._cuda:
                        self._cuda.after(transfer.completion_event)
                    self.saved_blocks += sum(block.ok for block in transfer.blocks)
                    continue
                # Blocks the layer hooks gathered are in slots [first_slot, +ready); a save
                # with blocks beyond them comes after every gathered one (they are the step's
                # first), so the chunks below may overwrite the slots.
                ready = max(0, min(len(save.block_ids), pregathered - slot))
                first_slot, slot = slot, slot + ready
                if ready:
                    self._store_staged(save, 0, ready, list(range(first_slot, slot)))
                for start in range(ready, len(save.block_ids), self._staging.slots):
                    end = min(start + self._staging.slots, len(save.block_ids))
                    self._staging.gather(save.block_ids[start:end])
                    self._store_staged(save, start, end, list(range(end - start)))
            except KvError as error:
                log.warning("save of request %s: %s", save.request_id, error)
        self._gathered = None

    def _store_staged(self, save: SaveSpec, start: int, end: int, slots: List[int]) -> None:
        # Called after _require_registered: _kept is set.
        transfer = cast(KeptRegistration, self._kept).store(slots, hashes=save.hashes[start:end],
                                    **self._store_args(save, start, end))
        self.saved_blocks += sum(block.ok for block in transfer.blocks)

    def shutdown(self) -> None:
        """Waits for the loader thread's loads (vLLM is shutting down: nobody asks for them)."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)


# ---- content keys: independent of vLLM's hash seed, algorithm and version ----

CONTENT_KEY_DOMAIN = b"memra-kv/vllm-content/v1"


class ContentKeys:
    """A request's block keys: SHA-256 chained over its whole blocks of token ids from a root
    binding the request's salt (vLLM's cache_salt and LoRA adapter), so the same tokens under
    another salt never share. The daemon scopes every key by the pool's layout fingerprint
    (model identity, element type, order, block size, heads, tp) and the engine's cache scope,
    so keys need not bind those again. vLLM's own block hashes are never used as keys: vLLM
    seeds them per process unless PYTHONHASHSEED is set (non-cryptographic hash functions),
    and they change with prefix_caching_hash_algo and vLLM's version. Extends incrementally."""

    def __init__(self, block_size: int, salt: bytes = b"") -> None:
        self.block_size = block_size
        root = hashlib.sha256(CONTENT_KEY_DOMAIN)
        root.update(len(salt).to_bytes(4, "little"))
        root.update(salt)
        self._root = root.digest()
        self.keys: List[bytes] = []

    def extend(self, token_ids: Sequence[int]) -> List[bytes]:
        """The keys of token_ids' whole blocks (token_ids starts with the tokens already keyed)."""
        for block in range(len(self.keys), len(token_ids) // self.block_size):
            parent = self.keys[-1] if self.keys else self._root
            tokens = token_ids[block * self.block_size:(block + 1) * self.block_size]
            self.keys.append(hashlib.sha256(
                parent + np.asarray(tokens, dtype="<i8").tobytes()).digest())
        return self.keys


def request_salt(cache_salt: Any, lora_name: Any) -> bytes:
    """The salt of a request's keys: its cache_salt and LoRA adapter, length-prefixed."""
    salt = b""
    for part in (cache_salt or "", lora_name or ""):
        raw = str(part).encode()
        salt += len(raw).to_bytes(4, "little") + raw
    return salt


def fused_lookup_layout(layer_names: Iterable[str], block_size: int, heads: int, content: int,
                        element_type: str, order: str, model: str,
                        tp_size: int = 1) -> Tuple[PoolLayout, int]:
    """The scheduler's lookup layout for vLLM >= 0.33 (one fused KV page per layer), derived
    from its KVCacheConfig and resolved layout: the same fingerprint as rank 0's workers'
    pool_layout of their caches."""
    block_bytes = heads * block_size * content * ELEMENT_BYTES[element_type]
    tensors = [TensorLayout(layer_index(name, position), "KV", 0, block_bytes, block_bytes)
               for position, name in enumerate(layer_names)]
    layout = PoolLayout(num_blocks=1, tokens_per_block=block_size, element_type=element_type,
                        num_kv_heads=heads, head_dim=content, model=model, tensors=tensors,
                        order=order, tp_rank=0, tp_size=tp_size)
    return lookup_layout(layout)


# The page order of each block-compact KVCacheLayout (vllm/v1/kv_cache_layout.py: logical
# [L, B, H, N, C], N the block's tokens).
LAYOUT_ORDERS = {"LBNHC": "NHD", "BLNHC": "NHD", "LBHNC": "HND", "BLHNC": "HND"}


# ---- the vLLM class, where vLLM is importable ----

RETRY_S = 5.0  # the pace of connection tries while the daemon is away
ASYNC_LOAD_MIN_TOKENS = 1024  # memra_async_load_min_tokens' default (bench/README.md, vLLM)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA)
except ImportError:  # vLLM is not installed: the logic above is all there is
    KVConnectorBase_V1 = None

if KVConnectorBase_V1 is not None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from .client import Client

    # vLLM's base classes are untyped here (Any): the subclasses are checked, their bases not.
    class _Metadata(KVConnectorMetadata, MemraConnectorMetadata):  # type: ignore[misc]
        """MemraConnectorMetadata as vLLM's KVConnectorMetadata."""

    class MemraKVConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
        """vLLM's view of MemraScheduler / MemraWorker. kv_connector_extra_config (strings and
        numbers only: vLLM pickles its config to worker processes): memra_socket (default
        /run/memra-kv/gpu0.sock), memra_engine_name, memra_cache_scope, memra_staging_blocks
        (64), memra_lookup_pin_ms (30000: how long a lookup holds what it found for the load;
        0: no pin), memra_async_load_min_tokens (1024: loads of at least that many tokens are
        asynchronous; 0: none), memra_layerwise (1: staged copies per layer in the layer
        hooks; 0: whole steps), memra_timeout_s (2: how long a connection try waits for the
        daemon).

        The daemon is a cache: one that is down, unreachable or refuses the pool leaves vLLM
        running without it (one warning; every request a miss, nothing saved) and is tried
        again at the next request or step."""

        # vLLM's hit metrics: the daemon serves from host memory (its host backend; a cuda
        # backend's hits are counted here too).
        _cache_hit_source = CacheHitSource.HOST

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            self._extra = extra
            self._model = str(vllm_config.model_config.model)
            self._block_size = vllm_config.cache_config.block_size
            self._socket = str(extra.get("memra_socket", "/run/memra-kv/gpu0.sock"))
            self._timeout = float(extra.get("memra_timeout_s", 2))
            self._engine_name = str(extra.get("memra_engine_name",
                                              "vllm-%s" % role.name.lower()))
            self._store: Optional[BlockStore] = None  # once connected
            self._next_try = 0.0  # time.monotonic() of the next connection try
            self._warned = False
            # request id -> (Request, ContentKeys): scheduler side
            self._requests: Dict[str, Tuple[Any, Optional[ContentKeys]]] = {}
            self._scheduler = LazyScheduler(self._make_scheduler, quiet=True)
            # Once the caches are registered.
            self._worker: Optional[MemraWorker] = None
            self._kv_caches: Optional[Dict[str, Any]] = None
            # Block ids of loads made while no worker was registered.
            self._unloaded: Set[int] = set()
            # Their asynchronous loads' requests, to report.
            self._unloaded_requests: Set[str] = set()

        # -- the daemon, connected on first use --

        def _connected_store(self) -> BlockStore:
            """The attached BlockStore. While the daemon is away, a try at most every
            RETRY_S seconds (KvError UNAVAILABLE in between), none that waits for a socket
            file that does not exist: vLLM's loops never stall on it."""
            if self._store is None:
                now = time.monotonic()
                if now < self._next_try:
                    raise KvError(grpc.StatusCode.UNAVAILABLE, "memra-kvd at %s: tried %.1fs "
                                  "ago, next try in %.1fs" % (self._socket,
                                                              now - self._next_try + RETRY_S,
                                                              self._next_try - now))
                self._next_try = now + RETRY_S
                if not os.path.exists(self._socket):
                    raise KvError(grpc.StatusCode.UNAVAILABLE, "no memra-kvd socket at %s "
                                  "(kv_connector_extra_config memra_socket)" % self._socket)
                client = Client.connect(self._socket, timeout=self._timeout)
                try:
                    client.attach(self._engine_name,
                                  cache_scope=str(self._extra.get("memra_cache_scope", "")))
                except BaseException:
                    client.close()
                    raise
                self._store = BlockStore(client)
            return self._store

        def _degraded(self, what: str, error: BaseException) -> None:
            """One warning for the connector's life: the daemon is unusable, vLLM goes on."""
            if not self._warned:
                self._warned = True
                log.warning("memra-kvd at %s is unusable (%s: %s): vLLM runs without the "
                            "external KV cache and tries again at each request", self._socket,
                            what, error)
            if self._store is not None:
                try:
                    self._store._client.close()
                except Exception:  # noqa: BLE001  (already gone)
                    pass
                self._store = None

        def _group_layers(self) -> Tuple[List[str], Any]:
            groups = self._kv_cache_config.kv_cache_groups
            return list(groups[0].layer_names), groups[0].kv_cache_spec

        def _single_group(self) -> bool:
            return len(self._kv_cache_config.kv_cache_groups) == 1

        # -- worker side --

        def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
            """vLLM's per-layer caches (KV group 0's layers): registered with the daemon now, or
            at the next step while it is away."""
            layer_names, _ = self._group_layers()
            self._kv_caches = {name: kv_caches[name] for name in layer_names
                               if name in kv_caches}
            self._ensure_worker()

        def _ensure_worker(self) -> Optional[MemraWorker]:
            if self._worker is None and self._kv_caches:
                try:
                    worker = MemraWorker(self._connected_store(),
                                         int(self._extra.get("memra_staging_blocks", 64)),
                                         bool(int(self._extra.get("memra_layerwise", 1))))
                    worker.register_kv_caches(
                        self._kv_caches, (), self._model, self._tp_rank(),
                        self._vllm_config.parallel_config.tensor_parallel_size)
                    self._worker = worker
                except (KvError, grpc.RpcError, OSError) as error:
                    self._degraded("registering the KV caches", error)
            return self._worker

        def _tp_rank(self) -> int:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
                return cast(int, get_tensor_model_parallel_rank())
            except AssertionError:  # no model-parallel group (a single process): rank 0
                return 0

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            """The step's metadata, before its forward: for the worker's layer hooks too."""
            super().bind_connector_metadata(connector_metadata)
            if self._worker is not None:
                self._worker.bind(connector_metadata)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            """The step's loads (MemraWorker.start_load_kv); with no worker, each a failure."""
            meta = self._get_connector_metadata()
            worker = self._ensure_worker()
            if worker is not None:
                worker.start_load_kv(meta)
            else:  # nothing can arrive: vLLM is told, as for any failed load
                self._unloaded |= {b for load in meta.loads for b in load.block_ids}
                self._unloaded_requests |= {load.request_id for load in meta.loads
                                            if load.asynchronous}

        def wait_for_layer_load(self, layer_name: str) -> None:
            """MemraWorker.wait_for_layer_load."""
            if self._worker is not None:
                self._worker.wait_for_layer_load(layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                          **kwargs: Any) -> None:
            """MemraWorker.save_kv_layer."""
            if self._worker is not None and self.has_connector_metadata():
                self._worker.save_kv_layer(layer_name)

        def wait_for_save(self) -> None:
            """MemraWorker.wait_for_save with the step's metadata."""
            if self._worker is not None and self.has_connector_metadata():
                self._worker.wait_for_save(self._get_connector_metadata())

        def get_finished(self, finished_req_ids: Any) -> Tuple[None, Optional[Set[str]]]:
            """(None, the requests whose asynchronous loads ended, or None)."""
            finished, self._unloaded_requests = self._unloaded_requests, set()
            if self._worker is not None:
                finished |= self._worker.get_finished(finished_req_ids)[1] or set()
            return None, (finished or None)

        def get_block_ids_with_load_errors(self) -> Set[int]:
            """Block ids whose load failed since the last call (vLLM recomputes them)."""
            errors, self._unloaded = self._unloaded, set()
            if self._worker is not None:
                errors |= self._worker.get_block_ids_with_load_errors()
            return errors

        @property
        def requires_kv_delivery(self) -> bool:
            """A best-effort cache: a dropped save is a later miss."""
            return False

        def shutdown(self) -> None:
            """Waits for the worker's loads and ends the lease."""
            if self._worker is not None:
                self._worker.shutdown()
            if self._store is not None:
                self._store._client.close()
                self._store = None

        # -- scheduler side --

        def _make_scheduler(self) -> MemraScheduler:
            layer_names, spec = self._group_layers()
            cache_config = self._vllm_config.cache_config
            layout = cache_config.get_resolved_kv_cache_layout().name
            if layout not in LAYOUT_ORDERS:
                raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "KV cache layout %s scatters "
                              "a block's page; the connector takes %s (VLLM_KV_CACHE_LAYOUT)"
                              % (layout, ", ".join(sorted(LAYOUT_ORDERS))))
            element_type = element_type_of(spec.dtype)
            content = spec.state_content_size_bytes // ELEMENT_BYTES[element_type]
            packed, nbytes = fused_lookup_layout(
                layer_names, self._block_size, spec.num_heads, content, element_type,
                LAYOUT_ORDERS[layout], self._model,
                self._vllm_config.parallel_config.tensor_parallel_size)
            try:
                registration = KeptRegistration(self._connected_store(),
                                                [HostPool(nbytes, "memra-kv-lookup")], packed)
            except (KvError, grpc.RpcError, OSError) as error:
                self._degraded("registering the scheduler's lookup pool", error)
                raise
            return MemraScheduler(
                registration, self._block_size, int(self._extra.get("memra_lookup_pin_ms", 30000)),
                int(self._extra.get("memra_async_load_min_tokens", ASYNC_LOAD_MIN_TOKENS)))

        def _keys(self, request: Any) -> Optional[List[bytes]]:
            """The request's content keys now, or None when its tokens do not name its KV
            (multimodal inputs, prompt embeddings): such a request never uses the store."""
            entry = self._requests.get(request.request_id)
            if entry is None:
                if getattr(request, "mm_features", None) or \
                        getattr(request, "prompt_embeds", None) is not None:
                    keys = None
                else:
                    lora = getattr(request, "lora_request", None)
                    keys = ContentKeys(self._block_size, request_salt(
                        getattr(request, "cache_salt", None),
                        getattr(lora, "lora_name", None)))
                entry = self._requests[request.request_id] = (request, keys)
            keys = entry[1]
            return None if keys is None else keys.extend(request.all_token_ids)

        def get_num_new_matched_tokens(self, request: Any,
                                       num_computed_tokens: int) -> Tuple[int, bool]:
            """MemraScheduler.get_num_new_matched_tokens; (0, False) without the store."""
            keys = self._keys(request)
            if keys is None or not self._single_group():
                return 0, False
            logic = self._scheduler.get()
            if logic is None:
                return 0, False
            return logic.get_num_new_matched_tokens(
                request.request_id, keys, request.all_token_ids, num_computed_tokens,
                request.block_hashes)

        def update_state_after_alloc(self, request: Any, blocks: Any,
                                     num_external_tokens: int) -> None:
            """MemraScheduler.update_state_after_alloc with KV group 0's blocks."""
            logic = self._scheduler.get() if self._single_group() else None
            if logic is None:
                return
            logic.update_state_after_alloc(
                request.request_id, blocks.get_block_ids()[0], num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> _Metadata:
            """The step's loads and saves (MemraScheduler.build_connector_meta)."""
            logic = self._scheduler.get() if self._single_group() else None
            if logic is None:
                return _Metadata([], [])
            computed: Dict[str, int] = {}
            for new in scheduler_output.scheduled_new_reqs:
                computed[new.req_id] = (new.num_computed_tokens
                                        + scheduler_output.num_scheduled_tokens[new.req_id])
                entry = self._requests.get(new.req_id)
                # A request with ContentKeys (entry[1]) has keys: _keys is not None for it.
                if entry is not None and entry[1] is not None:
                    logic.update_request(new.req_id, cast(List[bytes], self._keys(entry[0])),
                                         entry[0].all_token_ids, new.block_ids[0],
                                         entry[0].block_hashes, new.num_computed_tokens)
            cached = scheduler_output.scheduled_cached_reqs
            for i, request_id in enumerate(cached.req_ids):
                entry = self._requests.get(request_id)
                if entry is None or entry[1] is None:
                    continue
                request = entry[0]
                computed[request_id] = (cached.num_computed_tokens[i]
                                        + scheduler_output.num_scheduled_tokens[request_id])
                new_blocks = list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else []
                # A request resumed after preemption has new blocks, not more blocks.
                resumed = request_id in getattr(cached, "resumed_req_ids", ())
                block_ids = new_blocks if resumed else logic.block_ids(request_id) + new_blocks
                logic.update_request(request_id, cast(List[bytes], self._keys(request)),
                                     request.all_token_ids, block_ids, request.block_hashes)
            meta = logic.build_connector_meta(computed)
            return _Metadata(meta.loads, meta.saves)

        def request_finished(self, request: Any,
                             block_ids: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
            """MemraScheduler.request_finished: vLLM may free the blocks now."""
            self._requests.pop(request.request_id, None)
            logic = self._scheduler.get() if self._single_group() else None
            return (False, None) if logic is None else logic.request_finished(request.request_id)

        def request_finished_all_groups(
                self, request: Any, block_ids: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
            """SupportsHMA: the store serves single-group models only (a hybrid model's other
            groups are never loaded), so this is request_finished."""
            return self.request_finished(request, block_ids[0] if block_ids else [])
