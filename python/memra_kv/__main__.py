"""`python3 -m memra_kv [--help]`: what the package is, and the examples to start from."""

from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence, Tuple

# python/examples in a checkout (not installed with the package); each takes --socket.
EXAMPLES: List[Tuple[str, str]] = [
    ("decode_loop.py", "attach, register a plan, prefill in session.transaction(), then one "
     "advance_many call per decode step for a batch of sessions"),
    ("spec_decode.py", "speculative decoding on a hybrid plan: spec_snapshot, a verify "
     "transaction, spec_rollback to snapshot + accepted tokens"),
    ("prefix_share.py", "one process captures a prompt into the prefix cache, a second "
     "restores it into its own session and checks every byte"),
    ("admission_queue.py", "size sessions with max_context / fit, admit while there is room, "
     "queue requests the daemon refuses (AdmissionRefused.needed / .free)"),
]

USAGE = """usage: python3 -m memra_kv [--help]

memra_kv: the Python client of memra-kvd, the per-GPU KV-cache daemon.

    import memra_kv
    with memra_kv.connect("/tmp/memra-kv/gpu0.sock") as client:
        client.attach("my-engine")
        with client.create_session(plan_fingerprint, capacity=4096) as session:
            step = session.advance(next_rows=1)       # begin + prepare the first row
            ...                                       # write step.prepared's rows
            step = session.advance(1, 1, token_ids=[token])

Errors: memra_kv.MemraKvError and its subclasses (AdmissionRefused, NotFound,
DaemonRestarted, ...), .code a memra_kv.ErrorCode. Docs: python/README.md.

Examples (python/examples/ in a checkout; run with --socket PATH, --help for more):
"""


def examples_dir() -> Optional[str]:
    """python/examples beside this package when it runs from a checkout; None otherwise."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidate = os.path.join(here, "examples")
    return candidate if os.path.isdir(candidate) else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the help; exit status 2 for an unknown argument."""
    args = list(sys.argv[1:] if argv is None else argv)
    unknown = [arg for arg in args if arg not in ("-h", "--help")]
    out = sys.stderr if unknown else sys.stdout
    if unknown:
        print("python3 -m memra_kv: unknown argument %s" % unknown[0], file=out)
    text = USAGE + "".join("  %-20s %s\n" % (name, what) for name, what in EXAMPLES)
    where = examples_dir()
    if where is not None:
        text += "\nin this checkout: %s\n" % where
    out.write(text)
    return 2 if unknown else 0


if __name__ == "__main__":
    sys.exit(main())
