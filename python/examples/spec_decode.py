"""Speculative decoding with rollback on memra-kvd: a hybrid plan (full attention plus a
linear-attention layer whose conv/SSM state has no position), a spec snapshot before each
draft/verify round, and a rollback to snapshot + accepted tokens.

    python3 python/examples/spec_decode.py --socket /tmp/memra-kv/gpu0.sock

A session of a plan with recurrent layers must be created with spec_snapshot=True to snapshot
(docs/rules.md#spec-snapshot-and-rollback); the snapshot stays valid across rollbacks.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Sequence

import numpy as np

import memra_kv
from example_engine import (KV_LAYERS, check_rows, parse_args, register_model, token_stream,
                            write_rows)

PROMPT_TOKENS = 16
DRAFT_TOKENS = 4
ACCEPTED = [4, 1, 0, 3, 2, 4]  # what the target model accepts of each round's draft
RECURRENT_LAYER = KV_LAYERS


def write_recurrent_state(session: memra_kv.Session, tokens: Sequence[int]) -> None:
    """The recurrent path: the conv and SSM state after `tokens` (mutated in place, no rows)."""
    for kind in (memra_kv.CONV_STATE, memra_kv.SSM_STATE):
        session.plane(RECURRENT_LAYER, kind)[:] = float(sum(tokens) % 100003 + kind)


def recurrent_state_after(session: memra_kv.Session, tokens: Sequence[int]) -> bool:
    """Whether the planes hold the state after `tokens`."""
    return all(np.all(session.plane(RECURRENT_LAYER, kind) == float(sum(tokens) % 100003 + kind))
               for kind in (memra_kv.CONV_STATE, memra_kv.SSM_STATE))


def spec_round(session: memra_kv.Session, tokens: List[int], draft: List[int],
               accepted: int) -> memra_kv.SessionState:
    """One draft/verify round: snapshot, the verify pass appends the draft's rows and advances
    the recurrent state over it, then the rollback keeps `accepted` of them. Returns the state
    after the round; `tokens` grows by the accepted tokens."""
    snapshot = session.spec_snapshot()
    base = snapshot.committed_len
    with session.transaction() as txn:  # the verify pass: every drafted row is written
        append = txn.prepare(len(draft))
        write_rows(session, append, base, tokens + draft)
        write_recurrent_state(session, tokens + draft)
        txn.commit(len(draft), token_ids=draft)
    if accepted == len(draft):
        tokens.extend(draft)
        return session.state()
    state = session.spec_rollback(accepted)  # lengths to base + accepted, state to the snapshot
    # The recurrent state is the snapshot's: position says where its tokens end.
    assert state.committed_len == base + accepted and state.position == snapshot.position
    assert state.spec_snapshot_valid  # a rollback does not use the snapshot up
    assert recurrent_state_after(session, tokens)
    tokens.extend(draft[:accepted])
    write_recurrent_state(session, tokens)  # the engine replays the accepted tokens
    return state


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    with memra_kv.connect(args.socket) as client:
        client.attach("spec-decode-example")
        plan = register_model(client, None, recurrent=True)
        capacity = PROMPT_TOKENS + DRAFT_TOKENS * len(ACCEPTED)
        with client.create_session(plan, capacity, spec_snapshot=True) as session:
            tokens = token_stream(7, PROMPT_TOKENS)
            with session.transaction() as txn:  # the prompt; committed at the block's end
                write_rows(session, txn.prepare(len(tokens)), 0, tokens)
            write_recurrent_state(session, tokens)
            for round_index, accepted in enumerate(ACCEPTED):
                draft = token_stream(100 + round_index, DRAFT_TOKENS)
                state = spec_round(session, tokens, draft, accepted)
                print("round %d: accepted %d of %d, committed %d" % (
                    round_index, accepted, DRAFT_TOKENS, state.committed_len))
            assert check_rows(session, tokens) == len(tokens)
            assert recurrent_state_after(session, tokens)
    print("spec_decode: %d rounds, %d tokens, every row verified" % (len(ACCEPTED), len(tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
