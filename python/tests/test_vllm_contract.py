"""Contract test of memra_kv.vllm (vLLM cannot be installed here): engine processes replay vLLM
v0.15.0's KV-connector call order against the real daemon, numpy arrays in a memra HostPool
standing in for vLLM's paged KV caches. One process computes a prompt and saves its blocks;
another, with its own pool, looks them up, loads them into other block ids and finds the same
bytes; blocks evicted between lookup and load surface through get_block_ids_with_load_errors."""

from adapter_engine import BLOCK, HEADS, HEAD_DIM, LAYERS, PROMPT, vllm_hashes
from contract import DAEMON_FLAGS, run_engine

WHOLE_BLOCKS = len(PROMPT) // BLOCK  # 4
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 2  # every layer's K and V, fp16


def test_blocks_saved_by_one_engine_load_into_another(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    stored = run_engine(daemon, "vllm", "store")
    assert stored["groups"] == [BLOCK_BYTES]
    assert (stored["matched_tokens"], stored["load_async"]) == (0, False)
    assert stored["meta"] == {"loads": [], "saves": [WHOLE_BLOCKS]}
    assert (stored["saved_blocks"], stored["loaded_blocks"]) == (WHOLE_BLOCKS, 0)
    assert stored["finished"] == [None, None] and stored["load_errors"] == []
    assert stored["request_finished"] == [False, None]
    assert all(stored["pattern_ok"])

    loaded = run_engine(daemon, "vllm", "load")
    # Every whole block of the 70-token prompt; of a 64-token prompt the last block is left
    # for vLLM to compute (it computes at least the last token).
    assert loaded["matched_tokens"] == WHOLE_BLOCKS * BLOCK
    assert loaded["matched_tokens_of_64"] == 3 * BLOCK
    assert loaded["meta"] == {"loads": [WHOLE_BLOCKS], "saves": []}
    assert (loaded["loaded_blocks"], loaded["load_errors"]) == (WHOLE_BLOCKS, [])
    assert loaded["block_ids"][:WHOLE_BLOCKS] != stored["block_ids"][:WHOLE_BLOCKS]
    assert loaded["block_digests"] == stored["block_digests"]
    assert all(loaded["pattern_ok"])

    # Routers see the blocks under vLLM's own hashes, stored from an engine pool: one event
    # per store call's run of blocks, with the parent of its first block and their tokens.
    hashes = vllm_hashes(PROMPT)
    stored_events = pool_store_events(daemon, WHOLE_BLOCKS)
    assert [h for e in stored_events for h in e.block_hashes] == hashes
    position = 0
    for event in stored_events:
        blocks = len(event.block_hashes)
        assert event.from_engine_pool and event.block_tokens == BLOCK
        assert event.parent_block_hash == (hashes[position - 1] if position else b"")
        assert event.token_ids == PROMPT[position * BLOCK:(position + blocks) * BLOCK]
        position += blocks


def pool_store_events(daemon, blocks):
    """The daemon's STORED events (admin socket: every scope) until `blocks` blocks."""
    seen = []
    with daemon.admin() as admin:
        events = admin.events()
        while sum(len(e.block_hashes) for e in seen) < blocks:
            event = next(events)
            if event.kind == "stored":
                seen.append(event)
        events.cancel()
    return seen


def test_the_lookup_holds_its_blocks_until_the_load(kvd):
    """The scheduler's lookup pins what it found: an operator's eviction between lookup and
    load is refused (each block its own entry), the load gets every block."""
    daemon = kvd(*DAEMON_FLAGS)
    run_engine(daemon, "vllm", "store")
    held = run_engine(daemon, "vllm", "load-evicted")
    assert held["matched_tokens"] == WHOLE_BLOCKS * BLOCK
    assert len(held["evict_refusals"]) == WHOLE_BLOCKS
    for code, message in held["evict_refusals"]:
        assert code == "FAILED_PRECONDITION" and " is pinned by 1 restores" in message, message
    assert (held["loaded_blocks"], held["load_errors"]) == (WHOLE_BLOCKS, [])
    # The pins are gone with the request (and the engine): the blocks evict now.
    with daemon.admin() as admin:
        evicted = admin.evict_all_prefixes()
        assert evicted.refused == () and evicted.evicted_entries == WHOLE_BLOCKS
        assert evicted.freed_bytes > 0 and len(admin.list_prefixes().entries) == 0


def test_blocks_evicted_between_an_unpinned_lookup_and_load_are_load_errors(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    run_engine(daemon, "vllm", "store")
    evicted = run_engine(daemon, "vllm", "load-evicted-unpinned")
    assert evicted["evict_refusals"] == []
    assert evicted["matched_tokens"] == WHOLE_BLOCKS * BLOCK
    assert evicted["loaded_blocks"] == 0
    # vLLM recomputes exactly the blocks it was told failed: the ones allocated for the load.
    assert evicted["load_errors"] == sorted(evicted["block_ids"][:WHOLE_BLOCKS])
    assert evicted["finished"] == [None, None]


def test_caches_in_the_engines_own_memory_are_staged_both_ways(kvd):
    """vLLM's caches are its own tensors the daemon cannot map: 4 blocks through a 3-block
    staging pool, saved by one engine and loaded by another, same bytes as zero-copy."""
    daemon = kvd(*DAEMON_FLAGS)
    stored = run_engine(daemon, "vllm", "store-staged")
    assert stored["saved_blocks"] == WHOLE_BLOCKS and all(stored["pattern_ok"])
    loaded = run_engine(daemon, "vllm", "load")  # zero-copy reads what was staged
    assert (loaded["loaded_blocks"], loaded["load_errors"]) == (WHOLE_BLOCKS, [])
    staged = run_engine(daemon, "vllm", "load-staged")
    assert (staged["loaded_blocks"], staged["load_errors"]) == (WHOLE_BLOCKS, [])
    assert staged["block_digests"] == loaded["block_digests"] == stored["block_digests"]
    # Staged in a chunk of 3 and one of 1: the second chunk's parent is the third hash.
    stored_events = pool_store_events(daemon, WHOLE_BLOCKS)
    hashes = vllm_hashes(PROMPT)
    assert [h for e in stored_events for h in e.block_hashes] == hashes
    assert [len(e.block_hashes) for e in stored_events] == [3, 1]
    assert stored_events[1].parent_block_hash == hashes[2]


def test_the_scheduler_names_an_fp8_cache_as_its_workers_register_it():
    """vLLM allocates an fp8 KV cache as torch.uint8: the workers register "int8" bytes, so the
    scheduler's lookup layout must say the same (it once raised on "fp8")."""
    import numpy as np
    import pytest
    from memra_kv.block_store import element_type_of
    from memra_kv.errors import KvError
    from memra_kv.vllm import cache_element_type
    registered = element_type_of(np.dtype(np.uint8))  # a worker's torch.uint8 cache
    for cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert cache_element_type(cache_dtype, "torch.bfloat16") == registered
    assert cache_element_type("auto", "torch.bfloat16") == "bf16"
    assert cache_element_type("bfloat16", "torch.float16") == "bf16"
    with pytest.raises(KvError) as refused:
        cache_element_type("fp4", "torch.bfloat16")
    assert "KV cache dtype fp4" in str(refused.value)


def test_a_scheduler_registration_that_fails_is_a_miss_and_is_retried(kvd):
    """The lookup registration is made on first use: while the daemon refuses it (here: no
    prefix cache, so no block store) every request is a miss, nothing raises into vLLM, and
    the next call tries again."""
    import memra_kv
    from memra_kv.block_store import BlockStore, HostPool, KeptRegistration
    from memra_kv.vllm import LazyScheduler, MemraScheduler, scheduler_layout
    without_store = kvd("--budget_bytes=64MiB", "--prefix_cache_budget_bytes=0")
    with_store = kvd(*DAEMON_FLAGS)
    packed, nbytes = scheduler_layout(LAYERS, BLOCK, HEADS, HEAD_DIM, "fp16", "contract-model")
    pool = HostPool(nbytes)
    tries = []
    clients = []

    def make():
        socket = without_store.socket if not tries else with_store.socket
        tries.append(socket)
        client = memra_kv.connect(socket)
        clients.append(client)
        client.attach("vllm-scheduler")
        store = BlockStore(client)
        return MemraScheduler(KeptRegistration(store, [pool], packed), BLOCK)

    lazy = LazyScheduler(make)
    assert lazy.get() is None
    assert lazy.get() is not None
    assert lazy.get() is lazy.get() and len(tries) == 2
    for client in clients:
        client.close()
