"""memra_kv.KvError: every refusal and failure of a memra-kvd call, with its gRPC code."""

import grpc

from ._proto import cache_pb2

# grpc-status-details-bin: where gRPC carries a status's details (the daemon serializes a
# memra.kv.v1.StatusDetails there: common/grpc_status.cc).
_DETAILS_KEY = "grpc-status-details-bin"

_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class KvError(Exception):
    """A call the daemon refused (or that never reached it).

    code: a grpc.StatusCode; message: the daemon's message (its numbers included).
    An admission refusal (RESOURCE_EXHAUSTED from CreateSession, Reserve, Grow) also carries its
    structured numbers, in bytes: needed, free, evictable, budget, bytes_to_evict (needed - free
    when evicting the prefix cache would make room, else 0); they are None otherwise.
    The restart error (FAILED_PRECONDITION "memra-kvd restarted (epoch A -> B); ...": the daemon
    restarted and what the call named did not come back, docs/failure-model.md) carries both
    epochs: previous_epoch and epoch, None otherwise; is_daemon_restarted tells it apart.
    """

    def __init__(self, code, message, refusal=None, restart=None):
        super().__init__("%s: %s" % (code.name, message))
        self.code = code
        self.message = message
        self.previous_epoch = restart.previous_epoch if restart is not None else None
        self.epoch = restart.epoch if restart is not None else None
        self.needed = self.free = self.evictable = self.budget = self.bytes_to_evict = None
        if refusal is not None:
            self.needed = refusal.needed_bytes
            self.free = refusal.free_bytes
            self.evictable = refusal.evictable_bytes
            self.budget = refusal.budget_bytes
            self.bytes_to_evict = refusal.bytes_to_evict

    @property
    def is_admission_refusal(self):
        return self.needed is not None

    @property
    def is_daemon_restarted(self):
        return self.epoch is not None


def code_from_value(value):
    """The grpc.StatusCode of a google.rpc.Code value (StepResult.code)."""
    return _CODES_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def from_rpc_error(error):
    """KvError from a grpc.RpcError (whose trailing metadata may hold StatusDetails)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    refusal = None
    restart = None
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in metadata or ():
        if key != _DETAILS_KEY or not isinstance(value, bytes):
            continue
        details = cache_pb2.StatusDetails()
        try:
            details.ParseFromString(value)
        except Exception:  # details in another server's format are ignored, not trusted
            continue
        if details.HasField("admission_refusal"):
            refusal = details.admission_refusal
        if details.HasField("daemon_restart"):
            restart = details.daemon_restart
    return KvError(code or grpc.StatusCode.UNKNOWN, message or "", refusal, restart)
