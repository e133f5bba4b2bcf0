"""python_eval: run the model's Python (standard library only) in a sandboxed subprocess.

Each call gets a fresh process and a throwaway copy of the task directory, deleted afterwards.
The layers, outermost first:

- the process: `python -I -S -B` (no site-packages, no user environment), a cleared environment,
  stdin closed, its own session, and its whole process group killed when the call ends;
- where the machine allows it (`namespace_prefix()`), fresh network and PID namespaces: no
  interface but a downed loopback, and every descendant dies with the call;
- rlimits set before the code runs: address space, CPU seconds, file size, open files, no new
  processes (RLIMIT_NPROC does not bind root, hence the next layer);
- an audit hook in the child (see python_eval_child) that refuses network, processes, native code
  and files outside the working directory;
- here: a wall-clock deadline and a cap on the output read, read incrementally.

docs/tools.md lists what is refused and how, with the measured per-call overhead.
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ...contracts import ToolOutcome
from ..tool import Tool, ToolContext, ToolFailure
from ..workspace import scratch_copy
from . import python_eval_child as child

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
STDERR_TAIL_BYTES = 8 * KiB
"""Only the end of stderr is kept: the child's last line says how the code ended."""
PIPE_GRACE_S = 0.05
"""How long output is still read after the child exited, while descendants hold its pipes open."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one python_eval call may use."""

    timeout_s: float = 5.0
    """Wall-clock limit; when it runs out the process group is killed (outcome timeout)."""
    memory_bytes: int = 512 * MiB
    """RLIMIT_AS; an allocation past it raises MemoryError (outcome resource_limit)."""
    file_bytes: int = 1 * MiB
    """RLIMIT_FSIZE: the largest file the code may write (outcome resource_limit past it)."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    output_bytes: int = 64 * KiB
    """stdout read at most; past it the process is killed (outcome resource_limit)."""
    namespaces: bool = True
    """Run in fresh network and PID namespaces when this machine allows it (see namespace_prefix)."""
    audit_hook: bool = True
    """The in-process guard. Only tests turn it off, to show that the kernel layers hold alone."""


@functools.cache
def namespace_prefix() -> tuple[str, ...]:
    """The `unshare` command line that gives the child fresh network and PID namespaces, or () where
    this machine allows neither (then the audit hook alone keeps the code off the network).

    Tried once per process: as root plain namespaces, otherwise (or when those are not allowed)
    inside a user namespace; with a PID namespace when possible, else a network namespace only.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        log.info("python_eval: no unshare on PATH; no network namespace")
        return ()
    user_ns = [(), ("--map-root-user",)] if os.geteuid() == 0 else [("--map-root-user",)]
    for pid_ns in (("--pid", "--fork", "--kill-child"), ()):
        for user in user_ns:
            prefix = (unshare, *user, "--net", *pid_ns)
            try:
                done = subprocess.run([*prefix, sys.executable, "-I", "-S", "-c", "pass"], stdin=subprocess.DEVNULL,
                                      capture_output=True, timeout=10, check=False)
            except (OSError, subprocess.SubprocessError):
                continue
            if done.returncode == 0:
                log.info("python_eval: isolating with %s", " ".join(prefix))
                return prefix
    log.info("python_eval: namespaces are not allowed here; the audit hook alone refuses the network")
    return ()


@functools.cache
def _child_source() -> str:
    return Path(child.__file__).read_text()


@dataclass
class _Finished:
    returncode: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    overflowed: bool = False


class PythonEval(Tool):
    """Run Python code in the sandbox; the result is what it prints."""

    name: ClassVar[str] = "python_eval"
    description: ClassVar[str] = (
        "Run a short Python program (standard library only) and return what it prints. The working "
        "directory is a copy of the task's files; there is no network, no threads and no subprocesses.")
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "maxLength": 20000,
                                "description": "Python source; print() what you want to see."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()

    def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        limits = self.limits
        if "\0" in arguments["code"]:
            raise ToolFailure("code must not contain NUL characters", ToolOutcome.bad_arguments)
        with scratch_copy(context.workdir) as cwd:
            done = self._execute(arguments["code"], cwd)
        stdout = done.stdout.decode("utf-8", "replace").rstrip()
        if done.timed_out:
            raise ToolFailure(f"timed out after {limits.timeout_s:g}s", ToolOutcome.timeout)
        if done.overflowed:
            raise ToolFailure(f"output exceeded {limits.output_bytes} bytes; the program was stopped\n{stdout}",
                              ToolOutcome.resource_limit)
        if done.returncode == 0:
            return stdout
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        status = [line.removeprefix(child.STATUS_PREFIX) for line in lines if line.startswith(child.STATUS_PREFIX)]
        why = status[-1] if status else lines[-1] if lines else f"exit status {done.returncode}"
        outcome = {child.EXIT_REFUSED: ToolOutcome.refused, child.EXIT_MEMORY: ToolOutcome.resource_limit,
                   child.EXIT_FILE_SIZE: ToolOutcome.resource_limit, -signal.SIGXCPU: ToolOutcome.timeout,
                   }.get(done.returncode, ToolOutcome.error)
        if done.returncode is not None and done.returncode < 0 and not lines:
            why = f"killed by signal {-done.returncode}"
        raise ToolFailure(why + (f"\n--- stdout ---\n{stdout}" if stdout else ""), outcome)

    def _execute(self, code: str, cwd: Path) -> _Finished:
        limits = self.limits
        settings = ",".join(str(v) for v in (limits.memory_bytes, int(limits.timeout_s) + 1, limits.file_bytes,
                                             limits.open_files, int(limits.audit_hook)))
        prefix = namespace_prefix() if limits.namespaces else ()
        argv = [*prefix, sys.executable, "-I", "-S", "-B", "-c", child.BOOTSTRAP, _child_source(), settings, code]
        env = {"PATH": os.defpath, "HOME": str(cwd), "TMPDIR": str(cwd), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, close_fds=True, start_new_session=True)
        try:
            return _collect(proc, time.monotonic() + limits.timeout_s, limits.output_bytes)
        finally:
            _kill_group(proc)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()


def _collect(proc: subprocess.Popen, deadline: float, output_bytes: int) -> _Finished:
    """Read stdout (up to `output_bytes`) and the tail of stderr until the child exits and its pipes
    close, before `deadline`. The child is not reaped, so its process group id stays valid to kill.
    Descendants that still hold the pipes after the child exited are not waited for: they die with
    the group."""
    stdout, stderr = bytearray(), bytearray()
    exited_at = None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, stdout)
        selector.register(proc.stderr, selectors.EVENT_READ, stderr)
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                return _Finished(None, bytes(stdout), bytes(stderr), timed_out=True)
            if exited_at is None and _exit_status(proc.pid) is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > PIPE_GRACE_S:
                break
            for key, _ in selector.select(min(deadline - now, PIPE_GRACE_S)):
                chunk = os.read(key.fd, 64 * KiB)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = key.data
                buffer += chunk
                if buffer is stderr:
                    del buffer[:-STDERR_TAIL_BYTES]
                elif len(buffer) > output_bytes:
                    return _Finished(None, bytes(stdout[:output_bytes]), bytes(stderr), overflowed=True)
    while (code := _exit_status(proc.pid)) is None:  # pipes closed early: wait for the exit
        if time.monotonic() >= deadline:
            return _Finished(None, bytes(stdout), bytes(stderr), timed_out=True)
        time.sleep(0.002)
    return _Finished(code, bytes(stdout), bytes(stderr))


def _exit_status(pid: int) -> int | None:
    """The exit code (-signal when killed) of a child that has exited, without reaping it; else None."""
    status = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if status is None:
        return None
    return status.si_status if status.si_code == os.CLD_EXITED else -status.si_status


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it leads its own session, so that is all it started)."""
    for kill, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
