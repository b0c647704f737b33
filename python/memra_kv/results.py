"""Typed results of memra_kv's calls: frozen dataclasses read off the daemon's replies.

Field names are the wire's (proto/memra/kv/v1/*.proto), so `state.committed_len` reads as the
protobuf did; repeated fields are tuples, nested messages these classes, enums the value's name
in lower case without the enum's prefix (PREFIX_MEDIUM_DISK -> "disk", RESTART_SURVIVAL_ON ->
"on"). A model plan stays a memra.kv.v1.ModelPlan message: it is also what plans.py builds and
what calls take.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar

from .errors import MemraKvError

_Result = TypeVar("_Result")


# ---- sessions ----

@dataclass(frozen=True)
class LayerState:
    """One layer's lengths (cache.proto LayerState)."""

    layer: int
    length: int  # the value of the layer's length mirror, in rows
    ring_base: int  # ring layers: the absolute row at physical row 0; else 0
    ring: bool
    index_pools_ready: int  # latent layers with an indexer: pools whose keys are final
    index_resident_from: int  # ... the lowest absolute row the index plane still holds


@dataclass(frozen=True)
class SessionState:
    """A session's lengths and flags (cache.proto SessionState; docs/rules.md#transactions).

    Invariant: committed_len <= staged_len <= capacity; staged_len == committed_len outside a
    transaction; position == committed_len except after a spec rollback."""

    layout_version: int
    capacity: int  # tokens
    committed_len: int  # rows
    staged_len: int  # rows
    position: int  # tokens
    active_generation: int  # the open transaction's generation; 0: none
    next_generation: int  # what the next begin gets
    tainted: bool
    spec_snapshot_valid: bool  # a spec snapshot is held (rollbacks do not end it)
    grow_pending: bool
    layers: Tuple[LayerState, ...]


# ---- model import and admission queries (admin.proto) ----

@dataclass(frozen=True)
class ImportedModel:
    """Client.import_model: the plan of a config.json as the daemon imports it."""

    plan: Any  # memra.kv.v1.ModelPlan
    plan_fingerprint: bytes
    architecture: str
    registered: bool  # registered by this call (as this engine)
    kv_dtype: str  # what chose the formats ("bf16 from torch_dtype bfloat16", ...)
    kv_formats: str  # the formats the plan stores ("K/V bf16/bf16")


@dataclass(frozen=True)
class CostBreakdown:
    """core/sizing.h CostBreakdown: total_plane_bytes == fixed_bytes + the context-scaled rows
    at the capacity."""

    bytes_per_token: int
    kv_bytes_per_token: int
    ring_bytes_per_token: int
    latent_bytes_per_token: int
    ring_row_cap: int  # rows; 0: no ring (docs/rules.md#swa-ring)
    fixed_bytes: int
    total_plane_bytes: int


@dataclass(frozen=True)
class Cost:
    """Client.cost: what one session of the shape costs; arena_bytes is what admission charges
    and the backend allocates."""

    model_name: str
    plan_fingerprint: bytes
    capacity: int
    breakdown: Optional[CostBreakdown]
    arena_bytes: int
    granularity_bytes: int
    layers: int


@dataclass(frozen=True)
class Fit:
    """Client.fit: how many sessions of the shape fit now, after evicting the prefix cache and
    when empty, and the context tokens that fit packed at that capacity."""

    session_bytes: int
    sessions_now: int
    sessions_after_eviction: int
    sessions_when_empty: int
    total_tokens_now: int
    total_tokens_when_empty: int
    free_bytes: int
    evictable_bytes: int
    budget_bytes: int


@dataclass(frozen=True)
class MaxContext:
    """Client.max_context: the largest capacity one session could be created with (0 when not
    even one token fits)."""

    max_context_now: int
    max_context_after_eviction: int
    max_context_when_empty: int
    session_bytes_now: int
    free_bytes: int
    evictable_bytes: int
    budget_bytes: int


# ---- status and listings ----

@dataclass(frozen=True)
class EngineStatus:
    """One attached engine (admin.proto EngineStatus): pid, uid and gid as the kernel reported
    them at the handoff socket."""

    engine_id: int
    engine_name: str
    pid: int
    lease_live: bool
    sessions: int
    allocated_bytes: int
    reserved_bytes: int
    reservations: int
    last_heartbeat_age_ms: int
    pooled_bytes: int
    pool_hits: int
    new_arenas: int
    uid: int
    gid: int
    cache_scope: str
    awaiting_reattach: bool


@dataclass(frozen=True)
class AdmissionStatus:
    """The admission ledger: free_bytes == budget_bytes - reserved_bytes - allocated_bytes
    while that is >= 0 (else free 0 and over_budget_bytes > 0)."""

    budget_bytes: int
    reserved_bytes: int
    allocated_bytes: int
    free_bytes: int
    evictable_bytes: int
    reservations: int
    over_budget_bytes: int
    budget_rule: str
    granularity_bytes: int


@dataclass(frozen=True)
class Status:
    """Client.status: backend, device and accounting now. engine_status is empty on the engine
    socket. restart_survival: "on", "off", "lost" or "unspecified"; prefix_remote_tier: "none",
    "up" or "down"."""

    backend: str
    device_name: str
    device_uuid: str
    device_total_bytes: int
    device_free_bytes: int
    allocated_bytes: int
    arena_count: int
    sessions: int
    engines: int
    plans: int
    draining: bool
    engine_status: Tuple[EngineStatus, ...]
    admission: Optional[AdmissionStatus]
    epoch: int  # random per daemon start
    uptime_ms: int
    prefix_remote_tier: str
    restart_survival: str
    restart_survival_detail: str


@dataclass(frozen=True)
class SessionSummary:
    """One live session in Client.sessions (admin socket)."""

    session_id: int
    engine_id: int
    model_name: str
    plan_fingerprint: bytes
    capacity: int
    logical_len: int
    arena_bytes: int
    layout_version: int
    in_transaction: bool
    tainted: bool


# ---- prefix cache listings (admin socket) ----

@dataclass(frozen=True)
class PrefixEntry:
    """One prefix-cache entry (prefix.proto PrefixEntry); block_keys only from inspect_prefix.
    medium: the slowest tier a piece is in ("device", "pinned_host", "disk", "remote")."""

    entry_id: int
    shape_fingerprint: bytes
    boundary_tokens: int
    blocks: int
    block_bytes: int
    boundary_bytes: int
    epoch: int
    last_use_tick: int
    pins: int
    block_keys: Tuple[bytes, ...]
    cache_scope: str
    medium: str
    from_engine_pool: bool
    engine_id: int


@dataclass(frozen=True)
class PrefixTierStats:
    """One tier of the prefix cache."""

    medium: str
    stored_bytes: int
    budget_bytes: int
    hits: int
    promotions: int
    demotions: int


@dataclass(frozen=True)
class PrefixRemoteStats:
    """The remote tier's counters (monotonic since start)."""

    up: bool
    queued_bytes: int
    writes: int
    written_bytes: int
    dropped_writes: int
    write_errors: int
    reads: int
    read_errors: int
    read_timeouts: int
    read_refusals: int
    breaker_opens: int
    hits: int
    pulled_pieces: int
    pulled_bytes: int
    corrupt: int
    shape_mismatches: int
    queued_writes: int
    partial_lookups: int


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's totals: stored_bytes == pinned_bytes + evictable_bytes."""

    entries: int
    blocks: int
    stored_bytes: int
    evictable_bytes: int
    pinned_bytes: int
    budget_bytes: int
    lookup_hits: int
    lookup_partials: int
    lookup_misses: int
    captures: int
    restores: int
    tokens_restored: int
    evicted_entries: int
    dropped_entries: int
    death_captures: int
    epoch: int
    last_sequence: int
    block_tokens: int
    slabs: int
    slab_bytes: int
    slab_free_bytes: int
    slab_empty_bytes: int
    slab_fragmentation_ppm: int
    tiers: Tuple[PrefixTierStats, ...]
    remote: Optional[PrefixRemoteStats]  # None without a remote tier


@dataclass(frozen=True)
class PrefixListing:
    """Client.list_prefixes: every entry and the totals."""

    entries: Tuple[PrefixEntry, ...]
    stats: Optional[PrefixCacheStats]


@dataclass(frozen=True)
class PrefixEvicted:
    """Client.evict_prefix: the bytes freed and the totals after."""

    freed_bytes: int
    stats: Optional[PrefixCacheStats]


@dataclass(frozen=True)
class PrefixesEvicted:
    """Client.evict_all_prefixes: what went and what the daemon refused to evict.

    `refused` holds one (entry_id, error) per entry the daemon kept, e.g. FailedPrecondition
    "... is pinned by 1 restores" while an engine's lookup or restore holds it."""

    evicted_entries: int
    freed_bytes: int
    refused: Tuple[Tuple[int, MemraKvError], ...]


# ---- from the wire ----

def from_message(cls: Type[_Result], message: Any) -> _Result:
    """A `cls` (one of the dataclasses above) with its fields read off the protobuf `message`
    of the same field names: the one place replies become results."""
    hints = _field_hints(cls)  # type: ignore[arg-type]  # a class is hashable
    values: Dict[str, Any] = {}
    for name, hint in hints.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        values[name] = _value(hint, field, message, name)
    return cls(**values)


@functools.lru_cache(maxsize=None)
def _field_hints(cls: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def _value(hint: Any, field: Any, message: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    raw = getattr(message, name)
    if origin is typing.Union:  # Optional[a nested result]: None when the message lacks it
        (inner,) = [arg for arg in args if arg is not type(None)]
        return from_message(inner, raw) if message.HasField(name) else None
    if origin is tuple:
        return tuple(_scalar(args[0], field, item) for item in raw)
    return _scalar(hint, field, raw)


def _scalar(hint: Any, field: Any, raw: Any) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_message(hint, raw)
    if field.enum_type is not None:
        return _enum_name(field.enum_type, int(raw))
    if hint is Any:  # a message kept as protobuf (a ModelPlan): a copy the caller owns
        copy = type(raw)()
        copy.CopyFrom(raw)
        return copy
    return hint(raw) if hint in (int, bool, str, bytes, float) else raw


_ENUM_PREFIXES: Dict[str, str] = {}


def _enum_prefix(enum_type: Any) -> str:
    """The prefix every value name of the enum shares, up to its last "_" (cached by name)."""
    cached = _ENUM_PREFIXES.get(enum_type.full_name)
    if cached is not None:
        return cached
    names: List[str] = [str(value.name) for value in enum_type.values]
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    prefix = prefix[:prefix.rfind("_") + 1] if len(names) > 1 else ""
    _ENUM_PREFIXES[enum_type.full_name] = prefix
    return prefix


def _enum_name(enum_type: Any, number: int) -> str:
    value = enum_type.values_by_number.get(number)
    if value is None:
        return str(number)  # a value newer than this client
    name: str = value.name
    return name[len(_enum_prefix(enum_type)):].lower()
