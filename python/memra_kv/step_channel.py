"""The engine's end of its step channel, in Python (docs/step-channel.md): the twin of
client/step_channel_client.{h,cc}, speaking the layout of common/step_channel.h.

A Step by slot becomes fixed-size records written into the shared submission ring, and its
results are read from the completion ring: no protobuf, no gRPC, no socket per step. The daemon
is woken through its eventfd only when it sleeps; the engine waits for completions with a short
spin (small steps only), then FUTEX_WAIT on cq_tail.

Client.step uses it for batches it can carry (StepChannel.carries); everything else goes over
gRPC, with the same outcomes: both paths end in the daemon's one dispatcher.

Memory ordering: Python has no atomics, so the engine's stores into the region are plain
stores and its loads plain loads. On x86-64 (TSO) a plain store has release and a plain load
acquire semantics, which is what the protocol needs, except the one store-then-load pair of the
doorbell (store sq_tail, then read daemon_sleeping: the daemon sets daemon_sleeping, then
re-reads sq_tail). Without a fence that pair can miss a falling-asleep daemon, so before it
FUTEX_WAITs the engine rings the doorbell once per wait regardless (an eventfd write is a
syscall: it orders the sq_tail store before the daemon's wake-up). The FUTEX_WAIT itself
re-checks cq_tail in the kernel after a full barrier, so the engine_waiting / cq_tail pair needs
nothing more. Other architectures would need real fences: there the client steps over gRPC
(`supported()`).
"""

import ctypes
import mmap
import os
import platform
import struct
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import grpc

from .errors import KvError

# ---- common/step_channel.h, version 2 ----

MAGIC = 0x4D4B5343  # "CSKM" little-endian
VERSION = 2  # in the header and in every submission record
SLOTS = 512
SUBMISSION_SIDE_BYTES = 1024  # per ring slot: 256 token ids
COMPLETION_SIDE_BYTES = 8192  # per ring slot: a message or a plan
HEADER_BYTES = 4096
MAX_STEP_ENTRIES = 65536  # the Step RPC's limit; a bigger batch goes over gRPC for its refusal
MAX_KV_LAYERS = 128  # sessions with more K/V layers are stepped over gRPC
MAX_TOKEN_IDS = SUBMISSION_SIDE_BYTES // 4

# Submission record operations (step_channel::Op); a completion echoes its record's (0 when
# refused). 7 to 15 are reserved for session lifecycle records.
OP_BEGIN, OP_PREPARE, OP_PUBLISH, OP_COMMIT, OP_ABORT, OP_ADVANCE = 1, 2, 3, 4, 5, 6
# CompletionSide: what a completion's side span holds.
SIDE_NONE, SIDE_MESSAGE, SIDE_LAYERS, SIDE_LAYERS_TOO_LARGE = 0, 1, 2, 3
# LayerAppendRecord flags.
LAYER_RING, LAYER_REBASE = 1, 2

_CLOSE_REASONS = {0: "open", 1: "the engine was reclaimed", 2: "the engine opened another channel",
                  3: "the engine broke the ring protocol", 4: "the daemon is shutting down"}

# Header: magic, version, slots, the two record sizes, the two side span sizes, reserved0,
# region_bytes and the four offsets; then the counters, each on its own cache line (offsets
# checked against the C++ struct's offsetof).
_HEADER = struct.Struct("<8I5Q")
_HEADER_FIELDS = ("magic", "version", "slots", "submission_record_bytes",
                  "completion_record_bytes", "submission_side_bytes", "completion_side_bytes",
                  "reserved0", "region_bytes", "submissions_offset", "completions_offset",
                  "submission_side_offset", "completion_side_offset")
SQ_TAIL, SQ_HEAD, CQ_TAIL, ENGINE_WAITING, CQ_HEAD, DAEMON_SLEEPING, CLOSED = (
    128, 192, 256, 260, 320, 384, 388)
_U32 = struct.Struct("<I")
_DOORBELL = struct.pack("<Q", 1)  # one eventfd write

# SubmissionRecord (64 bytes): user_data, slot, op, version, reserved[2], generation, rows,
# next_rows, side_offset, side_length, reserved2, reserved3.
SUBMISSION = struct.Struct("<QIBB2xQQQQI12x")
# CompletionRecord (96 bytes): user_data, code, op, published, has_prepared, side_kind,
# generation, base_len, target, staged_len, committed_len, restart_previous_epoch,
# restart_epoch, side_offset, side_length, reserved, reserved2.
COMPLETION = struct.Struct("<QiBBBBQQQQQQQQI12x")
# LayerAppendRecord (40 bytes), a prepared plan's layers in the side span: layer, flags
# (LAYER_RING | LAYER_REBASE), reserved[3], write_row, src_row, keep_rows, new_base.
LAYER_APPEND = struct.Struct("<IB3xQQQQ")
assert SUBMISSION.size == 64 and COMPLETION.size == 96 and LAYER_APPEND.size == 40

# How long a send polls cq_tail before FUTEX_WAIT, and for how many records in flight at most
# (client/step_channel_client.cc's kSpin and kMaxRecordsToSpinFor, for the same reasons); one
# FUTEX_WAIT at most this long (the deadline and `closed` are re-checked between waits).
_SPIN_S = 50e-6
_MAX_RECORDS_TO_SPIN_FOR = 16
_MAX_FUTEX_WAIT_S = 0.1

# One Step entry as send() takes it: (op, slot, generation, rows, next_rows, token_ids).
Entry = Tuple[int, int, int, int, int, Sequence[int]]
# A completion record as COMPLETION unpacks it (index it with the C_* constants).
Record = Tuple[int, ...]
Result = TypeVar("Result")

# Indexes into a completion tuple (COMPLETION.unpack_from): what ChannelResult reads.
(C_USER_DATA, C_CODE, C_OP, C_PUBLISHED, C_HAS_PREPARED, C_SIDE_KIND, C_GENERATION,
 C_BASE_LEN, C_TARGET, C_STAGED_LEN, C_COMMITTED_LEN, C_RESTART_PREVIOUS_EPOCH, C_RESTART_EPOCH,
 C_SIDE_OFFSET, C_SIDE_LENGTH) = range(15)


def _page_aligned(n: int) -> int:
    page = mmap.PAGESIZE
    return (n + page - 1) // page * page


def layout() -> Tuple[int, int, int, int, int]:
    """(submissions, completions, submission side, completion side, region bytes): the offsets
    of common/step_channel.h LayoutFor(SLOTS)."""
    submissions = HEADER_BYTES
    completions = submissions + _page_aligned(SLOTS * SUBMISSION.size)
    submission_side = completions + _page_aligned(SLOTS * COMPLETION.size)
    completion_side = submission_side + _page_aligned(SLOTS * SUBMISSION_SIDE_BYTES)
    region = completion_side + _page_aligned(SLOTS * COMPLETION_SIDE_BYTES)
    return submissions, completions, submission_side, completion_side, region


def check_header(region: "bytes | bytearray | mmap.mmap", nbytes: int) -> None:
    """step_channel::CheckHeader: KvError INVALID_ARGUMENT naming the field and both values
    when the region's constant fields disagree with this module's layout, or the region is
    smaller than its layout needs."""
    if nbytes < _HEADER.size:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "step channel region of %d bytes: "
                      "smaller than its header" % nbytes)
    got: Dict[str, int] = dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(region, 0)))
    submissions, completions, submission_side, completion_side, region_bytes = layout()
    want = (("magic", MAGIC), ("version", VERSION), ("slots", SLOTS),
            ("submission_record_bytes", SUBMISSION.size),
            ("completion_record_bytes", COMPLETION.size),
            ("submission_side_bytes", SUBMISSION_SIDE_BYTES),
            ("completion_side_bytes", COMPLETION_SIDE_BYTES), ("region_bytes", region_bytes),
            ("submissions_offset", submissions), ("completions_offset", completions),
            ("submission_side_offset", submission_side),
            ("completion_side_offset", completion_side))
    for name, value in want:
        if got[name] != value:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "step channel header: %s is %d; this "
                          "library speaks %d" % (name, got[name], value))
    if nbytes < region_bytes:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "step channel region of %d bytes; its "
                      "layout needs %d" % (nbytes, region_bytes))


def supported() -> Optional[str]:
    """Why this process cannot use a step channel (a sentence), or None when it can: the
    ordering argument above holds on x86-64 Linux only."""
    if not platform.system() == "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return ("the Python step channel needs x86-64 Linux (its plain loads and stores rely "
                "on x86-64's ordering); this is %s %s" % (platform.system(), platform.machine()))
    return None


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a word of a MAP_SHARED mapping (shared futexes: not
    FUTEX_PRIVATE_FLAG), through libc's syscall(); ctypes releases the GIL for the call."""

    _SYS_FUTEX = 202  # x86-64
    _WAIT, _WAKE = 0, 1

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long

    def wait(self, address: int, expected: int, timeout_s: float) -> None:
        """Returns after a wake, the timeout, a signal, or at once when the word differs from
        `expected`; callers re-check what they wait for."""
        seconds = int(timeout_s)
        relative = self._Timespec(seconds, int((timeout_s - seconds) * 1e9))
        self._syscall(ctypes.c_long(self._SYS_FUTEX), ctypes.c_void_p(address),
                      ctypes.c_int(self._WAIT), ctypes.c_uint32(expected),
                      ctypes.byref(relative), None, ctypes.c_int(0))

    def wake_all(self, address: int) -> None:
        self._syscall(ctypes.c_long(self._SYS_FUTEX), ctypes.c_void_p(address),
                      ctypes.c_int(self._WAKE), ctypes.c_int(2 ** 31 - 1), None, None,
                      ctypes.c_int(0))


def plan_layers(side: bytes) -> List[Tuple[int, int, int, int, int, int]]:
    """A prepared plan's side span as (layer, flags, write_row, src_row, keep_rows, new_base)
    tuples, in layer order. REQUIRES: len(side) is a multiple of LAYER_APPEND.size (the
    completion reader checked it)."""
    return [(layer, flags, write_row, src_row, keep_rows, new_base)
            for layer, flags, write_row, src_row, keep_rows, new_base
            in LAYER_APPEND.iter_unpack(side)]


def _too_large(record: Record) -> Tuple[Record, bytes]:
    """A prepared append whose plan did not fit the side span (only sessions over
    MAX_KV_LAYERS, which the client steps over gRPC): DATA_LOSS, as the C++ client reports it.
    Returns the record with that code and no payload, and the message's bytes."""
    message = ("the append was prepared (generation %d, target %d) but its plan of %d bytes "
               "does not fit the step channel; step sessions of more than %d K/V layers over "
               "gRPC" % (record[C_GENERATION], record[C_TARGET], record[C_SIDE_LENGTH],
                         MAX_KV_LAYERS))
    changed = list(record)
    changed[C_CODE] = grpc.StatusCode.DATA_LOSS.value[0]
    changed[C_OP] = 0
    return tuple(changed), message.encode()


class ChannelResult:
    """One entry's completion as the daemon wrote it: `record` is the CompletionRecord tuple
    (index it with the C_* constants), `side` its side span's bytes (the refusal message, or
    the prepared append's LayerAppendRecords: plan_layers), copied out of the ring."""

    __slots__ = ("record", "side")

    def __init__(self, record: Record, side: bytes) -> None:
        self.record = record
        self.side = side

    @property
    def code(self) -> int:
        """google.rpc.Code (0 = OK)."""
        return self.record[C_CODE]

    @property
    def message(self) -> str:
        """The refusal's message ("" when OK)."""
        return self.side.decode("utf-8", "replace") if self.record[C_CODE] != 0 else ""


class StepChannel:
    """The engine's mapping of its step channel. Thread-safe: one send at a time (a lock); a
    send that failed (the daemon closed the channel, no answer within the deadline, abandon())
    breaks the channel for good, since records may still be in flight: the client then steps
    over gRPC."""

    def __init__(self, region_fd: int, nbytes: int, wake_fd: int) -> None:
        """Maps the region (the descriptors of the handoff's step channel answer; this object
        owns both from here on, also when it raises) and checks its header."""
        try:
            self._region = mmap.mmap(region_fd, nbytes, mmap.MAP_SHARED,
                                     mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as error:
            os.close(region_fd)
            os.close(wake_fd)
            raise KvError(grpc.StatusCode.INTERNAL, "mapping the step channel memfd of %d bytes:"
                          " %s" % (nbytes, error)) from None
        os.close(region_fd)  # the mapping keeps the memory
        self._wake_fd = wake_fd
        try:
            check_header(self._region, nbytes)
        except KvError:
            self.close()
            raise
        (self._submissions, self._completions, self._submission_side,
         self._completion_side, _) = layout()
        # The futex word's address in this process (the export is dropped at once so the
        # mapping can be closed; the address stays valid while it is mapped).
        anchor = ctypes.c_char.from_buffer(self._region)
        self._cq_tail_address = ctypes.addressof(anchor) + CQ_TAIL
        del anchor
        self._futex = _Futex()
        self._lock = threading.Lock()
        # This side's own counters (never read back from the region). Guarded by _lock.
        self._sq_tail = 0
        self._cq_head = 0
        self._rang = False  # the doorbell was rung since sq_tail was last published
        self.broken = False
        self._abandoned = False

    def close(self) -> None:
        """Abandons the channel and unmaps it (the daemon's end closes with the lease or when
        the engine opens another)."""
        self.abandon()
        with self._lock:
            if not self._region.closed:
                self._region.close()
            if self._wake_fd >= 0:
                os.close(self._wake_fd)
                self._wake_fd = -1

    @staticmethod
    def carries(entries: Sequence[Entry]) -> bool:
        """Whether `entries` (send's tuples) can go over the channel: at most MAX_STEP_ENTRIES,
        each naming an operation, token ids within a record's side span. The layer limit
        (MAX_KV_LAYERS) and the wait event are the caller's: it knows the sessions."""
        if len(entries) > MAX_STEP_ENTRIES:
            return False
        for entry in entries:
            if not OP_BEGIN <= entry[0] <= OP_ADVANCE or len(entry[5]) > MAX_TOKEN_IDS:
                return False
        return True

    def abandon(self) -> None:
        """The lease stream broke (the daemon died or restarted) or the engine detached: the
        daemon will answer no more. Breaks the channel and wakes a send waiting for
        completions, which fails at once (UNAVAILABLE) instead of at its deadline."""
        self._abandoned = True
        self.broken = True
        if not self._region.closed:
            self._futex.wake_all(self._cq_tail_address)

    def ring_doorbell(self) -> None:
        """Wakes the daemon's serving thread (a write of its eventfd)."""
        try:
            os.write(self._wake_fd, _DOORBELL)
        except OSError:
            pass  # a full counter still wakes the daemon's edge-triggered epoll

    def send(self, entries: Sequence[Entry], timeout_s: float,
             make_result: Callable[[Record, bytes], Result]) -> Optional[List[Result]]:
        """Runs `entries` in order, as one Step; one result per entry, in order:
        make_result(record, side) of its completion (ChannelResult, or the caller's outcome).

        entries: a sequence of (op, slot, generation, rows, next_rows, token_ids) with op one of
        OP_*; rows are prepare rows or commit / advance accepted rows; token_ids a sequence of
        int32 (commit, advance; empty otherwise). REQUIRES: carries(entries).

        KvError UNAVAILABLE when the daemon closed the channel (saying why), answered nothing
        within `timeout_s` or the channel was abandoned meanwhile; INTERNAL when its
        completions break the protocol. After any of these the channel is broken. ValueError
        (nothing sent) for a number a record cannot hold. None, with nothing sent, when the
        channel was broken before this send could start: the caller steps over gRPC."""
        with self._lock:
            if self.broken:
                return None
            try:
                return self._run(entries, time.monotonic() + timeout_s, make_result)
            except KvError:
                self.broken = True
                raise

    # -- the ring protocol (callers hold _lock) --

    def _run(self, entries: Sequence[Entry], give_up: float,
             make_result: Callable[[Record, bytes], Result]) -> List[Result]:
        count = len(entries)
        if count > SLOTS - (self._sq_tail - self._cq_head):
            # Records go out window by window: a bad number must refuse the whole step before
            # the first window is published.
            for index in range(count):
                error = self._refusal(entries, index)
                if error is not None:
                    raise error
        results: List[Optional[Result]] = [None] * count
        submitted = completed = 0
        while completed < count:
            if submitted < count and self._sq_tail - self._cq_head < SLOTS:
                submitted = self._submit(entries, submitted)
            tail = self._await_completions(give_up)
            available = (tail - self._cq_head) & 0xFFFFFFFF
            if available > self._sq_tail - self._cq_head:
                raise KvError(grpc.StatusCode.INTERNAL, "step channel: completion tail %d is "
                              "past the %d records written" % (tail, self._sq_tail & 0xFFFFFFFF))
            self._complete(results, available, make_result)
            completed += available
            _U32.pack_into(self._region, CQ_HEAD, self._cq_head & 0xFFFFFFFF)
        return results  # type: ignore[return-value]  # every entry completed: none is None

    def _publish(self, sq_tail: int) -> None:
        """Stores sq_tail (the records before it are written) and rings a sleeping daemon."""
        region = self._region
        _U32.pack_into(region, SQ_TAIL, sq_tail & 0xFFFFFFFF)
        self._rang = _U32.unpack_from(region, DAEMON_SLEEPING)[0] != 0
        if self._rang:
            self.ring_doorbell()

    def _pack(self, region: "bytearray | mmap.mmap", offset: int, index: int,
              entries: Sequence[Entry], side_offset: int) -> None:
        """Writes entries[index] as the record at `offset`; ValueError naming the entry for a
        number the record cannot hold."""
        op, slot, generation, rows, next_rows, token_ids = entries[index]
        try:
            SUBMISSION.pack_into(region, offset, index, slot, op, VERSION, generation, rows,
                                 next_rows, side_offset, 4 * len(token_ids))
        except struct.error:
            raise ValueError("step entry %d: slot %r, generation %r, rows %r, next rows %r: a "
                             "number out of range (slot u32, the others u64)"
                             % (index, slot, generation, rows, next_rows)) from None

    def _submit(self, entries: Sequence[Entry], first: int) -> int:
        """Writes entries[first:] while the ring has room, then publishes them; returns the
        index after the last. (Publishing the first records while writing the rest would let
        the daemon start sooner, but a bad number later in the window could then no longer
        refuse the whole step.)"""
        region = self._region
        pack_into = SUBMISSION.pack_into
        submissions = self._submissions
        end = min(len(entries), first + SLOTS - (self._sq_tail - self._cq_head))
        ring = self._sq_tail % SLOTS
        index = first
        try:
            while index < end:
                op, slot, generation, rows, next_rows, token_ids = entries[index]
                if token_ids:
                    side_offset = ring * SUBMISSION_SIDE_BYTES
                    struct.pack_into("<%di" % len(token_ids), region,
                                     self._submission_side + side_offset, *token_ids)
                    pack_into(region, submissions + ring * 64, index, slot, op, VERSION,
                              generation, rows, next_rows, side_offset, 4 * len(token_ids))
                else:
                    pack_into(region, submissions + ring * 64, index, slot, op, VERSION,
                              generation, rows, next_rows, 0, 0)
                index += 1
                ring = (ring + 1) % SLOTS
        except struct.error:
            # Nothing of this window is visible to the daemon (sq_tail is not stored), and
            # _run checked every window past the first before writing any.
            raise self._refusal(entries, index) or ValueError(
                "step entry %d: a record cannot hold it" % index) from None
        self._sq_tail += end - first
        self._publish(self._sq_tail)
        return end

    def _refusal(self, entries: Sequence[Entry], index: int) -> Optional[ValueError]:
        """The ValueError entries[index] gets (a number its record cannot hold), or None."""
        token_ids = entries[index][5]
        try:
            struct.pack("<%di" % len(token_ids), *token_ids)
        except struct.error:
            return ValueError("step entry %d: a token id out of int32 range" % index)
        try:
            self._pack(bytearray(SUBMISSION.size), 0, index, entries, 0)
        except ValueError as error:
            return error
        return None

    def _await_completions(self, give_up: float) -> int:
        """Waits until the daemon wrote a completion past _cq_head: its tail, or KvError."""
        region = self._region
        cq_head = self._cq_head & 0xFFFFFFFF
        outstanding = self._sq_tail - self._cq_head
        spin_until = time.perf_counter() + (_SPIN_S if outstanding <= _MAX_RECORDS_TO_SPIN_FOR
                                            else 0.0)
        while True:
            tail: int = _U32.unpack_from(region, CQ_TAIL)[0]
            if tail != cq_head:
                return tail
            if self._abandoned:
                raise KvError(grpc.StatusCode.UNAVAILABLE, "this engine's step channel was "
                              "abandoned: its lease stream to the daemon broke (the daemon died "
                              "or restarted) or it detached; records in flight (%d) may or may "
                              "not have run: check the sessions' state" % outstanding)
            closed = _U32.unpack_from(region, CLOSED)[0]
            if closed != 0:
                raise KvError(grpc.StatusCode.UNAVAILABLE, "the daemon closed this engine's step "
                              "channel (%s); records in flight may or may not have run: check "
                              "the sessions' state" % _CLOSE_REASONS.get(closed,
                                                                         "an unknown reason"))
            if time.perf_counter() < spin_until:
                continue
            left = give_up - time.monotonic()
            if left <= 0:
                raise KvError(grpc.StatusCode.UNAVAILABLE, "the daemon answered no step channel "
                              "record within the deadline (%d completions read, %d records "
                              "written)" % (cq_head, self._sq_tail & 0xFFFFFFFF))
            if not self._rang:
                # The doorbell's store-then-load pair has no fence here (module docstring): a
                # ring after each publish of sq_tail, at the latest before sleeping, makes a
                # missed wake-up impossible.
                self.ring_doorbell()
                self._rang = True
            _U32.pack_into(region, ENGINE_WAITING, 1)
            if _U32.unpack_from(region, CQ_TAIL)[0] == cq_head and not self._abandoned:
                self._futex.wait(self._cq_tail_address, cq_head, min(left, _MAX_FUTEX_WAIT_S))
            _U32.pack_into(region, ENGINE_WAITING, 0)

    def _complete(self, results: List[Optional[Result]], available: int,
                  make_result: Callable[[Record, bytes], Result]) -> None:
        """Reads `available` completions from _cq_head into `results`."""
        region = self._region
        count = len(results)
        completion_side = self._completion_side
        ring = self._cq_head % SLOTS
        while available:
            # The contiguous run up to the ring's end, unpacked in one call.
            run = min(available, SLOTS - ring)
            start = self._completions + ring * 96
            for record in COMPLETION.iter_unpack(region[start:start + run * 96]):
                index = record[0]  # C_USER_DATA
                if index >= count:
                    raise KvError(grpc.StatusCode.INTERNAL, "step channel completion for entry "
                                  "%d of a step of %d" % (index, count))
                side = b""
                if record[1] != 0 or record[4]:  # C_CODE, C_HAS_PREPARED
                    own = ring * COMPLETION_SIDE_BYTES
                    if (record[1] == 0 and record[5] == SIDE_LAYERS and record[13] == own
                            and record[14] <= COMPLETION_SIDE_BYTES
                            and record[14] % 40 == 0):  # LAYER_APPEND.size
                        # A plan where it belongs (the common case): its bytes.
                        side = region[completion_side + own:
                                      completion_side + own + record[14]]
                    else:
                        record, side = self._side(record, ring, completion_side)
                results[index] = make_result(record, side)
                ring += 1
            ring %= SLOTS
            available -= run
            self._cq_head += run

    def _side(self, record: Record, ring: int, completion_side: int) -> Tuple[Record, bytes]:
        """(record, side bytes) of a refusal or a prepared plan: the side span checked as the
        C++ client checks it; a plan too large for it as DATA_LOSS."""
        own = ring * COMPLETION_SIDE_BYTES
        length = record[C_SIDE_LENGTH]
        in_span = record[C_SIDE_OFFSET] == own and length <= COMPLETION_SIDE_BYTES
        op = record[C_OP]
        planned = record[C_CODE] == 0 and (
            op == OP_PREPARE or (op == OP_ADVANCE and record[C_HAS_PREPARED]))
        if planned and record[C_SIDE_KIND] == SIDE_LAYERS_TOO_LARGE:
            return _too_large(record)
        if planned and (record[C_SIDE_KIND] != SIDE_LAYERS or not in_span
                        or length % LAYER_APPEND.size != 0):
            raise KvError(grpc.StatusCode.INTERNAL, "step channel completion for entry %d: its "
                          "prepared plan is not in its side span (kind %d, offset %d, %d bytes)"
                          % (record[C_USER_DATA], record[C_SIDE_KIND], record[C_SIDE_OFFSET],
                             length))
        if not in_span:
            return record, b""
        start = completion_side + own
        return record, self._region[start:start + length]
