"""die_with_parent: a child started with it does not outlive its owner, even one killed with -9;
ThreadedServer: an app served from a thread starts, stops, and fails clearly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

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


# uvicorn ends its thread with SystemExit when it cannot bind: that is the case under test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_threaded_server_answers_then_stops_and_a_taken_port_is_a_clear_error():
    """ThreadedServer (the local exchange's, the embedded model server's, the reference trainer's):
    start() returns only once the app answers; stop() ends the thread; on a port another socket
    holds, start() raises ServerDidNotStart instead of waiting forever."""
    import socket

    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from rollmarket.localhost import ServerDidNotStart, ThreadedServer, free_port

    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("here"))])
    port = free_port()
    server = ThreadedServer(app, port, name="test server").start()
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text == "here"
    finally:
        server.stop()
    assert not server.thread.is_alive()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ServerDidNotStart, match="test server did not start"):
            ThreadedServer(app, taken.getsockname()[1], name="test server").start()
