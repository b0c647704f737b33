"""memra_kv installs as Python users install packages: `pip install` of its sdist (which carries
its own copy of proto/) and `pip install -e` of a checkout, each into a fresh virtual environment
built by /usr/bin/python3 -m venv, its dependencies and build requirements from the index pip
reaches. The installed package imports outside the checkout and talks to the real memra-kvd.
Nothing is written into this checkout: the package's sources are copied to a temporary
directory first (an editable install generates its stubs in place, in the copy)."""

import os
import shutil
import subprocess
import sys
import tarfile

import pytest

import kvtest

PYTHON = "/usr/bin/python3"
# What the fresh interpreter runs against the daemon: attach, and an empty block-store lookup
# through a registered pool (the stubs of two services, the memfd handoff).
SCRIPT = """
import sys
import memra_kv
from memra_kv.block_store import BlockStore, HostPool, PoolLayout, TensorLayout
print(memra_kv.__file__)
with memra_kv.Client.connect(sys.argv[1], timeout=10) as client:
    client.attach("pip-installed")
    store = BlockStore(client)
    layout = PoolLayout(num_blocks=2, tokens_per_block=4, element_type="fp16", num_kv_heads=1,
                        head_dim=8, model="pip-install-test",
                        tensors=[TensorLayout(0, "K", 0, 64, 64), TensorLayout(0, "V", 128, 64, 64)])
    pool = HostPool(256)
    registration = store.register([pool], layout)
    print("matched", store.lookup(registration, token_ids=list(range(8))).matched_blocks)
"""


def checkout_copy(destination):
    """python/ (sources only) and proto/ of this checkout, as a fresh clone has them."""
    root = os.environ.get("TEST_SRCDIR")
    root = (os.path.join(root, os.environ.get("TEST_WORKSPACE", "memra_kv")) if root
            else kvtest.repo_root())
    python = os.path.join(destination, "python")
    os.makedirs(os.path.join(python, "memra_kv"))
    os.makedirs(os.path.join(python, "tools"))
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in",
                 "tools/gen_protos.py"):
        shutil.copy(os.path.join(root, "python", name), os.path.join(python, name))
    sources = os.path.join(root, "python", "memra_kv")
    for name in os.listdir(sources):
        if name.endswith(".py"):
            shutil.copy(os.path.join(sources, name), os.path.join(python, "memra_kv", name))
    protos = os.path.join(root, "proto", "memra", "kv", "v1")
    os.makedirs(os.path.join(destination, "proto", "memra", "kv", "v1"))
    for name in os.listdir(protos):
        if name.endswith(".proto"):
            shutil.copy(os.path.join(protos, name),
                        os.path.join(destination, "proto", "memra", "kv", "v1", name))
    return python


def clean_environment():
    """This process's environment without what would leak the test's own memra_kv into the
    fresh interpreter (Bazel's PYTHONPATH), and a pip cache it may write (the sandbox's home is
    read-only)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    scratch = os.environ.get("TEST_TMPDIR")
    if scratch:
        env["PIP_CACHE_DIR"] = os.path.join(scratch, "pip-cache")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(*command, cwd=None):
    done = subprocess.run(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=clean_environment())
    assert done.returncode == 0, "%s exited %d:\n%s" % (" ".join(command), done.returncode,
                                                       done.stdout[-4000:])
    return done.stdout


@pytest.fixture
def fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    run(PYTHON, "-m", "venv", str(venv))
    return str(venv / "bin" / "python")


def test_the_sdist_installs_without_the_checkout_and_talks_to_the_daemon(kvd, tmp_path,
                                                                         fresh_venv):
    daemon = kvd("--prefix_cache_budget_bytes=16MiB", "--budget_bytes=64MiB")
    python = checkout_copy(str(tmp_path / "checkout"))
    # The sdist is built by setuptools from the copy (the build environment's setuptools and
    # grpcio-tools are the fresh venv's own, installed from the index).
    run(fresh_venv, "-m", "pip", "install", "--quiet", "setuptools>=64", "grpcio-tools>=1.62,<2")
    run(fresh_venv, "setup.py", "--quiet", "sdist", "--dist-dir", str(tmp_path / "dist"),
        cwd=python)
    (sdist,) = os.listdir(str(tmp_path / "dist"))
    with tarfile.open(str(tmp_path / "dist" / sdist)) as archive:
        names = archive.getnames()
    assert any(n.endswith("proto/memra/kv/v1/block_store.proto") for n in names), names
    assert not any("_pb2" in n for n in names), "the sdist carries protos, never stubs"
    shutil.rmtree(str(tmp_path / "checkout"))  # no ../proto to fall back on
    run(fresh_venv, "-m", "pip", "install", "--quiet", str(tmp_path / "dist" / sdist))
    out = run(fresh_venv, "-c", SCRIPT, daemon.socket, cwd=str(tmp_path))
    assert "site-packages/memra_kv/__init__.py" in out and "matched 0" in out, out
    # Its declared runtime: the grpcio and protobuf its stubs were generated for.
    requires = run(fresh_venv, "-c", "from importlib.metadata import requires; "
                   "print(requires('memra-kv'))")
    for name in ("'grpcio<2,>=1.", "'protobuf>=", "'numpy<3,>=1.24'"):
        assert name in requires, requires


def test_an_editable_install_runs_from_the_checkout(kvd, tmp_path, fresh_venv):
    daemon = kvd("--prefix_cache_budget_bytes=16MiB", "--budget_bytes=64MiB")
    python = checkout_copy(str(tmp_path / "checkout"))
    run(fresh_venv, "-m", "pip", "install", "--quiet", "-e", python)
    out = run(fresh_venv, "-c", SCRIPT, daemon.socket, cwd=str(tmp_path))
    assert os.path.join(python, "memra_kv", "__init__.py") in out and "matched 0" in out, out
    # Only the stubs were written into the checkout (setuptools' in-place editable build).
    assert sorted(os.listdir(python)) == ["MANIFEST.in", "README.md", "memra_kv",
                                          "pyproject.toml", "setup.py", "tools"]


def test_an_import_without_the_stubs_names_the_fix(tmp_path):
    python = checkout_copy(str(tmp_path / "checkout"))
    done = subprocess.run([sys.executable, "-c", "import memra_kv"], cwd=python,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=clean_environment())
    assert done.returncode != 0
    assert "pip install ./python" in done.stdout and "gen_protos.py" in done.stdout, done.stdout
