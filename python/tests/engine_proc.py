"""A Python engine process for test_lease.py: attaches, creates a session of the dense test plan,
commits rows through numpy, writes its ids to the --out file and holds its lease until killed.

    engine_proc.py SOCKET OUT_FILE
"""

import os
import sys
import time

import numpy as np

import memra_kv
from kvtest import dense_plan


def main(socket_path, out):
    client = memra_kv.Client.connect(socket_path)
    client.attach("py-doomed")
    plan = client.register_plan(dense_plan(2, 32, 1))
    session = client.create_session(plan, 512)
    tx = session.begin()
    append = session.prepare_append(tx.generation, 64)
    for layer in append.layers:
        session.plane(layer.layer, memra_kv.KEYS)[layer.write_row:layer.write_row + 64] = np.uint8(7)
    session.publish_append(tx.generation)
    session.commit(tx.generation, 64)
    with open(out + ".tmp", "w") as f:
        f.write("engine_id=%d\nsession_id=%d\n" % (client.engine_id, session.id))
    os.rename(out + ".tmp", out)
    while True:
        time.sleep(1)  # until SIGKILL


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
