"""What the contract tests share: an adapter_engine.py process run to completion against a
daemon, its facts (JSON) returned."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The prefix cache holds the block store's blocks (one store).
DAEMON_FLAGS = ("--budget_bytes=512MiB", "--prefix_cache_budget_bytes=128MiB")


def run_engine(daemon, engine, mode):
    """Runs adapter_engine.py ENGINE MODE as its own process; its facts."""
    out = os.path.join(daemon.dir, "%s-%s.json" % (engine, mode))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    done = subprocess.run([sys.executable, os.path.join(HERE, "adapter_engine.py"),
                           daemon.socket, daemon.admin_socket, out, engine, mode],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout
    with open(out) as f:
        return json.load(f)
