#!/usr/bin/python3
"""The Python client's decode step, for memra_bench's python_step section (bench/README.md).

    python_step.py --socket=S --dir=D --python_path=P --shapes=1,256 --rounds=3 --steps=100

Attaches to memra-kvd (as its own engine) with memra_kv, creates max(shapes) sessions of
Llama-3-8B's 32 K/V layers (capacity 128, as the hot path's), then for each shape N and round r
(0..rounds; 0 warms up) waits for D/go-N-r, resets its first N sessions and times `steps` decode
steps: ONE Step RPC per step carrying per session Begin, PrepareAppend(1 row), PublishAppend and
Commit(1 row) (the next generation is known), every outcome checked; then writes the step times
(ns, one per line) to D/done-N-r. memra_bench times the C++ client's same step in between, so
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
        plan = client.register_plan(llama3_8b())
        sessions = [client.create_session(plan, CAPACITY) for _ in range(max(shapes))]
        batch = memra_kv.StepBatch()
        for n in shapes:
            for round_index in range(args.rounds + 1):
                go = os.path.join(args.dir, "go-%d-%d" % (n, round_index))
                while not os.path.exists(go):
                    time.sleep(0.001)
                generations, committed = [], []
                for session in sessions[:n]:
                    state = session.reset()
                    generations.append(state.next_generation)
                    committed.append(0)
                times = []
                for _ in range(args.steps):
                    start = time.perf_counter_ns()
                    batch.clear()
                    for i, session in enumerate(sessions[:n]):
                        batch.begin(session)
                        batch.prepare(session, generations[i], 1)
                        batch.publish(session, generations[i])
                        batch.commit(session, generations[i], 1)
                    outcomes = client.step(batch)
                    for i in range(n):
                        done = outcomes[4 * i + 3]
                        if done.error is not None or done.committed_len != committed[i] + 1:
                            raise SystemExit("session %d: step failed: %s" % (
                                sessions[i].id, done.error))
                        committed[i] += 1
                        generations[i] += 1
                    times.append(time.perf_counter_ns() - start)
                done_path = os.path.join(args.dir, "done-%d-%d" % (n, round_index))
                with open(done_path + ".tmp", "w") as f:
                    f.write("\n".join(str(t) for t in times) + "\n")
                os.rename(done_path + ".tmp", done_path)
        for session in sessions:
            session.release()
    with open(os.path.join(args.dir, "finished"), "w"):
        pass


if __name__ == "__main__":
    main()
