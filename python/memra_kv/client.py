"""memra_kv.Client: an engine's connection to memra-kvd (mirrors client/client.h).

Every call takes `timeout` (seconds; None: the client's default_timeout) and raises KvError on a
refusal. Sessions map their arenas once (planes.py); Reset reuses the arena, Grow maps a new one.
"""

import functools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import List

import grpc

from ._proto import admin_pb2, admin_pb2_grpc, cache_pb2, cache_pb2_grpc, model_plan_pb2
from ._proto import prefix_pb2, prefix_pb2_grpc
from .errors import KvError, code_from_value, from_rpc_error
from .handoff import HandoffChannel, default_handoff_path
from . import step_channel
from .planes import (CudaArenaMapper, HostArenaMapper, PlaneGeometry, numpy_dtype,
                     torch_dtype, typed_geometry)

pb = cache_pb2

# A local socket: reconnect within 100 ms-1 s of the daemon coming back (gRPC's default backoff
# waits up to minutes, longer than a lease outlives a daemon restart), as client/client.cc.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]
_REATTACH_RETRY_S = 0.1


def _call(method, request, timeout):
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as error:
        raise from_rpc_error(error) from None


# ---- results ----

@dataclass
class Transaction:
    generation: int
    base_len: int  # rows committed when it began


@dataclass
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


@dataclass
class PreparedAppend:
    generation: int
    target: int  # staged rows after the append
    layers: List[LayerAppend]  # one per K/V layer, in layer order


def _prepared_from_proto(response):
    layers = []
    for plan in response.layers:
        # The daemon sends one plan per distinct plan; more_layers share it (cache.proto).
        for layer in [plan.layer] + list(plan.more_layers):
            layers.append(LayerAppend(layer, plan.write_row, plan.ring, plan.rebase,
                                      plan.src_row, plan.keep_rows, plan.new_base))
    layers.sort(key=lambda entry: entry.layer)
    return PreparedAppend(response.generation, response.target, layers)


@dataclass
class Reservation:
    id: int
    bytes: int
    ttl_ms: int


@dataclass
class PrefixCaptured:
    entry_id: int
    boundary_tokens: int
    already_present: bool
    added_bytes: int
    stored_bytes: int
    shape_fingerprint: bytes


@dataclass
class PrefixMatch:
    outcome: str  # "hit", "partial" or "miss"
    entry_id: int
    matched_tokens: int
    block_tokens: int
    medium: str = "device"  # the slowest tier a matched piece is in: "device" or "disk"


@dataclass
class PrefixRestored:
    entry_id: int
    restored_tokens: int
    state: "pb.SessionState"


@dataclass
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
    """One StepBatch entry's result: `error` (a KvError, None when it succeeded) or the field of
    its operation. Fields are read off the reply when asked for, so a decode loop that checks
    only what it needs pays for only that (a prepare's plan has a LayerAppend per K/V layer)."""

    __slots__ = ("_result", "_prepared", "_explain")

    def __init__(self, result, explain):
        self._result = result  # memra.kv.v1.StepResult
        self._prepared = None
        self._explain = explain  # Client._explain

    @property
    def ok(self):
        return self._result.code == 0

    @property
    def error(self):
        if self._result.code == 0:
            return None
        restart = (self._result.daemon_restart if self._result.HasField("daemon_restart")
                   else None)
        error = KvError(code_from_value(self._result.code), self._result.message, None, restart)
        return error if restart is not None else self._explain(error)

    @property
    def begun(self):
        """begin, advance with next rows: the Transaction."""
        if self._result.HasField("advance") and self._result.advance.HasField("prepared"):
            return Transaction(self._result.advance.prepared.generation,
                               self._result.advance.committed_len)
        if not self._result.HasField("begin"):
            return None
        return Transaction(self._result.begin.generation, self._result.begin.base_len)

    @property
    def prepared(self):
        """prepare, advance with next rows: the PreparedAppend."""
        if self._prepared is None:
            if self._result.HasField("prepare"):
                self._prepared = _prepared_from_proto(self._result.prepare)
            elif self._result.HasField("advance") and self._result.advance.HasField("prepared"):
                self._prepared = _prepared_from_proto(self._result.advance.prepared)
        return self._prepared

    @property
    def published(self):
        """advance: whether it published the finished transaction's append."""
        return self._result.advance.published

    @property
    def staged_len(self):
        """publish: the staged length."""
        return self._result.publish.staged_len

    @property
    def committed_len(self):
        """commit, abort, advance: the committed length."""
        if self._result.HasField("abort"):
            return self._result.abort.committed_len
        if self._result.HasField("advance"):
            return self._result.advance.committed_len
        return self._result.commit.committed_len


class _ChannelStepOutcome:
    """StepOutcome's interface over a step channel completion (step_channel.ChannelResult):
    the same values the Step RPC's StepResult gives, read off the record when asked for."""

    __slots__ = ("_record", "_side", "_prepared", "_explain")

    def __init__(self, record, side, explain):
        self._record = record
        self._side = side
        self._prepared = None
        self._explain = explain

    @property
    def ok(self):
        return self._record[step_channel.C_CODE] == 0

    @property
    def error(self):
        record = self._record
        if record[step_channel.C_CODE] == 0:
            return None
        restart = None
        if record[step_channel.C_RESTART_EPOCH] != 0:
            restart = pb.DaemonRestart(previous_epoch=record[step_channel.C_RESTART_PREVIOUS_EPOCH],
                                       epoch=record[step_channel.C_RESTART_EPOCH])
        error = KvError(code_from_value(record[step_channel.C_CODE]),
                        self._side.decode("utf-8", "replace"), None, restart)
        return error if restart is not None else self._explain(error)

    def _has_plan(self):
        record = self._record
        payload = record[step_channel.C_PAYLOAD]
        return payload == step_channel.PAYLOAD_PREPARE or (
            payload == step_channel.PAYLOAD_ADVANCE and record[step_channel.C_HAS_PREPARED])

    @property
    def begun(self):
        """begin, advance with next rows: the Transaction."""
        record = self._record
        payload = record[step_channel.C_PAYLOAD]
        if payload == step_channel.PAYLOAD_ADVANCE and record[step_channel.C_HAS_PREPARED]:
            return Transaction(record[step_channel.C_GENERATION],
                               record[step_channel.C_COMMITTED_LEN])
        if payload != step_channel.PAYLOAD_BEGIN:
            return None
        return Transaction(record[step_channel.C_GENERATION], record[step_channel.C_BASE_LEN])

    @property
    def prepared(self):
        """prepare, advance with next rows: the PreparedAppend."""
        if self._prepared is None and self._has_plan():
            try:
                plan = pb.PrepareAppendResponse.FromString(self._side)
            except Exception:  # the daemon's bytes, checked like the C++ client's parse
                raise KvError(grpc.StatusCode.INTERNAL, "step channel completion: its prepared "
                              "plan of %d bytes does not parse" % len(self._side)) from None
            self._prepared = _prepared_from_proto(plan)
        return self._prepared

    @property
    def published(self):
        """advance: whether it published the finished transaction's append."""
        return (self._record[step_channel.C_PAYLOAD] == step_channel.PAYLOAD_ADVANCE
                and self._record[step_channel.C_PUBLISHED] != 0)

    @property
    def staged_len(self):
        """publish: the staged length."""
        if self._record[step_channel.C_PAYLOAD] != step_channel.PAYLOAD_PUBLISH:
            return 0
        return self._record[step_channel.C_STAGED_LEN]

    @property
    def committed_len(self):
        """commit, abort, advance: the committed length."""
        if self._record[step_channel.C_PAYLOAD] not in _COMMITTING_PAYLOADS:
            return 0
        return self._record[step_channel.C_COMMITTED_LEN]


_COMMITTING_PAYLOADS = (step_channel.PAYLOAD_COMMIT, step_channel.PAYLOAD_ABORT,
                        step_channel.PAYLOAD_ADVANCE)


# ---- the client ----

class Client:
    """Thread-safe. Use as a context manager, or close() it (detaches, closes the channel)."""

    def __init__(self, channel, default_timeout, mapper, handoff_path, force_grpc_step=False):
        self._channel = channel
        self.force_grpc_step = force_grpc_step
        self.handoff_path = handoff_path
        self.default_timeout = default_timeout
        self.cache = cache_pb2_grpc.KvCacheStub(channel)
        self.admin_stub = admin_pb2_grpc.KvAdminStub(channel)
        self.prefix = prefix_pb2_grpc.KvPrefixCacheStub(channel)
        self._mapper = mapper
        self._lock = threading.Lock()
        self._lease = None  # _Lease while attached
        self._attached_as = None  # (engine_name, cache_scope) the first attach asked for
        self.backend = None

    @classmethod
    def connect(cls, socket_path, timeout=10.0, mapper=None, handoff_path=None,
                force_grpc_step=False):
        """Connects to the daemon's Unix socket, waiting up to `timeout` seconds for it
        (KvError UNAVAILABLE). `mapper`: None picks HostArenaMapper or CudaArenaMapper by the
        backend the daemon announces at attach. `handoff_path`: the daemon's handoff socket
        (attach gets its ticket there; host arenas' descriptors come over it); None: beside
        `socket_path` (".sock" -> ".handoff.sock"), as the daemon puts it by default.
        `force_grpc_step`: never open the step channel; every step goes over the Step RPC."""
        channel = grpc.insecure_channel("unix:" + socket_path, options=_CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise KvError(grpc.StatusCode.UNAVAILABLE, "memra-kvd is not answering on unix:%s "
                          "within %gs" % (socket_path, timeout)) from None
        return cls(channel, timeout, mapper,
                   handoff_path or default_handoff_path(socket_path), force_grpc_step)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.detach()
        self._channel.close()

    def _timeout(self, timeout):
        return self.default_timeout if timeout is None else timeout

    @property
    def mapper(self):
        if self._mapper is None:
            self._mapper = CudaArenaMapper() if self.backend == "cuda" else HostArenaMapper()
        return self._mapper

    # -- lease --

    def attach(self, engine_name, timeout=None, cache_scope=""):
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
                raise KvError(grpc.StatusCode.FAILED_PRECONDITION,
                              "already attached as engine %d" % self._lease.engine_id)
            return self._attach_locked(engine_name, timeout, cache_scope)

    def _attach_locked(self, engine_name, timeout, cache_scope):
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

    def attach_anew(self, timeout=None):
        """Once the lease is lost for good (lease_lost: the daemon restarted without this
        engine, or reclaimed it), attaches again as a new engine with the name and cache scope
        attach was given; what the old engine held (sessions, block store registrations, pins)
        is gone with it. Returns the engine id: the new one, or the current one when the lease
        is not lost (another caller attached anew first). KvError FAILED_PRECONDITION before
        attach; attach's errors (the lost lease stays lost)."""
        with self._lock:
            lease = self._lease
            if lease is None:
                raise KvError(grpc.StatusCode.FAILED_PRECONDITION,
                              "attach_anew before attach: there is no engine to replace")
            if lease.lost is None:
                return lease.engine_id
            engine_name, cache_scope = self._attached_as
            lease.stop()  # its thread has ended (re-attaching stopped): closes the handoff
            self._lease = None
            try:
                return self._attach_locked(engine_name, timeout, cache_scope)
            except BaseException:
                self._lease = lease  # still lost: a later call may try again
                raise

    def detach(self):
        """Ends the lease: the daemon frees this engine's sessions after its grace period."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.stop()

    def await_lease_settled(self, timeout):
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
    def lease_alive(self):
        lease = self._lease
        return lease is not None and lease.alive

    @property
    def lease_lost(self):
        """Why re-attaching stopped (a KvError: the daemon no longer knows this engine:
        is_daemon_restarted, or NOT_FOUND when it reclaimed it); None while the lease is live or
        being re-attached."""
        lease = self._lease
        return lease.lost if lease else None

    @property
    def reattaches(self):
        """Re-attaches done after the lease stream broke (each kept the engine and its sessions)."""
        lease = self._lease
        return lease.reattaches if lease else 0

    @property
    def epoch(self):
        """The epoch of the daemon the lease is held with (Attached.epoch); 0 before attach."""
        lease = self._lease
        return lease.epoch if lease else 0

    @property
    def cache_scope(self):
        """The prefix-cache scope this engine attached in ("" before attach)."""
        lease = self._lease
        return lease.cache_scope if lease else ""

    @property
    def engine_id(self):
        lease = self._lease
        return lease.engine_id if lease else 0

    @property
    def lease_timeout_ms(self):
        lease = self._lease
        return lease.lease_timeout_ms if lease else 0

    @property
    def step_channel_active(self):
        """Whether steps by slot go over the engine's step channel (docs/step-channel.md)."""
        lease = self._lease
        return lease is not None and lease.step_channel is not None and \
            not lease.step_channel.broken

    @property
    def step_channel_status(self):
        """Why there is no step channel (a KvError), or None while one is open: no attach yet,
        force_grpc_step, a daemon that offers none, another platform, or the failure that
        broke it (steps go over gRPC from then on)."""
        lease = self._lease
        if lease is None:
            return KvError(grpc.StatusCode.FAILED_PRECONDITION, "not attached")
        channel = lease.step_channel
        if channel is not None and channel.broken and lease.step_channel_status is None:
            return KvError(grpc.StatusCode.UNAVAILABLE, "the step channel broke")
        return lease.step_channel_status

    def _explain(self, error):
        """A session call's NOT_FOUND or PERMISSION_DENIED as the restart error when the daemon
        answering is not the one this engine attached to (client/client.cc KvClient::Explain):
        it restarted without keeping this engine's sessions."""
        lease = self._lease
        if (error.is_daemon_restarted or lease is None or lease.epoch == 0 or error.code not in (
                grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)):
            return error
        try:
            now = self.status().epoch
        except KvError:
            return error
        if now == lease.epoch:
            return error
        return KvError(grpc.StatusCode.FAILED_PRECONDITION,
                       "memra-kvd restarted (epoch %d -> %d); this engine attached to epoch %d "
                       "and the daemon answering does not have it: %s"
                       % (lease.epoch, now, lease.epoch, error.message), None,
                       pb.DaemonRestart(previous_epoch=lease.epoch, epoch=now))

    def _session_call(self, method, request, timeout):
        try:
            return _call(method, request, timeout)
        except KvError as error:
            raise self._explain(error) from None

    def _fetch_arena_fd(self, session_id, token, handle):
        """(descriptor, bytes) of a host arena of this engine's session, over the handoff
        connection attach opened."""
        lease = self._lease
        if lease is None:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "mapping a host arena before "
                          "attach: its descriptor comes over the engine's handoff connection")
        return lease.handoff.fetch_arena(session_id, token, handle)

    def _offer_buffer(self, fd, nbytes):
        """(buffer id, connection): the block store's buffer id for descriptor `fd` of this
        engine's pool memory and the handoff connection it was offered over (the lease's now;
        the id is valid while that connection stays open)."""
        lease = self._lease
        if lease is None:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "offering a pool buffer before "
                          "attach: it goes over the engine's handoff connection")
        handoff = lease.handoff
        return handoff.offer_buffer(fd, nbytes), handoff

    def _handoff_connection(self):
        """The lease's handoff connection now (each re-attach opens a new one); None before
        attach."""
        lease = self._lease
        return lease.handoff if lease is not None else None

    def _engine(self, what):
        lease = self._lease
        if lease is None:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION,
                          "%s before attach: sessions need a lease" % what)
        return pb.EngineRef(engine_id=lease.engine_id, engine_token=lease.engine_token)

    # -- plans --

    def register_plan(self, plan, timeout=None):
        """Validates a memra.kv.v1.ModelPlan; returns its 32-byte fingerprint. Needs attach():
        the plan counts against this engine's max_engine_plans (docs/security-model.md#limits)."""
        request = pb.RegisterPlanRequest(plan=plan, engine=self._engine("register_plan"))
        return _call(self.cache.RegisterPlan, request, self._timeout(timeout)).fingerprint

    def import_model(self, hf_config_json, name="", index_pool=0, register=True, swa_ring=False,
                     index_ring_rows=None, kv_dtype="", timeout=None):
        """The plan of a Hugging Face config.json (its text, or a path to it) as the daemon
        imports it; registered (with register_plan, as this engine) unless register=False.
        kv_dtype: "" / "auto" (the config's torch_dtype, or fp8_e4m3 for an fp8 KV cache),
        "bf16", "fp16", "f32", "fp8_e4m3", "fp8_e5m2", a K/V pair ("q8_0/q5_1") or "reference"
        (docs/rules.md#formats). Returns ImportModelResponse (plan, plan_fingerprint,
        architecture, registered, kv_dtype: what chose the formats, kv_formats).
        The daemon's own registering import is an operator's call (its admin socket); an
        engine converts, then registers the plan like any other."""
        request = admin_pb2.ImportModelRequest(hf_config_json=_json_text(hf_config_json),
                                               name=name, index_pool=index_pool,
                                               register=False, swa_ring=swa_ring,
                                               kv_dtype=kv_dtype)
        if index_ring_rows is not None:
            request.index_ring_rows = index_ring_rows
        imported = _call(self.admin_stub.ImportModel, request, self._timeout(timeout))
        if register:
            fingerprint = self.register_plan(imported.plan, timeout=timeout)
            imported.registered = fingerprint == imported.plan_fingerprint
        return imported

    # -- admission and sessions --

    def reserve(self, plan, capacity, layer_lo=0, layer_hi=None, tp_ranks=1,
                spec_snapshot=False, timeout=None):
        """Holds the exact bytes of a session shape for the daemon's reservation TTL. An
        admission refusal raises KvError RESOURCE_EXHAUSTED with its numbers."""
        request = pb.ReserveRequest(engine=self._engine("reserve"))
        _set_shape(request, plan, capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot)
        response = _call(self.cache.Reserve, request, self._timeout(timeout))
        return Reservation(response.reservation_id, response.bytes, response.ttl_ms)

    def cancel_reservation(self, reservation_id, timeout=None):
        """Returns the reservation's bytes to the budget (the bytes freed)."""
        request = pb.CancelReservationRequest(engine=self._engine("cancel_reservation"),
                                              reservation_id=reservation_id)
        return _call(self.cache.CancelReservation, request, self._timeout(timeout)).freed_bytes

    def create_session(self, plan, capacity, layer_lo=0, layer_hi=None, tp_ranks=1,
                       spec_snapshot=False, reservation=None, timeout=None):
        """A session of `capacity` tokens whose arenas are mapped here. `reservation`: a
        Reservation (or its id) for this shape: never refused for room."""
        request = pb.CreateSessionRequest(engine=self._engine("create_session"))
        _set_shape(request, plan, capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot)
        if reservation is not None:
            request.reservation_id = getattr(reservation, "id", reservation)
        response = _call(self.cache.CreateSession, request, self._timeout(timeout))
        self._unmap_freed_pool_arenas(response.unmap_handles)
        session = Session(self, response.session.session_id, response.session.session_token,
                          response.slot)
        try:
            session._adopt(response.layout)
        except Exception:
            try:  # never leave the daemon holding a session nobody can use
                session.release()
            except KvError:
                pass
            raise
        return session

    def _unmap_freed_pool_arenas(self, handles):
        """Drops the mappings of pooled arenas the daemon has freed (proto unmap_handles)."""
        for handle in handles:
            self.mapper.unmap(handle)  # nothing when this process already dropped it

    def step(self, batch, timeout=None):
        """Runs a StepBatch as one Step; one StepOutcome per entry, in order. The step's own
        failure raises; entries fail independently (StepOutcome.error). A batch by slot carries
        this client's engine credentials, and goes over the engine's step channel when it has
        one (no wait event, sessions of at most 128 K/V layers, at most 256 token ids per
        entry; docs/step-channel.md); anything else is one Step RPC. Same outcomes either way.
        A channel failure (UNAVAILABLE, INTERNAL) raises: records in flight may or may not
        have run; later steps go over gRPC."""
        if batch.by_slot:
            lease = self._lease
            channel = lease.step_channel if lease is not None else None
            if channel is not None and batch._channel_eligible():
                outcomes = channel.send(batch._entries, self._timeout(timeout),
                                        functools.partial(_ChannelStepOutcome,
                                                          explain=self._explain))
                if outcomes is not None:
                    return outcomes
        request = batch.request
        if batch.by_slot:
            request.engine.CopyFrom(self._engine("step by slot"))
        response = _call(self.cache.Step, request, self._timeout(timeout))
        if len(response.results) != len(request.entries):
            raise KvError(grpc.StatusCode.INTERNAL, "Step answered %d results for %d entries"
                          % (len(response.results), len(request.entries)))
        return [StepOutcome(result, self._explain) for result in response.results]

    # -- prefix cache --

    def capture_prefix(self, session, token_ids, boundary_tokens, timeout=None):
        """Copies the session's committed state at boundary_tokens into the cache; token_ids
        are its committed token ids from position 0."""
        request = prefix_pb2.CapturePrefixRequest(session=session.ref, token_ids=token_ids,
                                                  boundary_tokens=boundary_tokens)
        if session.wait_event:
            request.ordering.wait_event = session.wait_event
        r = _call(self.prefix.Capture, request, self._timeout(timeout))
        return PrefixCaptured(r.entry_id, r.boundary_tokens, r.already_present, r.added_bytes,
                              r.stored_bytes, r.shape_fingerprint)

    def lookup_prefix(self, plan, token_ids, layer_lo=0, layer_hi=None, tp_ranks=1,
                      timeout=None):
        """The longest restorable prefix of token_ids for sessions of this shape."""
        shape = prefix_pb2.PrefixShape(plan_fingerprint=plan, layer_lo=layer_lo,
                                       tp_ranks=tp_ranks)
        if layer_hi is not None:
            shape.layer_hi = layer_hi
        r = _call(self.prefix.Lookup, prefix_pb2.LookupPrefixRequest(
            shape=shape, token_ids=token_ids, engine=self._engine("lookup_prefix")),
            self._timeout(timeout))
        return PrefixMatch(_OUTCOMES.get(r.outcome, "miss"), r.entry_id, r.matched_tokens,
                           r.block_tokens, _MEDIA.get(r.medium, "device"))

    def restore_prefix(self, session, token_ids, entry_id=0, timeout=None):
        """Restores entry_id (0: the longest match) into the FRESH session."""
        request = prefix_pb2.RestorePrefixRequest(session=session.ref, entry_id=entry_id,
                                                  token_ids=token_ids)
        if session.wait_event:
            request.ordering.wait_event = session.wait_event
        r = _call(self.prefix.Restore, request, self._timeout(timeout))
        return PrefixRestored(r.entry_id, r.restored_tokens, r.state)

    def events(self, epoch=0, last_sequence=0):
        """The prefix cache's events after (epoch, last_sequence), then live ones: an iterator
        (PrefixEvents) that resumes from the last sequence it yielded when iterated again. On the
        engine socket an attached engine's, of its cache scope only (sequences skip over other
        scopes' events); on the admin socket every scope's."""
        lease = self._lease
        engine = (pb.EngineRef(engine_id=lease.engine_id, engine_token=lease.engine_token)
                  if lease is not None else None)
        return PrefixEvents(self.prefix, epoch, last_sequence, engine)

    def list_prefixes(self, timeout=None):
        return _call(self.prefix.ListPrefixes, prefix_pb2.ListPrefixesRequest(),
                     self._timeout(timeout))

    def inspect_prefix(self, entry_id, timeout=None):
        return _call(self.prefix.InspectPrefix, prefix_pb2.InspectPrefixRequest(
            entry_id=entry_id), self._timeout(timeout))

    def evict_prefix(self, entry_id, timeout=None):
        return _call(self.prefix.EvictPrefix, prefix_pb2.EvictPrefixRequest(entry_id=entry_id),
                     self._timeout(timeout))

    # -- admin (memra-kvctl's calls; replies are the admin.proto messages). status, cost, fit and
    # max_context are served on the engine socket too (status without the per-engine list);
    # sessions, engines, drain, undrain and the prefix listing/inspection/eviction only on the
    # daemon's admin socket (connect to its admin_socket_path; PERMISSION_DENIED elsewhere). --

    def status(self, timeout=None):
        return _call(self.admin_stub.GetStatus, admin_pb2.GetStatusRequest(),
                     self._timeout(timeout))

    def sessions(self, engine_id=0, timeout=None):
        return list(_call(self.admin_stub.ListSessions, admin_pb2.ListSessionsRequest(
            engine_id=engine_id), self._timeout(timeout)).sessions)

    def engines(self, timeout=None):
        return list(_call(self.admin_stub.ListEngines, admin_pb2.ListEnginesRequest(),
                          self._timeout(timeout)).engines)

    def cost(self, capacity, fingerprint=None, plan=None, hf_config=None, layer_lo=0,
             layer_hi=None, tp_ranks=1, spec_snapshot=False, timeout=None):
        """What a session of this shape costs. The model: one of fingerprint (registered),
        plan (a ModelPlan) or hf_config (config.json text or path)."""
        return _call(self.admin_stub.GetCost, admin_pb2.CostRequest(
            model=_selector(fingerprint, plan, hf_config),
            shape=_admin_shape(capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot)),
            self._timeout(timeout))

    def fit(self, capacity, fingerprint=None, plan=None, hf_config=None, layer_lo=0,
            layer_hi=None, tp_ranks=1, spec_snapshot=False, timeout=None):
        return _call(self.admin_stub.GetFit, admin_pb2.FitRequest(
            model=_selector(fingerprint, plan, hf_config),
            shape=_admin_shape(capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot)),
            self._timeout(timeout))

    def max_context(self, fingerprint=None, plan=None, hf_config=None, layer_lo=0,
                    layer_hi=None, tp_ranks=1, spec_snapshot=False, timeout=None):
        return _call(self.admin_stub.GetMaxContext, admin_pb2.MaxContextRequest(
            model=_selector(fingerprint, plan, hf_config),
            shape=_admin_shape(0, layer_lo, layer_hi, tp_ranks, spec_snapshot)),
            self._timeout(timeout))

    def drain(self, timeout=None):
        """Stops admitting new work (UNAVAILABLE); returns the sessions still open."""
        return _call(self.admin_stub.Drain, admin_pb2.DrainRequest(),
                     self._timeout(timeout)).sessions_open

    def undrain(self, timeout=None):
        _call(self.admin_stub.Undrain, admin_pb2.UndrainRequest(), self._timeout(timeout))


def _json_text(config):
    """config.json text, or the path of one."""
    text = config.decode() if isinstance(config, bytes) else config
    if not text.lstrip().startswith("{") and os.path.isfile(text):
        with open(text) as f:
            return f.read()
    return text


def _set_shape(request, plan, capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot):
    request.plan_fingerprint = plan
    request.capacity = capacity
    request.layer_lo = layer_lo
    if layer_hi is not None:
        request.layer_hi = layer_hi
    request.tp_ranks = tp_ranks
    request.spec_snapshot = spec_snapshot


def _admin_shape(capacity, layer_lo, layer_hi, tp_ranks, spec_snapshot):
    shape = admin_pb2.SessionShape(capacity=capacity, layer_lo=layer_lo, tp_ranks=tp_ranks,
                                   spec_snapshot=spec_snapshot)
    if layer_hi is not None:
        shape.layer_hi = layer_hi
    return shape


def _selector(fingerprint, plan, hf_config):
    given = [x is not None for x in (fingerprint, plan, hf_config)]
    if sum(given) != 1:
        raise ValueError("name the model by exactly one of fingerprint, plan, hf_config")
    if fingerprint is not None:
        return admin_pb2.ModelSelector(plan_fingerprint=fingerprint)
    if plan is not None:
        return admin_pb2.ModelSelector(plan=plan)
    return admin_pb2.ModelSelector(hf_config_json=_json_text(hf_config))


class _LeaseStream:
    """One Attach stream. gRPC's request thread sends `hello`, then a heartbeat every `period`
    once the daemon answered (attached()); the lease thread reads the answers, so a stream that
    breaks (the daemon died, or ended the lease) is noticed when it breaks, not at the next
    heartbeat."""

    def __init__(self, stub, hello, wait_for_ready):
        self._hello = hello
        self._period = None  # seconds between heartbeats, set by attached()
        self._go = threading.Event()  # attached() or close()
        self._closed = threading.Event()
        # No deadline on the stream: it lives as long as the engine (heartbeats are its clock).
        self.call = stub.Attach(self._requests(), wait_for_ready=wait_for_ready)

    def _requests(self):
        yield self._hello
        self._go.wait()
        sequence = 0
        while not self._closed.wait(self._period):
            sequence += 1
            yield pb.AttachRequest(heartbeat=pb.Heartbeat(sequence=sequence))
        # Returning ends the request stream: the daemon sees the lease end.

    def first_answer(self):
        """The daemon's Attached; KvError when the stream ended instead (the daemon's reason:
        CANCELLED when close() or a timer cancelled the wait)."""
        try:
            first = next(self.call)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        except StopIteration:
            raise KvError(grpc.StatusCode.INTERNAL, "Attach ended without an answer") from None
        if not first.HasField("attached"):
            self.close()
            raise KvError(grpc.StatusCode.INTERNAL, "Attach answered without Attached")
        return first.attached

    def attached(self, lease_timeout_ms):
        self._period = max(lease_timeout_ms / 3.0, 1.0) / 1000.0
        self._go.set()

    def await_end(self):
        """Reads heartbeat acks until the stream ends (it broke, or close())."""
        try:
            for _ in self.call:
                pass
        except grpc.RpcError:
            pass

    def close(self):
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

    def __init__(self, stub, engine_name, timeout, handoff, cache_scope, force_grpc_step=False):
        self._stub = stub
        self._force_grpc_step = force_grpc_step
        self.step_channel = None  # step_channel.StepChannel while one is open
        self.step_channel_status = None  # KvError: why there is none
        self._timeout = timeout
        self.handoff = handoff  # replaced by each re-attach; closed by stop()
        self._lock = threading.Lock()
        self._stopping = False
        self._reattaching = None  # the _LeaseStream of a re-attach in progress
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
            if error.code == grpc.StatusCode.CANCELLED:
                raise KvError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              "Attach: no answer within %gs" % timeout) from None
            raise
        finally:
            timer.cancel()
        self.engine_id = attached.engine.engine_id
        self.engine_token = attached.engine.engine_token
        self.backend = attached.backend
        self.cache_scope = attached.cache_scope
        self.lost = None  # KvError: why re-attaching stopped
        self.reattaches = 0
        self._take(stream, attached)
        self._open_step_channel(handoff, attached)
        self._thread = threading.Thread(target=self._keep, name="memra-kv-lease", daemon=True)
        self._thread.start()

    def _take(self, stream, attached):
        self._stream = stream
        self.epoch = attached.epoch
        self.lease_timeout_ms = attached.lease_timeout_ms
        self.lease_grace_ms = attached.lease_grace_ms
        stream.attached(attached.lease_timeout_ms)
        self.alive = True

    def _open_step_channel(self, handoff, attached):
        """Opens a step channel over `handoff` when the daemon offers one (client/client.cc
        OpenStepChannel); otherwise, or when that fails, step_channel_status says why and steps
        go over gRPC."""
        channel, status = None, None
        unsupported = step_channel.supported()
        if self._force_grpc_step:
            status = KvError(grpc.StatusCode.FAILED_PRECONDITION, "force_grpc_step is set")
        elif not attached.step_channel:
            status = KvError(grpc.StatusCode.FAILED_PRECONDITION, "the daemon offers no step "
                             "channel (Attached.step_channel)")
        elif unsupported is not None:
            status = KvError(grpc.StatusCode.FAILED_PRECONDITION, unsupported)
        else:
            try:
                region_fd, nbytes, wake_fd = handoff.open_step_channel()
                channel = step_channel.StepChannel(region_fd, nbytes, wake_fd)
            except KvError as error:
                status = error
        old, self.step_channel, self.step_channel_status = self.step_channel, channel, status
        if old is not None:
            old.close()

    def _abandon_step_channel(self):
        """Its daemon end is gone with the lease stream: a step waiting on it fails now."""
        channel = self.step_channel
        if channel is not None:
            channel.abandon()
            self.step_channel_status = KvError(grpc.StatusCode.UNAVAILABLE, "the lease stream "
                                               "broke: the step channel was abandoned")

    def _keep(self):
        while True:
            self._stream.await_end()
            self.alive = False
            self._abandon_step_channel()
            if not self._reattach():
                return

    def _reattach(self):
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
                try:
                    attached = stream.first_answer()
                except KvError as error:
                    stream.close()
                    handoff.close()
                    if (error.is_daemon_restarted or error.code in (
                            grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)):
                        self.lost = error  # the daemon will never know this engine again
                        return False
                    # UNAVAILABLE (no daemon yet, or a ticket of a daemon that died before
                    # this Attach reached the next one), a stream still held, or stop(): again,
                    # with a fresh ticket.
            with self._lock:
                self._reattaching = None
                if self._stopping:
                    if attached is not None:
                        stream.close()
                        handoff.close()
                    return False
                if attached is not None:
                    self.handoff.close()
                    self.handoff = handoff
                    self._take(stream, attached)
                    self._open_step_channel(handoff, attached)
                    self.reattaches += 1
                    return True
            time.sleep(_REATTACH_RETRY_S)

    def stop(self):
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

    def __init__(self, stub, epoch, last_sequence, engine=None):
        self._stub = stub
        self._engine = engine
        self.epoch = epoch
        self.last_sequence = last_sequence
        self._call = None
        self._lock = threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
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
            if error.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise from_rpc_error(error) from None
        self.epoch = event.epoch
        self.last_sequence = event.sequence
        kind = _EVENT_KINDS.get(event.kind, "stored")
        return PrefixEvent(event.sequence, event.epoch, kind, kind == "gap",
                           event.shape_fingerprint, list(event.block_keys), event.boundary_key,
                           event.reason, event.cache_scope,
                           _MEDIA.get(event.medium, "device"), list(event.block_hashes),
                           event.parent_block_hash, list(event.token_ids), event.block_tokens,
                           event.engine_id, event.from_engine_pool)

    def _end(self, call):
        with self._lock:
            if self._call is call:
                self._call = None

    def cancel(self):
        """Ends a wait in next() (from any thread): it stops iterating."""
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()


class StepBatch:
    """Per-step transaction calls for many sessions, sent as one Step (Client.step).
    by_slot: name each session by its dense slot (Session.slot; cheaper for the daemon, and only
    for the attached engine that created it) instead of its id and token; such a batch goes
    over the engine's step channel when it has one (docs/step-channel.md).

    Entries are kept as plain tuples (step_channel.StepChannel.send's form); the Step RPC's
    protobuf request is built only when the batch goes over gRPC (`request`), so a decode loop
    on the channel builds no protobuf per step. Numbers out of range raise ValueError at
    Client.step, before anything is sent, on either path."""

    def __init__(self, by_slot=False):
        self.by_slot = by_slot
        self._entries = []  # (op, slot, generation, rows, next_rows, token_ids)
        self._sessions = []  # the session of each entry (by id and token over gRPC)
        self._wait_event = b""
        self._fits_channel = True  # no session has more K/V layers than a completion carries

    @property
    def request(self):
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

    def _channel_eligible(self):
        # step_channel.StepChannel.carries, kept up to date entry by entry.
        return (not self._wait_event and self._fits_channel
                and len(self._entries) <= step_channel.MAX_STEP_ENTRIES)

    def set_wait_event(self, ipc_event_handle):
        self._wait_event = ipc_event_handle

    def _add(self, session, op, generation=0, rows=0, next_rows=0, token_ids=()):
        if (session._kv_layers > step_channel.MAX_KV_LAYERS
                or len(token_ids) > step_channel.MAX_TOKEN_IDS):
            self._fits_channel = False
        self._entries.append((op, session.slot, generation, rows, next_rows, token_ids))
        self._sessions.append(session)

    def begin(self, session):
        self._add(session, step_channel.OP_BEGIN)

    def prepare(self, session, generation, rows):
        self._add(session, step_channel.OP_PREPARE, generation, rows)

    def publish(self, session, generation):
        self._add(session, step_channel.OP_PUBLISH, generation)

    def commit(self, session, generation, accepted_rows, token_ids=()):
        self._add(session, step_channel.OP_COMMIT, generation, accepted_rows, 0, token_ids)

    def abort(self, session, generation):
        self._add(session, step_channel.OP_ABORT, generation)

    def advance(self, session, generation, accepted_rows, next_rows, token_ids=()):
        """One decode step of `session` in one entry (cache.proto StepAdvance): finishes
        transaction `generation` (publishing its prepared append first when not yet published,
        then committing accepted_rows with their token ids, or none) and begins the next,
        preparing next_rows. generation 0: nothing to finish; next_rows 0: begin none. The
        separate entries' rules and refusals, all or nothing."""
        self._add(session, step_channel.OP_ADVANCE, generation, accepted_rows, next_rows,
                  token_ids)

    def __len__(self):
        return len(self._entries)

    def clear(self):
        self._entries.clear()
        self._sessions.clear()
        self._fits_channel = True


class Session:
    """One session. Thread-compatible. Planes are arrays over this process's mapping of the
    session's arenas; they stay valid until grow() or release() (the memory stays mapped while
    an array over it lives, but the daemon no longer uses it)."""

    def __init__(self, client, session_id, token, slot=0):
        self._client = client
        self.id = session_id
        self.token = token
        self.slot = slot  # the dense slot the daemon handed out (StepBatch(by_slot=True))
        self.ref = pb.SessionRef(session_id=session_id, session_token=token)
        self.wait_event = b""
        self.layout = None
        self._bases = []
        self._planes = {}  # (layer, kind) -> PlaneGeometry
        self._kv_layers = 0  # layers of its layout: over step_channel.MAX_KV_LAYERS, gRPC steps
        self.released = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self.released:
            self.release()

    def set_wait_event(self, ipc_event_handle):
        """Cross-process device ordering (cuda backend; cache.proto DeviceOrdering): every later
        call that makes the daemon touch this session's memory carries the event. Host: b""."""
        self.wait_event = ipc_event_handle

    def _t(self, timeout):
        return self._client._timeout(timeout)

    def _rpc(self, method, request, timeout):
        return self._client._session_call(method, request, timeout)

    def _with_ordering(self, request):
        if self.wait_event:
            request.ordering.wait_event = self.wait_event
        return request

    def _adopt(self, layout):
        mapper = self._client.mapper
        bases = []
        for arena in layout.arenas:
            if arena.backend != mapper.backend:
                raise KvError(grpc.StatusCode.INVALID_ARGUMENT, 'the %s mapper cannot map a "%s" '
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
                    raise KvError(grpc.StatusCode.INTERNAL, "plane of layer %d names arena %d of "
                                  "%d" % (entry.layer, plane.arena, len(bases)))
                planes[(entry.layer, plane.kind)] = PlaneGeometry(
                    plane.kind, plane.arena, plane.offset, plane.bytes, plane.rows,
                    plane.row_bytes,
                    raw=raw_latent and plane.kind == pb.PLANE_KIND_LATENT_ROWS)
        self.layout, self._bases, self._planes = layout, bases, planes
        self._kv_layers = len(layout.layers)

    def geometry(self, layer, kind):
        """The PlaneGeometry of a plane; KvError NOT_FOUND when the layer has none."""
        geometry = self._planes.get((layer, kind))
        if geometry is None:
            raise KvError(grpc.StatusCode.NOT_FOUND, "layer %d has no %s plane"
                          % (layer, pb.PlaneKind.Name(kind) if kind in pb.PlaneKind.values()
                             else str(kind)))
        return geometry

    def has_plane(self, layer, kind):
        return (layer, kind) in self._planes

    def plane(self, layer, kind):
        """The plane as an array with its row shape (planes.PlaneGeometry.dtype_and_shape):
        numpy over the shared memory on the host backend, a CudaPlane on cuda."""
        if self.released:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "session %d was released" % self.id)
        geometry = self.geometry(layer, kind)
        return self._client.mapper.plane(self._bases[geometry.arena], geometry)

    def plane_bytes(self, layer, kind):
        """The plane's every byte, tail pad included, as one uint8 vector."""
        geometry = self.geometry(layer, kind)
        return self._client.mapper.plane_bytes(self._bases[geometry.arena], geometry)

    def typed_geometry(self, layer, kind):
        """The plane as an array (planes.TypedGeometry): element type, shape (rows, heads,
        head_dim), byte strides and the plan's fp8 scale. KvError FAILED_PRECONDITION for a
        block format or a mirror; NOT_FOUND when the layer has no such plane."""
        return typed_geometry(self.layer_layout(layer), self.geometry(layer, kind))

    def typed_plane(self, layer, kind, storage=False):
        """The plane as numpy (rows, heads, head_dim) of its element type, over the shared
        memory (docs/rules.md#formats): K/V in bf16 / f16 / f32 / fp8_e4m3 / fp8_e5m2, latent
        rows, and the f32 state planes. bf16 and fp8 need the ml_dtypes package
        (ml_dtypes.bfloat16, float8_e4m3fn, float8_e5m2); storage=True gives their bits as
        uint16 / uint8 instead (planes.bf16_bits converts f32 to bf16 bits). On cuda a CudaPlane
        of that shape (bf16 / fp8 as their storage bits: __cuda_array_interface__ has no such
        typestr). Valid as long as plane()'s arrays."""
        if self.released:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "session %d was released" % self.id)
        typed = self.typed_geometry(layer, kind)
        mapper = self._client.mapper
        # A CudaPlane carries bf16 / fp8 as their bits anyway: no ml_dtypes needed there.
        bits = storage or mapper.backend == "cuda"
        dtype = typed.element.storage if bits else numpy_dtype(typed.element)
        return mapper.typed_plane(self._bases[typed.plane.arena], typed, dtype)

    def torch_plane(self, layer, kind):
        """The plane as a torch tensor (rows, heads, head_dim) of its element type, no copy: on
        the host backend a CPU tensor over the shared memory, on cuda a CUDA tensor through
        __cuda_array_interface__. KvError FAILED_PRECONDITION when torch is not installed."""
        if self.released:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "session %d was released" % self.id)
        typed = self.typed_geometry(layer, kind)
        return self._client.mapper.torch_plane(self._bases[typed.plane.arena], typed,
                                               torch_dtype(typed.element))

    def layer_layout(self, layer):
        for entry in self.layout.layers:
            if entry.layer == layer:
                return entry
        raise KvError(grpc.StatusCode.NOT_FOUND, "the session has no layer %d" % layer)

    # -- transactions --

    def begin(self, timeout=None):
        r = self._rpc(self._client.cache.Begin, self._with_ordering(pb.SessionRequest(
            session=self.ref)), self._t(timeout))
        return Transaction(r.generation, r.base_len)

    def prepare_append(self, generation, rows, timeout=None):
        r = self._rpc(self._client.cache.PrepareAppend, pb.PrepareAppendRequest(
            session=self.ref, generation=generation, rows=rows), self._t(timeout))
        return _prepared_from_proto(r)

    def publish_append(self, generation, timeout=None):
        """Returns the staged length."""
        return self._rpc(self._client.cache.PublishAppend, self._with_ordering(pb.GenerationRequest(
            session=self.ref, generation=generation)), self._t(timeout)).staged_len

    def commit(self, generation, accepted_rows, token_ids=(), timeout=None):
        """Accepts accepted_rows staged rows (with their token ids, or none); returns the
        committed length."""
        return self._rpc(self._client.cache.Commit, self._with_ordering(pb.CommitRequest(
            session=self.ref, generation=generation, accepted_rows=accepted_rows,
            token_ids=token_ids)), self._t(timeout)).committed_len

    def abort(self, generation, timeout=None):
        """Returns the committed length."""
        return self._rpc(self._client.cache.Abort, self._with_ordering(pb.GenerationRequest(
            session=self.ref, generation=generation)), self._t(timeout)).committed_len

    def advance(self, generation, accepted_rows, next_rows, token_ids=(), timeout=None):
        """StepBatch.advance as a one-entry Step carrying this session's wait event; the
        StepOutcome (begun, prepared, committed_len, published), or KvError when refused (the
        session is then unchanged)."""
        batch = StepBatch()
        if self.wait_event:
            batch.set_wait_event(self.wait_event)
        batch.advance(self, generation, accepted_rows, next_rows, token_ids)
        outcome = self._client.step(batch, timeout)[0]
        if not outcome.ok:
            raise outcome.error
        return outcome

    # -- lengths --

    def rewind(self, target, timeout=None):
        return self._rpc(self._client.cache.Rewind, self._with_ordering(pb.RewindRequest(
            session=self.ref, target=target)), self._t(timeout)).state

    def can_rewind(self, target, timeout=None):
        return self._rpc(self._client.cache.CanRewind, pb.RewindRequest(
            session=self.ref, target=target), self._t(timeout)).can_rewind

    def hydrate(self, logical_len, resident_starts=(), timeout=None):
        """Fresh session only: publishes logical_len rows already written through the planes."""
        return self._rpc(self._client.cache.Hydrate, self._with_ordering(pb.HydrateRequest(
            session=self.ref, logical_len=logical_len, resident_starts=resident_starts)),
            self._t(timeout)).state

    def spec_snapshot(self, timeout=None):
        return self._rpc(self._client.cache.SpecSnapshot, self._with_ordering(pb.SessionRequest(
            session=self.ref)), self._t(timeout)).state

    def spec_rollback(self, accept_len, timeout=None):
        return self._rpc(self._client.cache.SpecRollback, self._with_ordering(
            pb.SpecRollbackRequest(session=self.ref, accept_len=accept_len)),
            self._t(timeout)).state

    def reset(self, timeout=None):
        """Empty again, on the same arena (nothing is re-mapped)."""
        return self._rpc(self._client.cache.ResetSession, self._with_ordering(pb.SessionRequest(
            session=self.ref)), self._t(timeout)).state

    def taint(self, reason, timeout=None):
        return self._rpc(self._client.cache.Taint, pb.TaintRequest(session=self.ref, reason=reason),
                     self._t(timeout)).state

    def state(self, timeout=None):
        """The daemon's memra.kv.v1.SessionState of this session."""
        return self._rpc(self._client.cache.GetSessionState, pb.GetSessionStateRequest(
            session=self.ref), self._t(timeout)).state

    def grow(self, target_capacity, timeout=None):
        """Regrows to target_capacity: maps the new arena, acknowledges the new layout (the
        daemon then frees the old arena) and unmaps the old one. Arrays over the old planes must
        no longer be used."""
        grown = self._rpc(self._client.cache.Grow, self._with_ordering(pb.GrowRequest(
            session=self.ref, target_capacity=target_capacity)), self._t(timeout))
        old = self.layout
        self._adopt(grown.layout)
        state = self._rpc(self._client.cache.AcknowledgeGrow, pb.AcknowledgeGrowRequest(
            session=self.ref, layout_version=grown.layout.layout_version), self._t(timeout)).state
        old_handles = {a.handle for a in old.arenas} - {a.handle for a in self.layout.arenas}
        for handle in old_handles:
            self._client.mapper.unmap(handle)
        return state

    def release(self, timeout=None):
        """Frees the session's memory in the daemon and unmaps it here; returns bytes freed."""
        if self.released:
            raise KvError(grpc.StatusCode.FAILED_PRECONDITION, "session %d was released" % self.id)
        self.released = True  # whatever the daemon answers, this process stops using the memory
        pooled = set()
        try:
            response = self._rpc(self._client.cache.ReleaseSession, self._with_ordering(
                pb.SessionRequest(session=self.ref)), self._t(timeout))
            # Arenas the daemon pooled for this engine stay mapped for the next session that
            # gets one back (same handle); those it has freed since are unmapped.
            pooled = set(response.pooled_handles)
            self._client._unmap_freed_pool_arenas(response.unmap_handles)
            return response.freed_bytes
        finally:
            if self.layout is not None:
                for arena in self.layout.arenas:
                    if arena.handle not in pooled:
                        self._client.mapper.unmap(arena.handle)
            self._bases = []
