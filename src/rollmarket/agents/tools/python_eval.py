"""python_eval: run the model's Python (standard library only) in a kernel sandbox.

Each call gets a fresh interpreter in a fresh bubblewrap sandbox (sandbox.py), whose only
writable place is a private tmpfs holding a copy of the task's files. The layers, outermost first:

- here: a wall-clock deadline and a cap on the output read, read incrementally; the sandbox's
  PID namespace is killed as a whole when the call ends, so nothing outlives it;
- the kernel (bubblewrap): a read-only root holding only the interpreter, its standard library
  and the libraries they link; no network (a fresh network namespace), fresh PID, IPC, UTS and
  cgroup namespaces, a new session, no capabilities, an unprivileged uid and gid;
- rlimits set in the child before the code runs: address space, CPU seconds, file size, open
  files, no new processes (RLIMIT_NPROC binds: the uid is not root);
- an audit hook in the child (see python_eval_child) that refuses network, processes, native code
  and files outside the working directory: a second layer, not the one the others rely on.

Where the sandbox cannot be set up, every call is refused with outcome `unavailable`, saying why
and how to fix it. The weaker mode of earlier versions (a host directory, `unshare` namespaces
and the audit hook) runs only when asked for by name: SandboxLimits(isolation=
"unsafe-audit-hook-only"), or ROLLMARKET_UNSAFE_PYTHON_EVAL=1 where bubblewrap is unavailable;
a process that uses it logs a WARNING. docs/security.md has the threat model, docs/tools.md the
limits and the measured cost per call.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ...contracts import ToolOutcome
from ..tool import Tool, ToolContext, ToolFailure
from ..workspace import TaskFilesError, pack_task_files, scratch_copy
from . import python_eval_child as child
from .sandbox import (
    INSTALL_HINT,
    SANDBOX_GID,
    SANDBOX_UID,
    TASK_DIR,
    Bubblewrap,
    SandboxUnavailable,
    find_bubblewrap,
    host_namespaces,
    probe_code,
)

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
STDERR_TAIL_BYTES = 8 * KiB
"""Only the end of stderr is kept: the child's last line says how the code ended."""
PIPE_GRACE_S = 0.05
"""How long output is still read after the child exited, while descendants hold its pipes open."""
KILL_WAIT_S = 10.0
"""How long a killed sandbox may take to be gone before bwrap itself is killed."""
BUBBLEWRAP = "bubblewrap"
UNSAFE_AUDIT_HOOK_ONLY = "unsafe-audit-hook-only"
ISOLATIONS = (BUBBLEWRAP, UNSAFE_AUDIT_HOOK_ONLY)
UNSAFE_ENV = "ROLLMARKET_UNSAFE_PYTHON_EVAL"
"""Set to 1 to run the weaker audit-hook-only mode where bubblewrap is unavailable (instead of refusing)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one python_eval call may use, and how it is isolated."""

    timeout_s: float = 5.0
    """Wall-clock limit; when it runs out the sandbox is killed (outcome timeout)."""
    memory_bytes: int = 512 * MiB
    """RLIMIT_AS; an allocation past it raises MemoryError (outcome resource_limit)."""
    file_bytes: int = 1 * MiB
    """RLIMIT_FSIZE: the largest file the code may write (outcome resource_limit past it)."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    output_bytes: int = 64 * KiB
    """stdout read at most; past it the process is killed (outcome resource_limit)."""
    disk_bytes: int = 32 * MiB
    """Size of the sandbox's task directory (a tmpfs, in memory), the task's files included; a write
    past it fails with ENOSPC (outcome resource_limit), larger task directories are refused."""
    isolation: str = BUBBLEWRAP
    """`bubblewrap` (refuse with outcome unavailable where it cannot be set up) or
    `unsafe-audit-hook-only` (the weaker fallback: a host directory, unshare, the audit hook)."""
    bwrap: str = "bwrap"
    """The bubblewrap program, a name on PATH or a path."""
    namespaces: bool = True
    """unsafe-audit-hook-only only: run in fresh network and PID namespaces (`unshare`) where allowed."""
    audit_hook: bool = True
    """The in-process guard. Only tests turn it off, to show that the kernel layers hold alone."""

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, not {self.isolation!r}")
        if self.disk_bytes < 64 * KiB:
            raise ValueError(f"disk_bytes must be at least 64 KiB, not {self.disk_bytes}")


_probe_lock = threading.Lock()
_probed: dict[str, Bubblewrap | str] = {}
"""bwrap program -> its working set-up, or why the sandbox is unavailable. Probed once per process."""
_warned_unsafe = False


def sandbox_setup(bwrap: str = "bwrap") -> Bubblewrap:
    """The bubblewrap set-up python_eval uses, or SandboxUnavailable saying why it cannot run.

    The first call in a process finds what to bind (sandbox.find_bubblewrap, about 0.5 s of `ldd`)
    and runs a check program inside a sandbox without the audit hook: the uid must be unprivileged
    on the host, no capabilities, no_new_privs, every namespace new, the root read-only and the task
    directory writable. The answer, either way, is kept for the life of the process.
    """
    with _probe_lock:
        if bwrap not in _probed:
            _probed[bwrap] = _probe(bwrap)
    found = _probed[bwrap]
    if isinstance(found, str):
        raise SandboxUnavailable(found)
    return found


def _probe(bwrap: str) -> Bubblewrap | str:
    try:
        box = find_bubblewrap(bwrap)
    except SandboxUnavailable as exc:
        return str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"looking for the sandbox's files failed: {exc}"
    if box.drop_root != (os.geteuid() == 0):
        return "the sandbox's set-up was made for another user"
    limits = SandboxLimits(timeout_s=60, audit_hook=False, bwrap=bwrap)
    try:
        done = _run_bubblewrap(box, limits, probe_code(host_namespaces(), user_namespace=not box.drop_root), None)
    except OSError as exc:
        return f"bubblewrap could not be started: {exc}"
    printed = done.stdout.decode("utf-8", "replace").strip()
    if done.timed_out:
        return "the sandbox did not start within 60 s"
    if done.returncode != 0 or printed != "ok":
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        why = printed or (lines[-1] if lines else f"exit status {done.returncode}")
        return f"the sandbox failed its self-check: {why.removeprefix(child.STATUS_PREFIX)}"
    log.info("python_eval: bubblewrap sandbox ready (%s, %d read-only paths, %s)", box.bwrap, len(box.read_only),
             "root drops to uid %d" % SANDBOX_UID if box.drop_root else "user namespace")
    return box


def _warn_unsafe(why: str) -> None:
    global _warned_unsafe
    if not _warned_unsafe:
        _warned_unsafe = True
        log.warning("python_eval is running WITHOUT its bubblewrap sandbox (%s): the model's code runs on the host, "
                    "confined only by rlimits, unshare namespaces and an in-process audit hook, which is not a "
                    "sandbox (docs/security.md)", why)


@functools.cache
def namespace_prefix() -> tuple[str, ...]:
    """The unsafe mode's `unshare` command line that gives the child fresh network and PID
    namespaces, or () where this machine allows neither (then the audit hook alone keeps the code
    off the network).

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
        code = arguments["code"]
        if "\0" in code:
            raise ToolFailure("code must not contain NUL characters", ToolOutcome.bad_arguments)
        if limits.isolation == UNSAFE_AUDIT_HOOK_ONLY:
            _warn_unsafe(f"isolation={UNSAFE_AUDIT_HOOK_ONLY!r}")
            return self._report(self._run_unsafe(code, context.workdir))
        try:
            box = sandbox_setup(limits.bwrap)
        except SandboxUnavailable as exc:
            if os.environ.get(UNSAFE_ENV) == "1":
                _warn_unsafe(f"{UNSAFE_ENV}=1 and the sandbox is unavailable: {exc}")
                return self._report(self._run_unsafe(code, context.workdir))
            raise ToolFailure(f"python_eval is unavailable: {exc}. To fix: {INSTALL_HINT}. (The weaker "
                              f"audit-hook-only mode runs only when opted in with {UNSAFE_ENV}=1; see "
                              "docs/security.md.)", ToolOutcome.unavailable) from None
        files = None
        if context.workdir is not None:
            try:
                files = pack_task_files(context.workdir, limits.disk_bytes)
            except TaskFilesError as exc:
                raise ToolFailure(str(exc), ToolOutcome.resource_limit if exc.too_large else ToolOutcome.refused) \
                    from None
        return self._report(_run_bubblewrap(box, limits, code, files))

    def _report(self, done: _Finished) -> str:
        """The printed text, or ToolFailure with the outcome the way the code ended says."""
        limits = self.limits
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
                   }.get(-1 if done.returncode is None else done.returncode, ToolOutcome.error)
        if done.returncode == child.EXIT_SETUP:
            why = "the sandbox could not drop to its unprivileged user; the code did not run"
        elif done.returncode is not None and done.returncode < 0 and not status:
            why = f"killed by signal {-done.returncode}"
        raise ToolFailure(why + (f"\n--- stdout ---\n{stdout}" if stdout else ""), outcome)

    def _run_unsafe(self, code: str, workdir: Path | None) -> _Finished:
        """The weaker mode: a throwaway host directory, `unshare` namespaces, rlimits and the audit hook."""
        limits = self.limits
        with scratch_copy(workdir) as cwd:
            settings = _settings(limits, uid=-1, gid=-1, files_fd=-1)
            prefix = namespace_prefix() if limits.namespaces else ()
            argv = [*prefix, sys.executable, "-I", "-S", "-B", "-c", child.BOOTSTRAP, _child_source(), settings, code]
            env = {"PATH": os.defpath, "HOME": str(cwd), "TMPDIR": str(cwd), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, close_fds=True, start_new_session=True)
            assert proc.stdout is not None and proc.stderr is not None  # both are pipes
            try:
                return _collect(proc, time.monotonic() + limits.timeout_s, limits.output_bytes)
            finally:
                _kill_group(proc)
                proc.wait()
                proc.stdout.close()
                proc.stderr.close()


def _settings(limits: SandboxLimits, *, uid: int, gid: int, files_fd: int) -> str:
    """The child's settings argument (python_eval_child.main reads it in this order)."""
    return ",".join(str(v) for v in (limits.memory_bytes, int(limits.timeout_s) + 1, limits.file_bytes,
                                     limits.open_files, int(limits.audit_hook), uid, gid, files_fd))


def _run_bubblewrap(box: Bubblewrap, limits: SandboxLimits, code: str, files: bytes | None) -> _Finished:
    """Run `code` in a fresh sandbox whose task directory gets `files` (pack_task_files' bytes)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": TASK_DIR, "TMPDIR": TASK_DIR, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    deadline = time.monotonic() + limits.timeout_s
    files_fd = -1
    if files is not None:
        # A memfd: the files reach the child without touching the host's disk or its permissions.
        files_fd = os.memfd_create("rollmarket-task-files", os.MFD_CLOEXEC)
        view = memoryview(files)
        while view:
            view = view[os.write(files_fd, view):]
        os.lseek(files_fd, 0, os.SEEK_SET)
    info_read, info_write = os.pipe()
    uid, gid = (SANDBOX_UID, SANDBOX_GID) if box.drop_root else (-1, -1)
    argv = [*box.argv(limits.disk_bytes, env, info_write), "-I", "-S", "-B", "-c", child.BOOTSTRAP, _child_source(),
            _settings(limits, uid=uid, gid=gid, files_fd=files_fd), code]
    try:
        proc = subprocess.Popen(argv, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, close_fds=True,
                                pass_fds=(info_write, files_fd) if files_fd >= 0 else (info_write,),
                                start_new_session=True)
    finally:
        for fd in (info_write, files_fd):
            if fd >= 0:
                os.close(fd)  # the child holds its own copies
    init = None
    try:
        init = _sandbox_init(proc.pid, info_read, deadline)
        done = _collect(proc, deadline, limits.output_bytes)
    finally:
        os.close(info_read)
        _end_sandbox(proc, init)
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
    if done.returncode is not None and done.returncode > 128:
        done.returncode = 128 - done.returncode  # bwrap reports a child killed by signal N as 128 + N
    return done


def _sandbox_init(bwrap_pid: int, info_read: int, deadline: float) -> int | None:
    """A pidfd of the sandbox's init process (the pid bwrap writes to --info-fd), or None when bwrap
    started none. Taken before the code can end, so the pid cannot have been reused."""
    chunks = []
    while time.monotonic() < deadline:
        if select.select([info_read], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(info_read, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    try:
        pid = int(json.loads(b"".join(chunks))["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, ProcessLookupError):
        return None
    if _parent_of(pid) != bwrap_pid:  # gone and reused between the write and the open: not ours
        os.close(pidfd)
        return None
    return pidfd


def _collect(proc: subprocess.Popen, deadline: float, output_bytes: int) -> _Finished:
    """Read stdout (up to `output_bytes`) and the tail of stderr until the child exits and its pipes
    close, before `deadline`. The child is not reaped, so its process group id stays valid to kill.
    Descendants that still hold the pipes after the child exited are not waited for: they die with
    the group."""
    stdout, stderr = bytearray(), bytearray()
    exited_at = None
    assert proc.stdout is not None and proc.stderr is not None  # both are pipes
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


def _end_sandbox(proc: subprocess.Popen, init: int | None) -> None:
    """Make sure nothing of the sandbox is left, then reap bwrap.

    When the code is still running (timeout, too much output, an error here), SIGKILL the init
    process of the sandbox's PID namespace: the kernel then kills every process in it. Either way,
    wait until that init process has exited, which it does only once every process of its
    namespace is gone (bwrap itself may exit a moment before it)."""
    running = _exit_status(proc.pid) is None
    if init is not None:
        try:
            if running:
                signal.pidfd_send_signal(init, signal.SIGKILL)
            select.select([init], [], [], KILL_WAIT_S)  # readable once the process has exited
        except ProcessLookupError:
            pass
        finally:
            os.close(init)
    elif running:
        _kill_group(proc)
    try:
        proc.wait(KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            return int(stat_file.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None
