"""A decode loop on memra-kvd: attach, register a plan, prefill in a transaction, then one
`advance` call per decode step for a batch of sessions, and read the rows back.

    deploy/dev.sh run                                   # the daemon, in another terminal
    python3 python/examples/decode_loop.py --socket /tmp/memra-kv/gpu0.sock

The "kernels" are numpy writes of made-up rows into the mapped planes (example_engine.py).
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

import memra_kv
from example_engine import check_rows, parse_args, register_model, token_stream, write_rows

PROMPT_TOKENS = 48
DECODE_STEPS = 32
SESSIONS = 2


def prefill(session: memra_kv.Session, tokens: Sequence[int]) -> int:
    """Writes the prompt's rows in one transaction; returns the committed length. An
    exception inside `with` aborts the transaction (the session stays empty)."""
    with session.transaction() as txn:
        append = txn.prepare(len(tokens))
        write_rows(session, append, 0, tokens)
        return txn.commit(len(tokens), token_ids=tokens)


def decode(client: memra_kv.Client, sessions: List[memra_kv.Session],
           tokens: List[List[int]], steps: int) -> List[int]:
    """`steps` decode steps of every session: each step one advance_many call that commits the
    last token's row and prepares the next one (the generation is tracked by the session)."""
    outcomes = client.advance_many([memra_kv.AdvanceStep(s, next_rows=1) for s in sessions])
    for step in range(steps):
        for i, (session, outcome) in enumerate(zip(sessions, outcomes)):
            assert outcome.prepared is not None
            tokens[i].append(token_stream(1000 + i, steps)[step])  # the sampler's choice
            write_rows(session, outcome.prepared, outcome.committed_len, tokens[i])
        last = step == steps - 1
        outcomes = client.advance_many([
            memra_kv.AdvanceStep(s, accepted_rows=1, next_rows=0 if last else 1,
                                 token_ids=[tokens[i][-1]])
            for i, s in enumerate(sessions)])
        for outcome in outcomes:
            if outcome.error is not None:
                raise outcome.error
    return [outcome.committed_len for outcome in outcomes]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    with memra_kv.connect(args.socket) as client:
        client.attach("decode-loop-example")  # the lease is kept alive on a daemon thread
        plan = register_model(client, args.hf_config)
        capacity = PROMPT_TOKENS + DECODE_STEPS
        print("a %d-token session costs %d bytes" % (
            capacity, client.cost(capacity, fingerprint=plan).arena_bytes))
        sessions = [client.create_session(plan, capacity) for _ in range(SESSIONS)]
        try:
            tokens = [token_stream(i, PROMPT_TOKENS) for i in range(SESSIONS)]
            for session, prompt in zip(sessions, tokens):
                prefill(session, prompt)
            committed = decode(client, sessions, tokens, DECODE_STEPS)
            checked = [check_rows(session, seq) for session, seq in zip(sessions, tokens)]
            assert checked == committed
        finally:
            for session in sessions:
                session.release()
    print("decode_loop: %d sessions, committed %s, every row verified" % (SESSIONS, committed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
