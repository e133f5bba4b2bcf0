"""die_with_parent: a child started with it does not outlive its owner, even one killed with -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

OWNER = """
import subprocess, sys, signal
from rollmarket.localhost import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                         preexec_fn=die_with_parent(signal.SIGTERM))
print(child.pid, flush=True)
import time; time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_the_child_goes_when_its_owner_is_killed_with_9():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(owner.stdout.readline())
        assert _alive(child)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=60)
        deadline = time.monotonic() + 60
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its owner"
    finally:
        owner.kill()
