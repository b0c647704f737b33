"""memra_kv's exceptions: every refusal and failure of a memra-kvd call (no grpc needed).

One base, MemraKvError (alias KvError, its name before this hierarchy), with `.code` (an
ErrorCode), `.message` (the daemon's text, its numbers included) and one subclass per code, so
callers catch what they handle next (absl's codes: UNAVAILABLE retry the call, ABORTED retry the
transaction, FAILED_PRECONDITION fix the state first, RESOURCE_EXHAUSTED no room):

    MemraKvError
      InvalidArgument, NotFound, AlreadyExists, PermissionDenied, Unauthenticated, OutOfRange,
      Unavailable, DeadlineExceeded, Cancelled, Aborted, Unimplemented, Internal, DataLoss,
      Unknown
      ResourceExhausted
        AdmissionRefused        .needed .free .evictable .budget .bytes_to_evict (bytes)
      FailedPrecondition
        DaemonRestarted         .previous_epoch .epoch

Constructing the base (`MemraKvError(code, message)`) gives the subclass of the code, so every
raise site produces the class a caller catches.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, Optional, Type


class ErrorCode(enum.Enum):
    """The status codes of memra-kvd's replies (google.rpc.Code; values are its numbers).

    For code written against grpc, a member compares equal to the grpc.StatusCode of the same
    name (`error.code == grpc.StatusCode.NOT_FOUND` keeps working); new code compares against
    ErrorCode and need not import grpc.
    """

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, code: Any) -> "ErrorCode":
        """The ErrorCode of an ErrorCode, a grpc.StatusCode (by name) or a google.rpc.Code
        number; UNKNOWN for anything else."""
        if isinstance(code, ErrorCode):
            return code
        if isinstance(code, int):
            try:
                return cls(code)
            except ValueError:
                return cls.UNKNOWN
        name = getattr(code, "name", None)
        return cls.__members__.get(name, cls.UNKNOWN) if isinstance(name, str) else cls.UNKNOWN

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ErrorCode):
            return self is other
        # A grpc.StatusCode: an enum whose value is (number, "name").
        value = getattr(other, "value", None)
        return (isinstance(value, tuple) and len(value) == 2 and value[0] == self.value and
                getattr(other, "name", None) == self.name)

    def __hash__(self) -> int:
        # Enum's own hash (of the name), as grpc.StatusCode's: equal members hash equally.
        return hash(self.name)


class MemraKvError(Exception):
    """A call the daemon refused (or that never reached it).

    code: the ErrorCode; message: the daemon's message, its numbers included. The number
    attributes are None unless the daemon sent them (AdmissionRefused, DaemonRestarted); they
    are on every instance so a handler of the base class can read them.
    """

    code: ErrorCode
    message: str
    # AdmissionRefused's numbers, in bytes.
    needed: Optional[int]
    free: Optional[int]
    evictable: Optional[int]
    budget: Optional[int]
    bytes_to_evict: Optional[int]
    # DaemonRestarted's epochs.
    previous_epoch: Optional[int]
    epoch: Optional[int]

    def __new__(cls, code: Any, message: str = "", refusal: Any = None,
                restart: Any = None) -> "MemraKvError":
        if cls is MemraKvError:
            cls = _class_of(ErrorCode.of(code), refusal is not None, restart is not None)
        return super().__new__(cls)

    def __init__(self, code: Any, message: str = "", refusal: Any = None,
                 restart: Any = None) -> None:
        """code: an ErrorCode (or grpc.StatusCode); refusal: a memra.kv.v1.AdmissionRefusal
        (or anything with its *_bytes fields); restart: a memra.kv.v1.DaemonRestart (or
        anything with previous_epoch and epoch)."""
        self.code = ErrorCode.of(code)
        self.message = message
        super().__init__("%s: %s" % (self.code.name, message))
        self.previous_epoch = int(restart.previous_epoch) if restart is not None else None
        self.epoch = int(restart.epoch) if restart is not None else None
        self.needed = self.free = self.evictable = self.budget = self.bytes_to_evict = None
        if refusal is not None:
            self.needed = int(refusal.needed_bytes)
            self.free = int(refusal.free_bytes)
            self.evictable = int(refusal.evictable_bytes)
            self.budget = int(refusal.budget_bytes)
            self.bytes_to_evict = int(refusal.bytes_to_evict)

    def __reduce__(self) -> Any:
        # Pickles (multiprocessing) as the same class with the same numbers.
        return (_rebuild, (type(self), self.code.value, self.message, self.__dict__.copy()))

    @property
    def is_admission_refusal(self) -> bool:
        """An admission refusal with its numbers (isinstance(error, AdmissionRefused))."""
        return self.needed is not None

    @property
    def is_daemon_restarted(self) -> bool:
        """The restart error with both epochs (isinstance(error, DaemonRestarted))."""
        return self.epoch is not None


KvError = MemraKvError
"""The base's name before the hierarchy; the same class."""


def _rebuild(cls: Type[MemraKvError], code: int, message: str,
             state: Dict[str, Any]) -> MemraKvError:
    error = cls(ErrorCode(code), message)
    error.__dict__.update(state)
    return error


class Cancelled(MemraKvError):
    """CANCELLED: the call was cancelled (a cancel() or the client closing)."""


class Unknown(MemraKvError):
    """UNKNOWN: a failure without a code (a reply the client could not read)."""


class InvalidArgument(MemraKvError):
    """INVALID_ARGUMENT: the request is wrong whatever the state (a bad plan, shape, count)."""


class DeadlineExceeded(MemraKvError):
    """DEADLINE_EXCEEDED: no answer within the call's timeout."""


class NotFound(MemraKvError):
    """NOT_FOUND: the session, engine, reservation, plan or prefix entry does not exist (any
    more)."""


class AlreadyExists(MemraKvError):
    """ALREADY_EXISTS: the thing to create is there already."""


class PermissionDenied(MemraKvError):
    """PERMISSION_DENIED: a wrong token, another engine's session, or an admin call on the
    engine socket."""


class ResourceExhausted(MemraKvError):
    """RESOURCE_EXHAUSTED: no room (a limit, a full pool); AdmissionRefused when the budget
    refused with its numbers."""


class AdmissionRefused(ResourceExhausted):
    """The admission ledger had no room (CreateSession, Reserve, Grow): needed, free,
    evictable, budget and bytes_to_evict (needed - free when evicting the prefix cache would
    make room, else 0) are ints, in bytes (docs/rules.md#admission)."""

    needed: int
    free: int
    evictable: int
    budget: int
    bytes_to_evict: int


class FailedPrecondition(MemraKvError):
    """FAILED_PRECONDITION: the state does not allow the call now (wrong generation, no
    transaction, a released session, ...): fix the state first."""


class DaemonRestarted(FailedPrecondition):
    """memra-kvd restarted and what the call named did not come back ("memra-kvd restarted
    (epoch A -> B); ...", docs/failure-model.md): previous_epoch and epoch are ints."""

    previous_epoch: int
    epoch: int


class Aborted(MemraKvError):
    """ABORTED: a conflict; retry the transaction."""


class OutOfRange(MemraKvError):
    """OUT_OF_RANGE: a length or position past what the session holds."""


class Unimplemented(MemraKvError):
    """UNIMPLEMENTED: this daemon (or backend) does not serve the call."""


class Internal(MemraKvError):
    """INTERNAL: a broken invariant in the daemon or client (a bug: report it)."""


class Unavailable(MemraKvError):
    """UNAVAILABLE: the daemon is not answering or is draining: retry the call later."""


class DataLoss(MemraKvError):
    """DATA_LOSS: stored bytes failed their checksum."""


class Unauthenticated(MemraKvError):
    """UNAUTHENTICATED: the caller's credentials were not accepted."""


_CLASS_BY_CODE: Dict[ErrorCode, Type[MemraKvError]] = {
    ErrorCode.CANCELLED: Cancelled,
    ErrorCode.UNKNOWN: Unknown,
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.ALREADY_EXISTS: AlreadyExists,
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    ErrorCode.FAILED_PRECONDITION: FailedPrecondition,
    ErrorCode.ABORTED: Aborted,
    ErrorCode.OUT_OF_RANGE: OutOfRange,
    ErrorCode.UNIMPLEMENTED: Unimplemented,
    ErrorCode.INTERNAL: Internal,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.DATA_LOSS: DataLoss,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
}


def _class_of(code: ErrorCode, refused: bool, restarted: bool) -> Type[MemraKvError]:
    if restarted:
        return DaemonRestarted
    if refused:
        return AdmissionRefused
    return _CLASS_BY_CODE.get(code, MemraKvError)


def code_from_value(value: int) -> ErrorCode:
    """The ErrorCode of a google.rpc.Code number (StepResult.code, BlockResult.code)."""
    return ErrorCode.of(int(value))
