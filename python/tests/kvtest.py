"""What the memra_kv tests share: the real memra-kvd as a subprocess, the test plans, and the
byte patterns engines write (the same functions as tests/e2e's C++ engines)."""

import os
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np

import memra_kv
from memra_kv import plans

REPO_MARKER = "WORKSPACE"
PATIENCE_S = 20.0


def repo_root():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(here))


def binary(relative):
    """A built binary: from the test's runfiles under Bazel, else bazel-bin/ of the checkout
    (build it first: bazel build //server:memra-kvd //tests/e2e:prefix_engine)."""
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        path = os.path.join(srcdir, os.environ.get("TEST_WORKSPACE", "memra_kv"), relative)
        if os.path.exists(path):
            return path
    path = os.path.join(repo_root(), "bazel-bin", relative)
    if not os.path.exists(path):
        raise FileNotFoundError("%s is not built (bazel build //%s:%s)" % (
            path, os.path.dirname(relative), os.path.basename(relative)))
    return path


def poll_until(predicate, pid=None, patience=PATIENCE_S):
    """True once predicate() holds; False after `patience` or once process `pid` is gone."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        if predicate():
            return True
        if pid is not None and not _alive(pid):
            return predicate()
        time.sleep(0.01)
    return False


def _alive(pid):
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
        return finished == 0
    except ChildProcessError:
        return False


class Daemon:
    """memra-kvd with its own socket in a fresh /tmp directory (Unix socket paths are < 108
    bytes), no watchdog, no metrics endpoint, short lease and drain graces (a test ends
    quickly); later flags win."""

    def __init__(self, flags=(), supervised=False):
        """supervised: under memra-kv-supervise (the daemon's pid in pid_file(), restarted when it
        dies and handed back its kept KV); the BUILD target then needs
        data = ["//server:memra-kv-supervise"]."""
        self.dir = tempfile.mkdtemp(prefix="memra-py-", dir="/tmp")
        self.socket = os.path.join(self.dir, "kvd.sock")
        self.admin_socket = os.path.join(self.dir, "kvd.admin.sock")  # the default, beside it
        self.pid_file = os.path.join(self.dir, "kvd.pid")
        self.log = open(os.path.join(self.dir, "kvd.log"), "w+")
        supervisor = ([binary("server/memra-kv-supervise"), "--pid_file=" + self.pid_file,
                       "--restart_delay_ms=20", "--"] if supervised else [])
        self._command = supervisor + [
            binary("server/memra-kvd"), "--socket_path=" + self.socket, "--socket_mode=0600",
            "--watchdog=false", "--metrics_address=", "--backend=host", "--lease_grace_ms=100",
            "--drain_grace_ms=500"] + list(flags)
        self._start()

    def _start(self):
        self.process = subprocess.Popen(self._command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + PATIENCE_S
        while not (os.path.exists(self.socket) and os.path.exists(self.admin_socket)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError("memra-kvd never listened on %s: %s" % (
                    self.socket, self.log.read()[-2000:]))
            time.sleep(0.01)

    def kill_and_start_again(self):
        """An unsupervised daemon SIGKILLed and started again on the same sockets: a new daemon
        that kept nothing of the old one (no service manager kept its journal)."""
        self.kill()
        self.start_again()

    def kill(self):
        """An unsupervised daemon SIGKILLed (its socket files stay, answering nothing)."""
        assert not os.path.exists(self.pid_file), "supervised: kill daemon_pid() instead"
        self.process.kill()
        self.process.wait()

    def start_again(self):
        """After kill(): a new daemon on the same sockets that kept nothing of the old one."""
        for path in (self.socket, self.admin_socket):  # the dead daemon's: wait for new ones
            os.unlink(path)
        self._start()

    def daemon_pid(self):
        """The memra-kvd process now (supervised: the supervisor's current child)."""
        if not os.path.exists(self.pid_file):
            return self.process.pid
        with open(self.pid_file) as f:
            return int(f.read())

    def client(self, name=None):
        client = memra_kv.Client.connect(self.socket, timeout=10)
        if name is not None:
            client.attach(name)
        return client

    def admin(self):
        """A client of the admin socket: the operators' calls (listings, drain, eviction)."""
        return memra_kv.Client.connect(self.admin_socket, timeout=10)

    def stop(self):
        """SIGTERM (drain) and the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(PATIENCE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.process.returncode


# ---- plans ----

FLAT_LAYER, SLIDING_LAYER, RECURRENT_LAYER, LATENT_LAYER = 0, 1, 2, 3
SLIDING_WINDOW = 32
INDEX_POOL = 4
E2E_CAPACITY = 6000  # > the 4671-row SWA ring: the ring wraps


def hybrid_test_plan():
    """tests/service/test_plans.h HybridTestPlan: one layer of every kind with state."""
    return plans.model_plan(
        [plans.kv_layer(FLAT_LAYER, 32, 2),
         plans.sliding_layer(SLIDING_LAYER, 32, 2, SLIDING_WINDOW),
         plans.recurrent_layer(RECURRENT_LAYER, 4, 4, 8),
         plans.latent_layer(LATENT_LAYER, 8, 8, INDEX_POOL)],
        name="hybrid-service-test", swa_ring=True, index_ring_rows=16)


def dense_plan(layers, head_dim, n_head_kv):
    """core/test_model_plans.h DenseModel."""
    return plans.model_plan([plans.kv_layer(i, head_dim, n_head_kv) for i in range(layers)])


# ---- byte patterns ----

def core_kind(kind):
    """core's PlaneKind value (the wire's minus one), which the C++ patterns use."""
    return kind - 1


def pattern_rows(layer, kind, first, rows, row_bytes):
    """tests/e2e/engine_script.cc PatternByte over rows [first, first + rows)."""
    row = np.arange(first, first + rows, dtype=np.uint64)[:, None]
    byte = np.arange(row_bytes, dtype=np.uint64)[None, :]
    value = row * 31 + layer * 7 + core_kind(kind) * 3 + byte * 5 + (row >> np.uint64(8))
    return (value & np.uint64(0xFF)).astype(np.uint8)


def prefix_pattern(layer, kind, first, end, row_bytes, seed):
    """tests/e2e/prefix_engine.cc Pattern over rows [first, end)."""
    row = np.arange(first, end, dtype=np.uint64)[:, None]
    byte = np.arange(row_bytes, dtype=np.uint64)[None, :]
    value = layer * 131 + core_kind(kind) * 31 + row * 7 + byte * 13 + seed * 17 + 1
    return (value & np.uint64(0xFF)).astype(np.uint8)


def as_bytes(plane):
    """A plane array's rows as uint8 rows (f32 planes: 4 bytes an element)."""
    return plane.view(np.uint8).reshape(plane.shape[0], -1)


def aligned_window_start(length, window):
    """core/kv_ring.h AlignedWindowStart (32-row alignment)."""
    return max(0, length - max(0, window - 1)) & ~31
