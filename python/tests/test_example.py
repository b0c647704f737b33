"""python/examples/decode_loop.py (python/README.md's example) runs against the real daemon."""

import os
import runpy

from kvtest import repo_root


def test_the_readme_example_runs(kvd, monkeypatch):
    # Two 4096-token bf16 Llama sessions (512 MiB each: the config's torch_dtype) and the cache.
    daemon = kvd("--budget_bytes=2GiB", "--prefix_cache_budget_bytes=256MiB")
    monkeypatch.setenv("MEMRA_KV_SOCKET", daemon.socket)
    monkeypatch.setenv("HF_CONFIG", os.path.join(repo_root(), "tests", "data", "hf_configs",
                                                 "llama-3.1-8b.json"))
    example = runpy.run_path(os.path.join(repo_root(), "python", "examples", "decode_loop.py"))
    restored, committed = example["main"]()
    assert restored == [0, 256]
    assert committed == [256 + example["STEPS"]] * 2
    with daemon.admin() as admin:
        assert admin.sessions() == []
        assert admin.list_prefixes().stats.restores == 1
