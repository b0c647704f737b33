"""memra_kv.vllm's asynchronous loads and layer hooks under the real vLLM 0.33.0 (each instance
its own process, instance.py; the real memra-kvd).

An asynchronous load (memra_async_load_min_tokens: 16 here, so the 64-token hit of PROMPT is
one) parks the request in vLLM's WAITING_FOR_REMOTE_KVS while the worker's loader thread loads
(its lookup's pin against an eviction: test_vllm_connector.py);
vLLM schedules it once the worker's get_finished reports the request, with the failed blocks
(if any) in get_block_ids_with_load_errors of that same step."""

import pytest

from test_vllm_connector import (DAEMON_FLAGS, WHOLE_BLOCKS, instance,
                                 instance_across_a_daemon_restart)

ASYNC = ("--async-load-min-tokens", "16")
LAYERS = 2  # python/engines/vllm/model/config.json
HIT = WHOLE_BLOCKS * 16


def test_an_async_load_parks_the_request_and_it_runs_with_byte_identical_kv(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    first, _ = instance(daemon.socket, "LBNHC")
    loaded, _ = instance(daemon.socket, "LBNHC", *ASYNC, seed="2")
    assert loaded["meta"][0] == {"loads": [WHOLE_BLOCKS], "async_loads": [True], "saves": []}
    assert loaded["async_waiting_steps"] >= 1 and loaded["async_matched_tokens"] == HIT
    assert loaded["finished_recving"] == ["req-0"]
    assert loaded["matched_tokens"] == HIT  # scheduled with the loaded tokens computed
    assert loaded["worker"] == {"saved_blocks": 0, "loaded_blocks": WHOLE_BLOCKS}
    assert loaded["invalid_block_ids"] == [] and loaded["finished"]
    assert loaded["digests"] == first["digests"]
    # Below the threshold the load is synchronous: no waiting, no report.
    below, _ = instance(daemon.socket, "LBNHC", "--async-load-min-tokens", str(HIT + 16),
                        seed="3")
    assert below["meta"][0]["async_loads"] == [False]
    assert below["async_waiting_steps"] == 0 and below["finished_recving"] == []
    assert below["digests"] == first["digests"]


def test_an_async_load_of_evicted_blocks_ends_in_recompute(kvd):
    """No lease (memra_lookup_pin_ms 0): the blocks go before the loader thread loads them; the
    request is reported finished receiving with every block a load error, and vLLM
    (kv_load_failure_policy "recompute") computes the prompt itself."""
    daemon = kvd(*DAEMON_FLAGS)
    first, _ = instance(daemon.socket, "LBNHC")
    lost, _ = instance(daemon.socket, "LBNHC", *ASYNC, "--evict-with", daemon.admin_socket,
                       "--lookup-pin-ms", "0", "--load-failure-policy", "recompute", seed="2")
    assert lost["meta"][0]["async_loads"] == [True] and lost["evict_refusals"] == []
    assert lost["finished_recving"] == ["req-0"]
    assert lost["invalid_block_ids"] == sorted(lost["async_block_ids"][:WHOLE_BLOCKS])
    assert lost["matched_tokens"] == 0 and lost["worker"]["loaded_blocks"] == 0
    assert lost["worker"]["saved_blocks"] == WHOLE_BLOCKS  # recomputed, so stored again
    assert lost["finished"] and lost["digests"] == first["digests"]


def test_an_async_load_from_a_daemon_killed_after_the_lookup_ends_in_recompute(kvd):
    """The daemon is SIGKILLed (and an empty one started) after vLLM's scheduler admitted the
    asynchronous load and before the worker made it: the loader thread's load finds nothing
    (the connector re-attaches and re-registers on its own), the request recomputes."""
    daemon = kvd(*DAEMON_FLAGS)
    first, _ = instance(daemon.socket, "LBNHC")
    killed, err = instance_across_a_daemon_restart(
        daemon, ASYNC + ("--load-failure-policy", "recompute", "--pause-before-load"),
        "LOAD-PLANNED", seed="2")
    assert killed["meta"][0]["async_loads"] == [True]
    assert killed["finished_recving"] == ["req-0"]
    assert killed["invalid_block_ids"] == sorted(killed["async_block_ids"][:WHOLE_BLOCKS])
    assert killed["worker"]["loaded_blocks"] == 0, err[-3000:]
    assert killed["worker"]["saved_blocks"] == WHOLE_BLOCKS, err[-3000:]  # into the new one
    assert killed["finished"] and killed["digests"] == first["digests"]


@pytest.mark.parametrize("layerwise", [1, 0], ids=["layer-hooks", "whole-steps"])
def test_layer_hooks_save_and_load_each_layer_byte_identical(kvd, layerwise):
    """With memra_layerwise 1 (the default) each layer's pages go out at its save_kv_layer and
    come in at its wait_for_layer_load; with 0 the step's copies are made whole (wait_for_save,
    start_load_kv). Either way another instance loads byte-identical pages."""
    daemon = kvd(*DAEMON_FLAGS)
    flags = ("--layerwise", str(layerwise))
    saved, _ = instance(daemon.socket, "LBNHC", *flags)
    assert saved["worker"]["saved_blocks"] == WHOLE_BLOCKS
    assert saved["layer_hooks"] == {"planes_saved_by_layer_hooks": LAYERS * layerwise,
                                    "planes_loaded_by_layer_hooks": 0}
    loaded, _ = instance(daemon.socket, "LBNHC", *flags, seed="2")
    assert loaded["worker"]["loaded_blocks"] == WHOLE_BLOCKS
    assert loaded["layer_hooks"] == {"planes_saved_by_layer_hooks": 0,
                                     "planes_loaded_by_layer_hooks": LAYERS * layerwise}
    assert loaded["invalid_block_ids"] == [] and loaded["digests"] == saved["digests"]
