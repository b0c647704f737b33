"""An admission-aware request queue on memra-kvd: size sessions from the daemon's own numbers
(max_context, fit), admit requests while the budget has room, and queue the ones the daemon
refuses (AdmissionRefused carries needed / free bytes) until a running request finishes.

    python3 python/examples/admission_queue.py --socket /tmp/memra-kv/gpu0.sock --requests 6

The capacity is chosen so that two sessions fit in what is free now: the third request waits.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Deque, Dict, List, Optional, Sequence

import memra_kv
from example_engine import parse_args, register_model

CONCURRENT = 2
DECODE_STEPS = 3  # each request's length here: a few advance calls


def capacity_for(client: memra_kv.Client, plan: bytes, sessions: int) -> int:
    """The largest capacity (in steps of 1/16) of which `sessions` sessions fit now."""
    largest = client.max_context(fingerprint=plan).max_context_now
    capacity = largest // sessions
    while capacity > 0 and client.fit(capacity, fingerprint=plan).sessions_now < sessions:
        capacity -= max(capacity // 16, 1)
    if capacity < DECODE_STEPS:
        raise SystemExit("the daemon has no room for %d sessions of this plan" % sessions)
    return capacity


def serve(client: memra_kv.Client, plan: bytes, capacity: int, requests: int) -> List[str]:
    """Runs every request to completion; returns the log of admissions and refusals."""
    waiting: Deque[int] = collections.deque(range(requests))
    running: Dict[int, memra_kv.Session] = {}
    steps_left: Dict[int, int] = {}
    log: List[str] = []
    while waiting or running:
        while waiting:
            request = waiting[0]
            try:
                session = client.create_session(plan, capacity)
            except memra_kv.AdmissionRefused as refused:
                log.append("request %d refused: needs %d bytes, %d free; waits" % (
                    request, refused.needed, refused.free))
                break  # keep the order: nothing behind it jumps the queue
            waiting.popleft()
            running[request] = session
            steps_left[request] = DECODE_STEPS
            session.advance(next_rows=1)
            log.append("request %d admitted (%d running)" % (request, len(running)))
        for request in list(running):  # one decode step of every running request
            session = running[request]
            steps_left[request] -= 1
            done = steps_left[request] == 0
            session.advance(accepted_rows=1, next_rows=0 if done else 1)
            if done:
                session.release()
                del running[request]
                log.append("request %d finished" % request)
    return log


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6, help="requests to serve")
    args = parse_args(parser.description or "", argv, parser)
    with memra_kv.connect(args.socket) as client:
        client.attach("admission-queue-example")
        plan = register_model(client, args.hf_config)
        capacity = capacity_for(client, plan, CONCURRENT)
        cost = client.cost(capacity, fingerprint=plan)
        print("sessions of %d tokens, %d bytes each" % (capacity, cost.arena_bytes))
        for line in serve(client, plan, capacity, args.requests):
            print(line)
    print("admission_queue: %d requests served" % args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
