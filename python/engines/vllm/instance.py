"""One vLLM instance on the CPU, built from vLLM's own parts, driving memra_kv.vllm the way
vLLM 0.33 does (python/engines/vllm/test_vllm_connector.py runs it as a separate process):

    instance.py SOCKET LAYOUT PROMPT_JSON [--hash-algo sha256] [--cache-salt S] [--mla]
                [--repeat N [--pause-before I]] [--lookup-pin-ms MS] [--load-failure-policy P]
                [--evict-with ADMIN_SOCKET] [--async-load-min-tokens N] [--layerwise 0|1]
                [--pause-before-load]

* VllmConfig of an offline model directory (model/config.json, HF_HUB_OFFLINE=1) with
  --kv-transfer-config's fields: kv_connector "MemraKVConnector", kv_connector_module_path
  "memra_kv.vllm", kv_role "kv_both", kv_connector_extra_config {"memra_socket": SOCKET}.
* The worker side: vLLM's ensure_kv_transfer_initialized creates the connector through
  KVConnectorFactory; vLLM's allocate_kv_cache allocates the KV cache as torch CPU tensors in
  the given KVCacheLayout, and they are registered as GPUModelRunner does.
* The scheduler side: vLLM's Scheduler (it creates its own connector through the factory)
  schedules a request of PROMPT; its SchedulerOutput, pickled as it crosses to the worker, is
  run through vLLM's KVConnectorModelRunnerMixin._get_kv_connector_output (bind, start_load_kv,
  the forward, wait_for_save, get_transfer_results, load errors); the "forward" writes each
  scheduled token's K and V (a pattern of layer, position and token id) into its slot; the
  ModelRunnerOutput goes back through Scheduler.update_from_output until the request ends.
  The forward stand-in calls the layer hooks per layer as vLLM's attention layers do
  (maybe_transfer_kv_layer: wait_for_layer_load, the layer, save_kv_layer). A request whose
  load is asynchronous waits (WAITING_FOR_REMOTE_KVS) while steps run without it, as vLLM's
  engine loop goes on stepping, until the worker's get_finished reports the load.

Prints one JSON object: what vLLM saw (matched tokens, block ids), the SHA-256 of each of the
request's whole blocks' pages (every layer, memory order), and what the connector did."""

import argparse
import hashlib
import json
import os
import pickle
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig, set_current_vllm_config)
from vllm.distributed import (ensure_model_parallel_initialized,  # noqa: E402
                              init_distributed_environment)
from vllm.distributed.kv_transfer.kv_transfer_state import (  # noqa: E402
    ensure_kv_transfer_initialized, get_kv_transfer_group)
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import \
    KVConnectorModelRunnerMixin  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
BLOCK_SIZE = 16
NUM_BLOCKS = 64
EOS = 2


def vllm_config(socket, layout, hash_algo, lookup_pin_ms=None, load_failure_policy="fail",
                async_load_min_tokens=None, layerwise=None):
    extra = {"memra_socket": socket, "memra_timeout_s": 2}
    if lookup_pin_ms is not None:
        extra["memra_lookup_pin_ms"] = lookup_pin_ms
    if async_load_min_tokens is not None:
        extra["memra_async_load_min_tokens"] = async_load_min_tokens
    if layerwise is not None:
        extra["memra_layerwise"] = layerwise
    model = ModelConfig(model=MODEL_DIR, dtype="float16", seed=0, skip_tokenizer_init=True)
    cache = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo)
    # The engine core resolves the layout before it builds connectors (resolve_kv_cache_layout).
    cache.kv_cache_layout = layout
    config = VllmConfig(
        model_config=model, cache_config=cache, device_config=DeviceConfig("cpu"),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MemraKVConnector", kv_connector_module_path="memra_kv.vllm",
            kv_role="kv_both", kv_load_failure_policy=load_failure_policy,
            kv_connector_extra_config=extra))
    return config


def kv_cache_config(config, layout, mla):
    """What vLLM's get_kv_cache_configs gives this model: one full-attention group (with `mla`,
    DeepSeek's multi-head latent attention: one 576-wide latent a token), one backing
    allocation holding every layer's pages in `layout`."""
    hf = config.model_config.hf_config
    if mla:
        spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576,
                                dtype=torch.float16)
    else:
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=hf.num_key_value_heads,
                                 head_size=hf.hidden_size // hf.num_attention_heads,
                                 dtype=torch.float16)
    names = ["model.layers.%d.self_attn.attn" % i for i in range(hf.num_hidden_layers)]
    page = spec.page_size_bytes
    layer_outer = KVCacheLayout[layout].is_layer_compact
    tensor = KVCacheTensor(size=page * NUM_BLOCKS * len(names), layers=names,
                           layer_stride=page * NUM_BLOCKS if layer_outer else page,
                           block_stride=page if layer_outer else page * len(names))
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                         kv_cache_layout=layout)


def forward(connector, kv_caches, scheduler_output, requests, block_ids):
    """The model's attention layers, each writing K and V of each scheduled token into its
    slot, between the connector's layer hooks as vLLM's maybe_transfer_kv_layer calls them (it
    does so only in a step with a forward and connector metadata)."""
    if not scheduler_output.num_scheduled_tokens:
        return
    starts = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    for layer, (name, cache) in enumerate(kv_caches.items()):
        connector.wait_for_layer_load(name)
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            request = requests[request_id]
            start = starts[request_id]
            for position in range(start, start + count):
                token = request.all_token_ids[position]
                block = block_ids[request_id][position // BLOCK_SIZE]
                cell = cache[block, :, position % BLOCK_SIZE, :]  # (heads, content)
                values = torch.arange(cell.numel(), dtype=torch.float32).reshape(cell.shape)
                cell.copy_((values + layer * 1000 + token * 7 + position) % 2048)
        connector.save_kv_layer(name, cache, attn_metadata=None)


def evict_everything(admin_socket):
    """An operator evicting every stored block (memra-kvctl evict): the refusals, as
    [code, message]."""
    import memra_kv
    with memra_kv.Client.connect(admin_socket, timeout=10) as admin:
        refused = admin.evict_all_prefixes().refused
    return [[error.code.name, error.message] for _, error in refused]


def page_digests(kv_caches, block_ids, order):
    """SHA-256 of each block's pages, every layer, in memory order."""
    digests = []
    for block in block_ids:
        h = hashlib.sha256()
        for cache in kv_caches.values():
            page = cache[block]
            if order == "NHD":
                page = page.permute(1, 0, 2)
            h.update(page.contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(h.hexdigest())
    return digests


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("layout")
    parser.add_argument("prompt")
    parser.add_argument("--hash-algo", default="sha256")
    parser.add_argument("--cache-salt", default=None)
    parser.add_argument("--mla", action="store_true")
    parser.add_argument("--lookup-pin-ms", type=int, default=None)
    parser.add_argument("--load-failure-policy", default="fail")
    parser.add_argument("--evict-with", default=None,
                        help="an admin socket: evict every stored block between the scheduler's "
                             "lookup and the worker's load (the refusals are reported)")
    parser.add_argument("--repeat", type=int, default=1, help="requests of PROMPT, one by one")
    parser.add_argument("--pause-before", type=int, default=-1,
                        help="before this request, print PAUSED and wait for a line on stdin")
    parser.add_argument("--async-load-min-tokens", type=int, default=None)
    parser.add_argument("--layerwise", type=int, default=None)
    parser.add_argument("--pause-before-load", action="store_true",
                        help="once the scheduler planned a load, before the worker starts it: "
                             "print LOAD-PLANNED and wait for a line on stdin")
    args = parser.parse_args(argv)
    prompt = json.loads(args.prompt)

    config = vllm_config(args.socket, args.layout, args.hash_algo, args.lookup_pin_ms,
                         args.load_failure_policy, args.async_load_min_tokens, args.layerwise)
    kv_config = kv_cache_config(config, args.layout, args.mla)

    # Worker: a one-process gloo group (vLLM's TP group: the connector asks its rank), vLLM's
    # factory makes the connector, vLLM allocates and registers the caches.
    with tempfile.TemporaryDirectory() as rendezvous, set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://%s/init" % rendezvous)
        ensure_model_parallel_initialized(1, 1)
    ensure_kv_transfer_initialized(config, kv_config)
    worker = get_kv_transfer_group()
    kv_caches = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[args.layout],
                                  [BLOCK_SIZE])
    worker.register_kv_caches(kv_caches)

    # Scheduler: vLLM's, with its own connector from the factory.
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK_SIZE, log_stats=True)
    hash_fn = get_hash_fn_by_name(args.hash_algo)
    init_none_hash(hash_fn)
    connectors = [type(scheduler.connector).__module__, type(scheduler.connector).__name__,
                  type(worker).__name__]
    results = []
    for index in range(args.repeat):
        if index == args.pause_before:
            # The test changes the world (restarts the daemon) and answers on stdin.
            print("PAUSED", flush=True)
            sys.stdin.readline()
        scheduler.reset_prefix_cache()  # a hit must come from memra-kvd, not vLLM's own cache
        results.append(run_request(config, scheduler, worker, kv_caches, args, prompt, hash_fn,
                                   "req-%d" % index))
    facts = dict(results[0], connector=connectors, requests=results)
    print("FACTS " + json.dumps(facts))


def run_request(config, scheduler, worker, kv_caches, args, prompt, hash_fn, request_id):
    """One request of `prompt` through vLLM's scheduler and the worker side until it ends;
    what it saw."""
    logic = worker._worker
    counters = ("saved_blocks", "loaded_blocks", "planes_saved_by_layer_hooks",
                "planes_loaded_by_layer_hooks")
    before = {name: getattr(logic, name) if logic is not None else 0 for name in counters}
    sampling = SamplingParams(max_tokens=1)
    sampling.update_from_generation_config({}, EOS)
    request = Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling,
                      pooling_params=None, cache_salt=args.cache_salt,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, hash_fn))
    scheduler.add_request(request)
    facts = {"vllm_block_hashes": [bytes(h).hex() for h in request.block_hashes]}
    block_ids = {}
    facts["async_waiting_steps"] = 0
    facts["invalid_block_ids"] = []
    facts["finished_recving"] = []
    steps = 0
    # vLLM's engine loop steps while requests are unfinished; a request waiting for its
    # asynchronous load is unfinished until the worker reports it (the loader thread ends it,
    # success or failure), so this ends. The bound only turns a connector that never reports
    # into a failed test instead of a hang.
    while scheduler.has_requests() and steps < 100000:
        steps += 1
        output = scheduler.schedule()
        for new in output.scheduled_new_reqs:
            block_ids[new.req_id] = list(new.block_ids[0])
            facts.setdefault("matched_tokens", new.num_computed_tokens)
        waiting = scheduler.requests.get(request_id)
        if waiting is not None and waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            facts["async_waiting_steps"] += 1
            facts.setdefault("async_matched_tokens", waiting.num_computed_tokens)
            facts.setdefault("async_block_ids",
                             list(scheduler.kv_cache_manager.get_block_ids(request_id)[0]))
        meta = output.kv_connector_metadata
        if meta.loads or meta.saves:
            facts.setdefault("meta", []).append({
                "loads": [len(l.block_ids) for l in meta.loads],
                "async_loads": [l.asynchronous for l in meta.loads],
                "saves": [len(s.block_ids) for s in meta.saves]})
        if args.evict_with and meta.loads:
            facts["evict_refusals"] = evict_everything(args.evict_with)
        if args.pause_before_load and meta.loads:
            print("LOAD-PLANNED", flush=True)  # the test changes the world, answers on stdin
            sys.stdin.readline()
        output = pickle.loads(pickle.dumps(output))  # as it crosses to the worker process
        with set_forward_context(None, config):
            with KVConnectorModelRunnerMixin._get_kv_connector_output(output) as kv_output:
                forward(worker, kv_caches, output, scheduler.requests, block_ids)
        facts["invalid_block_ids"].extend(sorted(kv_output.invalid_block_ids))
        facts["finished_recving"].extend(sorted(kv_output.finished_recving or ()))
        runner = ModelRunnerOutput(
            req_ids=list(output.num_scheduled_tokens),
            req_id_to_index={r: i for i, r in enumerate(output.num_scheduled_tokens)},
            sampled_token_ids=[[EOS] for _ in output.num_scheduled_tokens],
            kv_connector_output=kv_output)
        scheduler.update_from_output(output, runner)

    whole = len(prompt) // BLOCK_SIZE
    order = {"LBNHC": "NHD", "BLNHC": "NHD"}.get(args.layout, "HND")
    facts["block_ids"] = block_ids[request_id]
    facts["digests"] = page_digests(kv_caches, block_ids[request_id][:whole], order)
    logic = worker._worker
    facts["worker"] = None if logic is None else {
        name: getattr(logic, name) - before[name] for name in counters[:2]}
    facts["layer_hooks"] = None if logic is None else {
        name: getattr(logic, name) - before[name] for name in counters[2:]}
    facts["finished"] = not scheduler.has_requests()
    return facts


if __name__ == "__main__":
    main(sys.argv[1:])
