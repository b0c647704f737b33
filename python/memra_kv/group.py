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

Semantics and messages follow the C++ group client (client/group.h): a rank's refusal is a
GroupRankError naming the group id, the rank, its daemon and the daemon's error (its code and
numbers); a group session's refusal also says which ranks it left moved (GroupSession).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ._proto import group_pb2, group_pb2_grpc, model_plan_pb2
from .client import Client, PrefixCaptured, PrefixMatch, PreparedAppend, Session, _call
from .errors import ErrorCode, KvError, MemraKvError
from .results import SessionState

# The protocol's bounds (group.proto ReserveGroupRankRequest; core/admission.h).
MAX_GROUP_RANKS = 1024
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
    """A tp x pp group's stages and every rank's shard, by rank (plan_group_layout)."""

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
    """A rank refused (or did not answer) a group operation; the message is client/group.h's:
    "group 0x<id> rank r/N (<socket>): CODE: <the daemon's message>", and for a group session's
    operations " [ranks left moved: ...]".

    group_id (0 outside an admission), rank, ranks, daemon (the rank's socket), error (the
    daemon's MemraKvError: its code, message and numbers, e.g. AdmissionRefused.needed), moved
    (the ranks the operation left changed: () where every rank is in the same state)."""

    def __init__(self, group_id: int, rank: int, ranks: int, daemon: str, error: MemraKvError,
                 moved: Optional[Sequence[int]] = None) -> None:
        self.group_id = group_id
        self.rank = rank
        self.ranks = ranks
        self.daemon = daemon
        self.error = error
        self.moved: Tuple[int, ...] = tuple(moved or ())
        suffix = ("" if moved is None else " [ranks left moved: %s]" % (
            ", ".join(map(str, self.moved)) or "none"))
        super().__init__("group 0x%x rank %d/%d (%s): %s: %s%s" % (
            group_id, rank, ranks, daemon, error.code.name, error.message, suffix))

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
    """Group.lookup_prefix: the boundary every rank holds (0: a miss) and each rank's entry
    holding it (empty on a miss)."""

    matched_tokens: int
    entry_ids: Tuple[int, ...]

    @property
    def hit(self) -> bool:
        """Every rank holds a prefix of the tokens."""
        return self.matched_tokens > 0


@dataclass(frozen=True)
class GroupTransaction:
    """A transaction open on every rank: each rank's generation, and the committed rows when
    it began (every rank's)."""

    generations: Tuple[int, ...]
    base_len: int


# ---- the group ------------------------------------------------------------------------------

@dataclass
class _Rank:
    endpoint: GroupRankEndpoint
    client: Client
    stub: Any  # KvGroupStub on the client's channel


def _quietly(call: Any) -> bool:
    """call(); whether it succeeded (a refusal is swallowed: best-effort cleanup)."""
    try:
        call()
        return True
    except MemraKvError:
        return False


class Group:
    """The group client (client/group.h GroupClient in Python): one engine's clients to every
    rank's daemon, attached, and the group's operations with one answer each.

    Thread-safety: one thread at a time (as GroupClient); the Clients underneath are
    thread-safe. close() detaches every rank (a daemon then reclaims what the engine left after
    its lease grace)."""

    def __init__(self, group_file: GroupFile, ranks: List[_Rank]) -> None:
        """Use Group.connect."""
        self.file = group_file
        self._ranks = ranks
        self._layouts: Dict[bytes, GroupLayout] = {}  # fingerprint -> layout

    @classmethod
    def connect(cls, group: Union[GroupFile, str], engine_name: str = "memra-group",
                timeout: float = 10.0, cache_scope: str = "") -> "Group":
        """Connects to and attaches on every rank's daemon (a group file's path, or a
        GroupFile), each as "<engine_name> rank <r>". The first rank that cannot be reached or
        attached is a GroupRankError; nothing stays attached then."""
        group_file = read_group_file(group) if isinstance(group, str) else group
        ranks: List[_Rank] = []
        try:
            for endpoint in group_file.ranks:
                try:
                    client = Client.connect(endpoint.socket, timeout=timeout)
                    ranks.append(_Rank(endpoint, client,
                                       group_pb2_grpc.KvGroupStub(client._channel)))
                    client.attach("%s rank %d" % (engine_name, endpoint.rank), timeout=timeout,
                                  cache_scope=cache_scope)
                except MemraKvError as error:
                    raise GroupRankError(0, endpoint.rank, len(group_file.ranks),
                                         endpoint.socket, error) from None
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
        """Detaches from and disconnects every rank."""
        for rank in self._ranks:
            rank.client.close()

    @property
    def clients(self) -> List[Client]:
        """Each rank's Client, by rank."""
        return [rank.client for rank in self._ranks]

    def rank_error(self, group_id: int, rank: int, error: MemraKvError,
                   moved: Optional[Sequence[int]] = None) -> GroupRankError:
        """Rank `rank`'s refusal as the group reports it."""
        return GroupRankError(group_id, rank, len(self._ranks),
                              self._ranks[rank].endpoint.socket, error, moved)

    # -- plans and layout --

    def register_plan(self, plan: Any, timeout: Optional[float] = None) -> bytes:
        """Lays the group out (plan_group_layout: InvalidArgument for a layout the model cannot
        take, before any daemon is asked) and registers `plan` on every rank. Returns the
        fingerprint, the same on every rank (FailedPrecondition naming the rank otherwise)."""
        layout = plan_group_layout(plan, self.file.tp, self.file.pp, self.file.stage_layers)
        fingerprint = b""
        for index, rank in enumerate(self._ranks):
            try:
                got = rank.client.register_plan(plan, timeout=timeout)
            except MemraKvError as error:
                raise self.rank_error(0, index, error) from None
            if fingerprint and got != fingerprint:
                raise self.rank_error(0, index, MemraKvError(
                    ErrorCode.FAILED_PRECONDITION,
                    "fingerprint %s differs from rank 0's %s: the daemons resolve the plan's "
                    "formats differently (their MEMRA_KV_* defaults)" % (got.hex(),
                                                                        fingerprint.hex())))
            fingerprint = got
        self._layouts[fingerprint] = layout
        return fingerprint

    def layout(self, fingerprint: bytes) -> GroupLayout:
        """The layout of a plan registered through this group."""
        layout = self._layouts.get(fingerprint)
        if layout is None:
            raise KvError(ErrorCode.FAILED_PRECONDITION,
                          "plan %s was not registered through this group (register_plan)" %
                          fingerprint.hex())
        return layout

    def price(self, fingerprint: bytes, capacity: int, spec_snapshot: bool = False,
              timeout: Optional[float] = None) -> List[int]:
        """Each rank's exact arena bytes for its shard at `capacity`, as its daemon prices it."""
        out = []
        for shard in self.layout(fingerprint).ranks:
            try:
                cost = self._ranks[shard.rank].client.cost(
                    capacity, fingerprint=fingerprint, layer_lo=shard.layer_lo,
                    layer_hi=shard.layer_hi, tp_ranks=shard.tp_ranks,
                    spec_snapshot=spec_snapshot, timeout=timeout)
            except MemraKvError as error:
                raise self.rank_error(0, shard.rank, error) from None
            out.append(int(cost.arena_bytes))
        return out

    # -- admission --

    def reserve(self, fingerprint: bytes, capacity: int, spec_snapshot: bool = False,
                deadline_ms: int = DEFAULT_GROUP_DEADLINE_MS,
                timeout: Optional[float] = None) -> GroupAdmission:
        """Phase one: prices every rank's shard, then holds it on every rank under a fresh group
        id (PENDING until `deadline_ms`, after which each daemon frees it by itself). A rank's
        refusal releases the ranks that reserved and raises GroupRankError naming it: nothing
        is held."""
        if not 1 <= deadline_ms <= MAX_GROUP_DEADLINE_MS:
            raise _refuse("deadline_ms %d is outside 1..%d" % (deadline_ms, MAX_GROUP_DEADLINE_MS))
        layout = self.layout(fingerprint)
        expected = self.price(fingerprint, capacity, spec_snapshot, timeout)
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
                raise self.rank_error(group_id, shard.rank, error) from None
        return GroupAdmission(group_id, fingerprint, capacity, spec_snapshot, tuple(held))

    def confirm(self, admission: GroupAdmission,
                timeout: Optional[float] = None) -> GroupAdmission:
        """Phase two: CONFIRMED on every rank (held with no deadline). A rank that refuses (its
        deadline passed, its daemon restarted) releases every rank and raises GroupRankError:
        the group's answer is no."""
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
                raise self.rank_error(admission.group_id, state.rank, error) from None
        return GroupAdmission(admission.group_id, admission.fingerprint, admission.capacity,
                              admission.spec_snapshot, tuple(confirmed))

    def admit(self, fingerprint: bytes, capacity: int, spec_snapshot: bool = False,
              deadline_ms: int = DEFAULT_GROUP_DEADLINE_MS,
              timeout: Optional[float] = None) -> GroupAdmission:
        """reserve then confirm: the group's one yes (every rank holds its shard) or no
        (GroupRankError naming the rank that refused; nothing held anywhere)."""
        return self.confirm(self.reserve(fingerprint, capacity, spec_snapshot, deadline_ms,
                                         timeout), timeout)

    def release(self, admission: GroupAdmission, timeout: Optional[float] = None) -> int:
        """Frees the admission on every rank that still holds it (a rank that holds nothing,
        NotFound, is not a refusal); the bytes freed in all."""
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
                       admission: Optional[GroupAdmission] = None,
                       timeout: Optional[float] = None) -> "GroupSession":
        """One session per rank, each of its shard, from `admission` (confirmed; consumed) or
        from a fresh admit. A rank's refusal releases the sessions created and the reservations
        left: nothing stays held (GroupRankError naming the rank)."""
        if admission is None:
            admission = self.admit(fingerprint, capacity, spec_snapshot, timeout=timeout)
        layout = self.layout(fingerprint)
        sessions: List[Session] = []
        for shard, state in zip(layout.ranks, admission.ranks):
            try:
                sessions.append(self._ranks[shard.rank].client.create_session(
                    fingerprint, admission.capacity, layer_lo=shard.layer_lo,
                    layer_hi=shard.layer_hi, tp_ranks=shard.tp_ranks,
                    spec_snapshot=admission.spec_snapshot, reservation=state.reservation_id,
                    timeout=timeout))
            except MemraKvError as error:
                for session in sessions:
                    _quietly(session.release)
                self._release_ranks(admission.group_id,
                                    [s.rank for s in admission.ranks[len(sessions):]], timeout)
                raise self.rank_error(admission.group_id, shard.rank, error) from None
        return GroupSession(self, admission.group_id, fingerprint, layout, sessions)

    # -- prefixes --

    def capture_prefix(self, session: "GroupSession", token_ids: Sequence[int],
                       boundary_tokens: int,
                       timeout: Optional[float] = None) -> List[PrefixCaptured]:
        """Captures every rank's shard at `boundary_tokens`, each on its own daemon. A rank's
        refusal names it; the ranks before it hold their shard, which no group lookup finds
        without the others (LRU evicts it)."""
        out = []
        for index, rank_session in enumerate(session.sessions):
            try:
                out.append(self._ranks[index].client.capture_prefix(
                    rank_session, token_ids, boundary_tokens, timeout))
            except MemraKvError as error:
                raise self.rank_error(session.group_id, index, error) from None
        return out

    def lookup_prefix(self, fingerprint: bytes, token_ids: Sequence[int],
                      timeout: Optional[float] = None) -> GroupPrefixMatch:
        """The longest boundary every rank holds for `token_ids` (each rank's own shard shape):
        each rank answers its longest; asked again below the shortest until all answer the same
        one (each round lowers the bound, so it ends; a miss at 0)."""
        asked = list(token_ids)
        while True:
            matches: List[PrefixMatch] = []
            for shard in self.layout(fingerprint).ranks:
                try:
                    matches.append(self._ranks[shard.rank].client.lookup_prefix(
                        fingerprint, asked, layer_lo=shard.layer_lo, layer_hi=shard.layer_hi,
                        tp_ranks=shard.tp_ranks, timeout=timeout))
                except MemraKvError as error:
                    raise self.rank_error(0, shard.rank, error) from None
            lengths = [m.matched_tokens if m.outcome != "miss" else 0 for m in matches]
            if min(lengths) == 0:
                return GroupPrefixMatch(0, ())
            if len(set(lengths)) == 1:
                return GroupPrefixMatch(lengths[0], tuple(m.entry_id for m in matches))
            asked = asked[:min(lengths)]

    def restore_prefix(self, session: "GroupSession", token_ids: Sequence[int],
                       timeout: Optional[float] = None) -> int:
        """Restores the longest group hit into the FRESH `session` on every rank, or on none: a
        rank's refusal resets the ranks already restored (fresh again; those a reset fails on
        are its `moved`). The restored length; NotFound on a group miss."""
        match = self.lookup_prefix(session.fingerprint, token_ids, timeout)
        if not match.hit:
            raise KvError(ErrorCode.NOT_FOUND, "group 0x%x: no prefix of the %d tokens is held by "
                          "all %d ranks" % (session.group_id, len(token_ids), len(self._ranks)))
        prefix = list(token_ids[:match.matched_tokens])
        for index, rank_session in enumerate(session.sessions):
            try:
                self._ranks[index].client.restore_prefix(rank_session, prefix,
                                                         match.entry_ids[index], timeout)
            except MemraKvError as error:
                moved = [done for done in range(index)
                         if not _quietly(lambda: session.sessions[done].reset(timeout))]
                raise self.rank_error(session.group_id, index, error, moved) from None
        return match.matched_tokens


class GroupSession:
    """One session per rank of a group, each of its rank's shard, by rank
    (client/group.h GroupSession). Every operation runs on the ranks in rank order and has one
    answer. What a refusal at rank k leaves (its GroupRankError.moved; docs/groups.md):

      begin                  ranks < k aborted again: as it was.
      prepare, publish       the transaction is aborted on every rank: the group is at the
                             committed state it had before begin.
      commit                 k = 0: nothing moved (the transaction stays open). k > 0: ranks
                             >= k abort, ranks < k are rewound to the base: as before begin;
                             a rank that cannot rewind (a recurrent or lapped layer) stays moved.
      abort, rewind,
      spec_snapshot,
      spec_rollback          ranks < k moved (rewind first asks can_rewind of every rank, so a
                             target some rank cannot reach moves nothing).
    release tries every rank and raises the first refusal after."""

    def __init__(self, group: Group, group_id: int, fingerprint: bytes, layout: GroupLayout,
                 sessions: List[Session]) -> None:
        self.group = group
        self.group_id = group_id
        self.fingerprint = fingerprint
        self.layout = layout
        self.sessions = sessions  # by rank

    def __enter__(self) -> "GroupSession":
        return self

    def __exit__(self, *exc: object) -> None:
        if not all(session.released for session in self.sessions):
            self.release()

    def _refused(self, rank: int, error: MemraKvError, moved: Sequence[int]) -> GroupRankError:
        return self.group.rank_error(self.group_id, rank, error, moved)

    def _each(self, call: Any) -> List[Any]:
        """call(session) on every rank in order; a refusal at k leaves ranks < k moved."""
        out = []
        for index, session in enumerate(self.sessions):
            try:
                out.append(call(session))
            except MemraKvError as error:
                raise self._refused(index, error, range(index)) from None
        return out

    def states(self, timeout: Optional[float] = None) -> List[SessionState]:
        """Each rank's session state, by rank."""
        return self._each(lambda s: s.state(timeout))

    def committed_len(self, timeout: Optional[float] = None) -> int:
        """The committed length every rank agrees on; FailedPrecondition when they differ."""
        lengths = [state.committed_len for state in self.states(timeout)]
        if len(set(lengths)) != 1:
            raise KvError(ErrorCode.FAILED_PRECONDITION,
                          "group 0x%x ranks disagree on the committed length: %s" % (
                              self.group_id, lengths))
        return int(lengths[0])

    def _abort_all(self, transaction: GroupTransaction, below: int,
                   timeout: Optional[float]) -> List[int]:
        """Aborts every rank's transaction; the ranks < `below` an abort failed on."""
        return [every for every, session in enumerate(self.sessions)
                if not _quietly(lambda: session.abort(transaction.generations[every], timeout))
                and every < below]

    def begin(self, timeout: Optional[float] = None) -> GroupTransaction:
        """Begins a transaction on every rank."""
        generations: List[int] = []
        base_len = 0
        for index, session in enumerate(self.sessions):
            try:
                begun = session.begin(timeout)
            except MemraKvError as error:
                moved = [done for done in range(index) if not _quietly(
                    lambda: self.sessions[done].abort(generations[done], timeout))]
                raise self._refused(index, error, moved) from None
            generations.append(begun.generation)
            base_len = begun.base_len
        return GroupTransaction(tuple(generations), base_len)

    def prepare(self, transaction: GroupTransaction, rows: int,
                timeout: Optional[float] = None) -> List[PreparedAppend]:
        """PrepareAppend of `rows` on every rank: where each rank's K/V rows go, by rank."""
        out = []
        for index, session in enumerate(self.sessions):
            try:
                out.append(session.prepare_append(transaction.generations[index], rows, timeout))
            except MemraKvError as error:
                raise self._refused(index, error,
                                    self._abort_all(transaction, index, timeout)) from None
        return out

    def publish(self, transaction: GroupTransaction, timeout: Optional[float] = None) -> None:
        """Publishes every rank's prepared append."""
        for index, session in enumerate(self.sessions):
            try:
                session.publish_append(transaction.generations[index], timeout)
            except MemraKvError as error:
                raise self._refused(index, error,
                                    self._abort_all(transaction, index, timeout)) from None

    def commit(self, transaction: GroupTransaction, accepted_rows: int,
               token_ids: Sequence[int] = (), timeout: Optional[float] = None) -> int:
        """Commits every rank's transaction; the committed length (every rank's)."""
        committed = 0
        for index, session in enumerate(self.sessions):
            try:
                committed = session.commit(transaction.generations[index], accepted_rows,
                                           token_ids, timeout)
            except MemraKvError as error:
                if index == 0:
                    raise self._refused(index, error, ()) from None  # still open
                for later in range(index, len(self.sessions)):
                    _quietly(lambda: self.sessions[later].abort(transaction.generations[later],
                                                                timeout))
                moved = [earlier for earlier in range(index)
                         if not self._rewound(self.sessions[earlier], transaction.base_len,
                                              timeout)]
                raise self._refused(index, error, moved) from None
        return committed

    @staticmethod
    def _rewound(session: Session, target: int, timeout: Optional[float]) -> bool:
        try:
            if not session.can_rewind(target, timeout):
                return False
            session.rewind(target, timeout)
            return True
        except MemraKvError:
            return False

    def abort(self, transaction: GroupTransaction, timeout: Optional[float] = None) -> int:
        """Aborts every rank's transaction; the committed length."""
        committed = 0
        for index, session in enumerate(self.sessions):
            try:
                committed = session.abort(transaction.generations[index], timeout)
            except MemraKvError as error:
                raise self._refused(index, error, range(index)) from None
        return committed

    def rewind(self, target: int, timeout: Optional[float] = None) -> int:
        """Rewinds every rank to `target` tokens, after asking every rank can_rewind (a rank
        that cannot is FailedPrecondition naming it, and no rank moved)."""
        for index, session in enumerate(self.sessions):
            try:
                can = session.can_rewind(target, timeout)
            except MemraKvError as error:
                raise self._refused(index, error, ()) from None
            if not can:
                raise self._refused(index, MemraKvError(
                    ErrorCode.FAILED_PRECONDITION,
                    "cannot rewind to %d rows (can_rewind: a recurrent or lapped layer); no "
                    "rank was rewound" % target), ())
        states = self._each(lambda s: s.rewind(target, timeout))
        return int(states[-1].committed_len)

    def spec_snapshot(self, timeout: Optional[float] = None) -> None:
        """A spec-decode snapshot on every rank."""
        self._each(lambda s: s.spec_snapshot(timeout))

    def spec_rollback(self, accept_len: int, timeout: Optional[float] = None) -> int:
        """Rolls every rank back to its snapshot plus accept_len tokens; the committed length."""
        states = self._each(lambda s: s.spec_rollback(accept_len, timeout))
        return int(states[-1].committed_len)

    def release(self, timeout: Optional[float] = None) -> int:
        """Releases every rank's session (each is tried); the bytes freed on all ranks. The
        first refusal, naming its rank, after all were tried."""
        freed = 0
        first: Optional[GroupRankError] = None
        for index, session in enumerate(self.sessions):
            if session.released:
                continue
            try:
                freed += session.release(timeout)
            except MemraKvError as error:
                first = first or self._refused(index, error, ())
        if first is not None:
            raise first
        return freed


__all__ = [
    "GroupRankEndpoint", "GroupFile", "parse_group_file", "read_group_file",
    "group_from_sockets", "StageLayout", "RankShard", "GroupLayout", "default_stage_layers",
    "plan_group_layout", "GroupRankError", "GroupRankState", "GroupAdmission",
    "GroupPrefixMatch", "GroupTransaction", "Group", "GroupSession", "MAX_GROUP_RANKS",
    "MAX_GROUP_DEADLINE_MS", "DEFAULT_GROUP_DEADLINE_MS",
]
