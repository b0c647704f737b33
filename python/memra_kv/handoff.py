"""The engine's end of memra-kvd's handoff socket (common/handoff_wire.h, docs/handoff.md).

An engine connects before it attaches and attaches with the ticket the daemon sends; afterwards
it trades a session's arena handles for descriptors of the arenas' memfds (SCM_RIGHTS). The
daemon hands a descriptor only to the engine that owns the session, after checking the session
token; anything else is a refusal record (status code + message), and the connection stays open.

Frames: u32 length (little-endian; the bytes that follow) | u8 version (1) | u8 kind | body.
"""

import os
import socket
import struct
import threading
from typing import List, Sequence, Tuple

import grpc

from .errors import KvError, MemraKvError, code_from_value

VERSION = 1
KIND_TICKET, KIND_ARENA_REQUEST, KIND_ARENA, KIND_REFUSAL = 1, 2, 3, 4
# The step channel (docs/step-channel.md): engine -> daemon an empty request; daemon -> engine
# u64 region bytes with two descriptors (the region's sealed memfd, then the daemon's eventfd).
KIND_STEP_CHANNEL_REQUEST, KIND_STEP_CHANNEL = 5, 6
MAX_DESCRIPTORS = 2  # one frame carries at most (the step channel answer's two)
# The block store's buffer offer (docs/block-store.md): engine -> daemon u64 bytes with one
# descriptor attached; daemon -> engine u64 buffer id.
KIND_BUFFER_OFFER, KIND_BUFFER_ID = 16, 17
MAX_FRAME_BYTES = 1024
TICKET_BYTES = 32  # u64 daemon instance | u64 connection | 16 random bytes (opaque here)
MAX_TOKEN_BYTES = 64
MAX_HANDLE_BYTES = 256


def default_handoff_path(socket_path: str) -> str:
    """The handoff socket beside `socket_path`, as the daemon derives it when
    handoff_socket_path is not configured: ".sock" replaced by ".handoff.sock"."""
    stem = socket_path[:-len(".sock")] if socket_path.endswith(".sock") else socket_path
    return stem + ".handoff.sock"


def encode_arena_request(session_id: int, token: bytes, handle: bytes) -> bytes:
    """The frame asking for a host arena's descriptor (docs/handoff.md)."""
    if len(token) > MAX_TOKEN_BYTES:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "handoff arena request: a session token "
                      "of %d bytes; at most %d" % (len(token), MAX_TOKEN_BYTES))
    if not 1 <= len(handle) <= MAX_HANDLE_BYTES:
        raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "handoff arena request: an arena handle "
                      "of %d bytes; 1 to %d" % (len(handle), MAX_HANDLE_BYTES))
    body = (struct.pack("<QB", session_id, len(token)) + token
            + struct.pack("<H", len(handle)) + handle)
    return struct.pack("<IBB", 2 + len(body), VERSION, KIND_ARENA_REQUEST) + body


def decode_refusal(body: bytes) -> MemraKvError:
    """The KvError a refusal record carries."""
    if len(body) < 6:
        return KvError(grpc.StatusCode.INTERNAL, "handoff refusal of %d bytes" % len(body))
    code, length = struct.unpack_from("<IH", body)
    message = body[6:6 + length].decode("utf-8", "replace")
    # Code 0 (OK) is never a refusal: UNKNOWN, like an unknown code.
    return KvError(code_from_value(code) if code else grpc.StatusCode.UNKNOWN, message)


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


class HandoffChannel:
    """One connection to the handoff socket. Thread-safe (requests are serialised)."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self._timeout = timeout
        self._lock = threading.Lock()
        self._input = b""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            try:
                self._sock.connect(path)
            except OSError as error:
                raise KvError(grpc.StatusCode.UNAVAILABLE, "memra-kvd's handoff socket %s does "
                              "not answer: %s" % (path, error.strerror or error)) from None
            kind, body, fds = self._read_frame()
            _close_all(fds)
            if kind == KIND_REFUSAL:
                raise decode_refusal(body)
            if kind != KIND_TICKET or len(body) != TICKET_BYTES:
                raise KvError(grpc.StatusCode.INTERNAL, "handoff socket %s: the first frame is "
                              "kind %d of %d bytes, not a ticket" % (path, kind, len(body)))
            self.ticket = body
        except BaseException:
            self._sock.close()
            raise

    def close(self) -> None:
        """Closes the connection (the daemon drops what it bound to it)."""
        self._sock.close()

    def fetch_arena(self, session_id: int, token: bytes, handle: bytes) -> Tuple[int, int]:
        """(descriptor, bytes) of arena `handle` of session `session_id`; the caller closes
        the descriptor. KvError with the daemon's code and message when it refuses."""
        nbytes, fds = self._exchange(encode_arena_request(session_id, token, handle),
                                     KIND_ARENA, "an arena request")
        if not fds:
            raise KvError(grpc.StatusCode.DATA_LOSS, "handoff socket %s: the arena answer came "
                          "without a descriptor" % self.path)
        _close_all(fds[1:])
        return fds[0], nbytes

    def open_step_channel(self) -> Tuple[int, int, int]:
        """(region descriptor, region bytes, wake descriptor) of a new step channel for the
        engine this connection is bound to (docs/step-channel.md; ask only when Attached
        offered one); the caller closes both descriptors. A second request replaces the first
        channel. KvError with the daemon's code and message when it refuses."""
        nbytes, fds = self._exchange(struct.pack("<IBB", 2, VERSION, KIND_STEP_CHANNEL_REQUEST),
                                     KIND_STEP_CHANNEL, "a step channel request")
        if len(fds) != 2:
            _close_all(fds)
            raise KvError(grpc.StatusCode.DATA_LOSS, "handoff socket %s: the step channel answer "
                          "came with %d descriptors, not 2" % (self.path, len(fds)))
        return fds[0], nbytes, fds[1]

    def offer_buffer(self, fd: int, nbytes: int) -> int:
        """Offers the engine's own pool memory to the block store: `fd` (kept open by the
        caller) is a memfd sealed with F_SEAL_SHRINK and at least `nbytes` long. Returns the
        buffer id RegisterEngineBuffers names it by (single use, valid while this connection
        is open). KvError with the daemon's code and message when it refuses."""
        if nbytes <= 0:
            raise KvError(grpc.StatusCode.INVALID_ARGUMENT, "handoff buffer offer of %d bytes"
                          % nbytes)
        frame = struct.pack("<IBBQ", 2 + 8, VERSION, KIND_BUFFER_OFFER, nbytes)
        buffer_id, extra = self._exchange(frame, KIND_BUFFER_ID, "a buffer offer", [fd])
        _close_all(extra)
        return buffer_id

    def _exchange(self, frame: bytes, answer_kind: int, what: str,
                  pass_fds: Sequence[int] = ()) -> Tuple[int, List[int]]:
        """Sends one request frame (with `pass_fds`) and reads its answer: (the answer's u64
        body, the descriptors that came with it, the caller's to close). KvError with the
        daemon's code and message for a refusal; INTERNAL for another kind or body."""
        with self._lock:
            try:
                if pass_fds:
                    socket.send_fds(self._sock, [frame], list(pass_fds))
                else:
                    self._sock.sendall(frame)
            except OSError as error:
                raise KvError(grpc.StatusCode.UNAVAILABLE, "handoff socket %s: the daemon closed "
                              "the connection (%s)" % (self.path, error)) from None
            kind, body, fds = self._read_frame()
        if kind == KIND_REFUSAL:
            _close_all(fds)
            raise decode_refusal(body)
        if kind != answer_kind or len(body) != 8:
            _close_all(fds)
            raise KvError(grpc.StatusCode.INTERNAL, "handoff socket %s: %s answered with kind %d "
                          "of %d bytes" % (self.path, what, kind, len(body)))
        return int(struct.unpack("<Q", body)[0]), fds

    def _read_frame(self) -> Tuple[int, bytes, List[int]]:
        """(kind, body, descriptors that came with it: at most MAX_DESCRIPTORS, extras closed)."""
        fds: List[int] = []
        while True:
            if len(self._input) >= 4:
                (length,) = struct.unpack_from("<I", self._input)
                if not 2 <= length <= MAX_FRAME_BYTES:
                    raise KvError(grpc.StatusCode.INTERNAL, "handoff frame of %d bytes; a frame "
                                  "holds 2 to %d" % (length, MAX_FRAME_BYTES))
                if len(self._input) >= 4 + length:
                    version, kind = self._input[4], self._input[5]
                    body = self._input[6:4 + length]
                    self._input = self._input[4 + length:]
                    if version != VERSION:
                        raise KvError(grpc.StatusCode.INTERNAL, "handoff frame of protocol "
                                      "version %d; this side speaks version %d"
                                      % (version, VERSION))
                    return kind, body, fds
            try:
                data, received, _, _ = socket.recv_fds(self._sock, 4 + MAX_FRAME_BYTES,
                                                       MAX_DESCRIPTORS)
            except socket.timeout:
                raise KvError(grpc.StatusCode.UNAVAILABLE, "handoff socket %s: no answer within "
                              "%gs" % (self.path, self._timeout)) from None
            except OSError as error:
                raise KvError(grpc.StatusCode.UNAVAILABLE, "handoff socket %s: %s"
                              % (self.path, error)) from None
            for extra in received:
                if len(fds) < MAX_DESCRIPTORS:
                    fds.append(extra)
                else:
                    os.close(extra)
            if not data:
                raise KvError(grpc.StatusCode.UNAVAILABLE, "handoff socket %s: the daemon closed "
                              "the connection" % self.path)
            self._input += data
