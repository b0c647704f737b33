"""memra_kv.vllm under the real vLLM 0.33.0 from PyPI (python/engines/vllm-requirements.txt),
on the CPU, against the real memra-kvd: `deploy/dev.sh test` runs this file with the engine
venv's interpreter (python/engines/run_engine_tests.sh).

Each vLLM instance is its own process (instance.py: vLLM's Scheduler, vLLM's factory-made
connectors, vLLM's KV cache allocation as torch CPU tensors). What no CPU can run (a model's
forward on a GPU) is replaced by writing each scheduled token's K and V into its slot."""

import json
import os
import pickle
import subprocess
import sys

import pytest

import kvtest

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = list(range(100, 170))  # 70 tokens: 4 whole blocks of 16 and 6 more
WHOLE_BLOCKS = len(PROMPT) // 16
DAEMON_FLAGS = ("--budget_bytes=64MiB", "--prefix_cache_budget_bytes=32MiB")


def instance(socket, layout="LBNHC", *flags, seed="1", prompt=PROMPT):
    """Runs one vLLM instance; its FACTS and its stderr."""
    env = dict(os.environ, PYTHONHASHSEED=seed, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, os.path.join(HERE, "instance.py"), socket, layout,
                           json.dumps(prompt)] + list(flags), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    facts = [line[6:] for line in done.stdout.splitlines() if line.startswith("FACTS ")]
    assert done.returncode == 0 and facts, "instance exited %d:\n%s\n%s" % (
        done.returncode, done.stdout[-3000:], done.stderr[-6000:])
    return json.loads(facts[0]), done.stderr


def instance_across_a_daemon_restart(daemon, flags, pause_line, seed="1"):
    """Runs one vLLM instance with `flags` naming a pause; when it prints `pause_line` the
    daemon is SIGKILLed and started again (empty); the instance's FACTS and its stderr."""
    env = dict(os.environ, PYTHONHASHSEED=seed, HF_HUB_OFFLINE="1")
    process = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "instance.py"), daemon.socket, "LBNHC",
         json.dumps(PROMPT)] + list(flags),
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    paused = process.stdout.readline()
    assert paused == pause_line + "\n", paused + process.stderr.read()[-3000:]
    daemon.kill_and_start_again()
    out, err = process.communicate("go\n", timeout=600)
    assert process.returncode == 0, err[-6000:]
    (line,) = [l for l in out.splitlines() if l.startswith("FACTS ")]
    return json.loads(line[6:]), err


def test_vllms_factory_loads_the_connector_and_its_members_are_complete():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   SupportsHMA)
    config = KVTransferConfig(kv_connector="MemraKVConnector",
                              kv_connector_module_path="memra_kv.vllm", kv_role="kv_both",
                              kv_connector_extra_config={"memra_socket": "/tmp/none.sock"})
    connector = KVConnectorFactory.get_connector_class(config)
    import memra_kv.vllm
    assert connector is memra_kv.vllm.MemraKVConnector
    assert issubclass(connector, KVConnectorBase_V1) and issubclass(connector, SupportsHMA)
    assert not connector.__abstractmethods__
    # The configuration crosses to worker processes pickled.
    assert pickle.loads(pickle.dumps(config)).kv_connector_extra_config == {
        "memra_socket": "/tmp/none.sock"}


def test_a_second_instance_loads_the_firsts_blocks_byte_identical(kvd):
    """Different PYTHONHASHSEED and prefix_caching_hash_algo: vLLM's own block hashes differ,
    the connector's content keys do not."""
    daemon = kvd(*DAEMON_FLAGS)
    first, _ = instance(daemon.socket, "LBNHC", seed="1")
    assert first["connector"] == ["memra_kv.vllm", "MemraKVConnector", "MemraKVConnector"]
    assert first["matched_tokens"] == 0 and first["finished"]
    assert first["meta"][0] == {"loads": [], "async_loads": [], "saves": [WHOLE_BLOCKS]}
    assert first["worker"] == {"saved_blocks": WHOLE_BLOCKS, "loaded_blocks": 0}
    assert len(set(first["digests"])) == WHOLE_BLOCKS  # the pages differ from each other

    second, _ = instance(daemon.socket, "LBNHC", "--hash-algo", "sha256_cbor", seed="2")
    assert second["vllm_block_hashes"] != first["vllm_block_hashes"]
    assert second["matched_tokens"] == WHOLE_BLOCKS * 16
    assert second["meta"][0] == {"loads": [WHOLE_BLOCKS], "async_loads": [False], "saves": []}
    assert second["worker"] == {"saved_blocks": 0, "loaded_blocks": WHOLE_BLOCKS}
    assert second["invalid_block_ids"] == []
    assert second["digests"] == first["digests"]


@pytest.mark.parametrize("layout,flags", [("LBHNC", ()), ("BLNHC", ()), ("BLHNC", ()),
                                          ("LBNHC", ("--mla",))],
                         ids=["LBHNC", "BLNHC", "BLHNC", "MLA"])
def test_every_block_compact_layout_round_trips(kvd, layout, flags):
    """FlashInfer's HND pages, block-outer (cross-layer) layouts, and MLA's latent pages."""
    daemon = kvd(*DAEMON_FLAGS)
    first, _ = instance(daemon.socket, layout, *flags)
    assert first["worker"] == {"saved_blocks": WHOLE_BLOCKS, "loaded_blocks": 0}
    second, _ = instance(daemon.socket, layout, *flags, seed="2")
    assert second["matched_tokens"] == WHOLE_BLOCKS * 16
    assert second["digests"] == first["digests"]


def test_a_cache_salt_or_another_page_order_shares_nothing(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    instance(daemon.socket, "LBNHC")
    salted, _ = instance(daemon.socket, "LBNHC", "--cache-salt", "tenant-a")
    assert salted["matched_tokens"] == 0 and salted["worker"]["saved_blocks"] == WHOLE_BLOCKS
    # HND pages are other bytes than NHD pages: another layout fingerprint, no hits.
    other_order, _ = instance(daemon.socket, "LBHNC")
    assert other_order["matched_tokens"] == 0


def test_without_a_daemon_vllm_runs_on_with_one_warning_per_role(tmp_path):
    """The worker's and the scheduler's connector (one process here, two in a vLLM server)."""
    facts, stderr = instance(str(tmp_path / "absent.sock"), "LBNHC")
    assert facts["finished"] and facts["matched_tokens"] == 0 and facts["worker"] is None
    assert facts["invalid_block_ids"] == []
    warnings = [line for line in stderr.splitlines() if "memra" in line]
    assert len(warnings) == 2, stderr[-3000:]
    assert "registering the KV caches: UNAVAILABLE: no memra-kvd socket at" in warnings[0]
    assert "registering the scheduler's lookup pool: UNAVAILABLE" in warnings[1]
    assert all("absent.sock is unusable" in line for line in warnings)


def test_a_daemon_without_a_prefix_cache_is_named_and_vllm_runs_on(kvd):
    """The daemon's default prefix_cache_budget_bytes=0 leaves the block store off."""
    daemon = kvd("--budget_bytes=64MiB", "--prefix_cache_budget_bytes=0")
    facts, stderr = instance(daemon.socket, "LBNHC")
    assert facts["finished"] and facts["matched_tokens"] == 0 and facts["worker"] is None
    warnings = [line for line in stderr.splitlines() if "memra" in line]
    assert len(warnings) == 2, stderr[-3000:]
    assert all("FAILED_PRECONDITION" in line and "no prefix cache" in line
               for line in warnings), warnings


def test_a_daemon_restarted_mid_run_is_used_again(kvd):
    """Three requests of one prompt in one vLLM instance; between the first and the second the
    daemon is killed and started again (empty: nothing kept). The connector attaches and
    registers anew on its own: the second request misses and saves, the third loads."""
    daemon = kvd(*DAEMON_FLAGS)
    facts, err = instance_across_a_daemon_restart(
        daemon, ("--repeat", "3", "--pause-before", "1"), "PAUSED")
    first, second, third = facts["requests"]
    assert (first["matched_tokens"], first["worker"]["saved_blocks"]) == (0, WHOLE_BLOCKS)
    assert second["matched_tokens"] == 0  # the new daemon kept nothing
    assert second["worker"] == {"saved_blocks": WHOLE_BLOCKS, "loaded_blocks": 0}, err[-3000:]
    assert third["matched_tokens"] == WHOLE_BLOCKS * 16
    assert third["worker"] == {"saved_blocks": 0, "loaded_blocks": WHOLE_BLOCKS}
    assert third["digests"] == first["digests"] and third["invalid_block_ids"] == []


@pytest.mark.parametrize("load_flags", [(), ("--async-load-min-tokens", "16")],
                         ids=["sync-load", "async-load"])
def test_the_lookup_holds_its_blocks_until_vllm_loads_them(kvd, load_flags):
    """An operator evicts every block between vLLM's scheduling (the lookup) and the worker's
    load: the lookup's pins refuse it and the load gets every block, under vLLM's default
    kv_load_failure_policy "fail". An asynchronous load's pin lasts while vLLM waits for it."""
    daemon = kvd(*DAEMON_FLAGS)
    first, _ = instance(daemon.socket, "LBNHC")
    held, _ = instance(daemon.socket, "LBNHC", "--evict-with", daemon.admin_socket,
                       *load_flags, seed="2")
    assert held["meta"][0]["async_loads"] == [bool(load_flags)]
    assert held["matched_tokens"] == WHOLE_BLOCKS * 16
    assert len(held["evict_refusals"]) == WHOLE_BLOCKS
    assert all(code == "FAILED_PRECONDITION" and "is pinned by 1 restores" in message
               for code, message in held["evict_refusals"]), held["evict_refusals"]
    assert held["worker"]["loaded_blocks"] == WHOLE_BLOCKS and held["invalid_block_ids"] == []
    assert held["digests"] == first["digests"] and held["finished"]


def test_without_the_lease_an_evicted_block_is_recomputed_under_recompute(kvd):
    """memra_lookup_pin_ms 0: the eviction goes through, the load fails, vLLM is told which
    blocks (get_block_ids_with_load_errors) and recomputes them."""
    daemon = kvd(*DAEMON_FLAGS)
    first, _ = instance(daemon.socket, "LBNHC")
    lost, _ = instance(daemon.socket, "LBNHC", "--evict-with", daemon.admin_socket,
                       "--lookup-pin-ms", "0", "--load-failure-policy", "recompute", seed="2")
    assert lost["matched_tokens"] == WHOLE_BLOCKS * 16 and lost["evict_refusals"] == []
    assert lost["worker"]["loaded_blocks"] == 0
    assert lost["invalid_block_ids"] == sorted(lost["block_ids"][:WHOLE_BLOCKS])
    assert lost["finished"] and lost["digests"] == first["digests"]  # recomputed
