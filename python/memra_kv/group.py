"""memra_kv.group: an engine that spans GPUs, over one memra-kvd per GPU (docs/groups.md).

A tensor- x pipeline-parallel group of tp x pp ranks talks to one daemon per rank
(rank = stage * tp + tp_rank). This module holds, for Python engines and tools:

- the group file (read_group_file / parse_group_file / group_from_sockets): which daemon
  serves each rank; the grammar and refusals of client/group_file.h;
- the TP x PP layout (plan_group_layout): each rank's shard of a model plan; the rules and
  refusals of core/group_layout.h, which the C++ side applies (this is its Python mirror, kept
  to the same messages by python/tests/test_group.py);
- Group: group admission (reserve on every rank with one group id and a deadline, then confirm
  on all or release on all: one answer, a refusal naming the rank, its daemon and numbers),
  group sessions (one call creates the session on every rank; steps, rewinds and spec rollbacks
  apply to every rank) and group prefixes (found only when every rank holds the prefix,
  restored on every rank or on none).

Errors: a rank's refusal is a GroupRankError naming the group, the rank, its daemon and the
daemon's error (its code and numbers), with `moved`: the ranks the operation had already
changed when it stopped (empty where the group is as it was; see each method).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._proto import group_pb2, group_pb2_grpc, model_plan_pb2
from .client import Client, PrefixCaptured, PrefixMatch, Session, TransactionScope, _call
from .errors import ErrorCode, KvError, MemraKvError
from .results import SessionState

# The protocol's bounds (group.proto ReserveGroupRankRequest; core/admission.h).
MAX_GROUP_RANKS = 4096
MAX_GROUP_DEADLINE_MS = 600000
DEFAULT_GROUP_DEADLINE_MS = 10000
# A group file's bounds (client/group_file.h).
MAX_SOCKET_PATH_BYTES = 107
MAX_GROUP_NAME_BYTES = 64
MAX_GROUP_FILE_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9._-]+\Z")
_U32_MAX = 0xFFFFFFFF


def _refuse(message: str) -> MemraKvError:
    return MemraKvError(ErrorCode.INVALID_ARGUMENT, message)


# ---- the group file --------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupRankEndpoint:
    """One rank's daemon: its engine socket and (for memra-kvctl) its admin socket or ""."""

    rank: int
    socket: str
    admin_socket: str = ""


@dataclass(frozen=True)
class GroupFile:
    """A group: its name, tp, pp, trunk layers per stage (() = the default split) and the
    daemon of every rank, by rank."""

    name: str
    tp: int
    pp: int
    stage_layers: Tuple[int, ...]
    ranks: Tuple[GroupRankEndpoint, ...]


def _count(source: str, where: str, what: str, text: str) -> int:
    if not text.isdigit() or not text.isascii() or len(text) > 10 or int(text) > _U32_MAX:
        raise _refuse('%s %s: %s "%s" is not a whole number of at most %d' % (
            source, where, what, text, _U32_MAX))
    return int(text)


def _check_socket(source: str, where: str, what: str, path: str) -> None:
    if not path.startswith("/"):
        raise _refuse('%s %s: %s "%s" is not an absolute path' % (source, where, what, path))
    size = len(path.encode())
    if size > MAX_SOCKET_PATH_BYTES:
        raise _refuse("%s %s: %s is %d bytes; a Unix socket path holds at most %d" % (
            source, where, what, size, MAX_SOCKET_PATH_BYTES))


def _finish(source: str, name: Optional[Tuple[str, str]], tp: Optional[Tuple[int, str]],
            pp: Optional[Tuple[int, str]], stage_layers: Optional[Tuple[List[int], str]],
            ranks: List[Tuple[GroupRankEndpoint, str]]) -> GroupFile:
    """The rules that need the whole group (client/group_file.cc Finish)."""
    for key, value in (("group", name), ("tp", tp), ("pp", pp)):
        if value is None:
            raise _refuse("%s: no `%s` line" % (source, key))
    assert name is not None and tp is not None and pp is not None
    size = tp[0] * pp[0]
    if tp[0] == 0 or pp[0] == 0 or size > MAX_GROUP_RANKS:
        raise _refuse("%s %s: tp %d x pp %d is not a group of 1..%d ranks" % (
            source, tp[1], tp[0], pp[0], MAX_GROUP_RANKS))
    if stage_layers is not None and len(stage_layers[0]) != pp[0]:
        raise _refuse("%s %s: stage_layers lists %d stages for pp %d" % (
            source, stage_layers[1], len(stage_layers[0]), pp[0]))
    by_rank: Dict[int, Tuple[GroupRankEndpoint, str]] = {}
    by_socket: Dict[str, Tuple[GroupRankEndpoint, str]] = {}
    for endpoint, where in ranks:
        if endpoint.rank >= size:
            raise _refuse("%s %s: rank %d is outside tp %d x pp %d = %d ranks" % (
                source, where, endpoint.rank, tp[0], pp[0], size))
        if endpoint.rank in by_rank:
            raise _refuse("%s %s: rank %d given twice (%s and here)" % (
                source, where, endpoint.rank, by_rank[endpoint.rank][1]))
        by_rank[endpoint.rank] = (endpoint, where)
        _check_socket(source, where, "rank %d's socket" % endpoint.rank, endpoint.socket)
        if endpoint.admin_socket:
            _check_socket(source, where, "rank %d's admin socket" % endpoint.rank,
                          endpoint.admin_socket)
        for socket in (endpoint.socket, endpoint.admin_socket):
            if not socket:
                continue
            if socket in by_socket:
                other, other_where = by_socket[socket]
                raise _refuse("%s %s: socket %s of rank %d is rank %d's too (%s): one daemon "
                              "serves one rank" % (source, where, socket, endpoint.rank,
                                                   other.rank, other_where))
            by_socket[socket] = (endpoint, where)
    missing = [rank for rank in range(size) if rank not in by_rank]
    if missing:
        shown = ", ".join(str(rank) for rank in missing[:8])
        raise _refuse("%s: %d of tp %d x pp %d = %d ranks have no `rank` line: %s%s" % (
            source, len(missing), tp[0], pp[0], size, shown, ", ..." if len(missing) > 8 else ""))
    return GroupFile(name[0], tp[0], pp[0],
                     tuple(stage_layers[0]) if stage_layers is not None else (),
                     tuple(by_rank[rank][0] for rank in range(size)))


def parse_group_file(text: str, source: str) -> GroupFile:
    """The group file `text` (the format of client/group_file.h; docs/groups.md#the-group-file).
    `source` names it in refusals. InvalidArgument naming the line and the numbers."""
    source = "group file " + source
    if len(text.encode()) > MAX_GROUP_FILE_BYTES:
        raise _refuse("%s: %d bytes is over the limit of %d" % (
            source, len(text.encode()), MAX_GROUP_FILE_BYTES))
    name: Optional[Tuple[str, str]] = None
    tp: Optional[Tuple[int, str]] = None
    pp: Optional[Tuple[int, str]] = None
    stage_layers: Optional[Tuple[List[int], str]] = None
    ranks: List[Tuple[GroupRankEndpoint, str]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        fields = line.split("#", 1)[0].replace("\r", " ").replace("\t", " ").split()
        if not fields:
            continue
        where = "line %d" % number
        key, values = fields[0], fields[1:]

        def expect(lo: int, hi: int, usage: str) -> None:
            if not lo <= len(values) <= hi:
                raise _refuse("%s %s: `%s` takes %s, got %d value(s)" % (
                    source, where, key, usage, len(values)))

        def once(slot: Optional[Any]) -> None:
            if slot is not None:
                raise _refuse("%s %s: `%s` given twice (%s and here)" % (
                    source, where, key, slot[1]))

        if key == "group":
            expect(1, 1, "one name")
            if len(values[0]) > MAX_GROUP_NAME_BYTES or not _NAME.match(values[0]):
                raise _refuse('%s %s: group name "%s" is not 1..%d of [A-Za-z0-9._-]' % (
                    source, where, values[0], MAX_GROUP_NAME_BYTES))
            once(name)
            name = (values[0], where)
        elif key in ("tp", "pp"):
            expect(1, 1, "one number")
            value = _count(source, where, key, values[0])
            if key == "tp":
                once(tp)
                tp = (value, where)
            else:
                once(pp)
                pp = (value, where)
        elif key == "stage_layers":
            expect(1, 1, "one comma-separated list")
            layers: List[int] = []
            for item in values[0].split(","):
                count = _count(source, where, "stage_layers entry %d" % len(layers), item)
                if count == 0:
                    raise _refuse("%s %s: stage_layers entry %d is 0: every stage holds at "
                                  "least one layer" % (source, where, len(layers)))
                layers.append(count)
                if len(layers) > MAX_GROUP_RANKS:
                    raise _refuse("%s %s: stage_layers lists more than %d stages" % (
                        source, where, MAX_GROUP_RANKS))
            once(stage_layers)
            stage_layers = (layers, where)
        elif key == "rank":
            expect(2, 3, "a rank, a socket and optionally an admin socket")
            rank = _count(source, where, "rank", values[0])
            ranks.append((GroupRankEndpoint(rank, values[1],
                                            values[2] if len(values) == 3 else ""), where))
            if len(ranks) > MAX_GROUP_RANKS:
                raise _refuse("%s %s: more than %d `rank` lines" % (
                    source, where, MAX_GROUP_RANKS))
        else:
            raise _refuse('%s %s: unknown key "%s" (group, tp, pp, stage_layers, rank)' % (
                source, where, key))
    return _finish(source, name, tp, pp, stage_layers, ranks)


def read_group_file(path: str) -> GroupFile:
    """Reads and parses the group file at `path` (OSError when it cannot be read)."""
    with open(path, "rb") as f:
        data = f.read(MAX_GROUP_FILE_BYTES + 1)
    return parse_group_file(data.decode(errors="replace"), path)


def group_from_sockets(name: str, tp: int, pp: int, sockets: Sequence[str],
                       stage_layers: Sequence[int] = (), source: str = "sockets") -> GroupFile:
    """A group from engine sockets in rank order, under the group file's rules."""
    if len(name) > MAX_GROUP_NAME_BYTES or not _NAME.match(name):
        raise _refuse('%s: group name "%s" is not 1..%d of [A-Za-z0-9._-]' % (
            source, name, MAX_GROUP_NAME_BYTES))
    if len(sockets) != tp * pp:
        raise _refuse("%s: %d sockets for tp %d x pp %d = %d ranks" % (
            source, len(sockets), tp, pp, tp * pp))
    return _finish(source, (name, "name"), (tp, "tp"), (pp, "pp"),
                   (list(stage_layers), "stage_layers") if stage_layers else None,
                   [(GroupRankEndpoint(rank, socket), "entry %d" % rank)
                    for rank, socket in enumerate(sockets)])


# ---- the TP x PP layout (core/group_layout.h) -----------------------------------------------

@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: layers [layer_lo, layer_hi) (the last stage's include the MTP
    blocks), its K/V head shards (its sessions' tp_ranks), the TP ranks holding the same K/V
    (kv_replicas) and whether its latent rows are replicated on every TP rank."""

    stage: int
    layer_lo: int
    layer_hi: int
    mtp_blocks: int = 0
    kv_shards: int = 1
    kv_replicas: int = 1
    latent_replicated: bool = False


@dataclass(frozen=True)
class RankShard:
    """One rank's shard: its session shape (layer_lo, layer_hi, tp_ranks) and place."""

    rank: int
    stage: int
    tp_rank: int
    kv_shard: int
    layer_lo: int
    layer_hi: int
    tp_ranks: int


@dataclass(frozen=True)
class GroupLayout:
    tp: int
    pp: int
    stages: Tuple[StageLayout, ...]
    ranks: Tuple[RankShard, ...]


def default_stage_layers(trunk_layers: int, pp: int) -> List[int]:
    """vLLM's get_pp_indices split: trunk / pp each, the remainder one each to the stages
    before the last."""
    if pp == 0 or pp > trunk_layers:
        raise _refuse("pp %d does not split %d trunk layers (1 <= pp <= layers)" % (
            pp, trunk_layers))
    layers = [trunk_layers // pp] * pp
    for i in range(trunk_layers % pp):
        layers[pp - 2 - i] += 1
    return layers


_KV_KINDS = (model_plan_pb2.STATE_KIND_KV, model_plan_pb2.STATE_KIND_SLIDING_KV)


def _stage_name(lo: int, hi: int, stage: int) -> str:
    return "stage %d (layers [%d, %d))" % (stage, lo, hi)


def plan_group_layout(plan: Any, tp: int, pp: int,
                      stage_layers: Sequence[int] = ()) -> GroupLayout:
    """Each rank's shard of `plan` (a memra.kv.v1.ModelPlan) in a tp x pp group: the rules of
    core/group_layout.h, InvalidArgument with its messages. The daemons validate the plan
    itself (register_plan)."""
    if tp == 0 or pp == 0 or tp * pp > MAX_GROUP_RANKS:
        raise _refuse("tp %d x pp %d is not a group of 1..%d ranks" % (tp, pp, MAX_GROUP_RANKS))
    trunk = len(plan.layers)
    if not stage_layers:
        counts = default_stage_layers(trunk, pp)
    else:
        counts = list(stage_layers)
        if len(counts) != pp:
            raise _refuse("stage layers list %d stages for pp %d" % (len(counts), pp))
        for stage, count in enumerate(counts):
            if count == 0:
                raise _refuse("stage %d holds 0 layers: every stage holds at least one" % stage)
        if sum(counts) != trunk:
            raise _refuse("stage layers sum to %d but the plan has %d trunk layers" % (
                sum(counts), trunk))
    layers = {layer.index: layer for layer in list(plan.layers) + list(plan.mtp_blocks)}
    total = len(layers)
    stages: List[StageLayout] = []
    lo = 0
    for stage, count in enumerate(counts):
        last = stage + 1 == pp
        hi = total if last else lo + count
        name = _stage_name(lo, hi, stage)
        kv = [layers[i] for i in range(lo, hi) if i in layers and layers[i].kind in _KV_KINDS]
        latent = [layers[i] for i in range(lo, hi)
                  if i in layers and layers[i].kind == model_plan_pb2.STATE_KIND_LATENT]
        kv_shards, kv_replicas = 1, 1
        if tp > 1:
            for i in range(lo, hi):
                if i in layers and layers[i].kind == model_plan_pb2.STATE_KIND_RECURRENT:
                    raise _refuse("layer %d of %s: recurrent state is not sharded under tensor "
                                  "parallelism (tp %d); engines split it by heads, which a "
                                  "memra-kv session cannot hold" % (i, name, tp))
            if kv and latent:
                raise _refuse("%s mixes K/V layer %d (sharded over tp %d) with latent layer %d "
                              "(replicated under tp): one rank's session has one tp_ranks" % (
                                  name, kv[0].index, tp, latent[0].index))
            uneven = [layer for layer in kv if layer.n_head_kv % tp != 0]
            if kv and not uneven:
                kv_shards = tp
            elif uneven:
                heads = uneven[0].n_head_kv
                agree = all(layer.n_head_kv == kv[0].n_head_kv for layer in kv)
                if agree and heads < tp and tp % heads == 0:
                    kv_shards, kv_replicas = heads, tp // heads
                else:
                    why = ("tp is not a multiple of them either" if agree else
                           "and the stage's K/V layers do not all have the same heads (layer "
                           "%d has %d)" % (kv[0].index, kv[0].n_head_kv))
                    raise _refuse("layer %d of %s: n_head_kv %d is not divisible by tp %d, %s "
                                  "(K/V heads split evenly, or one head per rank when tp is a "
                                  "multiple of them)" % (uneven[0].index, name, heads, tp, why))
        for i in range(lo, hi):
            layer = layers.get(i)
            if (layer is not None and layer.kind == model_plan_pb2.STATE_KIND_SHARED_KV and
                    layer.shares_kv_with < lo):
                raise _refuse("layer %d of %s attends layer %d's K/V, which an earlier stage "
                              "holds" % (i, name, layer.shares_kv_with))
        stages.append(StageLayout(stage, lo, hi, len(plan.mtp_blocks) if last else 0, kv_shards,
                                  kv_replicas, tp > 1 and bool(latent)))
        lo = hi
    ranks = tuple(RankShard(s.stage * tp + tp_rank, s.stage, tp_rank, tp_rank // s.kv_replicas,
                            s.layer_lo, s.layer_hi, s.kv_shards)
                  for s in stages for tp_rank in range(tp))
    return GroupLayout(tp, pp, tuple(stages), ranks)


# ---- errors and results ----------------------------------------------------------------------

class GroupRankError(Exception):
    """A rank refused (or did not answer) a group operation.

    group, rank, daemon (the rank's socket), error (the daemon's MemraKvError: its code,
    message and numbers), moved (the ranks the operation had already changed when it stopped;
    () where the group is as it was)."""

    def __init__(self, group: str, rank: int, daemon: str, error: MemraKvError,
                 moved: Sequence[int] = ()) -> None:
        self.group = group
        self.rank = rank
        self.daemon = daemon
        self.error = error
        self.moved: Tuple[int, ...] = tuple(moved)
        moved_text = (" (ranks %s had already moved)" % ", ".join(map(str, self.moved))
                      if self.moved else "")
        super().__init__("group %s rank %d (%s): %s: %s%s" % (
            group, rank, daemon, error.code.name, error.message, moved_text))

    @property
    def code(self) -> ErrorCode:
        """The refusing daemon's code."""
        return self.error.code


@dataclass(frozen=True)
class GroupRankState:
    """A rank's group reservation as its daemon holds it (group.proto GroupRankState)."""

    rank: int
    reservation_id: int
    bytes: int
    phase: str  # "pending" or "confirmed"
    deadline_ms_left: int
    daemon: str


_PHASES = {group_pb2.GROUP_RANK_PHASE_PENDING: "pending",
           group_pb2.GROUP_RANK_PHASE_CONFIRMED: "confirmed"}


def _rank_state(reply: Any) -> GroupRankState:
    return GroupRankState(int(reply.group.rank), int(reply.reservation_id), int(reply.bytes),
                          _PHASES.get(reply.phase, "unspecified"), int(reply.deadline_ms_left),
                          str(reply.daemon))


@dataclass(frozen=True)
class GroupAdmission:
    """A group reservation held on every rank (Group.reserve / Group.admit)."""

    group_id: int
    fingerprint: bytes
    capacity: int
    spec_snapshot: bool
    ranks: Tuple[GroupRankState, ...]


@dataclass(frozen=True)
class GroupPrefixMatch:
    """Group.lookup_prefix: `matched_tokens` every rank holds (0: a miss on some rank) and
    each rank's own match."""

    matched_tokens: int
    ranks: Tuple[PrefixMatch, ...]

    @property
    def hit(self) -> bool:
        return self.matched_tokens > 0


# ---- the group ------------------------------------------------------------------------------

@dataclass
class _Rank:
    endpoint: GroupRankEndpoint
    client: Client
    stub: Any  # KvGroupStub on the client's channel


class Group:
    """One engine's clients to every rank's daemon, attached, and the group's operations.

    Thread-safety: as Client (each call drives the ranks one after another). close() detaches
    every rank (a daemon then reclaims what the engine left after its lease grace)."""

    def __init__(self, group_file: GroupFile, ranks: List[_Rank]) -> None:
        """Use Group.connect."""
        self.file = group_file
        self._ranks = ranks
        self._plans: Dict[bytes, Any] = {}  # fingerprint -> the registered ModelPlan

    @classmethod
    def connect(cls, group: "GroupFile | str", engine_name: str, timeout: float = 10.0,
                cache_scope: str = "") -> "Group":
        """Connects to and attaches on every rank's daemon (a group file's path, or a
        GroupFile). A rank that does not answer is a GroupRankError; the ranks already
        attached are detached."""
        group_file = read_group_file(group) if isinstance(group, str) else group
        ranks: List[_Rank] = []
        try:
            for endpoint in group_file.ranks:
                try:
                    client = Client.connect(endpoint.socket, timeout=timeout)
                except MemraKvError as error:
                    raise GroupRankError(group_file.name, endpoint.rank, endpoint.socket,
                                         error) from None
                ranks.append(_Rank(endpoint, client,
                                   group_pb2_grpc.KvGroupStub(client._channel)))
                try:
                    client.attach("%s/rank%d" % (engine_name, endpoint.rank), timeout=timeout,
                                  cache_scope=cache_scope)
                except MemraKvError as error:
                    raise GroupRankError(group_file.name, endpoint.rank, endpoint.socket,
                                         error) from None
        except BaseException:
            for rank in ranks:
                rank.client.close()
            raise
        return cls(group_file, ranks)

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for rank in self._ranks:
            rank.client.close()

    @property
    def clients(self) -> List[Client]:
        """Each rank's Client, by rank."""
        return [rank.client for rank in self._ranks]

    def _error(self, rank: int, error: MemraKvError, moved: Sequence[int] = ()) -> GroupRankError:
        return GroupRankError(self.file.name, rank, self._ranks[rank].endpoint.socket, error,
                              moved)

    # -- plans and layout --

    def register_plan(self, plan: Any, timeout: Optional[float] = None) -> bytes:
        """Registers `plan` on every rank (each daemon sizes its own shard of it) and lays the
        group out (plan_group_layout: InvalidArgument for a layout the model cannot take,
        before any daemon is asked). Returns the fingerprint, the same on every rank."""
        layout = plan_group_layout(plan, self.file.tp, self.file.pp, self.file.stage_layers)
        fingerprint = b""
        for index, rank in enumerate(self._ranks):
            try:
                got = rank.client.register_plan(plan, timeout=timeout)
            except MemraKvError as error:
                raise self._error(index, error) from None
            if fingerprint and got != fingerprint:
                raise self._error(index, MemraKvError(
                    ErrorCode.FAILED_PRECONDITION,
                    "fingerprint %s differs from rank 0's %s: the daemons resolve the plan's "
                    "formats differently (their MEMRA_KV_* defaults)" % (got.hex(),
                                                                        fingerprint.hex())))
            fingerprint = got
        self._plans[fingerprint] = (plan, layout)
        return fingerprint

    def layout(self, fingerprint: bytes) -> GroupLayout:
        """The layout of a plan registered through this group."""
        entry = self._plans.get(fingerprint)
        if entry is None:
            raise KvError(ErrorCode.FAILED_PRECONDITION,
                          "plan %s was not registered through this group (register_plan)" %
                          fingerprint.hex())
        return entry[1]  # type: ignore[no-any-return]

    def costs(self, fingerprint: bytes, capacity: int, spec_snapshot: bool = False,
              timeout: Optional[float] = None) -> List[int]:
        """Each rank's exact arena bytes for its shard at `capacity` tokens, by rank."""
        out = []
        for shard in self.layout(fingerprint).ranks:
            try:
                cost = self._ranks[shard.rank].client.cost(
                    capacity, fingerprint=fingerprint, layer_lo=shard.layer_lo,
                    layer_hi=shard.layer_hi, tp_ranks=shard.tp_ranks,
                    spec_snapshot=spec_snapshot, timeout=timeout)
            except MemraKvError as error:
                raise self._error(shard.rank, error) from None
            out.append(int(cost.arena_bytes))
        return out

    # -- admission --

    def reserve(self, fingerprint: bytes, capacity: int, deadline_ms: int =
                DEFAULT_GROUP_DEADLINE_MS, spec_snapshot: bool = False,
                timeout: Optional[float] = None) -> GroupAdmission:
        """Phase one: prices every rank's shard, then holds it on every rank (PENDING until
        `deadline_ms`, after which each daemon frees it by itself). A rank's refusal releases
        the ranks that reserved and raises GroupRankError (moved = ()): nothing is held."""
        if not 1 <= deadline_ms <= MAX_GROUP_DEADLINE_MS:
            raise _refuse("deadline_ms %d is outside 1..%d" % (deadline_ms, MAX_GROUP_DEADLINE_MS))
        layout = self.layout(fingerprint)
        expected = self.costs(fingerprint, capacity, spec_snapshot, timeout)
        group_id = random.getrandbits(64) or 1
        held: List[GroupRankState] = []
        for shard in layout.ranks:
            rank = self._ranks[shard.rank]
            request = group_pb2.ReserveGroupRankRequest(
                engine=rank.client._engine("reserve a group rank"),
                group=group_pb2.GroupRank(group_id=group_id, rank=shard.rank,
                                          ranks=len(layout.ranks)),
                plan_fingerprint=fingerprint, capacity=capacity, layer_lo=shard.layer_lo,
                layer_hi=shard.layer_hi, tp_ranks=shard.tp_ranks, spec_snapshot=spec_snapshot,
                deadline_ms=deadline_ms, expected_bytes=expected[shard.rank])
            try:
                held.append(_rank_state(_call(rank.stub.ReserveGroupRank, request,
                                              rank.client._timeout(timeout))))
            except MemraKvError as error:
                self._release_ranks(group_id, [state.rank for state in held], timeout)
                raise self._error(shard.rank, error) from None
        return GroupAdmission(group_id, fingerprint, capacity, spec_snapshot, tuple(held))

    def confirm(self, admission: GroupAdmission,
                timeout: Optional[float] = None) -> GroupAdmission:
        """Phase two: CONFIRMED on every rank (held with no deadline). A rank that refuses (its
        deadline passed, its daemon restarted) releases every rank and raises GroupRankError
        (moved = ()): the group's answer is no."""
        confirmed: List[GroupRankState] = []
        for state in admission.ranks:
            rank = self._ranks[state.rank]
            request = group_pb2.GroupRankRequest(
                engine=rank.client._engine("confirm a group rank"), group_id=admission.group_id)
            try:
                confirmed.append(_rank_state(_call(rank.stub.ConfirmGroupRank, request,
                                                   rank.client._timeout(timeout))))
            except MemraKvError as error:
                self.release(admission, timeout)
                raise self._error(state.rank, error) from None
        return GroupAdmission(admission.group_id, admission.fingerprint, admission.capacity,
                              admission.spec_snapshot, tuple(confirmed))

    def admit(self, fingerprint: bytes, capacity: int,
              deadline_ms: int = DEFAULT_GROUP_DEADLINE_MS, spec_snapshot: bool = False,
              timeout: Optional[float] = None) -> GroupAdmission:
        """reserve then confirm: one yes (every rank holds its shard) or one no
        (GroupRankError naming the rank that refused; nothing held anywhere)."""
        return self.confirm(self.reserve(fingerprint, capacity, deadline_ms, spec_snapshot,
                                         timeout), timeout)

    def release(self, admission: GroupAdmission, timeout: Optional[float] = None) -> int:
        """Frees the admission on every rank that still holds it; the bytes freed in all."""
        return self._release_ranks(admission.group_id,
                                   [state.rank for state in admission.ranks], timeout)

    def _release_ranks(self, group_id: int, ranks: Sequence[int],
                       timeout: Optional[float]) -> int:
        freed = 0
        for index in ranks:
            rank = self._ranks[index]
            try:
                freed += int(_call(rank.stub.ReleaseGroupRank, group_pb2.GroupRankRequest(
                    engine=rank.client._engine("release a group rank"), group_id=group_id),
                    rank.client._timeout(timeout)).freed_bytes)
            except MemraKvError:
                pass  # NOT_FOUND (freed at its deadline, used) or gone: nothing held there
        return freed

    def rank_state(self, index: int, group_id: int,
                   timeout: Optional[float] = None) -> GroupRankState:
        """Rank `index`'s reservation for `group_id` as its daemon holds it (NotFound once
        released, used or freed at its deadline)."""
        rank = self._ranks[index]
        return _rank_state(_call(rank.stub.GetGroupRank, group_pb2.GroupRankRequest(
            engine=rank.client._engine("read a group rank"), group_id=group_id),
            rank.client._timeout(timeout)))

    # -- sessions --

    def create_session(self, fingerprint: bytes, capacity: int, spec_snapshot: bool = False,
                       deadline_ms: int = DEFAULT_GROUP_DEADLINE_MS,
                       timeout: Optional[float] = None) -> "GroupSession":
        """Admits the group, then creates each rank's session of its shard from its
        reservation. One yes, or GroupRankError with nothing held on any rank (sessions
        already created are released, the other reservations too)."""
        admission = self.admit(fingerprint, capacity, deadline_ms, spec_snapshot, timeout)
        layout = self.layout(fingerprint)
        sessions: List[Session] = []
        for shard, state in zip(layout.ranks, admission.ranks):
            try:
                sessions.append(self._ranks[shard.rank].client.create_session(
                    fingerprint, capacity, layer_lo=shard.layer_lo, layer_hi=shard.layer_hi,
                    tp_ranks=shard.tp_ranks, spec_snapshot=spec_snapshot,
                    reservation=state.reservation_id, timeout=timeout))
            except MemraKvError as error:
                for session in sessions:
                    _quietly(session.release)
                self._release_ranks(admission.group_id,
                                    [s.rank for s in admission.ranks[len(sessions):]], timeout)
                raise self._error(shard.rank, error) from None
        return GroupSession(self, fingerprint, layout, sessions)

    # -- prefixes --

    def lookup_prefix(self, fingerprint: bytes, token_ids: Sequence[int],
                      timeout: Optional[float] = None) -> GroupPrefixMatch:
        """The prefix of `token_ids` every rank holds for its shard: the least matched tokens
        over the ranks (0 when any rank misses)."""
        matches = []
        for shard in self.layout(fingerprint).ranks:
            try:
                matches.append(self._ranks[shard.rank].client.lookup_prefix(
                    fingerprint, token_ids, layer_lo=shard.layer_lo, layer_hi=shard.layer_hi,
                    tp_ranks=shard.tp_ranks, timeout=timeout))
            except MemraKvError as error:
                raise self._error(shard.rank, error) from None
        least = min(match.matched_tokens if match.outcome != "miss" else 0 for match in matches)
        return GroupPrefixMatch(least, tuple(matches))


def _quietly(call: Any) -> None:
    try:
        call()
    except MemraKvError:
        pass


class GroupSession:
    """A session on every rank of a group, each of its rank's shard, in rank order.

    Outcomes (docs/groups.md#python): every method validates what it can on every rank before
    changing any; a refusal after some ranks changed raises GroupRankError whose `moved` names
    exactly those ranks (each daemon commits on its own, so a step cannot be undone on the ranks
    that took it; the engine rewinds them, or releases the group session). Releasing always
    reaches every rank."""

    def __init__(self, group: Group, fingerprint: bytes, layout: GroupLayout,
                 sessions: List[Session]) -> None:
        self.group = group
        self.fingerprint = fingerprint
        self.layout = layout
        self.sessions = sessions  # by rank

    def __enter__(self) -> "GroupSession":
        return self

    def __exit__(self, *exc: object) -> None:
        if not all(session.released for session in self.sessions):
            self.release()

    def _each(self, what: str, call: Any) -> List[Any]:
        """call(session) on every rank in order; a refusal names the rank and the ranks moved."""
        out = []
        for index, session in enumerate(self.sessions):
            try:
                out.append(call(session))
            except MemraKvError as error:
                raise self.group._error(index, error, moved=range(index)) from None
        return out

    def states(self, timeout: Optional[float] = None) -> List[SessionState]:
        """Each rank's session state."""
        return self._each("state", lambda s: s.state(timeout))

    def committed_len(self, timeout: Optional[float] = None) -> int:
        """The committed length every rank agrees on; FailedPrecondition when they differ (a
        step that some ranks took: GroupRankError.moved said which)."""
        lengths = [state.committed_len for state in self.states(timeout)]
        if len(set(lengths)) != 1:
            raise KvError(ErrorCode.FAILED_PRECONDITION,
                          "group %s ranks disagree on the committed length: %s" % (
                              self.group.file.name, lengths))
        return int(lengths[0])

    def transactions(self, timeout: Optional[float] = None) -> List[TransactionScope]:
        """Begins a transaction on every rank (a TransactionScope each, by rank). A refusal
        aborts the ones begun (moved = ())."""
        scopes: List[TransactionScope] = []
        for index, session in enumerate(self.sessions):
            try:
                scopes.append(session.transaction(timeout))
            except MemraKvError as error:
                for scope in scopes:
                    _quietly(scope.abort)
                raise self.group._error(index, error) from None
        return scopes

    def commit(self, scopes: Sequence[TransactionScope], accepted_rows: int,
               token_ids: Sequence[int] = ()) -> int:
        """Commits every rank's transaction (publishing its prepared append first). A refusal
        aborts the ranks not yet committed and names the ranks committed (moved). Returns the
        committed length."""
        committed = 0
        for index, scope in enumerate(scopes):
            try:
                if scope.prepared is not None and not scope.published:
                    scope.publish()
                committed = scope.commit(accepted_rows, token_ids)
            except MemraKvError as error:
                for rest in scopes[index:]:
                    if not rest.finished:
                        _quietly(rest.abort)
                raise self.group._error(index, error, moved=range(index)) from None
        return committed

    def rewind(self, target: int, timeout: Optional[float] = None) -> List[SessionState]:
        """Rewinds every rank to `target` tokens, after checking every rank can (a rank that
        cannot is FailedPrecondition naming it, and nothing moved)."""
        for index, session in enumerate(self.sessions):
            if not session.can_rewind(target, timeout):
                raise self.group._error(index, MemraKvError(
                    ErrorCode.FAILED_PRECONDITION,
                    "cannot rewind to %d tokens (its committed length is %d)" % (
                        target, session.state(timeout).committed_len)))
        return self._each("rewind", lambda s: s.rewind(target, timeout))

    def spec_snapshot(self, timeout: Optional[float] = None) -> List[SessionState]:
        """A spec-decode snapshot on every rank."""
        return self._each("spec_snapshot", lambda s: s.spec_snapshot(timeout))

    def spec_rollback(self, accept_len: int,
                      timeout: Optional[float] = None) -> List[SessionState]:
        """Rolls every rank back to its snapshot plus accept_len tokens."""
        return self._each("spec_rollback", lambda s: s.spec_rollback(accept_len, timeout))

    def reset(self, timeout: Optional[float] = None) -> List[SessionState]:
        """Empties every rank's session (same arenas)."""
        return self._each("reset", lambda s: s.reset(timeout))

    def release(self, timeout: Optional[float] = None) -> int:
        """Releases every rank's session, whatever any one answers; the bytes freed. The first
        refusal is raised after all were tried."""
        freed = 0
        first: Optional[GroupRankError] = None
        for index, session in enumerate(self.sessions):
            if session.released:
                continue
            try:
                freed += session.release(timeout)
            except MemraKvError as error:
                first = first or self.group._error(index, error)
        if first is not None:
            raise first
        return freed

    # -- prefixes --

    def capture_prefix(self, token_ids: Sequence[int], boundary_tokens: int,
                       timeout: Optional[float] = None) -> List[PrefixCaptured]:
        """Captures the committed prefix on every rank, each rank's shard on its own daemon.
        A refusal names the ranks that captured (moved); the group lookup never finds a prefix
        that not every rank holds."""
        return self._each("capture_prefix", lambda s: s._client.capture_prefix(
            s, token_ids, boundary_tokens, timeout))

    def restore_prefix(self, token_ids: Sequence[int],
                       timeout: Optional[float] = None) -> int:
        """Restores into this FRESH group session the prefix of `token_ids` that every rank
        holds, on every rank or on none: a miss on any rank restores nothing (returns 0); a
        rank that fails or restores a different length resets every rank (GroupRankError,
        moved = ()). Returns the restored tokens."""
        match = self.group.lookup_prefix(self.fingerprint, token_ids, timeout)
        if not match.hit:
            return 0
        tokens = list(token_ids[:match.matched_tokens])
        restored: List[int] = []
        for index, session in enumerate(self.sessions):
            try:
                got = session._client.restore_prefix(session, tokens, timeout=timeout)
            except MemraKvError as error:
                self._reset_quietly(timeout)
                raise self.group._error(index, error) from None
            if got.restored_tokens != match.matched_tokens:
                self._reset_quietly(timeout)
                raise self.group._error(index, MemraKvError(
                    ErrorCode.ABORTED,
                    "restored %d tokens where every rank holds %d: the group restored "
                    "nothing" % (got.restored_tokens, match.matched_tokens)))
            restored.append(got.restored_tokens)
        return restored[0]

    def _reset_quietly(self, timeout: Optional[float]) -> None:
        for session in self.sessions:
            _quietly(lambda: session.reset(timeout))


__all__ = [
    "GroupRankEndpoint", "GroupFile", "parse_group_file", "read_group_file",
    "group_from_sockets", "StageLayout", "RankShard", "GroupLayout", "default_stage_layers",
    "plan_group_layout", "GroupRankError", "GroupRankState", "GroupAdmission",
    "GroupPrefixMatch", "Group", "GroupSession", "MAX_GROUP_RANKS", "MAX_GROUP_DEADLINE_MS",
    "DEFAULT_GROUP_DEADLINE_MS",
]
