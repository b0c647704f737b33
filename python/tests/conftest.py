"""pytest fixtures: `kvd` starts memra-kvd processes (each with its own socket and directory)
and stops every one after the test."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvtest  # noqa: E402


@pytest.fixture
def kvd():
    started = []

    def start(*flags, supervised=False):
        daemon = kvtest.Daemon(flags, supervised=supervised)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        assert daemon.stop() == 0, "memra-kvd did not drain and exit 0"
