"""memra_kv.Client: an engine's connection to memra-kvd (mirrors client/client.h).

Every call takes `timeout` (seconds; None: the client's default_timeout) and raises a
MemraKvError subclass on a refusal (errors.py). Results are frozen dataclasses (results.py and
below). Sessions map their arenas once (planes.py); Reset reuses the arena, Grow maps a new one.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set,
                    Tuple, Type, TypeVar, Union)

import grpc

from ._proto import admin_pb2, admin_pb2_grpc, cache_pb2, cache_pb2_grpc, model_plan_pb2
from ._proto import prefix_pb2, prefix_pb2_grpc
from .errors import ErrorCode, KvError, MemraKvError, code_from_value
from .handoff import HandoffChannel, default_handoff_path
from . import step_channel
from .planes import (CudaArenaMapper, HostArenaMapper, PlaneGeometry, TypedGeometry,
                     numpy_dtype, torch_dtype, typed_geometry)
from .results import (Cost, EngineStatus, Fit, ImportedModel, MaxContext, PrefixEntry,
                      PrefixEvicted, PrefixesEvicted, PrefixListing, SessionState,
                      SessionSummary, Status,
                      from_message)

pb = cache_pb2

_Reply = TypeVar("_Reply")

# A local socket: reconnect within 100 ms-1 s of the daemon coming back (gRPC's default backoff
# waits up to minutes, longer than a lease outlives a daemon restart), as client/client.cc.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]
_REATTACH_RETRY_S = 0.1

# grpc-status-details-bin: where gRPC carries a status's details (the daemon serializes a
# memra.kv.v1.StatusDetails there: common/grpc_status.cc).
_DETAILS_KEY = "grpc-status-details-bin"


def from_rpc_error(error: Exception) -> MemraKvError:
    """The MemraKvError of a grpc.RpcError (whose trailing metadata may hold StatusDetails: an
    admission refusal's numbers, a restart's epochs)."""
    code = error.code() if hasattr(error, "code") else None
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
    return MemraKvError(ErrorCode.of(code), message or "", refusal, restart)


def _call(method: Any, request: Any, timeout: Optional[float]) -> Any:
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as error:
        raise from_rpc_error(error) from None


# ---- results ----

@dataclass(frozen=True)
class Transaction:
    """A begun transaction: its generation and the committed length it began at (rows)."""

    generation: int
    base_len: int


@dataclass(frozen=True)
class LayerAppend:
    """Where one K/V layer's appended rows go. Ring layers with `rebase`: first move `keep_rows`
    physical rows from `src_row` to physical row 0 of the K and V planes (memmove); the ring's
    base becomes `new_base` at publish."""

    layer: int
    write_row: int
    ring: bool = False
    rebase: bool = False
    src_row: int = 0
    keep_rows: int = 0
    new_base: int = 0


@dataclass(frozen=True)
class PreparedAppend:
    """A prepared append: write the rows at each layer's write_row, then publish."""

    generation: int
    target: int  # staged rows after the append
    layers: List[LayerAppend]  # one per K/V layer, in layer order


def _prepared_from_proto(response: Any) -> PreparedAppend:
    layers = []
    for plan in response.layers:
        # The daemon sends one plan per distinct plan; more_layers share it (cache.proto).
        for layer in [plan.layer] + list(plan.more_layers):
            layers.append(LayerAppend(int(layer), int(plan.write_row), bool(plan.ring),
                                      bool(plan.rebase), int(plan.src_row),
                                      int(plan.keep_rows), int(plan.new_base)))
    layers.sort(key=lambda entry: entry.layer)
    return PreparedAppend(int(response.generation), int(response.target), layers)


@dataclass(frozen=True)
class Advanced:
    """One decode step's result (Session.advance, Client.advance_many).

    committed_len: the committed length after the step (the next transaction's base);
    published: whether the step published the finished transaction's prepared append;
    transaction and prepared: the transaction it began and where its rows go (None when it
    began none: next_rows 0). In Client.advance_many an entry may fail alone: `error` is then
    its MemraKvError and the session is unchanged (the other fields are 0 / None)."""

    committed_len: int
    published: bool
    transaction: Optional[Transaction]
    prepared: Optional[PreparedAppend]
    error: Optional[MemraKvError] = None

    @property
    def ok(self) -> bool:
        """The step was applied."""
        return self.error is None


@dataclass(frozen=True)
class AdvanceStep:
    """One entry of Client.advance_many: Session.advance's arguments for one session."""

    session: "Session"
    accepted_rows: int = 0
    next_rows: int = 0
    token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class Reservation:
    """Admission bytes held for a session shape until ttl_ms passes (Client.reserve)."""

    id: int
    bytes: int
    ttl_ms: int


@dataclass(frozen=True)
class PrefixCaptured:
    """Client.capture_prefix: the entry holding the prefix and what the capture stored."""

    entry_id: int
    boundary_tokens: int
    already_present: bool
    added_bytes: int
    stored_bytes: int
    shape_fingerprint: bytes


@dataclass(frozen=True)
class PrefixMatch:
    """Client.lookup_prefix: the longest restorable prefix."""

    outcome: str  # "hit", "partial" or "miss"
    entry_id: int
    matched_tokens: int
    block_tokens: int
    medium: str = "device"  # the slowest tier a matched piece is in: "device" or "disk"


@dataclass(frozen=True)
class PrefixRestored:
    """Client.restore_prefix: the entry restored, its tokens and the session's state after."""

    entry_id: int
    restored_tokens: int
    state: SessionState


@dataclass(frozen=True)
class PrefixEvent:
    """One prefix-cache event. `gap`: events were missed that the daemon no longer buffers:
    drop what is known of this daemon and resync with list_prefixes (only sequence and epoch are
    set then). kind: "stored", "evicted", "dropped", "moved" (to another tier) or "gap"."""

    sequence: int
    epoch: int
    kind: str
    gap: bool
    shape_fingerprint: bytes = b""
    block_keys: List[bytes] = field(default_factory=list)
    boundary_key: bytes = b""
    reason: str = ""
    cache_scope: str = ""
    medium: str = "device"  # "moved" events: the tier the bytes are in now
    # What routers index (prefix.proto fields 20-25): the blocks' identities as their engine
    # knows them (an engine pool's own hashes; for memra sessions the block keys), one per
    # block key; "stored" events also the hash before the first block (b"" at a sequence's
    # start), the blocks' token ids when known (block_tokens per block) and the storing engine.
    block_hashes: List[bytes] = field(default_factory=list)
    parent_block_hash: bytes = b""
    token_ids: List[int] = field(default_factory=list)
    block_tokens: int = 0
    engine_id: int = 0
    from_engine_pool: bool = False


_EVENT_KINDS = {prefix_pb2.PrefixEvent.STORED: "stored", prefix_pb2.PrefixEvent.EVICTED: "evicted",
                prefix_pb2.PrefixEvent.DROPPED: "dropped", prefix_pb2.PrefixEvent.GAP: "gap",
                prefix_pb2.PrefixEvent.MOVED: "moved"}
_MEDIA = {prefix_pb2.PREFIX_MEDIUM_DEVICE: "device", prefix_pb2.PREFIX_MEDIUM_PINNED_HOST: "pinned_host",
          prefix_pb2.PREFIX_MEDIUM_DISK: "disk", prefix_pb2.PREFIX_MEDIUM_REMOTE: "remote"}
_OUTCOMES = {prefix_pb2.LOOKUP_OUTCOME_HIT: "hit", prefix_pb2.LOOKUP_OUTCOME_PARTIAL: "partial",
             prefix_pb2.LOOKUP_OUTCOME_MISS: "miss"}


class StepOutcome:
    """One StepBatch entry's result: `error` (a MemraKvError, None when it succeeded) or the
    field of its operation. Fields are read off the reply when asked for, so a decode loop that
    checks only what it needs pays for only that (a prepare's plan has a LayerAppend per K/V
    layer)."""

    __slots__ = ("_result", "_prepared", "_explain")

    def __init__(self, result: Any, explain: Callable[[MemraKvError], MemraKvError]) -> None:
        self._result = result  # memra.kv.v1.StepResult
        self._prepared: Optional[PreparedAppend] = None
        self._explain = explain  # Client._explain

    @property
    def ok(self) -> bool:
        """The entry was applied."""
        return bool(self._result.code == 0)

    @property
    def error(self) -> Optional[MemraKvError]:
        """Why the entry was refused (it changed nothing); None when it was applied."""
        if self._result.code == 0:
            return None
        restart = (self._result.daemon_restart if self._result.HasField("daemon_restart")
                   else None)
        error = MemraKvError(code_from_value(self._result.code), self._result.message, None,
                             restart)
        return error if restart is not None else self._explain(error)

    @property
    def begun(self) -> Optional[Transaction]:
        """begin, advance with next rows: the Transaction."""
        if self._result.HasField("advance") and self._result.advance.HasField("prepared"):
            return Transaction(int(self._result.advance.prepared.generation),
                               int(self._result.advance.committed_len))
        if not self._result.HasField("begin"):
            return None
        return Transaction(int(self._result.begin.generation), int(self._result.begin.base_len))

    @property
    def prepared(self) -> Optional[PreparedAppend]:
        """prepare, advance with next rows: the PreparedAppend."""
        if self._prepared is None:
            if self._result.HasField("prepare"):
                self._prepared = _prepared_from_proto(self._result.prepare)
            elif self._result.HasField("advance") and self._result.advance.HasField("prepared"):
                self._prepared = _prepared_from_proto(self._result.advance.prepared)
        return self._prepared

    @property
    def published(self) -> bool:
        """advance: whether it published the finished transaction's append."""
        return bool(self._result.advance.published)

    @property
    def staged_len(self) -> int:
        """publish: the staged length."""
        return int(self._result.publish.staged_len)

    @property
    def committed_len(self) -> int:
        """commit, abort, advance: the committed length."""
        if self._result.HasField("abort"):
            return int(self._result.abort.committed_len)
        if self._result.HasField("advance"):
            return int(self._result.advance.committed_len)
        return int(self._result.commit.committed_len)

    def advanced(self) -> Advanced:
        """An advance entry's outcome as an Advanced (its error set when refused)."""
        error = self.error
        if error is not None:
            return Advanced(0, False, None, None, error)
        return Advanced(self.committed_len, self.published, self.begun, self.prepared)


class _ChannelStepOutcome(StepOutcome):
    """A StepOutcome over a step channel completion (step_channel.ChannelResult's record and
    side bytes) instead of a StepResult: the same values, read off the record when asked for."""

    __slots__ = ("_record", "_side")

    def __init__(self, record: step_channel.Record, side: bytes,
                 explain: Callable[[MemraKvError], MemraKvError]) -> None:
        # StepOutcome.__init__ is not called: there is no StepResult, every property below
        # reads the record (advanced() comes from StepOutcome over them).
        self._result = None
        self._record = record
        self._side = side
        self._prepared: Optional[PreparedAppend] = None
        self._explain = explain  # Client._explain

    @property
    def ok(self) -> bool:
        """The entry was applied."""
        return self._record[step_channel.C_CODE] == 0

    @property
    def error(self) -> Optional[MemraKvError]:
        """Why the entry was refused (it changed nothing); None when it was applied."""
        record = self._record
        if record[step_channel.C_CODE] == 0:
            return None
        restart = None
        if record[step_channel.C_RESTART_EPOCH] != 0:
            restart = pb.DaemonRestart(previous_epoch=record[step_channel.C_RESTART_PREVIOUS_EPOCH],
                                       epoch=record[step_channel.C_RESTART_EPOCH])
        error = MemraKvError(code_from_value(record[step_channel.C_CODE]),
                             self._side.decode("utf-8", "replace"), None, restart)
        return error if restart is not None else self._explain(error)

    def _has_plan(self) -> bool:
        record = self._record
        op = record[step_channel.C_OP]
        return op == step_channel.OP_PREPARE or (
            op == step_channel.OP_ADVANCE and record[step_channel.C_HAS_PREPARED] != 0)

    @property
    def begun(self) -> Optional[Transaction]:
        """begin, advance with next rows: the Transaction."""
        record = self._record
        op = record[step_channel.C_OP]
        if op == step_channel.OP_ADVANCE and record[step_channel.C_HAS_PREPARED]:
            return Transaction(record[step_channel.C_GENERATION],
                               record[step_channel.C_COMMITTED_LEN])
        if op != step_channel.OP_BEGIN:
            return None
        return Transaction(record[step_channel.C_GENERATION], record[step_channel.C_BASE_LEN])

    @property
    def prepared(self) -> Optional[PreparedAppend]:
        """prepare, advance with next rows: the PreparedAppend (its plan parsed when asked)."""
        if self._prepared is None and self._has_plan():
            record = self._record
            self._prepared = PreparedAppend(
                record[step_channel.C_GENERATION], record[step_channel.C_TARGET],
                [LayerAppend(layer, write_row, bool(flags & step_channel.LAYER_RING),
                             bool(flags & step_channel.LAYER_REBASE), src_row, keep_rows,
                             new_base)
                 for layer, flags, write_row, src_row, keep_rows, new_base
                 in step_channel.plan_layers(self._side)])
        return self._prepared

    @property
    def published(self) -> bool:
        """advance: whether it published the finished transaction's append."""
        return (self._record[step_channel.C_OP] == step_channel.OP_ADVANCE
                and self._record[step_channel.C_PUBLISHED] != 0)

    @property
    def staged_len(self) -> int:
        """publish: the staged length."""
        if self._record[step_channel.C_OP] != step_channel.OP_PUBLISH:
            return 0
        return self._record[step_channel.C_STAGED_LEN]

    @property
    def committed_len(self) -> int:
        """commit, abort, advance: the committed length."""
        if self._record[step_channel.C_OP] not in _COMMITTING_OPS:
            return 0
        return self._record[step_channel.C_COMMITTED_LEN]


_COMMITTING_OPS = (step_channel.OP_COMMIT, step_channel.OP_ABORT, step_channel.OP_ADVANCE)


# ---- the client ----

class Client:
    """Thread-safe. Use as a context manager, or close() it (detaches, closes the channel)."""

    def __init__(self, channel: Any, default_timeout: float, mapper: Any,
                 handoff_path: str, force_grpc_step: bool = False) -> None:
        """Use Client.connect (memra_kv.connect)."""
        self._channel = channel
        self.force_grpc_step = force_grpc_step
        self.handoff_path = handoff_path
        self.default_timeout = default_timeout
        self.cache = cache_pb2_grpc.KvCacheStub(channel)
        self.admin_stub = admin_pb2_grpc.KvAdminStub(channel)
        self.prefix = prefix_pb2_grpc.KvPrefixCacheStub(channel)
        self._mapper = mapper
        self._lock = threading.Lock()
        self._lease: Optional[_Lease] = None  # while attached
        # (engine_name, cache_scope) the first attach asked for.
        self._attached_as: Optional[Tuple[str, str]] = None
        self.backend: Optional[str] = None  # "host" or "cuda", from attach

    @classmethod
    def connect(cls, socket_path: str, timeout: float = 10.0, mapper: Any = None,
                handoff_path: Optional[str] = None, force_grpc_step: bool = False) -> "Client":
        """Connects to the daemon's Unix socket, waiting up to `timeout` seconds for it
        (KvError UNAVAILABLE). `mapper`: None picks HostArenaMapper or CudaArenaMapper by the
        backend the daemon announces at attach. `handoff_path`: the daemon's handoff socket
        (attach gets its ticket there; host arenas' descriptors come over it); None: beside
        `socket_path` (".sock" -> ".handoff.sock"), as the daemon puts it by default.
        `force_grpc_step`: never open the step channel (docs/step-channel.md); every step goes
        over the Step RPC."""
        channel = grpc.insecure_channel("unix:" + socket_path, options=_CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise KvError(ErrorCode.UNAVAILABLE, "memra-kvd is not answering on unix:%s "
                          "within %gs" % (socket_path, timeout)) from None
        return cls(channel, timeout, mapper,
                   handoff_path or default_handoff_path(socket_path), force_grpc_step)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Detaches (when attached) and closes the channel."""
        self.detach()
        self._channel.close()

    def _timeout(self, timeout: Optional[float]) -> float:
        return self.default_timeout if timeout is None else timeout

    @property
    def mapper(self) -> Any:
        """The arena mapper (HostArenaMapper or CudaArenaMapper)."""
        if self._mapper is None:
            self._mapper = CudaArenaMapper() if self.backend == "cuda" else HostArenaMapper()
        return self._mapper

    # -- lease --

    def attach(self, engine_name: str, timeout: Optional[float] = None,
               cache_scope: str = "") -> int:
        """Connects to the handoff socket, opens the lease with its ticket and keeps the lease
        alive on a daemon thread (a heartbeat every third of the lease timeout). KvError
        FAILED_PRECONDITION when already attached, UNAVAILABLE when the handoff socket does not
        answer. `cache_scope`: the prefix-cache scope to attach in ("": this user's own,
        "uid:<uid>"; a named one must be allowed by the daemon's cache_scope_allow).

        When the lease stream breaks (the daemon restarted, or the connection dropped), that
        thread notices at once and re-attaches as the same engine every 100 ms until the daemon
        answers, each time over a new handoff connection (a fresh ticket) and in the same cache
        scope: one that re-adopted the engine from its restart journal gives the lease back
        and the sessions carry on with their mappings (reattaches counts it); one that does not
        answers with the restart error, which lease_lost then holds, and re-attaching stops."""
        with self._lock:
            if self._lease is not None:
                raise KvError(ErrorCode.FAILED_PRECONDITION,
                              "already attached as engine %d" % self._lease.engine_id)
            return self._attach_locked(engine_name, timeout, cache_scope)

    def _attach_locked(self, engine_name: str, timeout: Optional[float],
                       cache_scope: str) -> int:
        handoff = HandoffChannel(self.handoff_path, self._timeout(timeout))
        try:
            lease = _Lease(self.cache, engine_name, self._timeout(timeout), handoff, cache_scope,
                           self.force_grpc_step)
        except BaseException:
            handoff.close()
            raise
        self._lease = lease
        self._attached_as = (engine_name, cache_scope)
        self.backend = lease.backend
        return lease.engine_id

    def attach_anew(self, timeout: Optional[float] = None) -> int:
        """Once the lease is lost for good (lease_lost: the daemon restarted without this
        engine, or reclaimed it), attaches again as a new engine with the name and cache scope
        attach was given; what the old engine held (sessions, block store registrations, pins)
        is gone with it. Returns the engine id: the new one, or the current one when the lease
        is not lost (another caller attached anew first). KvError FAILED_PRECONDITION before
        attach; attach's errors (the lost lease stays lost)."""
        with self._lock:
            lease = self._lease
            if lease is None:
                raise KvError(ErrorCode.FAILED_PRECONDITION,
                              "attach_anew before attach: there is no engine to replace")
            if lease.lost is None:
                return lease.engine_id
            assert self._attached_as is not None  # set with the lease
            engine_name, cache_scope = self._attached_as
            lease.stop()  # its thread has ended (re-attaching stopped): closes the handoff
            self._lease = None
            try:
                return self._attach_locked(engine_name, timeout, cache_scope)
            except BaseException:
                self._lease = lease  # still lost: a later call may try again
                raise

    def detach(self) -> None:
        """Ends the lease: the daemon frees this engine's sessions after its grace period."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.stop()

    def await_lease_settled(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds until the lease is alive or lost for good (lease_lost),
        as the lease thread finds out after the lease stream broke; True once it is. A call the
        daemon refused because it does not know this engine (it restarted, or reclaimed it) can
        come before the lease thread's verdict: this waits for it."""
        deadline = time.monotonic() + timeout
        while True:
            lease = self._lease
            if lease is None or lease.alive or lease.lost is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    @property
    def lease_alive(self) -> bool:
        """Whether the lease stream is open now."""
        lease = self._lease
        return lease is not None and lease.alive

    @property
    def lease_lost(self) -> Optional[MemraKvError]:
        """Why re-attaching stopped (a KvError: the daemon no longer knows this engine:
        is_daemon_restarted, or NOT_FOUND when it reclaimed it); None while the lease is live or
        being re-attached."""
        lease = self._lease
        return lease.lost if lease else None

    @property
    def reattaches(self) -> int:
        """Re-attaches done after the lease stream broke (each kept the engine and its sessions)."""
        lease = self._lease
        return lease.reattaches if lease else 0

    @property
    def epoch(self) -> int:
        """The epoch of the daemon the lease is held with (Attached.epoch); 0 before attach."""
        lease = self._lease
        return lease.epoch if lease else 0

    @property
    def cache_scope(self) -> str:
        """The prefix-cache scope this engine attached in ("" before attach)."""
        lease = self._lease
        return lease.cache_scope if lease else ""

    @property
    def engine_id(self) -> int:
        """This engine's id; 0 before attach."""
        lease = self._lease
        return lease.engine_id if lease else 0

    @property
    def lease_timeout_ms(self) -> int:
        """The lease timeout the daemon granted; 0 before attach."""
        lease = self._lease
        return lease.lease_timeout_ms if lease else 0

    @property
    def step_channel_active(self) -> bool:
        """Whether steps by slot go over the engine's step channel (docs/step-channel.md)."""
        lease = self._lease
        return (lease is not None and lease.step_channel is not None
                and not lease.step_channel.broken)

    @property
    def step_channel_status(self) -> Optional[MemraKvError]:
        """Why there is no step channel, or None while one is open: no attach yet,
        force_grpc_step, a daemon that offers none, another platform, or the failure that
        broke it (steps go over gRPC from then on)."""
        lease = self._lease
        if lease is None:
            return KvError(ErrorCode.FAILED_PRECONDITION, "not attached")
        channel = lease.step_channel
        if channel is not None and channel.broken and lease.step_channel_status is None:
            return KvError(ErrorCode.UNAVAILABLE, "the step channel broke")
        return lease.step_channel_status

    def _explain(self, error: MemraKvError) -> MemraKvError:
        """A session call's NOT_FOUND or PERMISSION_DENIED as the restart error when the daemon
        answering is not the one this engine attached to (client/client.cc KvClient::Explain):
        it restarted without keeping this engine's sessions."""
        lease = self._lease
        if (error.is_daemon_restarted or lease is None or lease.epoch == 0 or error.code not in (
                ErrorCode.NOT_FOUND, ErrorCode.PERMISSION_DENIED)):
            return error
        try:
            now = self.status().epoch
        except KvError:
            return error
        if now == lease.epoch:
            return error
        return KvError(ErrorCode.FAILED_PRECONDITION,
                       "memra-kvd restarted (epoch %d -> %d); this engine attached to epoch %d "
                       "and the daemon answering does not have it: %s"
                       % (lease.epoch, now, lease.epoch, error.message), None,
                       pb.DaemonRestart(previous_epoch=lease.epoch, epoch=now))

    def _session_call(self, method: Any, request: Any, timeout: float) -> Any:
        try:
            return _call(method, request, timeout)
        except KvError as error:
            raise self._explain(error) from None

    def _fetch_arena_fd(self, session_id: int, token: bytes,
                        handle: bytes) -> Tuple[int, int]:
        """(descriptor, bytes) of a host arena of this engine's session, over the handoff
        connection attach opened."""
        lease = self._lease
        if lease is None:
            raise KvError(ErrorCode.FAILED_PRECONDITION, "mapping a host arena before "
                          "attach: its descriptor comes over the engine's handoff connection")
        fetched: Tuple[int, int] = lease.handoff.fetch_arena(session_id, token, handle)
        return fetched

    def _offer_buffer(self, fd: int, nbytes: int) -> Tuple[int, HandoffChannel]:
        """(buffer id, connection): the block store's buffer id for descriptor `fd` of this
        engine's pool memory and the handoff connection it was offered over (the lease's now;
        the id is valid while that connection stays open)."""
        lease = self._lease
        if lease is None:
            raise KvError(ErrorCode.FAILED_PRECONDITION, "offering a pool buffer before "
                          "attach: it goes over the engine's handoff connection")
        handoff = lease.handoff
        buffer_id: int = handoff.offer_buffer(fd, nbytes)
        return buffer_id, handoff

    def _handoff_connection(self) -> Optional[HandoffChannel]:
        """The lease's handoff connection now (each re-attach opens a new one); None before
        attach."""
        lease = self._lease
        return lease.handoff if lease is not None else None

    def _engine(self, what: str) -> Any:
        lease = self._lease
        if lease is None:
            raise KvError(ErrorCode.FAILED_PRECONDITION,
                          "%s before attach: sessions need a lease" % what)
        return pb.EngineRef(engine_id=lease.engine_id, engine_token=lease.engine_token)

    # -- plans --

    def register_plan(self, plan: Any, timeout: Optional[float] = None) -> bytes:
        """Validates a memra.kv.v1.ModelPlan; returns its 32-byte fingerprint. Needs attach():
        the plan counts against this engine's max_engine_plans (docs/security-model.md#limits)."""
        request = pb.RegisterPlanRequest(plan=plan, engine=self._engine("register_plan"))
        return bytes(_call(self.cache.RegisterPlan, request, self._timeout(timeout)).fingerprint)

    def import_model(self, hf_config_json: Union[str, bytes], name: str = "",
                     index_pool: int = 0, register: bool = True, swa_ring: bool = False,
                     index_ring_rows: Optional[int] = None, kv_dtype: str = "",
                     timeout: Optional[float] = None) -> ImportedModel:
        """The plan of a Hugging Face config.json (its text, or a path to it) as the daemon
        imports it; registered (with register_plan, as this engine) unless register=False.
        kv_dtype: "" / "auto" (the config's torch_dtype, or fp8_e4m3 for an fp8 KV cache),
        "bf16", "fp16", "f32", "fp8_e4m3", "fp8_e5m2", a K/V pair ("q8_0/q5_1") or "reference"
        (docs/rules.md#formats). Returns an ImportedModel (plan, plan_fingerprint,
        architecture, registered, kv_dtype: what chose the formats, kv_formats).
        The daemon's own registering import is an operator's call (its admin socket); an
        engine converts, then registers the plan like any other."""
        request = admin_pb2.ImportModelRequest(hf_config_json=_json_text(hf_config_json),
                                               name=name, index_pool=index_pool,
                                               register=False, swa_ring=swa_ring,
                                               kv_dtype=kv_dtype)
        if index_ring_rows is not None:
            request.index_ring_rows = index_ring_rows
        reply = _call(self.admin_stub.ImportModel, request, self._timeout(timeout))
        if register:
            fingerprint = self.register_plan(reply.plan, timeout=timeout)
            reply.registered = fingerprint == reply.plan_fingerprint
        return from_message(ImportedModel, reply)

    # -- admission and sessions --

    def reserve(self, plan: bytes, capacity: int, layer_lo: int = 0,
                layer_hi: Optional[int] = None, tp_ranks: int = 1, spec_snapshot: bool = False,
                timeout: Optional[float] = None) -> Reservation:
        """Holds the exact bytes of a session shape (plan: a registered plan's fingerprint) for
        the daemon's reservation TTL. AdmissionRefused (needed, free, ... bytes) when there is
        no room."""
        request = pb.ReserveRequest(engine=self._engine("reserve"))
        _set_shape(request, plan, capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot)
        response = _call(self.cache.Reserve, request, self._timeout(timeout))
        return Reservation(int(response.reservation_id), int(response.bytes),
                           int(response.ttl_ms))

    def cancel_reservation(self, reservation_id: int, timeout: Optional[float] = None) -> int:
        """Returns the reservation's bytes to the budget (the bytes freed)."""
        request = pb.CancelReservationRequest(engine=self._engine("cancel_reservation"),
                                              reservation_id=reservation_id)
        return int(_call(self.cache.CancelReservation, request,
                         self._timeout(timeout)).freed_bytes)

    def create_session(self, plan: bytes, capacity: int, layer_lo: int = 0,
                       layer_hi: Optional[int] = None, tp_ranks: int = 1,
                       spec_snapshot: bool = False,
                       reservation: Union[Reservation, int, None] = None,
                       timeout: Optional[float] = None) -> "Session":
        """A session of `capacity` tokens of the registered plan whose fingerprint is `plan`,
        its arenas mapped here. `reservation`: a Reservation (or its id) for this shape: never
        refused for room; otherwise AdmissionRefused when the budget has no room.
        spec_snapshot: also allocate the spec snapshot planes (needed by
        Session.spec_snapshot on plans with recurrent layers). Use it as a context manager to
        release it: `with client.create_session(fp, 4096) as session: ...`."""
        request = pb.CreateSessionRequest(engine=self._engine("create_session"))
        _set_shape(request, plan, capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot)
        if reservation is not None:
            request.reservation_id = (reservation.id if isinstance(reservation, Reservation)
                                      else reservation)
        response = _call(self.cache.CreateSession, request, self._timeout(timeout))
        self._unmap_freed_pool_arenas(response.unmap_handles)
        session = Session(self, int(response.session.session_id),
                          bytes(response.session.session_token), int(response.slot))
        try:
            session._adopt(response.layout)
        except Exception:
            try:  # never leave the daemon holding a session nobody can use
                session.release()
            except KvError:
                pass
            raise
        return session

    def _unmap_freed_pool_arenas(self, handles: Iterable[bytes]) -> None:
        """Drops the mappings of pooled arenas the daemon has freed (proto unmap_handles)."""
        for handle in handles:
            self.mapper.unmap(handle)  # nothing when this process already dropped it

    def step(self, batch: "StepBatch", timeout: Optional[float] = None) -> List[StepOutcome]:
        """Runs a StepBatch as one Step; one StepOutcome per entry, in order. The step's own
        failure raises; entries fail independently (StepOutcome.error). A batch by slot
        carries this client's engine credentials, and goes over the engine's step channel when
        it has one (no wait event, sessions of at most 128 K/V layers, at most 256 token ids
        per entry; docs/step-channel.md); anything else is one Step RPC. The same outcomes
        either way. A channel failure raises Unavailable (or Internal): records in flight may
        or may not have run; later steps go over gRPC. ValueError, nothing sent, for a number
        an entry cannot carry."""
        if batch.by_slot:
            lease = self._lease
            channel = lease.step_channel if lease is not None else None
            if channel is not None and batch._channel_eligible():
                outcomes = channel.send(batch._entries, self._timeout(timeout),
                                        functools.partial(_ChannelStepOutcome,
                                                          explain=self._explain))
                if outcomes is not None:
                    return list(outcomes)  # of _ChannelStepOutcome
        request = batch.request
        if batch.by_slot:
            request.engine.CopyFrom(self._engine("step by slot"))
        response = _call(self.cache.Step, request, self._timeout(timeout))
        if len(response.results) != len(request.entries):
            raise KvError(ErrorCode.INTERNAL, "Step answered %d results for %d entries"
                          % (len(response.results), len(request.entries)))
        return [StepOutcome(result, self._explain) for result in response.results]

    def advance_many(self, steps: Sequence[AdvanceStep],
                     timeout: Optional[float] = None) -> List[Advanced]:
        """One decode step of many sessions of this engine in one call: Session.advance for each
        AdvanceStep, in order, each with the generation its session has open. One Advanced per
        step; a refused step has `error` set and leaves its session unchanged while the others
        go on (refusals of the call itself raise). Raises InvalidArgument, sending nothing,
        when a session appears twice or was released."""
        seen: Set[int] = set()
        for step in steps:
            if step.session.released or step.session.id in seen:
                raise KvError(ErrorCode.INVALID_ARGUMENT, "advance_many: session %d is %s"
                              % (step.session.id, "released" if step.session.released
                                 else "named twice"))
            seen.add(step.session.id)
        outcomes = self._send_step(steps, timeout)
        for step, outcome in zip(steps, outcomes):
            step.session._track(outcome)
        return outcomes

    def _send_step(self, steps: Sequence[AdvanceStep],
                   timeout: Optional[float]) -> List[Advanced]:
        """The transport of Session.advance and advance_many: one Step RPC of advance entries
        by slot (the shared-memory step channel may replace this one call). One Advanced per
        step, in order. A Step carries one ordering event (cuda): the last of the sessions'
        wait events, as an engine records one event after the kernels of a step."""
        batch = StepBatch(by_slot=True)
        for step in steps:
            if step.session.wait_event:
                batch.set_wait_event(step.session.wait_event)
            batch.advance(step.session, step.session.open_generation, step.accepted_rows,
                          step.next_rows, step.token_ids)
        return [outcome.advanced() for outcome in self.step(batch, timeout)]

    # -- prefix cache --

    def capture_prefix(self, session: "Session", token_ids: Sequence[int],
                       boundary_tokens: int, timeout: Optional[float] = None) -> PrefixCaptured:
        """Copies the session's committed state at boundary_tokens into the cache; token_ids
        are its committed token ids from position 0."""
        request = prefix_pb2.CapturePrefixRequest(session=session.ref, token_ids=token_ids,
                                                  boundary_tokens=boundary_tokens)
        if session.wait_event:
            request.ordering.wait_event = session.wait_event
        r = _call(self.prefix.Capture, request, self._timeout(timeout))
        return PrefixCaptured(int(r.entry_id), int(r.boundary_tokens), bool(r.already_present),
                              int(r.added_bytes), int(r.stored_bytes), bytes(r.shape_fingerprint))

    def lookup_prefix(self, plan: bytes, token_ids: Sequence[int], layer_lo: int = 0,
                      layer_hi: Optional[int] = None, tp_ranks: int = 1,
                      timeout: Optional[float] = None) -> PrefixMatch:
        """The longest restorable prefix of token_ids for sessions of this shape (plan: the
        registered plan's fingerprint)."""
        shape = prefix_pb2.PrefixShape(plan_fingerprint=plan, layer_lo=layer_lo,
                                       tp_ranks=tp_ranks)
        if layer_hi is not None:
            shape.layer_hi = layer_hi
        r = _call(self.prefix.Lookup, prefix_pb2.LookupPrefixRequest(
            shape=shape, token_ids=token_ids, engine=self._engine("lookup_prefix")),
            self._timeout(timeout))
        return PrefixMatch(_OUTCOMES.get(r.outcome, "miss"), int(r.entry_id),
                           int(r.matched_tokens), int(r.block_tokens),
                           _MEDIA.get(r.medium, "device"))

    def restore_prefix(self, session: "Session", token_ids: Sequence[int], entry_id: int = 0,
                       timeout: Optional[float] = None) -> PrefixRestored:
        """Restores entry_id (0: the longest match) into the FRESH session."""
        request = prefix_pb2.RestorePrefixRequest(session=session.ref, entry_id=entry_id,
                                                  token_ids=token_ids)
        if session.wait_event:
            request.ordering.wait_event = session.wait_event
        r = _call(self.prefix.Restore, request, self._timeout(timeout))
        return PrefixRestored(int(r.entry_id), int(r.restored_tokens),
                              from_message(SessionState, r.state))

    def events(self, epoch: int = 0, last_sequence: int = 0) -> "PrefixEvents":
        """The prefix cache's events after (epoch, last_sequence), then live ones: an iterator
        (PrefixEvents) that resumes from the last sequence it yielded when iterated again. On the
        engine socket an attached engine's, of its cache scope only (sequences skip over other
        scopes' events); on the admin socket every scope's."""
        lease = self._lease
        engine = (pb.EngineRef(engine_id=lease.engine_id, engine_token=lease.engine_token)
                  if lease is not None else None)
        return PrefixEvents(self.prefix, epoch, last_sequence, engine)

    def list_prefixes(self, timeout: Optional[float] = None) -> PrefixListing:
        """Every prefix-cache entry and the totals (admin socket)."""
        return from_message(PrefixListing, _call(
            self.prefix.ListPrefixes, prefix_pb2.ListPrefixesRequest(), self._timeout(timeout)))

    def inspect_prefix(self, entry_id: int, timeout: Optional[float] = None) -> PrefixEntry:
        """One entry with its block keys (admin socket)."""
        return from_message(PrefixEntry, _call(self.prefix.InspectPrefix,
                                               prefix_pb2.InspectPrefixRequest(entry_id=entry_id),
                                               self._timeout(timeout)))

    def evict_prefix(self, entry_id: int, timeout: Optional[float] = None) -> PrefixEvicted:
        """Evicts one entry (admin socket): the bytes freed and the totals after."""
        return from_message(PrefixEvicted, _call(self.prefix.EvictPrefix,
                                                 prefix_pb2.EvictPrefixRequest(entry_id=entry_id),
                                                 self._timeout(timeout)))

    def evict_all_prefixes(self, timeout: Optional[float] = None) -> PrefixesEvicted:
        """Evicts every entry (admin socket), one EvictPrefix each: an entry the daemon refuses
        to evict (pinned by an engine's lookup or restore) is listed in `refused` with its
        error, and the rest still go."""
        evicted = 0
        freed = 0
        refused: List[Tuple[int, MemraKvError]] = []
        for entry in self.list_prefixes(timeout).entries:
            try:
                freed += self.evict_prefix(entry.entry_id, timeout).freed_bytes
                evicted += 1
            except MemraKvError as error:
                refused.append((entry.entry_id, error))
        return PrefixesEvicted(evicted_entries=evicted, freed_bytes=freed, refused=tuple(refused))

    # -- admin (memra-kvctl's calls). status, cost, fit and max_context are served on the
    # engine socket too (status without the per-engine list); sessions, engines, drain, undrain
    # and the prefix listing/inspection/eviction only on the daemon's admin socket (connect to
    # its admin_socket_path; PermissionDenied elsewhere). --

    def status(self, timeout: Optional[float] = None) -> Status:
        """Backend, device and accounting now (docs/architecture.md)."""
        return from_message(Status, _call(self.admin_stub.GetStatus,
                                          admin_pb2.GetStatusRequest(), self._timeout(timeout)))

    def sessions(self, engine_id: int = 0,
                 timeout: Optional[float] = None) -> List[SessionSummary]:
        """Live sessions (of engine_id; 0: every engine's). Admin socket."""
        reply = _call(self.admin_stub.ListSessions, admin_pb2.ListSessionsRequest(
            engine_id=engine_id), self._timeout(timeout))
        return [from_message(SessionSummary, entry) for entry in reply.sessions]

    def engines(self, timeout: Optional[float] = None) -> List[EngineStatus]:
        """Attached engines with their leases. Admin socket."""
        reply = _call(self.admin_stub.ListEngines, admin_pb2.ListEnginesRequest(),
                      self._timeout(timeout))
        return [from_message(EngineStatus, entry) for entry in reply.engines]

    def cost(self, capacity: int, fingerprint: Optional[bytes] = None, plan: Any = None,
             hf_config: Union[str, bytes, None] = None, layer_lo: int = 0,
             layer_hi: Optional[int] = None, tp_ranks: int = 1, spec_snapshot: bool = False,
             timeout: Optional[float] = None) -> Cost:
        """What a session of this shape costs. The model: one of fingerprint (registered),
        plan (a ModelPlan) or hf_config (config.json text or path)."""
        return from_message(Cost, _call(self.admin_stub.GetCost, admin_pb2.CostRequest(
            model=_selector(fingerprint, plan, hf_config),
            shape=_admin_shape(capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot)),
            self._timeout(timeout)))

    def fit(self, capacity: int, fingerprint: Optional[bytes] = None, plan: Any = None,
            hf_config: Union[str, bytes, None] = None, layer_lo: int = 0,
            layer_hi: Optional[int] = None, tp_ranks: int = 1, spec_snapshot: bool = False,
            timeout: Optional[float] = None) -> Fit:
        """How many sessions of this shape fit (now, after eviction, when empty). The model as
        for cost."""
        return from_message(Fit, _call(self.admin_stub.GetFit, admin_pb2.FitRequest(
            model=_selector(fingerprint, plan, hf_config),
            shape=_admin_shape(capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot)),
            self._timeout(timeout)))

    def max_context(self, fingerprint: Optional[bytes] = None, plan: Any = None,
                    hf_config: Union[str, bytes, None] = None, layer_lo: int = 0,
                    layer_hi: Optional[int] = None, tp_ranks: int = 1,
                    spec_snapshot: bool = False,
                    timeout: Optional[float] = None) -> MaxContext:
        """The largest capacity one session of this shape could be created with. The model as
        for cost."""
        return from_message(MaxContext, _call(self.admin_stub.GetMaxContext,
                                              admin_pb2.MaxContextRequest(
            model=_selector(fingerprint, plan, hf_config),
            shape=_admin_shape(0, layer_lo, layer_hi, tp_ranks, spec_snapshot)),
            self._timeout(timeout)))

    def drain(self, timeout: Optional[float] = None) -> int:
        """Stops admitting new work (Unavailable); returns the sessions still open."""
        return int(_call(self.admin_stub.Drain, admin_pb2.DrainRequest(),
                         self._timeout(timeout)).sessions_open)

    def undrain(self, timeout: Optional[float] = None) -> None:
        """Admits new work again."""
        _call(self.admin_stub.Undrain, admin_pb2.UndrainRequest(), self._timeout(timeout))


def _json_text(config: Union[str, bytes]) -> str:
    """config.json text, or the path of one."""
    text = config.decode() if isinstance(config, bytes) else config
    if not text.lstrip().startswith("{") and os.path.isfile(text):
        with open(text) as f:
            return f.read()
    return text


def _set_shape(request: Any, plan: bytes, capacity: int, layer_lo: int,
               layer_hi: Optional[int], tp_ranks: int, spec_snapshot: bool) -> None:
    request.plan_fingerprint = plan
    request.capacity = capacity
    request.layer_lo = layer_lo
    if layer_hi is not None:
        request.layer_hi = layer_hi
    request.tp_ranks = tp_ranks
    request.spec_snapshot = spec_snapshot


def _admin_shape(capacity: int, layer_lo: int, layer_hi: Optional[int], tp_ranks: int,
                 spec_snapshot: bool) -> Any:
    shape = admin_pb2.SessionShape(capacity=capacity, layer_lo=layer_lo, tp_ranks=tp_ranks,
                                   spec_snapshot=spec_snapshot)
    if layer_hi is not None:
        shape.layer_hi = layer_hi
    return shape


def _selector(fingerprint: Optional[bytes], plan: Any,
              hf_config: Union[str, bytes, None]) -> Any:
    given = [x is not None for x in (fingerprint, plan, hf_config)]
    if sum(given) != 1:
        raise ValueError("name the model by exactly one of fingerprint, plan, hf_config")
    if fingerprint is not None:
        return admin_pb2.ModelSelector(plan_fingerprint=fingerprint)
    if plan is not None:
        return admin_pb2.ModelSelector(plan=plan)
    assert hf_config is not None
    return admin_pb2.ModelSelector(hf_config_json=_json_text(hf_config))


class _LeaseStream:
    """One Attach stream. gRPC's request thread sends `hello`, then a heartbeat every `period`
    once the daemon answered (attached()); the lease thread reads the answers, so a stream that
    breaks (the daemon died, or ended the lease) is noticed when it breaks, not at the next
    heartbeat."""

    def __init__(self, stub: Any, hello: Any, wait_for_ready: bool) -> None:
        self._hello = hello
        self._period: Optional[float] = None  # seconds between heartbeats, set by attached()
        self._go = threading.Event()  # attached() or close()
        self._closed = threading.Event()
        # No deadline on the stream: it lives as long as the engine (heartbeats are its clock).
        self.call = stub.Attach(self._requests(), wait_for_ready=wait_for_ready)

    def _requests(self) -> Iterator[Any]:
        yield self._hello
        self._go.wait()
        sequence = 0
        while not self._closed.wait(self._period):
            sequence += 1
            yield pb.AttachRequest(heartbeat=pb.Heartbeat(sequence=sequence))
        # Returning ends the request stream: the daemon sees the lease end.

    def first_answer(self) -> Any:
        """The daemon's Attached; KvError when the stream ended instead (the daemon's reason:
        CANCELLED when close() or a timer cancelled the wait)."""
        try:
            first = next(self.call)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        except StopIteration:
            raise KvError(ErrorCode.INTERNAL, "Attach ended without an answer") from None
        if not first.HasField("attached"):
            self.close()
            raise KvError(ErrorCode.INTERNAL, "Attach answered without Attached")
        return first.attached

    def attached(self, lease_timeout_ms: int) -> None:
        self._period = max(lease_timeout_ms / 3.0, 1.0) / 1000.0
        self._go.set()

    def await_end(self) -> None:
        """Reads heartbeat acks until the stream ends (it broke, or close())."""
        try:
            for _ in self.call:
                pass
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._closed.set()
        self._go.set()
        self.call.cancel()  # unblocks a read waiting for an answer


class _Lease:
    """The engine's lease, held by a daemon thread (client/client.cc KvClient::KeepLease and
    Reattach): when the Attach stream breaks, it re-attaches as the same engine (Hello.resume,
    with the epoch it attached to) every 100 ms until the daemon answers. A daemon that knows
    the engine (it re-adopted it from its restart journal) gives the lease back: the sessions
    and their mappings carry on. One that does not answers with the restart error (or NOT_FOUND
    when it reclaimed the engine, PERMISSION_DENIED for a wrong token): `lost` holds it and
    re-attaching stops.

    It also holds the engine's step channel (step_channel.StepChannel), opened over the handoff
    connection of each attach the daemon offers one to, abandoned when the stream breaks."""

    def __init__(self, stub: Any, engine_name: str, timeout: float, handoff: HandoffChannel,
                 cache_scope: str, force_grpc_step: bool = False) -> None:
        self._stub = stub
        self._force_grpc_step = force_grpc_step
        self.step_channel: Optional[step_channel.StepChannel] = None  # while one is open
        self.step_channel_status: Optional[MemraKvError] = None  # why there is none
        self._timeout = timeout
        self.handoff = handoff  # replaced by each re-attach; closed by stop()
        self._lock = threading.Lock()
        self._stopping = False
        self._reattaching: Optional[_LeaseStream] = None  # a re-attach in progress
        stream = _LeaseStream(stub, pb.AttachRequest(hello=pb.Hello(
            engine_name=engine_name, pid=os.getpid(), handoff_ticket=handoff.ticket,
            cache_scope=cache_scope)), False)
        # The first answer within `timeout`, or the call is cancelled.
        timer = threading.Timer(timeout, stream.call.cancel)
        timer.start()
        try:
            attached = stream.first_answer()
        except KvError as error:
            stream.close()
            if error.code == ErrorCode.CANCELLED:
                raise KvError(ErrorCode.DEADLINE_EXCEEDED,
                              "Attach: no answer within %gs" % timeout) from None
            raise
        finally:
            timer.cancel()
        self.engine_id = int(attached.engine.engine_id)
        self.engine_token = bytes(attached.engine.engine_token)
        self.backend = str(attached.backend)
        self.cache_scope = str(attached.cache_scope)
        self.lost: Optional[MemraKvError] = None  # why re-attaching stopped
        self.reattaches = 0
        self._take(stream, attached)
        self._open_step_channel(handoff, attached)
        self._thread = threading.Thread(target=self._keep, name="memra-kv-lease", daemon=True)
        self._thread.start()

    def _take(self, stream: _LeaseStream, attached: Any) -> None:
        self._stream = stream
        self.epoch = int(attached.epoch)
        self.lease_timeout_ms = int(attached.lease_timeout_ms)
        self.lease_grace_ms = int(attached.lease_grace_ms)
        stream.attached(attached.lease_timeout_ms)
        self.alive = True

    def _open_step_channel(self, handoff: HandoffChannel, attached: Any) -> None:
        """Opens a step channel over `handoff` when the daemon offers one (client/client.cc
        OpenStepChannel); otherwise, or when that fails, step_channel_status says why and steps
        go over gRPC."""
        channel: Optional[step_channel.StepChannel] = None
        status: Optional[MemraKvError] = None
        unsupported = step_channel.supported()
        if self._force_grpc_step:
            status = KvError(ErrorCode.FAILED_PRECONDITION, "force_grpc_step is set")
        elif not attached.step_channel:
            status = KvError(ErrorCode.FAILED_PRECONDITION, "the daemon offers no step channel "
                             "(Attached.step_channel)")
        elif unsupported is not None:
            status = KvError(ErrorCode.FAILED_PRECONDITION, unsupported)
        else:
            try:
                region_fd, nbytes, wake_fd = handoff.open_step_channel()
                channel = step_channel.StepChannel(region_fd, nbytes, wake_fd)
            except MemraKvError as error:
                status = error
        old, self.step_channel, self.step_channel_status = self.step_channel, channel, status
        if old is not None:
            old.close()

    def _abandon_step_channel(self) -> None:
        """Its daemon end is gone with the lease stream: a step waiting on it fails now."""
        channel = self.step_channel
        if channel is not None:
            channel.abandon()
            self.step_channel_status = KvError(ErrorCode.UNAVAILABLE, "the lease stream broke: "
                                               "the step channel was abandoned")

    def _keep(self) -> None:
        while True:
            self._stream.await_end()
            self.alive = False
            self._abandon_step_channel()
            if not self._reattach():
                return

    def _reattach(self) -> bool:
        """True once the lease is back; False after stop() or when the daemon refuses for good."""
        self._stream.close()
        while True:
            # Every Attach presents a fresh handoff ticket (the old connection broke with the
            # daemon); the daemon binds this connection's peer credentials again and checks
            # them against the engine's. No answer there yet: the daemon is not back.
            try:
                handoff = HandoffChannel(self.handoff.path, self._timeout)
            except KvError:
                handoff = None
            if handoff is not None:
                hello = pb.AttachRequest(hello=pb.Hello(
                    resume=pb.EngineRef(engine_id=self.engine_id, engine_token=self.engine_token),
                    resume_epoch=self.epoch, pid=os.getpid(), handoff_ticket=handoff.ticket,
                    cache_scope=self.cache_scope))
            with self._lock:
                if self._stopping:
                    if handoff is not None:
                        handoff.close()
                    return False
                # Waits for the daemon to listen again (wait_for_ready) instead of failing fast
                # while the channel reconnects; stop() cancels the wait.
                stream = _LeaseStream(self._stub, hello, True) if handoff is not None else None
                self._reattaching = stream
            attached = None
            if stream is not None:
                assert handoff is not None  # a stream is opened with a handoff only
                try:
                    attached = stream.first_answer()
                except KvError as error:
                    stream.close()
                    handoff.close()
                    if (error.is_daemon_restarted or error.code in (
                            ErrorCode.NOT_FOUND, ErrorCode.PERMISSION_DENIED)):
                        self.lost = error  # the daemon will never know this engine again
                        return False
                    # UNAVAILABLE (no daemon yet, or a ticket of a daemon that died before
                    # this Attach reached the next one), a stream still held, or stop(): again,
                    # with a fresh ticket.
            with self._lock:
                self._reattaching = None
                if attached is None:
                    if self._stopping:
                        return False
                else:
                    assert stream is not None and handoff is not None  # what answered
                    if self._stopping:
                        stream.close()
                        handoff.close()
                        return False
                    self.handoff.close()
                    self.handoff = handoff
                    self._take(stream, attached)
                    self._open_step_channel(handoff, attached)
                    self.reattaches += 1
                    return True
            time.sleep(_REATTACH_RETRY_S)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._stream.close()
            if self._reattaching is not None:
                self._reattaching.close()
        self._thread.join()
        if self.step_channel is not None:
            self.step_channel.close()
        self.handoff.close()
        self.alive = False


class PrefixEvents:
    """Iterator over prefix-cache events (KvPrefixCache.SubscribeEvents). Tracks the epoch and
    last sequence it yielded; iterating again after the stream ended (or cancel()) resubscribes
    from there, so nothing is yielded twice, and a PrefixEvent with gap=True says the daemon no
    longer had what was missed. A stream that ends with an error raises KvError."""

    def __init__(self, stub: Any, epoch: int, last_sequence: int, engine: Any = None) -> None:
        self._stub = stub
        self._engine = engine
        self.epoch = epoch
        self.last_sequence = last_sequence
        self._call: Any = None
        self._lock = threading.Lock()

    def __iter__(self) -> "PrefixEvents":
        return self

    def __next__(self) -> PrefixEvent:
        with self._lock:
            if self._call is None:
                self._call = self._stub.SubscribeEvents(prefix_pb2.SubscribePrefixEventsRequest(
                    epoch=self.epoch, last_sequence=self.last_sequence, engine=self._engine))
            call = self._call
        try:
            event = next(call)
        except StopIteration:
            self._end(call)
            raise
        except grpc.RpcError as error:
            self._end(call)
            if error.code() == grpc.StatusCode.CANCELLED:  # a raw grpc.RpcError
                raise StopIteration from None
            raise from_rpc_error(error) from None
        self.epoch = int(event.epoch)
        self.last_sequence = int(event.sequence)
        kind = _EVENT_KINDS.get(event.kind, "stored")
        return PrefixEvent(int(event.sequence), int(event.epoch), kind, kind == "gap",
                           bytes(event.shape_fingerprint), list(event.block_keys),
                           bytes(event.boundary_key), str(event.reason), str(event.cache_scope),
                           _MEDIA.get(event.medium, "device"), list(event.block_hashes),
                           bytes(event.parent_block_hash), list(event.token_ids),
                           int(event.block_tokens), int(event.engine_id),
                           bool(event.from_engine_pool))

    def _end(self, call: Any) -> None:
        with self._lock:
            if self._call is call:
                self._call = None

    def cancel(self) -> None:
        """Ends a wait in next() (from any thread): it stops iterating."""
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()


class StepBatch:
    """Per-step transaction calls for many sessions, sent as one Step (Client.step): the
    explicit form, generations passed by hand (Client.advance_many is the one-call decode step
    that tracks them). by_slot: name each session by its dense slot (Session.slot; cheaper for
    the daemon, and only for the attached engine that created it) instead of its id and token;
    such a batch goes over the engine's step channel when it has one (docs/step-channel.md).

    Entries are kept as plain tuples (step_channel.StepChannel.send's form); the Step RPC's
    protobuf request is built only when the batch goes over gRPC (`request`), so a decode loop
    on the channel builds no protobuf per step. Numbers out of range raise ValueError at
    Client.step, before anything is sent, on either path."""

    def __init__(self, by_slot: bool = False) -> None:
        self.by_slot = by_slot
        self._entries: List[step_channel.Entry] = []
        self._sessions: List["Session"] = []  # each entry's (by id and token over gRPC)
        self._wait_event = b""
        # No session has more K/V layers, no entry more token ids, than the channel carries.
        self._fits_channel = True

    @property
    def request(self) -> Any:
        """The batch as the Step RPC's memra.kv.v1.StepRequest (engine credentials not set)."""
        request = pb.StepRequest()
        if self._wait_event:
            request.ordering.wait_event = self._wait_event
        for (op, slot, generation, rows, next_rows, token_ids), session in zip(
                self._entries, self._sessions):
            entry = request.entries.add()
            if self.by_slot:
                entry.slot = slot
            else:
                entry.session.session_id = session.id
                entry.session.session_token = session.token
            if op == step_channel.OP_BEGIN:
                entry.begin.SetInParent()
            elif op == step_channel.OP_PREPARE:
                entry.prepare.generation = generation
                entry.prepare.rows = rows
            elif op == step_channel.OP_PUBLISH:
                entry.publish.generation = generation
            elif op == step_channel.OP_COMMIT:
                entry.commit.generation = generation
                entry.commit.accepted_rows = rows
                entry.commit.token_ids.extend(token_ids)
            elif op == step_channel.OP_ABORT:
                entry.abort.generation = generation
            else:
                entry.advance.generation = generation
                entry.advance.accepted_rows = rows
                entry.advance.next_rows = next_rows
                entry.advance.token_ids.extend(token_ids)
        return request

    def _channel_eligible(self) -> bool:
        # step_channel.StepChannel.carries, kept up to date entry by entry.
        return (not self._wait_event and self._fits_channel
                and len(self._entries) <= step_channel.MAX_STEP_ENTRIES)

    def set_wait_event(self, ipc_event_handle: bytes) -> None:
        """The ordering event every entry's device work waits for (cuda backend)."""
        self._wait_event = ipc_event_handle

    def _add(self, session: "Session", op: int, generation: int = 0, rows: int = 0,
             next_rows: int = 0, token_ids: Sequence[int] = ()) -> None:
        if (session._kv_layers > step_channel.MAX_KV_LAYERS
                or len(token_ids) > step_channel.MAX_TOKEN_IDS):
            self._fits_channel = False
        self._entries.append((op, session.slot, generation, rows, next_rows, token_ids))
        self._sessions.append(session)

    def begin(self, session: "Session") -> None:
        """Session.begin as an entry."""
        self._add(session, step_channel.OP_BEGIN)

    def prepare(self, session: "Session", generation: int, rows: int) -> None:
        """Session.prepare_append as an entry."""
        self._add(session, step_channel.OP_PREPARE, generation, rows)

    def publish(self, session: "Session", generation: int) -> None:
        """Session.publish_append as an entry."""
        self._add(session, step_channel.OP_PUBLISH, generation)

    def commit(self, session: "Session", generation: int, accepted_rows: int,
               token_ids: Sequence[int] = ()) -> None:
        """Session.commit as an entry."""
        self._add(session, step_channel.OP_COMMIT, generation, accepted_rows, 0, token_ids)

    def abort(self, session: "Session", generation: int) -> None:
        """Session.abort as an entry."""
        self._add(session, step_channel.OP_ABORT, generation)

    def advance(self, session: "Session", generation: int, accepted_rows: int, next_rows: int,
                token_ids: Sequence[int] = ()) -> None:
        """One decode step of `session` in one entry (cache.proto StepAdvance): finishes
        transaction `generation` (publishing its prepared append first when not yet published,
        then committing accepted_rows with their token ids, or none) and begins the next,
        preparing next_rows. generation 0: nothing to finish; next_rows 0: begin none. The
        separate entries' rules and refusals, all or nothing."""
        self._add(session, step_channel.OP_ADVANCE, generation, accepted_rows, next_rows,
                  token_ids)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drops every entry (the batch is reused for the next step)."""
        self._entries.clear()
        self._sessions.clear()
        self._fits_channel = True


class TransactionScope:
    """An open transaction of one session as a context manager (Session.transaction).

    Inside `with`: prepare(rows) says where the rows go, the engine writes them, then
    publish() and commit(accepted_rows, token_ids), or abort(). Leaving the block:
      - by an exception: an unfinished transaction is aborted (the session is as it was before
        begin) and the exception propagates (should the daemon refuse the abort, that refusal
        is raised instead, with the block's exception as its __context__);
      - normally: an unfinished transaction is committed whole: its prepared append is
        published when it was not, and every staged row is accepted (no token ids); one with
        nothing prepared is aborted (there is nothing to commit).
    Not thread-safe: one thread drives a session's transaction."""

    def __init__(self, session: "Session", begun: Transaction,
                 timeout: Optional[float]) -> None:
        self.session = session
        self.generation = begun.generation
        self.base_len = begun.base_len  # committed rows when it began
        self.prepared: Optional[PreparedAppend] = None  # the last prepare's plan
        self.published = False
        self.committed_len: Optional[int] = None  # once committed or aborted
        self._timeout = timeout

    @property
    def finished(self) -> bool:
        """Committed or aborted."""
        return self.committed_len is not None

    def prepare(self, rows: int) -> PreparedAppend:
        """PrepareAppend of `rows` rows (>= 1): where each K/V layer's rows go."""
        self.prepared = self.session.prepare_append(self.generation, rows, self._timeout)
        self.published = False
        return self.prepared

    def publish(self) -> int:
        """PublishAppend: returns the staged length."""
        staged = self.session.publish_append(self.generation, self._timeout)
        self.published = True
        return staged

    def commit(self, accepted_rows: Optional[int] = None, token_ids: Sequence[int] = ()) -> int:
        """Commits accepted_rows staged rows (None: all of them), with their token ids (or
        none); publishes a prepared append first when it was not. Returns the committed
        length."""
        if self.prepared is not None and not self.published:
            self.publish()
        if accepted_rows is None:
            accepted_rows = (self.prepared.target - self.base_len
                             if self.prepared is not None else 0)
        self.committed_len = self.session.commit(self.generation, accepted_rows, token_ids,
                                                 self._timeout)
        return self.committed_len

    def abort(self) -> int:
        """Aborts: nothing of the transaction is kept. Returns the committed length."""
        self.committed_len = self.session.abort(self.generation, self._timeout)
        return self.committed_len

    def __enter__(self) -> "TransactionScope":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]],
                 exc: Optional[BaseException], traceback: Optional[TracebackType]) -> None:
        if self.finished:
            return
        if exc_type is not None or self.prepared is None:
            self.abort()
        else:
            self.commit()


class Session:
    """One session. Thread-compatible. Planes are arrays over this process's mapping of the
    session's arenas; they stay valid until grow() or release() (the memory stays mapped while
    an array over it lives, but the daemon no longer uses it). A context manager: leaving
    `with` releases it."""

    def __init__(self, client: Client, session_id: int, token: bytes, slot: int = 0) -> None:
        """Client.create_session makes sessions."""
        self._client = client
        self.id = session_id
        self.token = token
        self.slot = slot  # the dense slot the daemon handed out (StepBatch(by_slot=True))
        self.ref = pb.SessionRef(session_id=session_id, session_token=token)
        self.wait_event = b""
        self.layout: Any = None  # memra.kv.v1.SessionLayout
        self._bases: List[Any] = []
        self._planes: Dict[Tuple[int, int], PlaneGeometry] = {}
        self._kv_layers = 0  # layers of its layout: over step_channel.MAX_KV_LAYERS, gRPC steps
        self.released = False
        # The generation of the transaction this process began and has not finished (begin,
        # transaction(), advance keep it); 0: none. The daemon's state is the truth: a call
        # with a stale generation is refused there.
        self.open_generation = 0

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]],
                 exc: Optional[BaseException], traceback: Optional[TracebackType]) -> None:
        if self.released:
            return
        try:
            self.release()
        except MemraKvError:
            if exc_type is None:
                raise
            # The exception leaving the block is the one to see; the daemon frees the
            # session with the engine anyway.

    def set_wait_event(self, ipc_event_handle: bytes) -> None:
        """Cross-process device ordering (cuda backend; cache.proto DeviceOrdering): every later
        call that makes the daemon touch this session's memory carries the event. Host: b""."""
        self.wait_event = ipc_event_handle

    def _t(self, timeout: Optional[float]) -> float:
        return self._client._timeout(timeout)

    def _rpc(self, method: Any, request: Any, timeout: float) -> Any:
        return self._client._session_call(method, request, timeout)

    def _with_ordering(self, request: Any) -> Any:
        if self.wait_event:
            request.ordering.wait_event = self.wait_event
        return request

    def _state_call(self, method: Any, request: Any, timeout: Optional[float]) -> SessionState:
        """A call answering SessionStateResponse, as the SessionState."""
        return from_message(SessionState, self._rpc(method, request, self._t(timeout)).state)

    def _adopt(self, layout: Any) -> None:
        mapper = self._client.mapper
        bases = []
        for arena in layout.arenas:
            if arena.backend != mapper.backend:
                raise KvError(ErrorCode.INVALID_ARGUMENT, 'the %s mapper cannot map a "%s" '
                              "arena export" % (mapper.backend, arena.backend))
            bases.append(mapper.map(
                arena.handle, arena.bytes,
                lambda handle=arena.handle: self._client._fetch_arena_fd(self.id, self.token,
                                                                         handle)))
        planes = {}
        for entry in layout.layers:
            # Latent rows in another element type than f32 have no f32 raw view: their bytes.
            raw_latent = entry.latent_format not in (model_plan_pb2.ELEMENT_FORMAT_UNSPECIFIED,
                                                     model_plan_pb2.ELEMENT_FORMAT_F32)
            for plane in entry.planes:
                if plane.arena >= len(bases):
                    raise KvError(ErrorCode.INTERNAL, "plane of layer %d names arena %d of "
                                  "%d" % (entry.layer, plane.arena, len(bases)))
                planes[(int(entry.layer), int(plane.kind))] = PlaneGeometry(
                    plane.kind, plane.arena, plane.offset, plane.bytes, plane.rows,
                    plane.row_bytes,
                    raw=raw_latent and plane.kind == pb.PLANE_KIND_LATENT_ROWS)
        self.layout, self._bases, self._planes = layout, bases, planes
        self._kv_layers = len(layout.layers)

    def geometry(self, layer: int, kind: int) -> PlaneGeometry:
        """The PlaneGeometry of a plane; NotFound when the layer has none."""
        geometry = self._planes.get((layer, kind))
        if geometry is None:
            raise KvError(ErrorCode.NOT_FOUND, "layer %d has no %s plane"
                          % (layer, pb.PlaneKind.Name(kind) if kind in pb.PlaneKind.values()
                             else str(kind)))
        return geometry

    def has_plane(self, layer: int, kind: int) -> bool:
        """Whether the layer has a plane of this kind (memra_kv.KEYS, VALUES, ...)."""
        return (layer, kind) in self._planes

    def _check_live(self) -> None:
        if self.released:
            raise KvError(ErrorCode.FAILED_PRECONDITION, "session %d was released" % self.id)

    def plane(self, layer: int, kind: int) -> Any:
        """The plane as an array with its row shape (planes.PlaneGeometry.dtype_and_shape):
        numpy over the shared memory on the host backend, a CudaPlane on cuda."""
        self._check_live()
        geometry = self.geometry(layer, kind)
        return self._client.mapper.plane(self._bases[geometry.arena], geometry)

    def plane_bytes(self, layer: int, kind: int) -> Any:
        """The plane's every byte, tail pad included, as one uint8 vector."""
        geometry = self.geometry(layer, kind)
        return self._client.mapper.plane_bytes(self._bases[geometry.arena], geometry)

    def typed_geometry(self, layer: int, kind: int) -> TypedGeometry:
        """The plane as an array (planes.TypedGeometry): element type, shape (rows, heads,
        head_dim), byte strides and the plan's fp8 scale. FailedPrecondition for a block format
        or a mirror; NotFound when the layer has no such plane."""
        return typed_geometry(self.layer_layout(layer), self.geometry(layer, kind))

    def typed_plane(self, layer: int, kind: int, storage: bool = False) -> Any:
        """The plane as numpy (rows, heads, head_dim) of its element type, over the shared
        memory (docs/rules.md#formats): K/V in bf16 / f16 / f32 / fp8_e4m3 / fp8_e5m2, latent
        rows, and the f32 state planes. bf16 and fp8 need the ml_dtypes package
        (ml_dtypes.bfloat16, float8_e4m3fn, float8_e5m2); storage=True gives their bits as
        uint16 / uint8 instead (planes.bf16_bits converts f32 to bf16 bits). On cuda a CudaPlane
        of that shape (bf16 / fp8 as their storage bits: __cuda_array_interface__ has no such
        typestr). Valid as long as plane()'s arrays."""
        self._check_live()
        typed = self.typed_geometry(layer, kind)
        mapper = self._client.mapper
        # A CudaPlane carries bf16 / fp8 as their bits anyway: no ml_dtypes needed there.
        bits = storage or mapper.backend == "cuda"
        dtype = typed.element.storage if bits else numpy_dtype(typed.element)
        return mapper.typed_plane(self._bases[typed.plane.arena], typed, dtype)

    def torch_plane(self, layer: int, kind: int) -> Any:
        """The plane as a torch tensor (rows, heads, head_dim) of its element type, no copy: on
        the host backend a CPU tensor over the shared memory, on cuda a CUDA tensor through
        __cuda_array_interface__. FailedPrecondition when torch is not installed."""
        self._check_live()
        typed = self.typed_geometry(layer, kind)
        return self._client.mapper.torch_plane(self._bases[typed.plane.arena], typed,
                                               torch_dtype(typed.element))

    def layer_layout(self, layer: int) -> Any:
        """The layer's memra.kv.v1.LayerLayout (its planes and formats); NotFound when the
        session has no such layer."""
        for entry in self.layout.layers:
            if entry.layer == layer:
                return entry
        raise KvError(ErrorCode.NOT_FOUND, "the session has no layer %d" % layer)

    # -- transactions (docs/rules.md#transactions) --

    def transaction(self, timeout: Optional[float] = None) -> TransactionScope:
        """Begins a transaction as a context manager (TransactionScope): aborted when the
        block raises, committed whole when it ends with the transaction unfinished.

            with session.transaction() as txn:
                append = txn.prepare(1)
                ... write row append.layers[i].write_row of each K/V layer ...
                txn.commit(1, token_ids=[token])   # or leave it to the block's end
        """
        return TransactionScope(self, self.begin(timeout), timeout)

    def begin(self, timeout: Optional[float] = None) -> Transaction:
        """Begins a transaction: its generation and base length. FailedPrecondition while one
        is active or the session is half-committed."""
        r = self._rpc(self._client.cache.Begin, self._with_ordering(pb.SessionRequest(
            session=self.ref)), self._t(timeout))
        self.open_generation = int(r.generation)
        return Transaction(int(r.generation), int(r.base_len))

    def prepare_append(self, generation: int, rows: int,
                       timeout: Optional[float] = None) -> PreparedAppend:
        """Plans an append of `rows` rows (>= 1) to transaction `generation`: where each K/V
        layer's rows go (and the ring rebase copies to do first). InvalidArgument past the
        capacity."""
        r = self._rpc(self._client.cache.PrepareAppend, pb.PrepareAppendRequest(
            session=self.ref, generation=generation, rows=rows), self._t(timeout))
        return _prepared_from_proto(r)

    def publish_append(self, generation: int, timeout: Optional[float] = None) -> int:
        """Publishes the written rows of transaction `generation` (ring rebases, then the
        staged length); returns the staged length."""
        return int(self._rpc(self._client.cache.PublishAppend, self._with_ordering(
            pb.GenerationRequest(session=self.ref, generation=generation)),
            self._t(timeout)).staged_len)

    def commit(self, generation: int, accepted_rows: int, token_ids: Sequence[int] = (),
               timeout: Optional[float] = None) -> int:
        """Accepts accepted_rows staged rows (with their token ids, or none) and ends the
        transaction; returns the committed length."""
        committed = int(self._rpc(self._client.cache.Commit, self._with_ordering(
            pb.CommitRequest(session=self.ref, generation=generation,
                             accepted_rows=accepted_rows, token_ids=token_ids)),
            self._t(timeout)).committed_len)
        self._finished(generation)
        return committed

    def abort(self, generation: int, timeout: Optional[float] = None) -> int:
        """Ends the transaction keeping nothing of it; returns the committed length."""
        committed = int(self._rpc(self._client.cache.Abort, self._with_ordering(
            pb.GenerationRequest(session=self.ref, generation=generation)),
            self._t(timeout)).committed_len)
        self._finished(generation)
        return committed

    def _finished(self, generation: int) -> None:
        if self.open_generation == generation:
            self.open_generation = 0

    def _track(self, outcome: Advanced) -> None:
        """Session.advance's bookkeeping: the transaction an applied step began is open."""
        if outcome.ok:
            self.open_generation = (outcome.transaction.generation
                                    if outcome.transaction is not None else 0)

    def advance(self, accepted_rows: int = 0, next_rows: int = 0, token_ids: Sequence[int] = (),
                timeout: Optional[float] = None) -> Advanced:
        """One decode step in one call (docs/rules.md#advance): finishes the transaction this
        session has open (open_generation; none on the first step), publishing its prepared
        append when not yet published and committing accepted_rows with their token ids, then
        begins the next one and prepares next_rows (0: begins none, the last step). All or
        nothing: a refusal raises (the first refused part's code and message) and changes
        nothing. Returns where the next rows go (Advanced.prepared).

            step = session.advance(next_rows=1)                 # the first step
            while decoding:
                ... write the rows at step.prepared.layers[i].write_row ...
                step = session.advance(1, 1, token_ids=[token])
            session.advance(1, token_ids=[token])               # the last
        """
        self._check_live()
        outcome = self._client._send_step(
            [AdvanceStep(self, accepted_rows, next_rows, token_ids)], timeout)[0]
        if outcome.error is not None:
            raise outcome.error
        self._track(outcome)
        return outcome

    # -- lengths --

    def rewind(self, target: int, timeout: Optional[float] = None) -> SessionState:
        """Sets the committed and staged length to `target` and ends any transaction.
        InvalidArgument past the staged length; FailedPrecondition "SWA ring rewind checkpoint
        has been lapped; ..." when a ring layer no longer holds the window ending at target."""
        state = self._state_call(self._client.cache.Rewind, self._with_ordering(
            pb.RewindRequest(session=self.ref, target=target)), timeout)
        self.open_generation = 0
        return state

    def can_rewind(self, target: int, timeout: Optional[float] = None) -> bool:
        """Whether rewind(target) would be accepted (changes nothing)."""
        return bool(self._rpc(self._client.cache.CanRewind, pb.RewindRequest(
            session=self.ref, target=target), self._t(timeout)).can_rewind)

    def hydrate(self, logical_len: int, resident_starts: Sequence[int] = (),
                timeout: Optional[float] = None) -> SessionState:
        """Fresh session only: publishes logical_len rows already written through the planes."""
        return self._state_call(self._client.cache.Hydrate, self._with_ordering(
            pb.HydrateRequest(session=self.ref, logical_len=logical_len,
                              resident_starts=resident_starts)), timeout)

    def spec_snapshot(self, timeout: Optional[float] = None) -> SessionState:
        """Snapshots the committed state for speculative decoding (docs/rules.md#spec-snapshot-
        and-rollback). Plans with recurrent layers need a session created with
        spec_snapshot=True: FailedPrecondition otherwise. The snapshot stays valid across
        rollbacks (roll back to it again next round) until a new snapshot, reset, hydrate, a
        prefix restore or grow."""
        return self._state_call(self._client.cache.SpecSnapshot, self._with_ordering(
            pb.SessionRequest(session=self.ref)), timeout)

    def spec_rollback(self, accept_len: int, timeout: Optional[float] = None) -> SessionState:
        """Rolls back to the snapshot plus accept_len accepted tokens."""
        return self._state_call(self._client.cache.SpecRollback, self._with_ordering(
            pb.SpecRollbackRequest(session=self.ref, accept_len=accept_len)), timeout)

    def reset(self, timeout: Optional[float] = None) -> SessionState:
        """Empty again, on the same arena (nothing is re-mapped)."""
        state = self._state_call(self._client.cache.ResetSession, self._with_ordering(
            pb.SessionRequest(session=self.ref)), timeout)
        self.open_generation = 0
        return state

    def taint(self, reason: str, timeout: Optional[float] = None) -> SessionState:
        """Marks the session's contents untrusted: it then refuses transactions, snapshots,
        rollback, capture, grow and reset (docs/rules.md#taint)."""
        return self._state_call(self._client.cache.Taint,
                                pb.TaintRequest(session=self.ref, reason=reason), timeout)

    def state(self, timeout: Optional[float] = None) -> SessionState:
        """The daemon's state of this session."""
        return self._state_call(self._client.cache.GetSessionState,
                                pb.GetSessionStateRequest(session=self.ref), timeout)

    def grow(self, target_capacity: int, timeout: Optional[float] = None) -> SessionState:
        """Regrows to target_capacity: maps the new arena, acknowledges the new layout (the
        daemon then frees the old arena) and unmaps the old one. Arrays over the old planes must
        no longer be used."""
        grown = self._rpc(self._client.cache.Grow, self._with_ordering(pb.GrowRequest(
            session=self.ref, target_capacity=target_capacity)), self._t(timeout))
        old = self.layout
        self._adopt(grown.layout)
        state = self._state_call(self._client.cache.AcknowledgeGrow, pb.AcknowledgeGrowRequest(
            session=self.ref, layout_version=grown.layout.layout_version), timeout)
        old_handles = {a.handle for a in old.arenas} - {a.handle for a in self.layout.arenas}
        for handle in old_handles:
            self._client.mapper.unmap(handle)
        return state

    def release(self, timeout: Optional[float] = None) -> int:
        """Frees the session's memory in the daemon and unmaps it here; returns bytes freed."""
        self._check_live()
        self.released = True  # whatever the daemon answers, this process stops using the memory
        self.open_generation = 0
        pooled: Set[bytes] = set()
        try:
            response = self._rpc(self._client.cache.ReleaseSession, self._with_ordering(
                pb.SessionRequest(session=self.ref)), self._t(timeout))
            # Arenas the daemon pooled for this engine stay mapped for the next session that
            # gets one back (same handle); those it has freed since are unmapped.
            pooled = set(response.pooled_handles)
            self._client._unmap_freed_pool_arenas(response.unmap_handles)
            return int(response.freed_bytes)
        finally:
            if self.layout is not None:
                for arena in self.layout.arenas:
                    if arena.handle not in pooled:
                        self._client.mapper.unmap(arena.handle)
            self._bases = []
