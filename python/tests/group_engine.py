"""A Python group engine for test_group.py that dies mid-admission: connects to every rank of a
group file, registers the test plan, reserves the group (phase one) with a deadline, writes
the group id to OUT_FILE and waits, never confirming, until it is SIGKILLed.

    group_engine.py GROUP_FILE OUT_FILE DEADLINE_MS
"""

import os
import sys
import time

from memra_kv.group import Group
from group_plans import CAPACITY, group_plan


def main(group_path, out, deadline_ms):
    group = Group.connect(group_path, "py-group-doomed")
    fingerprint = group.register_plan(group_plan())
    admission = group.reserve(fingerprint, CAPACITY, deadline_ms=deadline_ms)
    with open(out + ".tmp", "w") as f:
        f.write("group_id=%d\nbytes=%s\n" % (
            admission.group_id, ",".join(str(state.bytes) for state in admission.ranks)))
    os.rename(out + ".tmp", out)
    while True:
        time.sleep(1)  # until SIGKILL


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
