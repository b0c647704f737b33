"""memra_kv.block_store: memra-kvd as the shared cache tier of an engine with its own paged KV
pool (proto/memra/kv/v1/block_store.proto, docs/block-store.md).

An attached engine registers its pool once (BlockStore.register), then per request asks how
many leading blocks of a sequence are stored (lookup), copies stored blocks into pool blocks it
allocated (load) and computed pool blocks into the store (store). On the host backend the pool
is shared memory the daemon maps: a HostPool (a memfd sealed against shrinking and growing,
mapped here as a numpy array) whose descriptor travels over the handoff socket; never a name.

Blocks are named by the engine's own chained block hashes (`hashes=`, opaque, 1..64 bytes each)
or by token ids from position 0 (`token_ids=`, whole blocks). Every call raises KvError with
the daemon's code and numbers when refused (a refused call changes nothing); a load's per-block
failures (NOT_FOUND: no longer stored, DATA_LOSS: checksum mismatch) are in its Transfer.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Sequence,
                    Tuple, TypeVar, Union, cast)

import grpc
import numpy as np

from ._proto import block_store_pb2 as bs
from ._proto import block_store_pb2_grpc
from .client import _MEDIA, _call
from .errors import KvError, code_from_value
from .handoff import HandoffChannel

if TYPE_CHECKING:
    from .client import Client

ELEMENT_TYPES = {"bf16": bs.BLOCK_ELEMENT_BF16, "fp16": bs.BLOCK_ELEMENT_FP16,
                 "fp32": bs.BLOCK_ELEMENT_FP32, "fp8_e4m3": bs.BLOCK_ELEMENT_FP8_E4M3,
                 "fp8_e5m2": bs.BLOCK_ELEMENT_FP8_E5M2, "int8": bs.BLOCK_ELEMENT_INT8}
# Bytes per element of the unquantized types (the quantized ones are per 32-element block:
# block_store.proto BlockElementType).
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
ORDERS = {"NHD": bs.BLOCK_ORDER_NHD, "HND": bs.BLOCK_ORDER_HND}
TENSOR_KINDS = {"K": bs.BLOCK_TENSOR_K, "V": bs.BLOCK_TENSOR_V, "KV": bs.BLOCK_TENSOR_KV,
                "STATE": bs.BLOCK_TENSOR_STATE}

log = logging.getLogger("memra_kv.block_store")


class HostPool:
    """`nbytes` of shared memory for an engine's KV pool: a memfd sealed with F_SEAL_SHRINK |
    F_SEAL_GROW | F_SEAL_SEAL (so the daemon that maps it can never be made to fault), mapped
    MAP_SHARED here. `array` is every byte as a uint8 numpy vector; `view(dtype, shape,
    offset)` a typed view. close() unmaps and closes the descriptor (the daemon keeps its own
    mapping until the registration ends)."""

    def __init__(self, nbytes: int, name: str = "memra-kv-pool") -> None:
        if nbytes <= 0:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT,
                          "a host pool of %d bytes; at least 1" % nbytes)
        self.nbytes = nbytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        # None once closed.
        self.array: Optional[np.ndarray[Any, np.dtype[np.uint8]]] = np.frombuffer(
            self._map, dtype=np.uint8)

    def view(self, dtype: Any, shape: Any, offset: int = 0) -> np.ndarray[Any, Any]:
        """A typed array over the pool from byte `offset` (the engine's tensor)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        if offset < 0 or offset + count * dtype.itemsize > self.nbytes:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "a view of %d bytes at offset %d "
                          "of a %d-byte pool" % (count * dtype.itemsize, offset, self.nbytes))
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=offset).reshape(shape)

    def close(self) -> None:
        """Unmaps the pool and closes its memfd."""
        self.array = None
        try:
            self._map.close()
        except BufferError:  # views still exported: the mapping lives until they are gone
            pass
        os.close(self.fd)


@dataclass
class CudaBuffer:
    """A cuda pool allocation: its cudaIpcMemHandle_t (64 bytes) and where the buffer starts."""
    ipc_handle: bytes
    nbytes: int
    offset_in_allocation: int = 0


CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


@dataclass
class CudaRegion:
    """A GPU buffer of the engine's pool: `buffer` as the daemon opens it, `address` the device
    address where it starts in the engine (to locate the caches that lie in it)."""
    address: int
    buffer: CudaBuffer


def ipc_memory_handle(handle: Iterable[int]) -> bytes:
    """The 64 raw bytes of cudaIpcMemHandle_t in what PyTorch's storage._share_cuda_() returns:
    the raw handle, or (newer PyTorch) a type byte b"c" (cudaMalloc memory) before it. KvError
    INVALID_ARGUMENT for an expandable segment's handle (type b"e": not a CUDA IPC handle; run
    without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or any other size."""
    handle = bytes(handle)
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 1 and handle[:1] == b"c":
        return handle[1:]
    kind = ("an expandable segment's handle" if handle[:1] == b"e" else
            "a %d-byte handle" % len(handle))
    raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "%s: the cuda block store opens CUDA IPC "
                  "memory handles (%d bytes) of cudaMalloc allocations"
                  % (kind, CUDA_IPC_HANDLE_BYTES))


def cuda_region_of(tensor: Any) -> CudaRegion:
    """The CudaRegion of a CUDA tensor's whole storage, from PyTorch's
    tensor.untyped_storage()._share_cuda_() (device, handle, storage bytes, storage offset in
    its allocation, ...). Needs no import of torch: only the tensor's own methods."""
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    return CudaRegion(storage.data_ptr(), CudaBuffer(ipc_memory_handle(shared[1]),
                                                     int(shared[2]), int(shared[3])))


@dataclass
class TensorLayout:
    """Where block b of one pool tensor lives: buffers[buffer] + offset + b * block_stride,
    block_bytes contiguous bytes. kind: "K", "V", "KV" or "STATE"."""
    layer: int
    kind: str
    offset: int
    block_stride: int
    block_bytes: int
    kv_group: int = 0
    buffer: int = 0


@dataclass
class PoolLayout:
    """An engine pool's layout (RegisterEngineBuffersRequest without the memory)."""
    num_blocks: int
    tokens_per_block: int
    element_type: str  # a key of ELEMENT_TYPES
    num_kv_heads: int
    head_dim: int
    model: str
    tensors: List[TensorLayout]
    order: str = "NHD"
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one K or V tensor."""
        return self.num_kv_heads * self.head_dim * ELEMENT_BYTES[self.element_type]

    @property
    def block_bytes(self) -> int:
        """Bytes of one K or V block."""
        return self.tokens_per_block * self.token_bytes


def element_type_of(dtype: Any) -> str:
    """The block store's element name of a numpy or torch dtype's name ("bfloat16" -> "bf16")."""
    name = str(dtype).replace("torch.", "")
    names = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
             "float": "fp32", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
             "int8": "int8", "uint8": "int8"}
    if name not in names:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "element type %s: the block store "
                      "takes %s" % (name, ", ".join(sorted(names))))
    return names[name]


@dataclass
class KvGroup:
    """One KV group of a registration: its layout fingerprint and per-block bytes."""
    kv_group: int
    layout_fingerprint: bytes
    block_bytes: int
    state_bytes: int


@dataclass
class Registration:
    """A registered pool layout (BlockStore.register): its id and KV groups."""
    id: int
    layout: PoolLayout
    groups: List[KvGroup]
    engine_id: int = 0  # the engine that registered it (the request's)


# A registration, or its id (what BlockStore calls name).
RegistrationRef = Union[Registration, int]
# What a KeptRegistration.call returns: its method's result.
_Result = TypeVar("_Result")


@dataclass
class BlockMatch:
    """BlockStore.lookup: the leading blocks stored, and the pin holding them when asked."""
    matched_blocks: int
    pin_id: int = 0
    medium: str = "device"


@dataclass
class BlockOutcome:
    """One block's result in a Transfer."""
    code: grpc.StatusCode  # OK, NOT_FOUND (no longer stored), DATA_LOSS (corrupt)
    message: str = ""
    already_present: bool = False  # store: it was stored before (nothing copied)

    @property
    def ok(self) -> bool:
        """Stored or loaded."""
        return bool(self.code == grpc.StatusCode.OK)


@dataclass
class Transfer:
    """One StoreBlocks / LoadBlocks: an outcome per block id, in order."""
    blocks: List[BlockOutcome] = field(default_factory=list)
    copied_bytes: int = 0
    completion_event: bytes = b""  # cuda: wait on it before using the blocks

    @property
    def ok(self) -> bool:
        """Every block succeeded."""
        return all(block.ok for block in self.blocks)

    def failed(self) -> List[int]:
        """Indices (into the call's block ids) of the blocks that failed."""
        return [i for i, block in enumerate(self.blocks) if not block.ok]


def _keys(hashes: Optional[Iterable[Any]], token_ids: Optional[Iterable[int]]) -> Any:
    if (hashes is None) == (token_ids is None):
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT,
                      "name the blocks by exactly one of hashes or token_ids")
    if hashes is not None:
        return bs.BlockKeys(hashes=[bytes(h) for h in hashes])
    return bs.BlockKeys(token_ids=list(cast(Iterable[int], token_ids)))


def _transfer(response: Any) -> Transfer:
    return Transfer([BlockOutcome(code_from_value(b.code), b.message, b.already_present)
                     for b in response.blocks], response.copied_bytes, response.completion_event)


class BlockStore:
    """The block store calls of an attached memra_kv.Client. Thread-safe."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._stub = block_store_pb2_grpc.KvBlockStoreStub(client._channel)
        # Offers a refused registration left unconsumed: HostPool -> (handoff connection,
        # buffer id). The daemon erases offers only when a registration succeeds (an id is
        # used up by one registration) or their connection closes: every refusal leaves them
        # waiting, so the pool's next register over the same connection names them again
        # instead of leaving one more offer behind (each counts against the engine's offer
        # and byte caps until the connection closes).
        # Guarded by _offers_lock.
        self._unconsumed_offers: weakref.WeakKeyDictionary[
            HostPool, Tuple[HandoffChannel, int]] = weakref.WeakKeyDictionary()
        self._offers_lock = threading.Lock()

    @property
    def backend(self) -> Optional[str]:
        """The daemon's backend ("host" or "cuda"), as announced at attach."""
        return self._client.backend

    def _t(self, timeout: Optional[float]) -> float:
        return self._client._timeout(timeout)

    def _engine(self, what: str) -> Any:
        return self._client._engine(what)

    def register(self, buffers: Sequence[Union[HostPool, CudaBuffer]], layout: PoolLayout,
                 timeout: Optional[float] = None) -> Registration:
        """Registers the pool: `buffers` HostPool (host backend: each descriptor is offered over
        the handoff socket first) or CudaBuffer (cuda backend), `layout` what lives where.
        Returns the Registration (its KV groups' layout fingerprints and stored block bytes).

        A registration uses its offers up, so one id never serves two registrations. A refused
        one consumed none: whatever the refusal (limits, layout, a buffer range, a deadline),
        the next register of the same pools over the same handoff connection names those
        offers again, except an offer the daemon answered NOT_FOUND for (used up, say by a
        registration whose answer was lost): that pool is offered anew."""
        request = bs.RegisterEngineBuffersRequest(
            engine=self._engine("register"), num_blocks=layout.num_blocks,
            tokens_per_block=layout.tokens_per_block,
            element_type=ELEMENT_TYPES.get(layout.element_type, bs.BLOCK_ELEMENT_UNSPECIFIED),
            order=ORDERS.get(layout.order, bs.BLOCK_ORDER_UNSPECIFIED),
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, tp_rank=layout.tp_rank,
            tp_size=layout.tp_size, model=layout.model)
        for tensor in layout.tensors:
            request.tensors.add(layer=tensor.layer,
                                kind=TENSOR_KINDS.get(tensor.kind, bs.BLOCK_TENSOR_UNSPECIFIED),
                                kv_group=tensor.kv_group, buffer=tensor.buffer,
                                offset=tensor.offset, block_stride=tensor.block_stride,
                                block_bytes=tensor.block_bytes)
        offered: List[Tuple[HostPool, HandoffChannel, int]] = []  # (pool, connection, buffer id)
        sent = False
        try:
            for buffer in buffers:
                if isinstance(buffer, HostPool):
                    connection, buffer_id = self._offer(buffer)
                    offered.append((buffer, connection, buffer_id))
                    request.buffers.add(handoff_buffer_id=buffer_id, bytes=buffer.nbytes)
                else:
                    request.buffers.add(cuda_ipc_handle=buffer.ipc_handle, bytes=buffer.nbytes,
                                        offset_in_allocation=buffer.offset_in_allocation)
            sent = True
            response = _call(self._stub.RegisterEngineBuffers, request, self._t(timeout))
        except KvError as error:
            if not (sent and _offers_are_dead(error)):
                with self._offers_lock:
                    for pool, connection, buffer_id in offered:
                        self._unconsumed_offers[pool] = (connection, buffer_id)
            raise
        return Registration(response.registration_id, layout,
                            [KvGroup(g.kv_group, g.layout_fingerprint, g.block_bytes,
                                     g.state_bytes) for g in response.groups],
                            request.engine.engine_id)

    def _offer(self, pool: HostPool) -> Tuple[HandoffChannel, int]:
        """(connection, buffer id) naming `pool` for one registration: its unconsumed offer
        over the lease's handoff connection now, else a new offer."""
        with self._offers_lock:
            unconsumed = self._unconsumed_offers.pop(pool, None)
        if unconsumed is not None and unconsumed[0] is self._client._handoff_connection():
            return unconsumed
        buffer_id, connection = self._client._offer_buffer(pool.fd, pool.nbytes)
        return connection, buffer_id

    def unregister(self, registration: RegistrationRef, timeout: Optional[float] = None) -> None:
        """Drops the registration (the daemon forgets the pool's buffers)."""
        _call(self._stub.UnregisterEngineBuffers, bs.UnregisterEngineBuffersRequest(
            engine=self._engine("unregister"), registration_id=_id(registration)),
            self._t(timeout))

    def lookup(self, registration: RegistrationRef, hashes: Optional[Iterable[Any]] = None,
               token_ids: Optional[Iterable[int]] = None, kv_group: int = 0,
               pin_ttl_ms: int = 0, timeout: Optional[float] = None) -> BlockMatch:
        """How many leading blocks are stored (BlockMatch); with pin_ttl_ms, pinned for a
        following load (BlockMatch.pin_id, released by it or unpin)."""
        response = _call(self._stub.LookupBlocks, bs.LookupBlocksRequest(
            engine=self._engine("lookup"), registration_id=_id(registration),
            kv_group=kv_group, keys=_keys(hashes, token_ids), pin_ttl_ms=pin_ttl_ms),
            self._t(timeout))
        return BlockMatch(response.matched_blocks, response.pin_id,
                          _MEDIA.get(response.medium, "device"))

    def store(self, registration: RegistrationRef, block_ids: Iterable[int],
              hashes: Optional[Iterable[Any]] = None, token_ids: Optional[Iterable[int]] = None,
              kv_group: int = 0, skip_blocks: int = 0, parent_hash: bytes = b"",
              event_token_ids: Iterable[int] = (), wait_event: bytes = b"",
              timeout: Optional[float] = None, event_hashes: Iterable[Any] = ()) -> Transfer:
        """Copies pool blocks `block_ids` into the store under the keys (block i of the keys
        from block_ids[i]; with token_ids, after skip_blocks already stored). parent_hash,
        event_token_ids and event_hashes (the blocks' names in routers' events when not the
        keys: none or one per block) are for routers' events only (with hashes)."""
        request = bs.StoreBlocksRequest(
            engine=self._engine("store"), registration_id=_id(registration),
            kv_group=kv_group, keys=_keys(hashes, token_ids), block_ids=list(block_ids),
            skip_blocks=skip_blocks, parent_hash=parent_hash,
            event_token_ids=list(event_token_ids),
            event_block_hashes=[bytes(h) for h in event_hashes])
        if wait_event:
            request.ordering.wait_event = wait_event
        return _transfer(_call(self._stub.StoreBlocks, request, self._t(timeout)))

    def load(self, registration: RegistrationRef, block_ids: Iterable[int],
             hashes: Optional[Iterable[Any]] = None, token_ids: Optional[Iterable[int]] = None,
             kv_group: int = 0, skip_blocks: int = 0, pin_id: int = 0, wait_event: bytes = b"",
             timeout: Optional[float] = None) -> Transfer:
        """Copies stored blocks into pool blocks `block_ids` (distinct); per-block outcomes."""
        request = bs.LoadBlocksRequest(
            engine=self._engine("load"), registration_id=_id(registration),
            kv_group=kv_group, keys=_keys(hashes, token_ids), block_ids=list(block_ids),
            skip_blocks=skip_blocks, pin_id=pin_id)
        if wait_event:
            request.ordering.wait_event = wait_event
        return _transfer(_call(self._stub.LoadBlocks, request, self._t(timeout)))

    def unpin(self, pin_id: int, timeout: Optional[float] = None) -> None:
        """Releases a pin a lookup took."""
        _call(self._stub.UnpinBlocks, bs.UnpinBlocksRequest(
            engine=self._engine("unpin"), pin_id=pin_id), self._t(timeout))


def _id(registration: RegistrationRef) -> int:
    return cast(int, getattr(registration, "id", cast(Any, registration)))


# RegisterEngineBuffers' refusal of an offer that came over a handoff connection the daemon has
# since closed (server/store/block_store.cc).
_CLOSED_CONNECTION = "which is closed"


def _offers_are_dead(error: KvError) -> bool:
    """Whether a refused registration's offers can never be named again: one is unknown or used
    up (NOT_FOUND; the daemon uses up a registration's offers together, so after a lost answer
    all of them went with it), they came over a connection the daemon closed, or they are not
    this engine's (PERMISSION_DENIED). Any other refusal leaves every offer waiting."""
    return bool(error.code == grpc.StatusCode.NOT_FOUND or
                error.code == grpc.StatusCode.PERMISSION_DENIED or
                _CLOSED_CONNECTION in error.message)


class KeptRegistration:
    """A pool's registration an adapter keeps for the engine's life: lookup, store and load
    with it, made again once when the daemon no longer has it.

    The daemon forgets a registration behind the engine's back: it restarted (registrations
    are not journaled), the engine's lease was lost and the client attached anew, an operator
    or another call unregistered it. A call refused for that (NOT_FOUND "no registration N",
    or any refusal once the client's lease is lost for good), or made while the client is
    another engine than the one that registered, re-registers the same buffers and layout
    first (Client.attach_anew first when the lease is lost) and is made once more. A daemon
    restart alone is no reason: registration ids count up from a per-epoch base
    (BlockStore::FirstIdOfEpoch), so the old id sent once to the new daemon is answered
    NOT_FOUND, never names another pool's registration, and re-registering only then leaves
    no second registration behind. A call refused with NOT_FOUND "engine N is not attached"
    (the daemon restarted before the lease thread noticed) waits for the lease thread's verdict
    (Client.await_lease_settled) and then re-registers the same way (the epoch read around a racing re-attach could). At
    most one re-registration and one retry a call, never a loop: a second refusal, or the
    re-registration's own, is raised. Blocks stored under the old registration may be gone: a
    load then misses, its bytes are never another pool's. Thread-safe: concurrent calls that
    find the registration gone re-register it once."""

    def __init__(self, store: BlockStore, buffers: Sequence[Union[HostPool, CudaBuffer]],
                 layout: PoolLayout, timeout: Optional[float] = None) -> None:
        self._store = store
        self._client = store._client
        self._buffers = list(buffers)  # kept alive: re-registering offers them again
        self._layout = layout
        self._timeout = timeout
        self._lock = threading.Lock()
        self.reregistrations = 0
        self._registration = self._register()  # guarded by _lock

    @property
    def registration(self) -> Registration:
        """The live registration (re-registered once when the daemon lost it)."""
        with self._lock:
            return self._registration

    def _register(self) -> Registration:
        return self._store.register(self._buffers, self._layout, self._timeout)

    def _stale_locked(self) -> Optional[str]:
        """Why the registration cannot be named now (a phrase), or None.

        An engine id other than the registering one (another thread's attach_anew replaced
        the lost engine) is checked, not left to the daemon: that daemon ended the old
        engine, but until its registrations are dropped with it the old id is answered
        PERMISSION_DENIED (another engine's), which is not a lost registration and would be
        raised. Nothing leaks: the new engine holds none, the old one's end with it. The
        engine id is the one the register request carried, so a racing re-attach cannot make
        it stale."""
        lost = self._client.lease_lost
        if lost is not None:
            return "the lease was lost (%s)" % lost
        engine_id = self._registration.engine_id
        if self._client.engine_id != engine_id:
            return "the client is engine %d now, not engine %d" % (self._client.engine_id,
                                                                   engine_id)
        return None

    def _renew_locked(self, why: str) -> Registration:
        old = self._registration
        if self._client.lease_lost is not None:
            self._client.attach_anew(self._timeout)
        self._registration = self._register()
        self.reregistrations += 1
        log.warning("re-registered the pool (%s): registration %d of engine %d -> "
                    "registration %d of engine %d", why, old.id, old.engine_id,
                    self._registration.id, self._registration.engine_id)
        return self._registration

    def _forgotten(self, error: KvError, registration: Registration) -> bool:
        if error.code == grpc.StatusCode.NOT_FOUND and error.message.startswith(
                "engine %d is not attached" % registration.engine_id):
            # The daemon does not know the engine (restarted, or reclaimed it) and the lease
            # thread has not said so yet: its verdict decides how _renew_locked re-registers.
            self._client.await_lease_settled(self._timeout or 10.0)
            return True
        return self._client.lease_lost is not None or (
            error.code == grpc.StatusCode.NOT_FOUND
            and error.message.startswith("no registration %d " % registration.id))

    def call(self, method: Callable[..., _Result], *args: Any, **kwargs: Any) -> _Result:
        """method(registration, *args, **kwargs): a BlockStore call with the registration now,
        made again once when the daemon lost it."""
        with self._lock:
            registration = self._registration
            why = self._stale_locked()
            if why is not None:
                registration = self._renew_locked(why)
        try:
            return method(registration, *args, **kwargs)
        except KvError as error:
            if why is not None or not self._forgotten(error, registration):
                raise
            why = error.message
        with self._lock:
            if self._registration is registration:  # else another call re-registered it
                self._renew_locked(why)
            registration = self._registration
        return method(registration, *args, **kwargs)

    def lookup(self, **kwargs: Any) -> BlockMatch:
        """BlockStore.lookup with the registration."""
        return self.call(self._store.lookup, **kwargs)

    def store(self, block_ids: Iterable[int], **kwargs: Any) -> Transfer:
        """BlockStore.store with the registration."""
        return self.call(self._store.store, block_ids, **kwargs)

    def load(self, block_ids: Iterable[int], **kwargs: Any) -> Transfer:
        """BlockStore.load with the registration."""
        return self.call(self._store.load, block_ids, **kwargs)

    def unpin(self, pin_id: int) -> None:
        """Releases a pin a lookup took (BlockStore.unpin): pins are the engine's, not the
        registration's (a pin of an engine the client replaced is gone with it: NOT_FOUND)."""
        self._store.unpin(pin_id, self._timeout)


def page_key(key: Any) -> bytes:
    """An engine's block key as the block store's opaque hash: bytes as they are, a string as
    its UTF-8 bytes (SGLang's 64-hex-digit page keys fit the 64-byte limit), an int (vLLM's
    ExternalBlockHash may be one) as 16 signed big-endian bytes; longer than 64 bytes: its
    SHA-256 (still binding the whole key)."""
    if isinstance(key, int):
        raw = key.to_bytes(16, "big", signed=True)
    elif isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
    else:
        raw = str(key).encode()
    return hashlib.sha256(raw).digest() if len(raw) > 64 else raw


__all__ = ["BlockMatch", "BlockOutcome", "BlockStore", "CudaBuffer", "CudaRegion", "HostPool",
           "KeptRegistration", "KvGroup", "cuda_region_of", "ipc_memory_handle",
           "PoolLayout", "Registration", "TensorLayout", "Transfer", "element_type_of",
           "page_key"]
