"""One SGLang process on the CPU, built from SGLang 0.5.23's own parts, driving
memra_kv.sglang the way SGLang's HiCache does (python/engines/sglang/test_*.py run it as a
separate process):

    instance.py SOCKET CONFIGS_JSON

CONFIGS_JSON: a list of {"label", "pool": "mha" | "mla", "layout", "dtype", "v1": bool,
"mamba": bool}. For each, SGLang's device pool on "cpu" (MHATokenToKVPool / MLATokenToKVPool),
its paged allocator, its host pool (MHATokenToKVPoolHost / MLATokenToKVPoolHost in `layout`,
torch CPU memory), and SGLang's HiCacheController over them with --hicache-storage-backend
dynamic and the extra config docs/engine-adapters.md documents ("interface_v1" when v1); with
"mamba", a hybrid model: a HostPoolGroup of that KV pool and a MambaPoolHost under SGLang's
HybridCacheController, the state at the prompt's last page travelling with the pages (SGLang's
v2 calls). The controller builds the backend through SGLang's StorageBackendFactory and runs
its own prefetch, I/O and backup threads.

Then one command a line on stdin, each answered by one line "FACTS <json>" (a list: one object
a config):

* store: the pages of PROMPT get their K and V (a pattern of each page's key) in host pages the
  host pool allocates, and controller.write_storage backs them up (SGLang's backup thread);
  what the acknowledgement says.
* load [--evict ADMIN_SOCKET]: controller.prefetch of PROMPT: SGLang's prefetch thread asks
  the backend (batch_exists); the hit is given host pages as SGLang's radix cache does
  (alloc_prefetch_host_buffers, prefetch_buffer) and SGLang's I/O thread loads them; the
  completed tokens from its acknowledgements, and the SHA-256 of each page that arrived.
  --evict: once every config's hit query is answered, an operator evicts every stored block,
  then the loads run.
* quit.

What is not SGLang here is the scheduler's part: putting requests in and taking the
controller's queues out (SGLang's radix cache does that in a server)."""

import hashlib
import json
import os
import sys
import tempfile
import threading

import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE = 16
PROMPT = [(i * 37 + 11) % 5000 for i in range(6 * PAGE)]  # 6 pages
DEVICE_TOKENS = 512
LAYERS = 3
MAMBA_SLOTS = 8
HOST_BUDGET = 1 << 30  # bytes SGLang may book for the host pools (its check, not psutil's)
ACK_TIMEOUT_S = 300  # a safety net against a hang, never a synchronisation


def memra_config(socket, label, v1):
    extra = {"backend_name": "memra-kv", "module_path": "memra_kv.sglang",
             "class_name": "MemraHiCacheStorage", "memra_socket": socket,
             "memra_engine_name": "sglang-" + label, "memra_staging_pages": 4}
    if v1:
        extra["interface_v1"] = 1
    return extra


def device_and_host_pools(config, dtype):
    """SGLang's device pool on "cpu" and its host pool in config's layout (torch CPU memory),
    booked against HOST_BUDGET with SGLang's own host_memory_budget_scope: its default check
    keeps 10 GiB of the machine free, more than a shared test machine may have."""
    with host_memory_budget_scope(HOST_BUDGET):
        if config["pool"] == "mla":
            device = MLATokenToKVPool(DEVICE_TOKENS, PAGE, dtype, kv_lora_rank=32,
                                      qk_rope_head_dim=8, layer_num=LAYERS, device="cpu",
                                      enable_memory_saver=False, start_layer=0,
                                      end_layer=LAYERS)
            host = MLATokenToKVPoolHost(
                device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, config["layout"],
                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                end_layer=LAYERS, target_layer_num=LAYERS)
        else:
            device = MHATokenToKVPool(DEVICE_TOKENS, PAGE, dtype, head_num=2, head_dim=8,
                                      layer_num=LAYERS, device="cpu",
                                      enable_memory_saver=False, start_layer=0,
                                      end_layer=LAYERS)
            host = MHATokenToKVPoolHost(
                device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, config["layout"],
                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                end_layer=LAYERS)
    return device, host


def mamba_host_pool():
    """SGLang's Mamba state host pool (page_size 1: a state slot a page) over CPU state
    buffers of 2 Mamba layers: fp32 temporal state and a bf16 conv state."""
    info = MambaStateBufferInfo(temporal=torch.zeros(2, MAMBA_SLOTS + 1, 4, 8),
                                conv=(torch.zeros(2, MAMBA_SLOTS + 1, 3, 16,
                                                  dtype=torch.bfloat16),))
    with host_memory_budget_scope(HOST_BUDGET):
        return MambaPoolHost(info, 2, 0, device_capacity=MAMBA_SLOTS, pin_memory=False,
                             layout="page_first")


class Instance:
    """One model's pools and SGLang's controller over them ("hybrid": a KV pool and a Mamba
    state pool in SGLang's HostPoolGroup under its HybridCacheController)."""

    def __init__(self, socket, config):
        self.label = config["label"]
        dtype = getattr(torch, config["dtype"])
        device, self.host = device_and_host_pools(config, dtype)
        allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, dtype, "cpu", device, False)
        arguments = dict(write_policy="write_through", io_backend="direct",
                         storage_backend="dynamic", prefetch_threshold=PAGE,
                         model_name="memra-test-model",
                         storage_backend_extra_config=memra_config(socket, self.label,
                                                                   config["v1"]))
        self.mamba = None
        if config.get("mamba"):
            self.mamba = mamba_host_pool()
            group = HostPoolGroup([
                PoolEntry(PoolName.KV, self.host, device, lambda layer: layer, True),
                PoolEntry(PoolName.MAMBA, self.mamba, None, lambda layer: layer)])
            self.controller = HybridCacheController(
                allocator, group, PAGE, torch.distributed.group.WORLD, threading.Event(),
                **arguments)
        else:
            self.controller = HiCacheController(
                allocator, self.host, PAGE, torch.distributed.group.WORLD, threading.Event(),
                **arguments)
        self.keys = get_storage_hash_str(PROMPT, None, page_size=PAGE)

    def mamba_transfer(self, slot):
        """The Mamba state at the prompt's last page, as SGLang's radix cache names it."""
        return PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[self.keys[-1]],
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)

    def facts(self, **more):
        backend = self.controller.storage_backend
        threads = [self.controller.prefetch_thread, self.controller.prefetch_io_aux_thread,
                   self.controller.backup_thread]
        return dict(more, label=self.label, backend=type(backend).__module__ + "."
                    + type(backend).__name__,
                    page_get=self.controller.page_get_func.__name__,
                    threads_alive=all(t.is_alive() for t in threads))

    def digest(self, index):
        return digest(self.host, index)

    def store(self):
        indices = self.host.alloc(len(PROMPT))
        starts = indices[::PAGE].tolist()
        for start, key in zip(starts, self.keys):
            fill(self.host, start, key)
        extra = {}
        if self.mamba is not None:
            slot = self.mamba.alloc(1)
            fill(self.mamba, int(slot[0]), self.keys[-1])
            extra["extra_pools"] = [self.mamba_transfer(slot)]
        self.controller.write_storage(indices, PROMPT, hash_value=self.keys, **extra)
        done = self.controller.ack_backup_queue.get(timeout=ACK_TIMEOUT_S)
        digests = [self.digest(start) for start in starts]
        self.host.free(indices)
        if self.mamba is None:
            return self.facts(stored_tokens=done.completed_tokens, digests=digests)
        mamba = digest(self.mamba, int(slot[0]))
        self.mamba.free(slot)
        return self.facts(stored_tokens=done.completed_tokens, digests=digests,
                          mamba_stored=done.pool_storage_result.extra_pool_hit_pages,
                          mamba_digest=mamba)

    def query(self):
        """controller.prefetch: SGLang's prefetch thread's hit query (batch_exists); the
        operation it queued for the radix cache."""
        if self.mamba is None:
            operation = self.controller.prefetch("req-%s" % self.label, PROMPT)
        else:
            # The hybrid controller takes the radix cache's request handle, not a request id.
            handle = CacheRequestHandle(rid="req-%s" % self.label, attempt_id=0)
            operation = self.controller.prefetch(handle, PROMPT, extra_pools=[
                self.mamba_transfer(self.mamba.alloc(1))])
        queried = self.controller.prefetch_hit_queue.get(timeout=ACK_TIMEOUT_S)
        assert queried is operation
        return operation

    def load(self, operation, evict_refusals):
        """The hit given host pages as SGLang's radix cache does and loaded by SGLang's I/O
        thread (batch_get_v1 / batch_get)."""
        controller = self.controller
        hit = operation.storage_hit_count
        completed, digests = 0, []
        if hit:
            indices = controller.alloc_prefetch_host_buffers(operation, hit)
            # Stale bytes in the fresh host pages: only what the backend loads may match.
            for start in indices[::PAGE].tolist():
                self.host.set_from_flat_data_page(start, self.host.get_dummy_flat_data_page())
            operation.host_indices = indices
            operation.hash_value = operation.hash_value[:hit // PAGE]
            controller.prefetch_buffer.put(operation)
            pool_hits = {}
            while True:
                ack = controller.ack_prefetch_queue.get(timeout=ACK_TIMEOUT_S)
                if ack.completed_tokens is not None:
                    completed = max(completed, ack.completed_tokens)
                pool_hits.update(getattr(ack, "pool_hits", None) or {})
                if ack.completed_req:
                    break
            digests = [self.digest(start) for start in indices[:completed:PAGE].tolist()]
            self.host.free(indices)
        facts = self.facts(hit_tokens=hit, loaded_tokens=completed, digests=digests,
                           evict_refusals=evict_refusals)
        if self.mamba is not None:
            (transfer,) = operation.pool_transfers
            facts.update(mamba_loaded={str(k): v for k, v in pool_hits.items()} if hit else {},
                         mamba_digest=digest(self.mamba, int(transfer.host_indices[0])))
            self.mamba.free(transfer.host_indices)
        return facts


def fill(pool, index, key):
    """The page of host pool `pool` at `index` gets bytes of a pattern seeded by its key (what
    the model would have computed there)."""
    size = pool.get_dummy_flat_data_page().numel() * pool.get_dummy_flat_data_page().element_size()
    generator = torch.Generator().manual_seed(int(key[:12], 16))
    pattern = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
    pool.set_from_flat_data_page(index, pattern.view(pool.get_dummy_flat_data_page().dtype))


def digest(pool, index):
    """SHA-256 of the page of host pool `pool` at `index` (its flat page bytes)."""
    page = pool.get_data_page(index, flat=True).contiguous()
    return hashlib.sha256(page.view(torch.uint8).numpy().tobytes()).hexdigest()


def evict_everything(admin_socket):
    """An operator evicting every stored block (memra-kvctl evict): the refusals."""
    import memra_kv
    with memra_kv.Client.connect(admin_socket, timeout=10) as admin:
        refused = admin.evict_all_prefixes().refused
    return [[error.code.name, error.message] for _, error in refused]


def main(argv):
    socket, configs = argv[0], json.loads(argv[1])
    with tempfile.TemporaryDirectory() as rendezvous:
        torch.distributed.init_process_group("gloo", init_method="file://%s/init" % rendezvous,
                                             rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    instances = [Instance(socket, config) for config in configs]
    print("READY", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "store":
            facts = [instance.store() for instance in instances]
        elif words[0] == "load":
            operations = [instance.query() for instance in instances]
            refusals = evict_everything(words[2]) if words[1:2] == ["--evict"] else []
            facts = [instance.load(operation, refusals)
                     for instance, operation in zip(instances, operations)]
        else:
            raise SystemExit("unknown command %r" % line)
        print("FACTS " + json.dumps(facts), flush=True)
    for instance in instances:
        instance.controller.detach_storage_backend()


if __name__ == "__main__":
    main(sys.argv[1:])
