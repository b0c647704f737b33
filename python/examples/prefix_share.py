"""Prefix sharing between two engine processes on memra-kvd: this process prefills a prompt
and captures it into the daemon's prefix cache; a second process (this script again, with
--reader) looks the prompt up, restores it into a fresh session of its own and checks every
restored byte. The daemon needs a prefix cache (--prefix_cache_budget_bytes, e.g. 256MiB).

    deploy/dev.sh run --prefix_cache_budget_bytes=256MiB
    python3 python/examples/prefix_share.py --socket /tmp/memra-kv/gpu0.sock

Both processes run as the same user, so they share the default prefix-cache scope.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Optional, Sequence

import memra_kv
from example_engine import check_rows, parse_args, register_model, token_stream, write_rows

BLOCK_TOKENS = 256  # the daemon's default prefix block
PROMPT_TOKENS = 2 * BLOCK_TOKENS + 40  # two whole blocks are cacheable; the tail is not
CAPACITY = 1024


def writer(client: memra_kv.Client, plan: bytes, args: argparse.Namespace) -> int:
    """Prefills, captures the prompt's whole blocks, then runs the reader process."""
    tokens = token_stream(42, PROMPT_TOKENS)
    with client.create_session(plan, CAPACITY) as session:
        with session.transaction() as txn:
            write_rows(session, txn.prepare(len(tokens)), 0, tokens)
            txn.commit(len(tokens), token_ids=tokens)
        boundary = len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS
        captured = client.capture_prefix(session, tokens, boundary)
        print("writer: captured %d tokens as entry %d (%d bytes)" % (
            captured.boundary_tokens, captured.entry_id, captured.stored_bytes))
    # The writer's session is released; the cache entry outlives it.
    command = [sys.executable, __file__, "--reader", "--socket", args.socket]
    if args.hf_config:
        command += ["--hf-config", args.hf_config]
    return subprocess.call(command)


def reader(client: memra_kv.Client, plan: bytes) -> int:
    """Restores the longest cached prefix of the same prompt and verifies its rows."""
    tokens = token_stream(42, PROMPT_TOKENS)
    match = client.lookup_prefix(plan, tokens)
    if match.outcome == "miss":
        print("reader: no cached prefix (does the daemon have a prefix cache?)")
        return 1
    with client.create_session(plan, CAPACITY) as session:
        restored = client.restore_prefix(session, tokens, match.entry_id)
        assert restored.state.committed_len == restored.restored_tokens
        rows = check_rows(session, tokens[:restored.restored_tokens])
        # The rest of the prompt is this engine's own prefill.
        with session.transaction() as txn:
            write_rows(session, txn.prepare(len(tokens) - rows), rows, tokens)
        assert check_rows(session, tokens) == len(tokens)
    print("reader: restored %d of %d prompt tokens (%s), every row verified" % (
        restored.restored_tokens, len(tokens), match.outcome))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reader", action="store_true", help="be the second process")
    args = parse_args(parser.description or "", argv, parser)
    with memra_kv.connect(args.socket) as client:
        client.attach("prefix-reader" if args.reader else "prefix-writer")
        # The same plan registered by either process has the same fingerprint.
        plan = register_model(client, args.hf_config)
        if args.reader:
            return reader(client, plan)
        status = writer(client, plan, args)
    if status == 0:
        print("prefix_share: the second process restored the first one's prefix")
    return status


if __name__ == "__main__":
    sys.exit(main())
