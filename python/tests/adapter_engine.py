"""An engine process for the contract tests: it replays vLLM's or SGLang's documented call order
against memra_kv.vllm / memra_kv.sglang, with numpy arrays in a memra HostPool standing in for
the engine's paged KV pool, and writes what it saw as JSON to OUT.

    adapter_engine.py SOCKET ADMIN_SOCKET OUT ENGINE MODE

ENGINE vllm: MODE store (a request's prompt computed and saved), load (the same prompt from a
fresh pool: its blocks loaded, the bytes checked), load-evicted (an operator evicts the stored
blocks between lookup and load: the lookup's pin refuses it, the load succeeds),
load-evicted-unpinned (the same with a scheduler that does not pin: load errors); store-staged and load-staged with caches in plain
memory (staged through a 3-block HostPool). ENGINE sglang: memra_kv.sglang.PageTier, the
page store under MemraHiCacheStorage, with SGLang's page calls made on a numpy layer_first host
pool (SglangPages; the real SGLang drives the backend in python/engines/sglang/): MODE set
(host pages backed up), get (loaded into other pages, the bytes checked), get-partial (unstored
pages after the stored ones; then every page evicted between the lookup and the load);
concurrent: loads and stores from two threads at once, each through its own staging slots.

Every block's bytes are a function of (its position in the sequence, layer, K or V), never of
the pool block it sits in, so a process can check what another one stored.
"""

import hashlib
import json
import os
import sys
import threading

import numpy as np

import memra_kv
from memra_kv.block_store import (BlockStore, HostPool, KeptRegistration, PoolLayout,
                                  TensorLayout)
from memra_kv.sglang import PageFormat, PageTier, model_identity
from memra_kv.vllm import MemraScheduler, MemraWorker, lookup_layout

MODEL = "contract-model/rev1"
LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 8, 16
POOL_BLOCKS = 16
PROMPT = [(i * 7 + 3) % 1000 for i in range(70)]  # 4 whole blocks and 6 tokens


def pattern(position, layer, kind, shape):
    """The bytes of sequence block `position` of `layer`'s K (0) or V (1)."""
    flat = np.arange(int(np.prod(shape)), dtype=np.uint32)
    value = flat * 5 + position * 31 + layer * 7 + kind * 3 + 11
    return (value & 0xFF).astype(np.uint8).reshape(shape)


def digest(arrays):
    h = hashlib.sha256()
    for array in arrays:
        h.update(np.ascontiguousarray(array).view(np.uint8).tobytes())
    return h.hexdigest()


# ---- vLLM ----

def vllm_hashes(tokens):
    """Chained block hashes as vLLM derives them (each binds its whole prefix)."""
    hashes, parent = [], b""
    for b in range(len(tokens) // BLOCK):
        h = hashlib.sha256(parent + np.asarray(tokens[b * BLOCK:(b + 1) * BLOCK],
                                               dtype=np.int64).tobytes()).digest()
        hashes.append(h)
        parent = h
    return hashes


def vllm_pool():
    """vLLM's per-layer FlashAttention caches (2, num_blocks, block_size, heads, head_dim)
    fp16, back to back in one HostPool."""
    per_layer = 2 * POOL_BLOCKS * BLOCK * HEADS * HEAD_DIM * 2
    pool = HostPool(LAYERS * per_layer)
    caches = {"model.layers.%d.self_attn.attn" % layer:
              pool.view(np.float16, (2, POOL_BLOCKS, BLOCK, HEADS, HEAD_DIM), layer * per_layer)
              for layer in range(LAYERS)}
    return pool, caches


def block_bytes(caches, layer, kind, block_id):
    return caches["model.layers.%d.self_attn.attn" % layer][kind, block_id].reshape(-1).view(np.uint8)


def vllm_engine(socket, admin_socket, mode):
    facts = {}
    staged = mode.endswith("-staged")
    mode = mode[:-len("-staged")] if staged else mode
    pin_ttl_ms = 0 if mode.endswith("-unpinned") else 30000
    with memra_kv.connect(socket) as sched_client, memra_kv.connect(socket) as worker_client:
        sched_client.attach("vllm-scheduler")
        worker_client.attach("vllm-worker-0")
        if staged:  # vLLM's own memory, not a HostPool: blocks go through a staging pool
            pools = []
            caches = {"model.layers.%d.self_attn.attn" % layer:
                      np.zeros((2, POOL_BLOCKS, BLOCK, HEADS, HEAD_DIM), dtype=np.float16)
                      for layer in range(LAYERS)}
        else:
            pool, caches = vllm_pool()
            pools = [pool]
        worker = MemraWorker(BlockStore(worker_client), staging_blocks=3)
        # vLLM: register_kv_caches once the worker allocated its caches.
        registration = worker.register_kv_caches(caches, pools, MODEL)
        facts["groups"] = [g.block_bytes for g in registration.groups]
        packed, nbytes = lookup_layout(registration.layout)
        lookup_pool = HostPool(nbytes)
        store = BlockStore(sched_client)
        scheduler = MemraScheduler(KeptRegistration(store, [lookup_pool], packed), BLOCK,
                                   pin_ttl_ms)

        hashes = vllm_hashes(PROMPT)
        request = "req-0"
        # Scheduler step: matched tokens, allocation, connector metadata.
        matched, load_async = scheduler.get_num_new_matched_tokens(request, hashes, PROMPT, 0)
        facts["matched_tokens"], facts["load_async"] = matched, load_async
        # Whole blocks only, never the last token: a prompt of exactly 4 blocks gets 3.
        facts["matched_tokens_of_64"] = scheduler.get_num_new_matched_tokens(
            "req-64", hashes[:4], PROMPT[:64], 0)[0]
        scheduler.request_finished("req-64")
        block_ids = [9, 3, 7, 1, 12] if mode.startswith("load") else [2, 5, 0, 11, 6]
        scheduler.update_state_after_alloc(request, block_ids, matched)
        meta = scheduler.build_connector_meta({request: len(PROMPT)})
        facts["meta"] = {"loads": [len(l.block_ids) for l in meta.loads],
                         "saves": [len(s.block_ids) for s in meta.saves]}
        if mode.startswith("load-evicted"):
            with memra_kv.connect(admin_socket) as admin:
                facts["evict_refusals"] = [[error.code.name, error.message]
                                           for _, error in admin.evict_all_prefixes().refused]

        # Worker step: bind metadata, start loads, per layer wait / compute / save, wait.
        worker.start_load_kv(meta)
        loaded = matched // BLOCK
        for layer in range(LAYERS):
            worker.wait_for_layer_load("model.layers.%d.self_attn.attn" % layer)
            for position in range(loaded, len(hashes)):  # the forward pass computes the rest
                for kind in (0, 1):
                    target = block_bytes(caches, layer, kind, block_ids[position])
                    target[...] = pattern(position, layer, kind, target.shape)
            worker.save_kv_layer("model.layers.%d.self_attn.attn" % layer)
        worker.wait_for_save(meta)
        facts["finished"] = [None if ids is None else sorted(ids)
                             for ids in worker.get_finished({request})]
        facts["load_errors"] = sorted(worker.get_block_ids_with_load_errors())
        facts["saved_blocks"], facts["loaded_blocks"] = worker.saved_blocks, worker.loaded_blocks
        facts["request_finished"] = list(scheduler.request_finished(request))

        # What the pool holds for the sequence's blocks, and whether it is the pattern.
        facts["block_digests"] = [
            digest([block_bytes(caches, layer, kind, block_ids[p])
                    for layer in range(LAYERS) for kind in (0, 1)]) for p in range(len(hashes))]
        facts["pattern_ok"] = [
            all(np.array_equal(block_bytes(caches, layer, kind, block_ids[p]),
                               pattern(p, layer, kind, (BLOCK * HEADS * HEAD_DIM * 2,)))
                for layer in range(LAYERS) for kind in (0, 1)) for p in range(len(hashes))]
        facts["block_ids"] = block_ids
    return facts


# ---- SGLang ----

PAGE = 16
HOST_TOKENS = 32 * PAGE


def sglang_keys(tokens):
    """SGLang's chained page keys: hex SHA-256 over the prior key's bytes and the page's token
    ids (4 bytes little-endian each)."""
    keys, prior = [], None
    for p in range(len(tokens) // PAGE):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[p * PAGE:(p + 1) * PAGE]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        keys.append(prior)
    return keys


def sglang_pool():
    """SGLang's layer_first MHA host pool (2, layer_num, size, head_num, head_dim) bf16-sized
    (2 bytes an element) in one HostPool."""
    shape = (2, LAYERS, HOST_TOKENS, HEADS, HEAD_DIM)
    pool = HostPool(int(np.prod(shape)) * 2)
    return pool, pool.view(np.float16, shape)


class SglangPages:
    """SGLang's page calls (batch_exists, exists, batch_get_v1, batch_set_v1: page keys and host
    token indices, page_size a key) on a numpy layer_first host pool `kv_buffer` (2, layers,
    tokens, heads, head_dim), made the way MemraHiCacheStorage makes them: through a PageTier
    whose page is the host pool's flat page (every layer's K and V of its tokens)."""

    def __init__(self, client, kv_buffer, staging_pages=3):
        _, layers, _, heads, head_dim = kv_buffer.shape
        self.page_shape = (2, layers, PAGE, heads, head_dim)
        page_format = PageFormat(
            page_bytes=int(np.prod(self.page_shape)) * kv_buffer.itemsize,
            tokens_per_page=PAGE, element_type="fp16", heads=heads, head_dim=head_dim,
            identity=model_identity(MODEL, "contract:layer_first:float16"))
        self.tier = PageTier(BlockStore(client), page_format, staging_pages)
        self.kv_buffer = kv_buffer

    @property
    def registration(self):
        return self.tier.registration

    def _starts(self, keys, indices):
        indices = np.asarray(indices).reshape(-1)
        assert len(indices) == len(keys) * PAGE
        return [int(i) for i in indices[::PAGE]]

    def _page(self, slot):
        return slot.view(self.kv_buffer.dtype).reshape(self.page_shape)

    def batch_set_v1(self, keys, indices):
        starts = self._starts(keys, indices)

        def copy_out(i, slot):
            self._page(slot)[...] = self.kv_buffer[:, :, starts[i]:starts[i] + PAGE]
        return self.tier.store(keys, copy_out)

    def batch_get_v1(self, keys, indices):
        starts = self._starts(keys, indices)

        def copy_in(i, slot):
            self.kv_buffer[:, :, starts[i]:starts[i] + PAGE] = self._page(slot)
        return self.tier.load(keys, copy_in)

    def batch_exists(self, keys):
        return self.tier.leading(keys)

    def exists(self, key):
        return self.tier.leading([key]) == 1


def page_layout(pool):
    """A PoolLayout of sglang_pool()'s HostPool as whole flat pages (a "KV" tensor a page)."""
    page = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2
    return PoolLayout(num_blocks=pool.nbytes // page, tokens_per_block=PAGE,
                      element_type="fp16", num_kv_heads=HEADS, head_dim=HEAD_DIM, model=MODEL,
                      tensors=[TensorLayout(0, "KV", 0, page, page)])


def page_bytes(kv_buffer, layer, kind, page):
    return kv_buffer[kind, layer, page * PAGE:(page + 1) * PAGE].view(np.uint8).reshape(-1)


def host_indices(pages):
    return np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in pages]) if pages else \
        np.zeros(0, dtype=np.int64)


def fill_pages(kv_buffer, pages, first_position):
    """Host pages `pages` hold sequence positions first_position, first_position + 1, ..."""
    for position, page in enumerate(pages, first_position):
        for layer in range(LAYERS):
            for kind in (0, 1):
                target = page_bytes(kv_buffer, layer, kind, page)
                target[...] = pattern(position, layer, kind, target.shape)


def pages_hold(kv_buffer, pages, first_position):
    """Per page of `pages`: whether it holds what fill_pages(first_position) wrote."""
    return [all(np.array_equal(page_bytes(kv_buffer, layer, kind, page),
                               pattern(position, layer, kind, (PAGE * HEADS * HEAD_DIM * 2,)))
                for layer in range(LAYERS) for kind in (0, 1))
            for position, page in enumerate(pages, first_position)]


def sglang_engine(socket, admin_socket, mode):
    facts = {}
    tokens = [(i * 13 + 5) % 997 for i in range(6 * PAGE)]
    keys = sglang_keys(tokens)[:4]
    with memra_kv.connect(socket) as client:
        client.attach("sglang-tp0")
        kv_buffer = np.zeros((2, LAYERS, HOST_TOKENS, HEADS, HEAD_DIM), dtype=np.float16)
        # SGLang: the cache controller registers its host pool with the backend once.
        backend = SglangPages(client, kv_buffer, staging_pages=3)
        pages = [4, 9, 1, 20] if mode.startswith("get") else [0, 1, 2, 3]
        if mode == "set":
            # write-through backup: host pages hold the device's KV; batch_exists, then set.
            for position, page in enumerate(pages):
                for layer in range(LAYERS):
                    for kind in (0, 1):
                        target = page_bytes(kv_buffer, layer, kind, page)
                        target[...] = pattern(position, layer, kind, target.shape)
            facts["exists_before"] = backend.batch_exists(keys)
            facts["set"] = backend.batch_set_v1(keys, host_indices(pages))
            facts["set_again"] = backend.batch_set_v1(keys, host_indices(pages))
            facts["exists_after"] = backend.batch_exists(keys)
        elif mode == "get":
            # prefetch: batch_exists counts the leading stored pages, batch_get_v1 loads them.
            hit = backend.batch_exists(keys)
            facts["exists"] = hit
            facts["get"] = backend.batch_get_v1(keys[:hit], host_indices(pages[:hit]))
            facts["exists_one"] = backend.exists(keys[0])
        elif mode == "concurrent":
            # SGLang's prefetch thread (batch_get_v1) and backup thread (batch_set_v1) at once,
            # both through the one staging pool: every page set and got keeps its own bytes.
            fill_pages(kv_buffer, pages, 0)
            facts["set"] = backend.batch_set_v1(keys, host_indices(pages))
            set_pages, got_pages, rounds = [4, 5, 6], [20, 21, 22], 25
            fill_pages(kv_buffer, set_pages, 10)
            set_keys = [sglang_keys([r * 1000 + 7 + t for t in range(3 * PAGE)])
                        for r in range(rounds)]
            got, sets = [], []

            def prefetch():
                for _ in range(rounds):
                    got.append(backend.batch_get_v1(keys[:3], host_indices(got_pages)))
                    got.append(pages_hold(kv_buffer, got_pages, 0))

            def backup():
                for round_keys in set_keys:
                    sets.append(backend.batch_set_v1(round_keys, host_indices(set_pages)))

            threads = [threading.Thread(target=prefetch), threading.Thread(target=backup)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            facts["concurrent_got"] = got
            facts["concurrent_set"] = sets
            check_pages = [24, 25, 26]
            facts["concurrent_set_bytes_ok"] = []
            for round_keys in set_keys:
                loaded = backend.batch_get_v1(round_keys, host_indices(check_pages))
                facts["concurrent_set_bytes_ok"].append(
                    loaded + pages_hold(kv_buffer, check_pages, 10))
        else:  # get-partial
            more = sglang_keys(tokens)  # 6 pages: the last 2 never stored
            facts["exists"] = backend.batch_exists(more)
            facts["get"] = backend.batch_get_v1(more[:5], host_indices([4, 9, 1, 20, 22]))
            with memra_kv.connect(admin_socket) as admin:
                assert admin.evict_all_prefixes().refused == ()
            facts["get_after_eviction"] = backend.batch_get_v1(keys, host_indices(pages))
            facts["exists_after_eviction"] = backend.batch_exists(keys)
        facts["page_digests"] = [
            digest([page_bytes(kv_buffer, layer, kind, page)
                    for layer in range(LAYERS) for kind in (0, 1)]) for page in pages]
        facts["pattern_ok"] = [
            all(np.array_equal(page_bytes(kv_buffer, layer, kind, page),
                               pattern(position, layer, kind, (PAGE * HEADS * HEAD_DIM * 2,)))
                for layer in range(LAYERS) for kind in (0, 1))
            for position, page in enumerate(pages)]
    return facts


def main(socket, admin_socket, out, engine, mode):
    facts = (vllm_engine if engine == "vllm" else sglang_engine)(socket, admin_socket, mode)
    with open(out + ".tmp", "w") as f:
        json.dump(facts, f)
    os.rename(out + ".tmp", out)


if __name__ == "__main__":
    main(*sys.argv[1:6])
