"""memra_kv: Python engines and operators on memra-kvd (python/README.md)."""

try:
    import grpc  # noqa: F401
    import google.protobuf  # noqa: F401
    import numpy  # noqa: F401
except ImportError as _missing:
    raise ImportError(
        "memra_kv needs grpcio, protobuf and numpy (%s): `pip install ./python` from a checkout "
        "installs them with the package; on Debian: apt install python3-grpcio python3-protobuf "
        "python3-numpy" % _missing) from _missing
try:
    from ._proto import admin_pb2, cache_pb2, model_plan_pb2, prefix_pb2
except ImportError as _missing:
    raise ImportError(
        "memra_kv's gRPC stubs (memra_kv._proto, generated from proto/, never checked in) are "
        "missing or were generated for another protobuf (%s): install the package with `pip "
        "install ./python` (or `pip install -e ./python`), depend on //python:memra_kv under "
        "Bazel, or run python/tools/gen_protos.py in a checkout" % _missing) from _missing
from .client import (AdvanceStep, Advanced, Client, LayerAppend, PrefixCaptured, PrefixEvent,
                     PrefixEvents, PrefixMatch, PrefixRestored, PreparedAppend, Reservation,
                     Session, StepBatch, StepOutcome, Transaction, TransactionScope)
from .errors import (Aborted, AdmissionRefused, AlreadyExists, Cancelled, DaemonRestarted, DataLoss,
                     DeadlineExceeded, ErrorCode, FailedPrecondition, Internal, InvalidArgument,
                     KvError, MemraKvError, NotFound, OutOfRange, PermissionDenied,
                     ResourceExhausted, Unauthenticated, Unavailable, Unimplemented, Unknown)
from .planes import (CudaArenaMapper, CudaPlane, CudaRuntime, HostArenaMapper, PlaneGeometry,
                     TypedGeometry, bf16_bits, float32_from_bf16_bits)
from .results import (AdmissionStatus, Cost, CostBreakdown, EngineStatus, Fit, ImportedModel,
                      LayerState, MaxContext, PrefixCacheStats, PrefixEntry, PrefixEvicted,
                      PrefixesEvicted,
                      PrefixListing, PrefixRemoteStats, PrefixTierStats, SessionState,
                      SessionSummary, Status)
from . import plans

# Plane kinds (cache.proto PlaneKind), for Session.plane(layer, kind).
KEYS = cache_pb2.PLANE_KIND_KEYS
VALUES = cache_pb2.PLANE_KIND_VALUES
LEN_MIRROR = cache_pb2.PLANE_KIND_LEN_MIRROR
BASE_MIRROR = cache_pb2.PLANE_KIND_BASE_MIRROR
CONV_STATE = cache_pb2.PLANE_KIND_CONV_STATE
SSM_STATE = cache_pb2.PLANE_KIND_SSM_STATE
SSM_STATE_ALT = cache_pb2.PLANE_KIND_SSM_STATE_ALT
LATENT_ROWS = cache_pb2.PLANE_KIND_LATENT_ROWS
INDEX_ROWS = cache_pb2.PLANE_KIND_INDEX_ROWS
POOL_KEYS = cache_pb2.PLANE_KIND_POOL_KEYS
SPEC_CONV = cache_pb2.PLANE_KIND_SPEC_CONV
SPEC_SSM = cache_pb2.PLANE_KIND_SPEC_SSM

connect = Client.connect
"""memra_kv.connect(socket_path, timeout=10.0): Client.connect."""
