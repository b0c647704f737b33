"""A registration the daemon lost behind the adapters' back (memra_kv.block_store.
KeptRegistration): unregistered by another call, gone with a daemon restarted without a
supervisor (the lease lost: the client attaches anew) or with one (the same engine, another
epoch). The next save or load through the vLLM and the SGLang adapter re-registers the same
pool once and works, with the pool's bytes; a re-registration the daemon refuses surfaces with
its code and numbers, and its offer is named again by the next try."""

import dataclasses
import logging
import os
import re
import signal

import grpc
import numpy as np
import pytest

from memra_kv import KvError
from memra_kv.block_store import BlockStore, HostPool, KeptRegistration
from memra_kv.vllm import MemraScheduler, MemraWorker, lookup_layout

from adapter_engine import (BLOCK, HEAD_DIM, HEADS, LAYERS, MODEL, PAGE, PROMPT, SglangPages,
                            block_bytes, fill_pages, page_layout,
                            host_indices, pages_hold, pattern, sglang_keys, sglang_pool,
                            vllm_hashes, vllm_pool)
from contract import DAEMON_FLAGS
from kvtest import poll_until

WHOLE_BLOCKS = len(PROMPT) // BLOCK  # 4
REREGISTERED = "re-registered the pool (%s): registration %d of engine %d -> registration %d of engine %d"


def reregistrations(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "memra_kv.block_store" and r.getMessage().startswith("re-registered")]


def unregister_behind_the_back(client, registration):
    """Another call of the same engine drops the adapter's registration."""
    BlockStore(client).unregister(registration)


# ---- vLLM ----

class VllmEngine:
    """A scheduler and a worker (each its own engine, as in vLLM) over one zero-copy pool."""

    def __init__(self, daemon):
        self.sched_client = daemon.client("vllm-scheduler")
        self.worker_client = daemon.client("vllm-worker-0")
        self.pool, self.caches = vllm_pool()
        self.worker = MemraWorker(BlockStore(self.worker_client))
        layout = self.worker.register_kv_caches(self.caches, [self.pool], MODEL).layout
        packed, nbytes = lookup_layout(layout)
        self.lookup = KeptRegistration(BlockStore(self.sched_client), [HostPool(nbytes)], packed)
        self.scheduler = MemraScheduler(self.lookup, BLOCK)
        self.hashes = vllm_hashes(PROMPT)

    def matched_blocks(self, request):
        return self.scheduler.get_num_new_matched_tokens(request, self.hashes, PROMPT, 0)[0] \
            // BLOCK

    def save(self, request, block_ids):
        """The prompt computed into block_ids (the pattern) and saved; blocks saved."""
        self.scheduler.get_num_new_matched_tokens(request, self.hashes, PROMPT, 0)
        for position, block_id in enumerate(block_ids[:WHOLE_BLOCKS]):
            for layer in range(LAYERS):
                for kind in (0, 1):
                    target = block_bytes(self.caches, layer, kind, block_id)
                    target[...] = pattern(position, layer, kind, target.shape)
        self.scheduler.update_state_after_alloc(request, block_ids, 0)
        meta = self.scheduler.build_connector_meta({request: len(PROMPT)})
        before = self.worker.saved_blocks
        self.worker.wait_for_save(meta)
        self.scheduler.request_finished(request)
        return self.worker.saved_blocks - before

    def load(self, request, block_ids, before_load=lambda: None):
        """The stored prompt loaded into zeroed block_ids: (blocks loaded, load errors, whether
        every loaded block holds its pattern)."""
        matched = self.scheduler.get_num_new_matched_tokens(request, self.hashes, PROMPT, 0)[0]
        for cache in self.caches.values():
            cache[:, block_ids] = 0
        self.scheduler.update_state_after_alloc(request, block_ids, matched)
        meta = self.scheduler.build_connector_meta({request: len(PROMPT)})
        before_load()
        before = self.worker.loaded_blocks
        self.worker.start_load_kv(meta)
        loaded = self.worker.loaded_blocks - before
        self.scheduler.request_finished(request)
        holds = all(np.array_equal(block_bytes(self.caches, layer, kind, block_ids[p]),
                                   pattern(p, layer, kind, (BLOCK * HEADS * HEAD_DIM * 2,)))
                    for p in range(loaded) for layer in range(LAYERS) for kind in (0, 1))
        return loaded, sorted(self.worker.get_block_ids_with_load_errors()), holds

    def close(self):
        self.sched_client.close()
        self.worker_client.close()


def test_vllm_saves_and_loads_after_its_registrations_were_unregistered(kvd, caplog):
    caplog.set_level(logging.WARNING, logger="memra_kv.block_store")
    engine = VllmEngine(kvd(*DAEMON_FLAGS))
    worker_engine, sched_engine = engine.worker_client.engine_id, engine.sched_client.engine_id
    first = engine.worker.registration.id
    unregister_behind_the_back(engine.worker_client, first)
    assert engine.save("req-0", [2, 5, 0, 11, 6]) == WHOLE_BLOCKS
    second = engine.worker.registration.id
    assert second != first

    lookup_first = engine.lookup.registration.id
    unregister_behind_the_back(engine.sched_client, lookup_first)
    assert engine.matched_blocks("req-1") == WHOLE_BLOCKS
    engine.scheduler.request_finished("req-1")
    lookup_second = engine.lookup.registration.id

    # Dropped between the scheduler's lookup and the worker's load: the load re-registers.
    loaded = engine.load("req-2", [9, 3, 7, 1, 12],
                         lambda: unregister_behind_the_back(engine.worker_client, second))
    assert loaded == (WHOLE_BLOCKS, [], True)
    third = engine.worker.registration.id
    gone = "no registration %d (unregistered, or its engine's lease ended)"
    assert reregistrations(caplog) == [
        REREGISTERED % (gone % first, first, worker_engine, second, worker_engine),
        REREGISTERED % (gone % lookup_first, lookup_first, sched_engine, lookup_second,
                        sched_engine),
        REREGISTERED % (gone % second, second, worker_engine, third, worker_engine)]
    engine.close()


def test_vllm_carries_on_after_a_daemon_restart_that_lost_its_engines(kvd, caplog):
    """Without a supervisor the restarted daemon knows neither engine: each client attaches
    anew (another engine id) and re-registers; what was stored before is a miss."""
    caplog.set_level(logging.WARNING, logger="memra_kv.block_store")
    daemon = kvd("--lease_timeout_ms=60000", *DAEMON_FLAGS)
    engine = VllmEngine(daemon)
    assert engine.save("req-0", [2, 5, 0, 11, 6]) == WHOLE_BLOCKS
    old_worker, old_sched = engine.worker_client.engine_id, engine.sched_client.engine_id
    old_registration, old_lookup = engine.worker.registration.id, engine.lookup.registration.id
    daemon.kill_and_start_again()
    assert poll_until(lambda: engine.worker_client.lease_lost is not None
                      and engine.sched_client.lease_lost is not None)

    assert engine.matched_blocks("req-1") == 0  # the store died with the daemon: a miss
    engine.scheduler.request_finished("req-1")
    assert engine.sched_client.lease_alive and engine.sched_client.lease_lost is None
    assert engine.save("req-2", [2, 5, 0, 11, 6]) == WHOLE_BLOCKS
    assert engine.worker_client.lease_alive and engine.worker_client.lease_lost is None
    assert engine.load("req-3", [9, 3, 7, 1, 12]) == (WHOLE_BLOCKS, [], True)
    messages = reregistrations(caplog)
    assert len(messages) == 2
    assert messages[0].startswith("re-registered the pool (the lease was lost (FAILED_PRECONDITION"
                                  ": memra-kvd restarted (epoch ")
    assert messages[0].endswith("): registration %d of engine %d -> registration %d of engine %d"
                                % (old_lookup, old_sched, engine.lookup.registration.id,
                                   engine.sched_client.engine_id))
    assert messages[1].endswith("): registration %d of engine %d -> registration %d of engine %d"
                                % (old_registration, old_worker, engine.worker.registration.id,
                                   engine.worker_client.engine_id))
    engine.close()


def test_vllm_calls_right_after_a_daemon_restart_wait_for_the_leases_verdict(kvd, caplog):
    """The first calls after the restart may reach the new daemon before the lease threads
    noticed (NOT_FOUND "engine N is not attached"): they wait for the verdict, attach anew and
    re-register instead of failing (vLLM's connector calls without waiting for anything)."""
    caplog.set_level(logging.WARNING, logger="memra_kv.block_store")
    daemon = kvd("--lease_timeout_ms=60000", *DAEMON_FLAGS)
    engine = VllmEngine(daemon)
    assert engine.save("req-0", [2, 5, 0, 11, 6]) == WHOLE_BLOCKS
    daemon.kill_and_start_again()
    assert engine.matched_blocks("req-1") == 0  # no poll for the lease threads first
    engine.scheduler.request_finished("req-1")
    assert engine.save("req-2", [2, 5, 0, 11, 6]) == WHOLE_BLOCKS
    assert engine.load("req-3", [9, 3, 7, 1, 12]) == (WHOLE_BLOCKS, [], True)
    messages = reregistrations(caplog)
    assert len(messages) == 2 and all(m.startswith("re-registered the pool (") for m in messages)
    engine.close()


# ---- SGLang ----

def sglang_backend(client):
    kv_buffer = np.zeros((2, LAYERS, 32 * PAGE, 2, 8), dtype=np.float16)
    return SglangPages(client, kv_buffer), kv_buffer


SGLANG_KEYS = sglang_keys([(i * 13 + 5) % 997 for i in range(4 * PAGE)])


def test_sglang_sets_and_gets_after_its_registration_was_unregistered(kvd, caplog):
    caplog.set_level(logging.WARNING, logger="memra_kv.block_store")
    daemon = kvd(*DAEMON_FLAGS)
    with daemon.client("sglang-tp0") as client:
        backend, kv_buffer = sglang_backend(client)
        ids = [backend.registration.id]
        fill_pages(kv_buffer, [0, 1, 2, 3], 0)
        unregister_behind_the_back(client, ids[-1])
        assert backend.batch_set_v1(SGLANG_KEYS, host_indices([0, 1, 2, 3])) == [True] * 4
        ids.append(backend.registration.id)
        unregister_behind_the_back(client, ids[-1])
        assert backend.batch_exists(SGLANG_KEYS) == 4
        ids.append(backend.registration.id)
        unregister_behind_the_back(client, ids[-1])
        assert backend.batch_get_v1(SGLANG_KEYS, host_indices([4, 9, 1, 20])) == [True] * 4
        ids.append(backend.registration.id)
        assert pages_hold(kv_buffer, [4, 9, 1, 20], 0) == [True] * 4
        assert len(set(ids)) == 4
        engine = client.engine_id
        assert reregistrations(caplog) == [
            REREGISTERED % ("no registration %d (unregistered, or its engine's lease ended)"
                            % old, old, engine, new, engine) for old, new in zip(ids, ids[1:])]


def test_sglang_carries_on_after_a_supervised_restart_as_the_same_engine(kvd, caplog):
    """Under memra-kv-supervise the engine comes back (same id, the next epoch) but the
    registration does not: the first call names the old id once, the new daemon answers
    NOT_FOUND (ids are per epoch), and the pool is registered again, once. One registration
    an engine here: a second one left behind would make the re-registration or the check
    after it fail."""
    caplog.set_level(logging.WARNING, logger="memra_kv.block_store")
    daemon = kvd("--lease_timeout_ms=60000", *DAEMON_FLAGS, "--block_store_max_registrations=1",
                 supervised=True)
    with daemon.client("sglang-tp0") as client:
        backend, kv_buffer = sglang_backend(client)
        fill_pages(kv_buffer, [0, 1, 2, 3], 0)
        assert backend.batch_set_v1(SGLANG_KEYS, host_indices([0, 1, 2, 3])) == [True] * 4
        engine, epoch, old = client.engine_id, client.epoch, backend.registration.id
        os.kill(daemon.daemon_pid(), signal.SIGKILL)
        assert poll_until(lambda: client.reattaches == 1), client.lease_lost
        assert (client.engine_id, client.epoch) == (engine, epoch + 1)

        assert backend.batch_set_v1(SGLANG_KEYS, host_indices([0, 1, 2, 3])) == [True] * 4
        assert backend.batch_get_v1(SGLANG_KEYS, host_indices([4, 9, 1, 20])) == [True] * 4
        assert pages_hold(kv_buffer, [4, 9, 1, 20], 0) == [True] * 4
        assert backend.registration.id != old
        assert reregistrations(caplog) == [REREGISTERED % (
            "no registration %d (unregistered, or its engine's lease ended)" % old, old, engine,
            backend.registration.id, engine)]
        with pytest.raises(KvError) as full:
            take_the_slot(client)
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert full.value.message == slot_refusal(client)


# ---- what is not re-made, and what is not retried ----

# One registration an engine and one waiting offer of all engines: a second registration of
# the engine takes the dropped one's slot, so re-registering is refused.
ONE_SLOT = ("--block_store_max_registrations=1", "--block_store_max_offers=1")


def take_the_slot(client):
    """Another pool of the same engine registered in the only slot; its Registration."""
    pool, kv_buffer = sglang_pool()
    store = BlockStore(client)
    return store.register([pool], page_layout(pool))


def slot_refusal(client):
    return "engine %d holds 1 registrations; the limit is 1" % client.engine_id


def test_a_registration_that_cannot_be_re_made_is_the_sglang_adapters_miss(kvd, caplog):
    caplog.set_level(logging.WARNING)
    daemon = kvd(*DAEMON_FLAGS, *ONE_SLOT)
    with daemon.client("sglang-tp0") as client:
        backend, kv_buffer = sglang_backend(client)
        first = backend.registration
        unregister_behind_the_back(client, first)
        other = take_the_slot(client)
        assert backend.batch_set_v1(SGLANG_KEYS, host_indices([0, 1, 2, 3])) == [False] * 4
        assert backend.batch_exists(SGLANG_KEYS) == 0
        warnings = [r.getMessage() for r in caplog.records if r.name == "memra_kv.sglang"]
        assert warnings == [  # the store in chunks of 3 staging pages
            "kv: store of 3 pages: RESOURCE_EXHAUSTED: " + slot_refusal(client),
            "kv: store of 1 pages: RESOURCE_EXHAUSTED: " + slot_refusal(client),
            "kv: lookup of 4 pages: RESOURCE_EXHAUSTED: " + slot_refusal(client)]
        assert backend.registration is first and reregistrations(caplog) == []
        BlockStore(client).unregister(other)
        fill_pages(kv_buffer, [0, 1, 2, 3], 0)
        assert backend.batch_set_v1(SGLANG_KEYS, host_indices([0, 1, 2, 3])) == [True] * 4
        assert len(reregistrations(caplog)) == 1 and backend.registration.id != first.id


def test_a_registration_that_cannot_be_re_made_is_the_vllm_workers_failure(kvd, caplog):
    caplog.set_level(logging.WARNING)
    engine = VllmEngine(kvd(*DAEMON_FLAGS, *ONE_SLOT))
    first = engine.worker.registration
    unregister_behind_the_back(engine.worker_client, first)
    take_the_slot(engine.worker_client)
    assert engine.save("req-0", [2, 5, 0, 11, 6]) == 0
    # The lookup (another engine, its own slot) finds nothing: nothing is loaded.
    assert engine.load("req-1", [9, 3, 7, 1, 12]) == (0, [], True)
    warnings = [r.getMessage() for r in caplog.records if r.name == "memra_kv.vllm"]
    assert warnings == ["save of request req-0: RESOURCE_EXHAUSTED: "
                        + slot_refusal(engine.worker_client)]
    assert engine.worker.registration is first and reregistrations(caplog) == []
    engine.close()


def test_a_refused_re_registration_is_raised_at_each_call_and_names_its_offer_again(kvd):
    """KeptRegistration raises the re-registration's refusal, once a call: the next call
    tries again with the same offer (the daemon holds one waiting offer at most here, so a
    new one would be refused by the offer limit instead) and, once the slot is free,
    re-registers."""
    daemon = kvd(*DAEMON_FLAGS, *ONE_SLOT)
    with daemon.client("py-kept") as client:
        pool, kv_buffer = sglang_pool()
        store = BlockStore(client)
        kept = KeptRegistration(store, [pool], page_layout(pool))
        first = kept.registration
        store.unregister(first)
        other = take_the_slot(client)
        for _ in range(3):
            with pytest.raises(KvError) as refused:
                kept.lookup(hashes=[b"x"])
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.message == slot_refusal(client)
        assert kept.registration is first and kept.reregistrations == 0
        store.unregister(other)
        assert kept.lookup(hashes=[b"x"]).matched_blocks == 0
        assert kept.reregistrations == 1 and kept.registration.id > other.id


def test_a_second_refusal_after_the_re_registration_is_raised_not_retried(kvd, caplog):
    """A daemon that forgets the registration again before every call: one re-registration
    and one retry, whose refusal is the caller's."""
    caplog.set_level(logging.WARNING, logger="memra_kv.block_store")
    daemon = kvd(*DAEMON_FLAGS)
    with daemon.client("py-kept") as client:
        pool, kv_buffer = sglang_pool()
        store = BlockStore(client)
        kept = KeptRegistration(store, [pool], page_layout(pool))
        first = kept.registration
        tried = []

        def forgetful_lookup(registration, **keys):
            tried.append(registration.id)
            store.unregister(registration)
            return store.lookup(registration, **keys)

        with pytest.raises(KvError) as refused:
            kept.call(forgetful_lookup, hashes=[b"x"])
        second = kept.registration
        assert tried == [first.id, second.id] and kept.reregistrations == 1
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        assert refused.value.message == ("no registration %d (unregistered, or its engine's "
                                         "lease ended)" % second.id)
        assert len(reregistrations(caplog)) == 1


def test_refusals_that_are_not_a_lost_registration_are_not_retried(kvd, caplog):
    caplog.set_level(logging.WARNING, logger="memra_kv.block_store")
    daemon = kvd(*DAEMON_FLAGS)
    with daemon.client("py-kept") as client:
        pool, kv_buffer = sglang_pool()
        kept = KeptRegistration(BlockStore(client), [pool],
                                page_layout(pool))
        registration = kept.registration
        with pytest.raises(KvError) as refused:
            kept.lookup(hashes=[b"x"], kv_group=5)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message == ("kv_group 5 is not registered (the registration has "
                                         "groups 0)")
        assert kept.registration is registration and kept.reregistrations == 0
        assert reregistrations(caplog) == []


# ---- offers a refused registration leaves waiting ----

def offered_buffer_of(message):
    return int(re.search(r"offered buffer (\d+)", message).group(1))


def test_a_registration_refused_for_its_buffer_range_names_its_offer_again(kvd):
    """The daemon keeps an offer through any refusal of the registration naming it (only a
    registration that succeeds uses it up): after FAILED_PRECONDITION, as after
    RESOURCE_EXHAUSTED, the next register names the same offer. One waiting offer of all
    engines here: a second offer of the pool would be refused by that limit instead."""
    daemon = kvd(*DAEMON_FLAGS, *ONE_SLOT)
    with daemon.client("py-offers") as client:
        pool, kv_buffer = sglang_pool()
        layout = page_layout(pool)
        store = BlockStore(client)
        other = take_the_slot(client)
        with pytest.raises(KvError) as full:
            store.register([pool], layout)
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert full.value.message == slot_refusal(client)
        store.unregister(other)

        # An engine that states its pool 4 KiB larger than the file: a range past the buffer.
        file_bytes = pool.nbytes
        pool.nbytes = file_bytes + 4096
        with pytest.raises(KvError) as past:
            store.register([pool], layout)
        pool.nbytes = file_bytes
        assert past.value.code == grpc.StatusCode.FAILED_PRECONDITION
        offer = offered_buffer_of(past.value.message)
        assert past.value.message == ("buffer 0: %d bytes at offset 0 of offered buffer %d, "
                                      "which holds %d" % (file_bytes + 4096, offer, file_bytes))

        registration = store.register([pool], layout)
        assert registration.engine_id == client.engine_id
        assert store.lookup(registration, hashes=[b"x"]).matched_blocks == 0
        # The offer was used up by that registration: the limit has room for a new one.
        store.unregister(registration)
        assert store.register([pool], layout).id > registration.id


def test_an_offer_the_daemon_no_longer_holds_is_offered_anew(kvd):
    """A register refused NOT_FOUND for its kept offer (used up by a registration whose
    answer the client never read) names that id no more: the next register offers the pool
    anew and succeeds (naming the id again would be NOT_FOUND again)."""
    daemon = kvd(*DAEMON_FLAGS, "--block_store_max_offers=1")
    with daemon.client("py-offers") as client:
        pool, kv_buffer = sglang_pool()
        layout = page_layout(pool)
        store = BlockStore(client)
        with pytest.raises(KvError) as bad_layout:  # twice the blocks the pool holds
            store.register([pool], dataclasses.replace(layout, num_blocks=2 * layout.num_blocks))
        assert bad_layout.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # The registration whose answer was lost: made with the same offer id, by another
        # BlockStore of the engine that was handed it.
        lost_answer = BlockStore(client)
        lost_answer._unconsumed_offers[pool] = store._unconsumed_offers[pool]
        offer = store._unconsumed_offers[pool][1]
        consumed = lost_answer.register([pool], layout)

        with pytest.raises(KvError) as gone:
            store.register([pool], layout)
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
        assert gone.value.message.startswith("buffer 0: no offered buffer %d " % offer)
        registration = store.register([pool], layout)
        assert registration.id > consumed.id
        assert store.lookup(registration, hashes=[b"x"]).matched_blocks == 0
