"""memra_kv.sglang under the real SGLang 0.5.23 from PyPI (python/engines/sglang-requirements.txt),
on the CPU, against the real memra-kvd: `deploy/dev.sh test` runs this file with the engine
venv's interpreter (python/engines/run_engine_tests.sh).

Each SGLang process is instance.py: SGLang's device and host pools as torch CPU tensors and
SGLang's own HiCacheController, which builds the backend through SGLang's StorageBackendFactory
from the documented dynamic-backend config and runs its own prefetch, I/O and backup threads.
What no CPU runs (a forward pass, the radix cache scheduling requests) is replaced by writing a
pattern into host pages and by taking the controller's queues the way SGLang's radix cache
does."""

import json
import os
import subprocess
import sys

import grpc
import pytest
import torch

from kvtest import poll_until

HERE = os.path.dirname(os.path.abspath(__file__))
PAGES = 6  # instance.PROMPT
TOKENS = PAGES * 16
DAEMON_FLAGS = ("--budget_bytes=64MiB", "--prefix_cache_budget_bytes=32MiB")


def config(label, pool="mha", layout="layer_first", dtype="bfloat16", v1=True, mamba=False):
    return {"label": label, "pool": pool, "layout": layout, "dtype": dtype, "v1": v1,
            "mamba": mamba}


class Sglang:
    """One SGLang process (instance.py) serving `configs`; commands on its stdin."""

    def __init__(self, socket, configs):
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "instance.py"), socket, json.dumps(configs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = self.process.stdout.readline()
        assert ready == "READY\n", ready + self._stderr()

    def _stderr(self):
        self.process.kill()
        return self.process.stderr.read()[-6000:]

    def run(self, command):
        """The command's facts, by label."""
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line.startswith("FACTS "), line + self._stderr()
        return {facts["label"]: facts for facts in json.loads(line[6:])}

    def quit(self):
        """Ends the process; its stderr."""
        _, err = self.process.communicate("quit\n", timeout=600)
        assert self.process.returncode == 0, err[-6000:]
        return err


def sglang(socket, *configs):
    return Sglang(socket, list(configs))


def storage_config(socket, mla, v1):
    """The HiCacheStorageConfig SGLang's controller gives the factory (one rank), with the
    documented dynamic-backend extra config (instance.py's)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from instance import memra_config
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="m", extra_config=memra_config(socket, "rank0", v1))


def test_sglangs_factory_builds_the_backend_and_every_call_it_makes_is_ours(kvd):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    import memra_kv.sglang
    daemon = kvd(*DAEMON_FLAGS)
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(daemon.socket, mla=False, v1=False), None)
    assert type(backend) is memra_kv.sglang.MemraHiCacheStorage
    assert not type(backend).__abstractmethods__
    # Every call SGLang 0.5.23's controllers make on a backend is answered here, none by
    # HiCacheStorage's defaults (which raise NotImplementedError or return None).
    called = ["register_mem_pool_host", "register_mem_host_pool_v2", "batch_exists",
              "exists", "batch_get_v1", "batch_set_v1", "get", "set", "batch_get",
              "batch_set", "batch_exists_v2", "batch_get_v2", "batch_set_v2", "close"]
    assert [name for name in called if name not in vars(memra_kv.sglang.MemraHiCacheStorage)
            ] == []
    assert all(hasattr(HiCacheStorage, name) for name in called if name != "close")
    assert backend.batch_exists(["a" * 64]) == 0  # nothing registered: a miss, logged
    backend.close()


# The page formats stored by one process and loaded by another: MHA in each host layout,
# MLA's latent rows, bf16 / fp16 / fp8, and SGLang's per-page calls (no interface_v1).
FORMATS = [config("mha-layer_first-bf16"),
           config("mha-page_first-fp16", layout="page_first", dtype="float16"),
           config("mha-page_first_direct-fp8", layout="page_first_direct",
                  dtype="float8_e4m3fn"),
           config("mha-page_head-bf16", layout="page_head"),
           config("mla-layer_first-bf16", pool="mla"),
           config("mla-page_first-fp16", pool="mla", layout="page_first", dtype="float16"),
           config("mha-layer_first-fp16-no-v1", dtype="float16", v1=False)]


def test_pages_one_sglang_stores_another_loads_byte_identical(kvd):
    daemon = kvd(*DAEMON_FLAGS)
    first = sglang(daemon.socket, *FORMATS)
    stored = first.run("store")
    first.quit()
    second = sglang(daemon.socket, *FORMATS)
    loaded = second.run("load")
    second.quit()
    for fmt in FORMATS:
        label = fmt["label"]
        assert stored[label]["backend"] == "memra_kv.sglang.MemraHiCacheStorage"
        assert stored[label]["page_get"] == (
            "_page_get_zero_copy" if fmt["v1"] else "_generic_page_get")
        assert stored[label]["stored_tokens"] == TOKENS, label
        assert len(set(stored[label]["digests"])) == PAGES, label  # the pages differ
        assert (loaded[label]["hit_tokens"], loaded[label]["loaded_tokens"]) == (
            TOKENS, TOKENS), label
        assert loaded[label]["digests"] == stored[label]["digests"], label
        assert loaded[label]["threads_alive"], label


def test_the_per_page_calls_and_the_v1_api_share_pages_and_other_formats_share_none(kvd):
    """SGLang without interface_v1 stores through batch_set, with it loads through
    batch_get_v1: the same pages. A page_first pool of the same model is another format."""
    daemon = kvd(*DAEMON_FLAGS)
    writer = sglang(daemon.socket, config("lf", dtype="float16", v1=False))
    stored = writer.run("store")["lf"]
    writer.quit()
    reader = sglang(daemon.socket, config("lf", dtype="float16", v1=True),
                    config("pf", layout="page_first", dtype="float16"))
    loaded = reader.run("load")
    reader.quit()
    assert loaded["lf"]["page_get"] == "_page_get_zero_copy"
    assert loaded["lf"]["loaded_tokens"] == TOKENS
    assert loaded["lf"]["digests"] == stored["digests"]
    assert loaded["pf"]["hit_tokens"] == 0


def test_a_page_evicted_between_the_hit_query_and_the_load_is_recomputed(kvd):
    """batch_exists finds every page, an operator evicts them before batch_get_v1 (no pin
    holds them: SGLang's query and load are separate calls): the load completes 0 tokens,
    which SGLang's radix cache then computes; storing them again and loading works."""
    daemon = kvd(*DAEMON_FLAGS)
    first = sglang(daemon.socket, config("mha"), config("mla", pool="mla"))
    stored = first.run("store")
    first.quit()
    second = sglang(daemon.socket, config("mha"), config("mla", pool="mla"))
    evicted = second.run("load --evict " + daemon.admin_socket)
    for label in ("mha", "mla"):
        assert evicted[label]["hit_tokens"] == TOKENS
        assert evicted[label]["loaded_tokens"] == 0 and evicted[label]["digests"] == []
        assert evicted[label]["threads_alive"]
    assert evicted["mha"]["evict_refusals"] == [] and evicted["mla"]["evict_refusals"] == []
    assert all(again["stored_tokens"] == TOKENS for again in second.run("store").values())
    reloaded = second.run("load")
    second.quit()
    for label in ("mha", "mla"):
        assert reloaded[label]["loaded_tokens"] == TOKENS
        assert reloaded[label]["digests"] == stored[label]["digests"]


def test_sglang_runs_on_while_the_daemon_is_dead_and_uses_the_next_one(kvd):
    """The daemon is SIGKILLed mid-run: SGLang's queries miss and its backups fail (logged),
    its threads live on. A new daemon (empty) is used again without a restart of SGLang."""
    daemon = kvd(*DAEMON_FLAGS)
    engine = sglang(daemon.socket, config("mha"))
    assert engine.run("store")["mha"]["stored_tokens"] == TOKENS
    daemon.kill()
    missed = engine.run("load")["mha"]
    assert (missed["hit_tokens"], missed["loaded_tokens"], missed["threads_alive"]) == (
        0, 0, True)
    unsaved = engine.run("store")["mha"]
    assert unsaved["stored_tokens"] == 0 and unsaved["threads_alive"]
    daemon.start_again()
    # Until the client's channel reconnects (its backoff is at most 1 s) a call still misses;
    # then the lease is found lost and the backend attaches anew and registers again.
    stores = []
    assert poll_until(lambda: stores.append(engine.run("store")["mha"]) or
                      stores[-1]["stored_tokens"] == TOKENS)
    again = stores[-1]
    reloaded = engine.run("load")["mha"]
    err = engine.quit()
    assert reloaded["loaded_tokens"] == TOKENS and reloaded["digests"] == again["digests"]
    assert "UNAVAILABLE" in err  # the misses were logged, with the daemon's status


def test_a_hybrid_models_mamba_state_travels_with_its_pages(kvd):
    """SGLang's HybridCacheController over a HostPoolGroup (the KV pool and a Mamba state pool,
    fp32 and bf16 states in one page): the state at the prompt's last page is stored with
    batch_set_v2, found by batch_exists_v2 (TRAILING_PAGES) and loaded with batch_get_v2 into
    another process's state slot, byte-identical."""
    daemon = kvd(*DAEMON_FLAGS)
    hybrid = config("hybrid", layout="page_first", mamba=True)
    first = sglang(daemon.socket, hybrid)
    stored = first.run("store")["hybrid"]
    first.quit()
    assert stored["stored_tokens"] == TOKENS and stored["mamba_stored"] == {"mamba": 1}
    second = sglang(daemon.socket, hybrid)
    loaded = second.run("load")["hybrid"]
    second.quit()
    assert (loaded["hit_tokens"], loaded["loaded_tokens"]) == (TOKENS, TOKENS)
    assert loaded["digests"] == stored["digests"]
    assert loaded["mamba_loaded"]["mamba"] == 1  # the ack lists every pool SGLang knows
    assert loaded["mamba_digest"] == stored["mamba_digest"]


def test_a_pool_without_host_pages_is_refused_when_sglang_attaches_it(kvd):
    """An allocator-only MLA host pool (kv_buffer None) cannot be stored from: registering it
    raises, naming why, so SGLang's attach fails at startup instead of a thread dying later."""
    from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from memra_kv import KvError
    daemon = kvd(*DAEMON_FLAGS)
    allocation = MLAHostAllocation(dtype=torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=8,
                                   kv_cache_dim=40, size_per_token=40 * 2 * 3)
    pool = MLATokenToKVPoolHost(allocation, 2, 0, 16, "layer_first", pin_memory=False,
                                device_capacity_tokens=256, start_layer=0, end_layer=3,
                                target_layer_num=3)
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(daemon.socket, mla=True, v1=True), pool)
    with pytest.raises(KvError) as refused:
        backend.register_mem_pool_host(pool)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message == (
        "kv host pool MLATokenToKVPoolHost holds no pages (kv_buffer is None: an "
        "allocator-only pool); the L3 backend stores pages a host pool holds")
    backend.close()
