"""A session's planes in this process: arenas mapped once, planes as arrays over them.

Host backend: the arena handle is opaque; HostArenaMapper trades it, once per arena, for the
arena's memfd over the engine's handoff connection (handoff.py) and maps that (like
client/mapper.cc); a plane is a numpy array over the mapping. Cuda backend: the handle is a 64-byte cudaIpcMemHandle_t; CudaArenaMapper opens it once
through ctypes on /usr/local/cuda's libcudart (cudaIpcOpenMemHandle) and a plane is a CudaPlane
exposing __cuda_array_interface__ (torch.as_tensor, cupy.asarray, numba.cuda.as_cuda_array).
"""

import ctypes
import ctypes.util
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ._proto import cache_pb2
from ._proto import model_plan_pb2
from .errors import ErrorCode, KvError, MemraKvError

# () -> (descriptor, bytes) of a host arena (Client._fetch_arena_fd).
FetchFd = Callable[[], Tuple[int, int]]

# Planes whose rows are f32 elements (cache.proto PlaneKind; latent rows unless the layer's
# latent_format says otherwise); K/V rows are bytes in the raw view and the mirrors one int32.
F32_KINDS = frozenset([
    cache_pb2.PLANE_KIND_CONV_STATE, cache_pb2.PLANE_KIND_SSM_STATE,
    cache_pb2.PLANE_KIND_SSM_STATE_ALT, cache_pb2.PLANE_KIND_LATENT_ROWS,
    cache_pb2.PLANE_KIND_INDEX_ROWS, cache_pb2.PLANE_KIND_POOL_KEYS,
    cache_pb2.PLANE_KIND_SPEC_CONV, cache_pb2.PLANE_KIND_SPEC_SSM,
])
MIRROR_KINDS = frozenset([cache_pb2.PLANE_KIND_LEN_MIRROR, cache_pb2.PLANE_KIND_BASE_MIRROR])


@dataclass(frozen=True)
class PlaneGeometry:
    """One plane of a layer (cache.proto Plane): `bytes` at `offset` of arena `arena`.
    `raw`: the plane's rows are not f32 whatever its kind (latent rows in a non-f32
    latent_format), so the raw view gives their bytes."""
    kind: int
    arena: int
    offset: int
    bytes: int
    rows: int
    row_bytes: int
    raw: bool = False

    def dtype_and_shape(self) -> Tuple["np.dtype[Any]", Tuple[int, ...]]:
        """The plane's element type and row shape: (rows, row_bytes) uint8 for K/V, (rows,
        row_bytes / 4) float32 for f32 planes, (rows,) int32 for the mirrors. Tail pads (K/V's 8
        bytes, an empty pool-key plane's 4) are outside the shape."""
        if self.kind in MIRROR_KINDS:
            return np.dtype("<i4"), (self.rows,)
        if self.kind in F32_KINDS and not self.raw:
            return np.dtype("<f4"), (self.rows, self.row_bytes // 4)
        return np.dtype(np.uint8), (self.rows, self.row_bytes)


# ---- typed views (docs/rules.md#formats) ----

@dataclass(frozen=True)
class ElementType:
    """One element format: its name, bytes, the numpy dtype holding its bits (`storage`), and
    the names of its real type in ml_dtypes and torch (None where numpy has it natively)."""
    name: str
    bytes: int
    storage: "np.dtype[Any]"
    ml_dtypes_name: Optional[str]
    torch_name: str


# By wire value (model_plan.proto ElementFormat; UNSPECIFIED is f32).
ELEMENT_TYPES = {
    model_plan_pb2.ELEMENT_FORMAT_F32: ElementType("f32", 4, np.dtype("<f4"), None, "float32"),
    model_plan_pb2.ELEMENT_FORMAT_BF16: ElementType("bf16", 2, np.dtype("<u2"), "bfloat16",
                                                    "bfloat16"),
    model_plan_pb2.ELEMENT_FORMAT_F16: ElementType("f16", 2, np.dtype("<f2"), None, "float16"),
    model_plan_pb2.ELEMENT_FORMAT_FP8_E4M3: ElementType("fp8_e4m3", 1, np.dtype(np.uint8),
                                                        "float8_e4m3fn", "float8_e4m3fn"),
    model_plan_pb2.ELEMENT_FORMAT_FP8_E5M2: ElementType("fp8_e5m2", 1, np.dtype(np.uint8),
                                                        "float8_e5m2", "float8_e5m2"),
}
ELEMENT_TYPES[model_plan_pb2.ELEMENT_FORMAT_UNSPECIFIED] = \
    ELEMENT_TYPES[model_plan_pb2.ELEMENT_FORMAT_F32]

# K / V formats that store one element per value, by wire value; the block formats (q8_0, fp8,
# q5_1, q4_0) are absent: they have no typed view.
_K_ELEMENTS = {
    model_plan_pb2.K_FORMAT_BF16: model_plan_pb2.ELEMENT_FORMAT_BF16,
    model_plan_pb2.K_FORMAT_F16: model_plan_pb2.ELEMENT_FORMAT_F16,
    model_plan_pb2.K_FORMAT_F32: model_plan_pb2.ELEMENT_FORMAT_F32,
    model_plan_pb2.K_FORMAT_FP8_E4M3: model_plan_pb2.ELEMENT_FORMAT_FP8_E4M3,
    model_plan_pb2.K_FORMAT_FP8_E5M2: model_plan_pb2.ELEMENT_FORMAT_FP8_E5M2,
}
_V_ELEMENTS = {
    model_plan_pb2.V_FORMAT_BF16: model_plan_pb2.ELEMENT_FORMAT_BF16,
    model_plan_pb2.V_FORMAT_F16: model_plan_pb2.ELEMENT_FORMAT_F16,
    model_plan_pb2.V_FORMAT_F32: model_plan_pb2.ELEMENT_FORMAT_F32,
    model_plan_pb2.V_FORMAT_FP8_E4M3: model_plan_pb2.ELEMENT_FORMAT_FP8_E4M3,
    model_plan_pb2.V_FORMAT_FP8_E5M2: model_plan_pb2.ELEMENT_FORMAT_FP8_E5M2,
}


@dataclass(frozen=True)
class TypedGeometry:
    """A plane as an array (client.h TypedPlaneView): element [row][head][i] at offset
    row * strides[0] + head * strides[1] + i * strides[2] bytes. `scale`: the plan's fp8 scale
    (empty: 1.0)."""
    plane: PlaneGeometry
    element: ElementType
    shape: Tuple[int, int, int]
    strides: Tuple[int, int, int]
    scale: Tuple[float, ...]


def typed_geometry(entry: Any, plane: PlaneGeometry) -> TypedGeometry:
    """The TypedGeometry of `plane` of layer layout `entry` (cache.proto LayerLayout):
    (rows, n_head_kv, head_dim) for element-format K/V, (rows, 1, latent_width) for latent rows,
    (rows, 1, row_bytes / 4) f32 for the indexer, pool-key, conv and SSM planes. KvError
    FAILED_PRECONDITION for block formats and mirrors, naming layer, plane and format."""
    kind_name = cache_pb2.PlaneKind.Name(plane.kind).replace("PLANE_KIND_", "").lower()
    if plane.kind in MIRROR_KINDS:
        raise _bad(ErrorCode.FAILED_PRECONDITION, "layer %d %s is an i32 mirror the daemon "
                   "owns: no typed view" % (entry.layer, kind_name))
    heads: int = 1
    head_dim: Optional[int] = None
    scale: Tuple[float, ...] = ()
    element_format: int
    if plane.kind in (cache_pb2.PLANE_KIND_KEYS, cache_pb2.PLANE_KIND_VALUES):
        keys = plane.kind == cache_pb2.PLANE_KIND_KEYS
        wire = entry.formats.k if keys else entry.formats.v
        known = (_K_ELEMENTS if keys else _V_ELEMENTS).get(wire)
        if known is None:
            name = (model_plan_pb2.KFormat.Name(wire) if keys
                    else model_plan_pb2.VFormat.Name(wire)).split("_FORMAT_")[1].lower()
            raise _bad(ErrorCode.FAILED_PRECONDITION,
                       "layer %d %s are %s, a block format: no typed view (read the bytes "
                       "through plane(); docs/rules.md#formats)" % (entry.layer, kind_name, name))
        element_format = known
        heads = int(entry.n_head_kv)
        head_dim = int(entry.head_dim_k if keys else entry.head_dim_v)
        scale = tuple(entry.k_scale if keys else entry.v_scale)
    elif plane.kind == cache_pb2.PLANE_KIND_LATENT_ROWS:
        element_format = int(entry.latent_format)
        head_dim = int(entry.latent_width)
        scale = tuple(entry.k_scale)
    else:
        element_format = model_plan_pb2.ELEMENT_FORMAT_F32
    element = ELEMENT_TYPES[element_format]
    if head_dim is None:
        head_dim = plane.row_bytes // element.bytes
    if heads == 0 or head_dim == 0 or heads * head_dim * element.bytes != plane.row_bytes:
        raise _bad(ErrorCode.FAILED_PRECONDITION,
                   "layer %d %s: rows of %d bytes are not %d heads x %d x %d-byte elements (a "
                   "daemon without head geometry in its layouts?)"
                   % (entry.layer, kind_name, plane.row_bytes, heads, head_dim, element.bytes))
    return TypedGeometry(plane, element, (plane.rows, heads, head_dim),
                         (plane.row_bytes, head_dim * element.bytes, element.bytes), scale)


def numpy_dtype(element: ElementType) -> "np.dtype[Any]":
    """The numpy dtype of `element`'s real values: native for f32 / f16, ml_dtypes' for bf16 and
    the fp8 formats (KvError FAILED_PRECONDITION naming the package when it is missing)."""
    if element.ml_dtypes_name is None:
        return element.storage
    try:
        import ml_dtypes
    except ImportError:
        raise _bad(ErrorCode.FAILED_PRECONDITION,
                   "%s planes as numpy need the ml_dtypes package (pip install ml-dtypes); "
                   "storage=True gives the %s bits, torch_plane() a torch tensor"
                   % (element.name, element.storage.name)) from None
    real: "np.dtype[Any]" = np.dtype(getattr(ml_dtypes, element.ml_dtypes_name))
    return real


def torch_dtype(element: ElementType) -> Any:
    """torch's dtype for `element` (KvError FAILED_PRECONDITION when torch is not installed)."""
    try:
        import torch
    except ImportError:
        raise _bad(ErrorCode.FAILED_PRECONDITION,
                   "torch_plane() needs torch; typed_plane() gives numpy arrays") from None
    return getattr(torch, element.torch_name)


def bf16_bits(values: Any) -> Any:
    """float32 values -> their bf16 bits (uint16), rounded to nearest even: the encoding of a
    bf16 plane for engines without ml_dtypes or torch (NaN stays NaN)."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(values, dtype=np.float32))
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype("<u2")


def float32_from_bf16_bits(bits: Any) -> Any:
    """bf16 bits (uint16) -> float32 values: the decoding of bf16_bits."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def _bad(code: ErrorCode, message: str) -> MemraKvError:
    return KvError(code, message)


class _CachingArenaMapper:
    """Opens each arena once, by handle (client/mapper.h CachingArenaMapper); thread-safe.
    Subclasses name their `backend` and implement _open(handle, size, fetch_fd) and
    _close(base). `fetch_fd` () -> (descriptor, bytes) is called at most once per map(), only
    when the handle is not mapped yet (host arenas: over the handoff socket)."""

    backend = ""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: Dict[bytes, Tuple[Any, int]] = {}  # handle -> (base, bytes)
        self.opens = 0

    def map(self, handle: bytes, size: int, fetch_fd: Optional[FetchFd] = None) -> Any:
        """The base of the arena's mapping (mapped on first use; the same after)."""
        if size == 0:
            raise _bad(ErrorCode.INVALID_ARGUMENT, "Map %r: an arena of 0 bytes" % (handle,))
        with self._lock:
            entry = self._mapped.get(handle)
            if entry is not None:
                if entry[1] != size:
                    raise _bad(ErrorCode.FAILED_PRECONDITION,
                               "Map %s: already mapped with %d bytes, asked for %d"
                               % (_printable(handle), entry[1], size))
                return entry[0]
            base = self._open(handle, size, fetch_fd)
            self._mapped[handle] = (base, size)
            self.opens += 1
            return base

    def _open(self, handle: bytes, size: int, fetch_fd: Optional[FetchFd]) -> Any:
        raise NotImplementedError

    def _close(self, base: Any) -> None:
        raise NotImplementedError

    def unmap(self, handle: bytes) -> None:
        """Drops the arena's mapping (nothing when it is not mapped)."""
        with self._lock:
            entry = self._mapped.pop(handle, None)
        if entry is not None:
            self._close(entry[0])

    @property
    def mapped_count(self) -> int:
        """Arenas mapped now."""
        with self._lock:
            return len(self._mapped)


def _printable(handle: Any) -> str:
    """A host handle as its name; a binary (cuda) one escaped."""
    if isinstance(handle, bytes):
        text = handle.decode("ascii", "replace")
        return text if handle.isascii() and text.isprintable() else repr(handle)
    return str(handle)


class HostArenaMapper(_CachingArenaMapper):
    """Maps host arenas: memfds the daemon hands the owning engine over its handoff connection.
    An arena stays mapped while an array over it lives, even after unmap() (the mapping closes
    when the last one goes)."""

    backend = "host"

    def _open(self, handle: bytes, size: int, fetch_fd: Optional[FetchFd]) -> Any:
        if not 1 <= len(handle) <= 256:
            raise _bad(ErrorCode.INVALID_ARGUMENT,
                       "%r is not a host arena handle (1 to 256 bytes)" % (handle,))
        if fetch_fd is None:
            raise _bad(ErrorCode.FAILED_PRECONDITION,
                       "a host arena is mapped from the descriptor the daemon hands its owning "
                       "engine over the handoff socket: map it through a Client session")
        fd, said = fetch_fd()
        try:
            held = os.fstat(fd).st_size
            # Mapping past the memory's end would turn a touch there into SIGBUS.
            if held != size or said != size:
                raise _bad(ErrorCode.FAILED_PRECONDITION,
                           "Map host arena %s: the descriptor holds %d bytes (the daemon said %d), "
                           "asked for %d" % (_printable(handle), held, said, size))
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def _close(self, base: Any) -> None:
        pass  # closed when no array over it is left (closing under one would raise)

    def plane(self, base: Any, geometry: PlaneGeometry) -> Any:
        """numpy with the plane's row shape over the mapping."""
        dtype, shape = geometry.dtype_and_shape()
        count = int(np.prod(shape)) if shape else 1
        return np.frombuffer(base, dtype=dtype, count=count, offset=geometry.offset).reshape(shape)

    def plane_bytes(self, base: Any, geometry: PlaneGeometry) -> Any:
        """The plane's bytes as one uint8 vector."""
        return np.frombuffer(base, dtype=np.uint8, count=geometry.bytes, offset=geometry.offset)

    def typed_plane(self, base: Any, typed: TypedGeometry, dtype: Any) -> Any:
        """numpy (rows, heads, head_dim) of `dtype` over the shared memory."""
        count = int(np.prod(typed.shape))
        return np.frombuffer(base, dtype=dtype, count=count,
                             offset=typed.plane.offset).reshape(typed.shape)

    def torch_plane(self, base: Any, typed: TypedGeometry, dtype: Any) -> Any:
        """A torch CPU tensor over the shared memory itself (no copy)."""
        import torch
        count = typed.shape[0] * typed.plane.row_bytes
        raw = torch.frombuffer(base, dtype=torch.uint8, count=count, offset=typed.plane.offset)
        return raw.view(dtype).view(typed.shape)


# ---- cuda ----

_CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CUDA_EVENT_DISABLE_TIMING = 0x02
_CUDA_EVENT_INTERPROCESS = 0x04
_IPC_HANDLE_BYTES = 64


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


def _find_cudart() -> Optional[str]:
    root = os.environ.get("CUDA_PATH", "/usr/local/cuda")
    for candidate in (os.path.join(root, "lib64", "libcudart.so"),
                      os.path.join(root, "lib64", "libcudart.so.12"),
                      ctypes.util.find_library("cudart")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


class CudaRuntime:
    """The few CUDA runtime calls the client needs, through ctypes (no compiled extension)."""

    def __init__(self, device: int = 0) -> None:
        path = _find_cudart()
        if path is None:
            raise _bad(ErrorCode.UNAVAILABLE,
                       "no libcudart under /usr/local/cuda/lib64 (or $CUDA_PATH)")
        self.lib = ctypes.CDLL(path)
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        count = ctypes.c_int(0)
        self._check(self.lib.cudaGetDeviceCount(ctypes.byref(count)), "cudaGetDeviceCount")
        if count.value == 0:
            raise _bad(ErrorCode.UNAVAILABLE, "cudaGetDeviceCount: no CUDA device")
        self._check(self.lib.cudaSetDevice(ctypes.c_int(device)), "cudaSetDevice(%d)" % device)
        self.device = device

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise _bad(ErrorCode.UNAVAILABLE if code in (35, 100) else
                       ErrorCode.INTERNAL, "%s: CUDA error %d (%s)" % (
                           what, code, self.lib.cudaGetErrorString(code).decode()))

    def ipc_open(self, handle: bytes) -> int:
        """cudaIpcOpenMemHandle: the device pointer of an arena's IPC handle."""
        if len(handle) != _IPC_HANDLE_BYTES:
            raise _bad(ErrorCode.INVALID_ARGUMENT, "a cuda arena handle is %d bytes, not %d"
                       % (_IPC_HANDLE_BYTES, len(handle)))
        pointer = ctypes.c_void_p()
        self._check(self.lib.cudaIpcOpenMemHandle(
            ctypes.byref(pointer), _IpcHandle(handle), ctypes.c_uint(
                _CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)), "cudaIpcOpenMemHandle")
        return int(pointer.value or 0)

    def ipc_close(self, pointer: int) -> None:
        """cudaIpcCloseMemHandle."""
        self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(pointer)),
                    "cudaIpcCloseMemHandle")

    def memcpy(self, dst: int, src: int, size: int, kind: int) -> None:
        """cudaMemcpy (kind 1: host to device, 2: device to host)."""
        self._check(self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src),
                                        ctypes.c_size_t(size), ctypes.c_int(kind)), "cudaMemcpy")

    def interprocess_event(self) -> Tuple[Any, bytes]:
        """(event, its 64-byte cudaIpcEventHandle_t): record the event after the kernels that
        touch a session's planes and pass the handle to Session.set_wait_event (cache.proto
        DeviceOrdering)."""
        event = ctypes.c_void_p()
        self._check(self.lib.cudaEventCreateWithFlags(
            ctypes.byref(event), ctypes.c_uint(_CUDA_EVENT_INTERPROCESS |
                                               _CUDA_EVENT_DISABLE_TIMING)),
            "cudaEventCreateWithFlags")
        handle = _IpcHandle()
        self._check(self.lib.cudaIpcGetEventHandle(ctypes.byref(handle), event),
                    "cudaIpcGetEventHandle")
        return event, bytes(handle.reserved)

    def record(self, event: Any, stream: Optional[int] = None) -> None:
        """cudaEventRecord on `stream` (None: the default stream)."""
        self._check(self.lib.cudaEventRecord(event, ctypes.c_void_p(stream)), "cudaEventRecord")


class CudaPlane:
    """A plane in device memory: __cuda_array_interface__ (v3) with the plane's row shape (or a
    typed view's shape and storage dtype)."""

    def __init__(self, pointer: int, geometry: PlaneGeometry, runtime: CudaRuntime,
                 dtype_and_shape: Optional[Tuple[Any, Tuple[int, ...]]] = None) -> None:
        dtype, shape = dtype_and_shape or geometry.dtype_and_shape()
        self.pointer = pointer
        self.shape = shape
        self.dtype = dtype
        self.nbytes = geometry.rows * geometry.row_bytes if geometry.kind not in MIRROR_KINDS \
            else 4 * geometry.rows
        self._runtime = runtime

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        """The CUDA array interface, version 3."""
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.pointer, False),
                "version": 3, "strides": None, "stream": None}

    def to_host(self) -> Any:
        """A numpy copy (cudaMemcpy device to host)."""
        out = np.empty(self.shape, dtype=self.dtype)
        self._runtime.memcpy(out.ctypes.data, self.pointer, out.nbytes, 2)
        return out

    def from_host(self, array: Any) -> None:
        """Copies a numpy array of this plane's shape into the plane (host to device)."""
        array = np.ascontiguousarray(array, dtype=self.dtype)
        if array.shape != tuple(self.shape):
            raise ValueError("shape %s, plane %s" % (array.shape, self.shape))
        self._runtime.memcpy(self.pointer, array.ctypes.data, array.nbytes, 1)


class CudaArenaMapper(_CachingArenaMapper):
    """Opens cuda arenas (64-byte CUDA IPC handles) once each."""

    backend = "cuda"

    def __init__(self, device: int = 0) -> None:
        super().__init__()
        self.runtime = CudaRuntime(device)

    def _open(self, handle: bytes, size: int, fetch_fd: Optional[FetchFd]) -> Any:
        return self.runtime.ipc_open(handle)  # an IPC handle opens the memory by itself

    def _close(self, base: Any) -> None:
        self.runtime.ipc_close(base)

    def plane(self, base: Any, geometry: PlaneGeometry) -> Any:
        """A CudaPlane with the plane's row shape."""
        return CudaPlane(base + geometry.offset, geometry, self.runtime)

    def plane_bytes(self, base: Any, geometry: PlaneGeometry) -> Any:
        """The plane's bytes as one uint8 CudaPlane."""
        flat = PlaneGeometry(cache_pb2.PLANE_KIND_KEYS, geometry.arena, geometry.offset,
                             geometry.bytes, 1, geometry.bytes)
        return CudaPlane(base + geometry.offset, flat, self.runtime)

    def typed_plane(self, base: Any, typed: TypedGeometry, dtype: Any) -> Any:
        """A CudaPlane of the typed shape. __cuda_array_interface__ has no bf16 / fp8 typestr,
        so those travel as their storage bits (torch_plane() views them as the real type)."""
        if typed.element.ml_dtypes_name is not None:
            dtype = typed.element.storage
        return CudaPlane(base + typed.plane.offset, typed.plane, self.runtime,
                         (dtype, typed.shape))

    def torch_plane(self, base: Any, typed: TypedGeometry, dtype: Any) -> Any:
        """A torch CUDA tensor over the device memory (__cuda_array_interface__, no copy)."""
        import torch
        storage = self.typed_plane(base, typed, typed.element.storage)
        return torch.as_tensor(storage, device="cuda").view(dtype)
