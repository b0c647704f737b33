#!/usr/bin/python3
"""The Python client's decode step, for memra_bench's python_step section (bench/README.md).

    python_step.py --socket=S --dir=D --python_path=P --shapes=1,256 --rounds=3 --steps=100

Attaches to memra-kvd (as its own engine) with memra_kv, creates max(shapes) sessions of
Llama-3-8B's 32 K/V layers (capacity 128, as the hot path's), then for each shape N and round r
(0..rounds; 0 warms up) waits for D/go-N-r and times `steps` decode steps of its first N
sessions twice: over the engine's step channel (a StepBatch by slot) and over the Step RPC (a
StepBatch by session id and token), each after resetting the sessions. A decode step is ONE
Advance entry per session (commit the previous step's row, prepare the next one's), as an
engine's loop writes it: every outcome's error and committed length checked, its next
generation read off it. Writes the step times (ns, one per line) to D/done-N-r.channel and
D/done-N-r.grpc, then D/done-N-r. memra_bench times the C++ client's same steps in between, so
both see the same daemon and the same neighbours. It writes D/finished once it has released its
sessions and detached.
"""

import argparse
import os
import sys
import time

CAPACITY = 128


def llama3_8b():
    from memra_kv import plans
    return plans.model_plan([plans.kv_layer(i, 128, 8) for i in range(32)], name="llama-3-8b")


def time_steps(client, batch, sessions, steps):
    """`steps` Advance steps of `sessions` (reset: no transaction open); ns per step."""
    n = len(sessions)
    open_generation = [0] * n  # the transaction each session's next Advance finishes
    committed = [0] * n
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        batch.clear()
        for i, session in enumerate(sessions):
            generation = open_generation[i]
            batch.advance(session, generation, 1 if generation else 0, 1)
        outcomes = client.step(batch)
        for i, outcome in enumerate(outcomes):
            expected = committed[i] + (1 if open_generation[i] else 0)
            if outcome.error is not None or outcome.committed_len != expected:
                raise SystemExit("session %d: advance answered %s, committed %d; expected %d"
                                 % (sessions[i].id, outcome.error, outcome.committed_len,
                                    expected))
            committed[i] = expected
            open_generation[i] = outcome.begun.generation
        times.append(time.perf_counter_ns() - start)
    return times


def write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def main():
    parser = argparse.ArgumentParser()
    for flag in ("socket", "dir", "python_path", "shapes"):
        parser.add_argument("--" + flag, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    sys.path.insert(0, args.python_path)
    import memra_kv

    shapes = [int(n) for n in args.shapes.split(",")]
    with memra_kv.Client.connect(args.socket) as client:
        client.attach("bench-python-step")
        if not client.step_channel_active:
            raise SystemExit("no step channel: %s" % client.step_channel_status)
        plan = client.register_plan(llama3_8b())
        sessions = [client.create_session(plan, CAPACITY) for _ in range(max(shapes))]
        paths = {"channel": memra_kv.StepBatch(by_slot=True), "grpc": memra_kv.StepBatch()}
        for n in shapes:
            for round_index in range(args.rounds + 1):
                name = os.path.join(args.dir, "%s-%d-%d" % ("%s", n, round_index))
                while not os.path.exists(name % "go"):
                    time.sleep(0.001)
                for path, batch in paths.items():
                    for session in sessions[:n]:
                        session.reset()
                    times = time_steps(client, batch, sessions[:n], args.steps)
                    write_atomically("%s.%s" % (name % "done", path),
                                     "\n".join(str(t) for t in times) + "\n")
                if not client.step_channel_active:
                    raise SystemExit("the step channel broke: %s" % client.step_channel_status)
                write_atomically(name % "done", "")
        for session in sessions:
            session.release()
    with open(os.path.join(args.dir, "finished"), "w"):
        pass


if __name__ == "__main__":
    main()
