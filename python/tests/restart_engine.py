"""A Python engine process for the restart chaos test (tests/restart/chaos_test.cc), the twin of
tests/restart/restart_engine.cc: attaches, creates --sessions sessions of a small dense plan and,
until the --until file exists, steps each (begin, prepare --rows rows, write those rows through
its own numpy mapping, publish, commit). When a call fails because the daemon went away it waits
for its client to re-attach, reads the session's state and checks that the daemon kept what it
acknowledged (the committed length last acknowledged, or that plus a commit in flight) and that
every committed row still holds its bytes. Set-up calls answered UNAVAILABLE (a daemon
restarting) are retried, as docs/failure-model.md asks of an engine. Once every session holds
rows it writes --ready; at the end it checks everything again, releases its sessions and writes
its facts (key=value lines) to --out. Exit 0 only when every check held.
"""

import argparse
import os
import sys
import time

import grpc
import numpy as np

import memra_kv
from memra_kv import KvError
from kvtest import dense_plan

LAYERS = 2
KINDS = (memra_kv.KEYS, memra_kv.VALUES)
RETRY_FOR_S = 30.0
RETRY_PERIOD_S = 0.02


def pattern(seed, session, row, layer, kind):
    return (seed * 131 + session * 31 + row * 7 + layer * 5 + kind * 3) & 0xff


def rows_of(session, layer, kind):
    """The plane as (rows, row bytes) uint8 over the shared mapping."""
    plane = session.plane(layer, kind)
    return plane.reshape(plane.shape[0], -1).view(np.uint8)


def write_rows(session, index, seed, first, rows):
    for layer in range(LAYERS):
        for kind in KINDS:
            plane = rows_of(session, layer, kind)
            for row in range(first, first + rows):
                plane[row] = pattern(seed, index, row, layer, kind)


def verify_rows(session, index, seed, committed):
    for layer in range(LAYERS):
        for kind in KINDS:
            plane = rows_of(session, layer, kind)
            for row in range(committed):
                want = pattern(seed, index, row, layer, kind)
                if not np.all(plane[row] == want):
                    raise AssertionError("session %d layer %d kind %d row %d differs" % (
                        session.id, layer, kind, row))


def retry_unavailable(client, call, counter=None):
    """call() until it answers anything but UNAVAILABLE, the lease is lost, or RETRY_FOR_S."""
    give_up = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            return call()
        except KvError as error:
            if error.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > give_up:
                raise
            if client is not None and client.lease_lost is not None:
                raise client.lease_lost from None
            if counter is not None:
                counter[0] += 1
            time.sleep(RETRY_PERIOD_S)


class Tracked:
    def __init__(self):
        self.session = None
        self.acked = 0     # the committed length the daemon last acknowledged
        self.inflight = 0  # rows of a commit sent and not acknowledged


def step(tracked, index, args):
    session = tracked.session
    if tracked.acked + args.rows > args.capacity:
        session.reset()
        tracked.acked = 0
    tx = session.begin()
    session.prepare_append(tx.generation, args.rows)
    write_rows(session, index, args.seed, tx.base_len, args.rows)
    session.publish_append(tx.generation)
    tracked.inflight = args.rows
    committed = session.commit(tx.generation, args.rows)
    tracked.inflight = 0
    tracked.acked = committed


def resync(client, tracked, index, args, failure):
    """After a failed step: once a daemon answers, it must hold what it acknowledged."""
    give_up = time.monotonic() + RETRY_FOR_S
    while True:
        if client.lease_lost is not None:
            raise client.lease_lost
        try:
            committed = tracked.session.state().committed_len
        except KvError as error:
            if error.is_daemon_restarted:
                raise
            if time.monotonic() > give_up:
                raise AssertionError("no daemon answered for %gs after %s; last %s" % (
                    RETRY_FOR_S, failure, error)) from None
            time.sleep(0.05)
            continue
        if committed not in (tracked.acked, tracked.acked + tracked.inflight):
            raise AssertionError("session %d: the daemon has %d committed rows; acknowledged %d "
                                 "(+%d in flight) before: %s" % (
                                     tracked.session.id, committed, tracked.acked,
                                     tracked.inflight, failure))
        tracked.acked = committed
        tracked.inflight = 0
        verify_rows(tracked.session, index, args.seed, committed)
        return


def write_facts(path, facts):
    if not path:
        return
    with open(path + ".partial", "w") as out:
        out.write("".join("%s=%s\n" % (key, value) for key, value in facts))
    os.rename(path + ".partial", path)


def run(args):
    client = retry_unavailable(None, lambda: memra_kv.Client.connect(args.socket, timeout=5.0))
    retry_unavailable(None, lambda: client.attach(args.name))
    first_epoch = client.epoch
    uncertain_creates = [0]
    sessions = [Tracked() for _ in range(args.sessions)]
    for tracked in sessions:
        while tracked.session is None:
            # A restarted daemon keeps only the plans its re-adopted sessions use: register
            # (again) before each create.
            plan = retry_unavailable(client, lambda: client.register_plan(
                dense_plan(LAYERS, 64, 2)))
            registered_at = client.reattaches
            try:
                tracked.session = retry_unavailable(
                    client, lambda: client.create_session(plan, args.capacity), uncertain_creates)
            except KvError as error:
                if error.code != grpc.StatusCode.NOT_FOUND or client.reattaches == registered_at:
                    raise
    steps = resyncs = 0

    def step_or_resync(tracked, index):
        nonlocal steps, resyncs
        try:
            step(tracked, index, args)
            steps += 1
        except KvError as failure:
            resync(client, tracked, index, args, failure)
            resyncs += 1

    for index, tracked in enumerate(sessions):
        while tracked.acked == 0:
            step_or_resync(tracked, index)
    write_facts(args.ready, [("epoch", first_epoch), ("engine_id", client.engine_id),
                             ("uncertain_creates", uncertain_creates[0])])
    while not os.path.exists(args.until):
        for index, tracked in enumerate(sessions):
            step_or_resync(tracked, index)
        time.sleep(0.002)
    rows = 0
    for index, tracked in enumerate(sessions):
        committed = tracked.session.state().committed_len
        if committed != tracked.acked:
            raise AssertionError("session %d has %d rows; acknowledged %d" % (
                tracked.session.id, committed, tracked.acked))
        verify_rows(tracked.session, index, args.seed, committed)
        rows += committed
    for tracked in sessions:
        tracked.session.release()
    write_facts(args.out, [("ok", 1), ("steps", steps), ("resyncs", resyncs), ("rows", rows),
                           ("reattaches", client.reattaches), ("first_epoch", first_epoch),
                           ("epoch", client.epoch)])
    client.detach()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--name", default="py-restart-engine")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--until", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--ready", default="")
    args = parser.parse_args()
    try:
        run(args)
    except BaseException as error:  # the log says why; the exit code says that it failed
        print("py restart engine %s failed: %r" % (args.name, error), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
