"""Contract test of memra_kv.sglang (SGLang cannot be installed here): engine processes replay
SGLang HiCache's storage calls (write-through backup: batch_exists, batch_set_v1; prefetch:
batch_exists, batch_get_v1) against the real daemon, a layer_first host pool in a memra HostPool.
Pages set by one process arrive in another's pages with the same bytes; pages never stored or
evicted are False / partial counts, as SGLang expects."""

from contract import DAEMON_FLAGS, run_engine


def test_pages_set_by_one_engine_are_prefetched_by_another(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    stored = run_engine(daemon, "sglang", "set")
    assert stored["exists_before"] == 0
    assert stored["set"] == [True] * 4 and stored["set_again"] == [True] * 4
    assert stored["exists_after"] == 4
    assert all(stored["pattern_ok"])

    fetched = run_engine(daemon, "sglang", "get")
    assert fetched["exists"] == 4 and fetched["exists_one"] is True
    assert fetched["get"] == [True] * 4
    assert fetched["page_digests"] == stored["page_digests"]
    assert all(fetched["pattern_ok"])


def test_unstored_and_evicted_pages_are_partial_and_false(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    run_engine(daemon, "sglang", "set")
    partial = run_engine(daemon, "sglang", "get-partial")
    assert partial["exists"] == 4  # of 6 keys: the leading stored ones
    assert partial["get"] == [True, True, True, True, False]
    assert partial["get_after_eviction"] == [False] * 4
    assert partial["exists_after_eviction"] == 0


def test_a_host_pool_in_the_engines_own_memory_is_staged_both_ways(kvd):
    """SGLang's host pool is torch memory the daemon cannot map: 4 pages through a 3-page
    staging pool, stored from one engine and prefetched by another, same bytes as zero-copy."""
    daemon = kvd(*DAEMON_FLAGS)
    stored = run_engine(daemon, "sglang", "set-staged")
    assert stored["set"] == [True] * 4 and stored["exists_after"] == 4
    fetched = run_engine(daemon, "sglang", "get")  # zero-copy reads what was staged
    assert fetched["get"] == [True] * 4 and all(fetched["pattern_ok"])
    staged = run_engine(daemon, "sglang", "get-staged")
    assert staged["get"] == [True] * 4 and all(staged["pattern_ok"])
    assert staged["page_digests"] == fetched["page_digests"] == stored["page_digests"]


def test_concurrent_gets_and_sets_through_the_staging_pool_keep_their_bytes(kvd):
    """SGLang calls batch_get_v1 (prefetch) and batch_set_v1 (backup) from different threads:
    a set must store its own pages' bytes, never what a get is staging meanwhile."""
    daemon = kvd(*DAEMON_FLAGS)
    facts = run_engine(daemon, "sglang", "concurrent-staged")
    assert facts["set"] == [True] * 4
    assert all(all(round_ok) for round_ok in facts["concurrent_got"])
    assert all(all(round_ok) for round_ok in facts["concurrent_set"])
    assert all(all(round_ok) for round_ok in facts["concurrent_set_bytes_ok"])
