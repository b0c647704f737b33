"""Contract test of memra_kv.sglang's page store (PageTier) without SGLang: engine processes
make SGLang HiCache's page calls (write-through backup: batch_exists, batch_set_v1; prefetch:
batch_exists, batch_get_v1) on a numpy layer_first host pool through PageTier, as
MemraHiCacheStorage does, against the real daemon. Pages set by one process arrive in another's
pages with the same bytes; pages never stored or evicted are False / partial counts, as SGLang
expects. The same backend under the real SGLang 0.5.23: python/engines/sglang/."""

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


def test_concurrent_gets_and_sets_keep_their_bytes(kvd):
    """SGLang calls batch_get_v1 (prefetch) and batch_set_v1 (backup) from different threads:
    a set must store its own pages' bytes, never what a get is staging meanwhile, in chunks of
    3 staging pages."""
    daemon = kvd(*DAEMON_FLAGS)
    facts = run_engine(daemon, "sglang", "concurrent")
    assert facts["set"] == [True] * 4
    assert all(all(round_ok) for round_ok in facts["concurrent_got"])
    assert all(all(round_ok) for round_ok in facts["concurrent_set"])
    assert all(all(round_ok) for round_ok in facts["concurrent_set_bytes_ok"])
