"""Escapes from python_eval and read_file, tried by behaviour and judged from outside.

Every hostile program runs twice: with the audit hook (the default) and without it
(SandboxLimits(audit_hook=False)), so that the kernel layer is shown to hold alone. After every
call the judges here, outside the sandbox, check that:

- nothing of the Python installation changed (inotify on every directory of the standard library,
  the installation's site-packages and this virtualenv's site-packages, plus a stat-and-content
  digest of them before and after the module);
- no file appeared outside the task directory (names carrying the session's marker in /tmp,
  /dev/shm, /var/tmp, $HOME, the installation, and a world-writable canary directory whose listing
  and secret must stay as they were);
- listeners of the test's own saw nothing: TCP and UDP on loopback, a world-writable unix socket,
  an abstract unix socket;
- no process outlived its call (no process carries the call's marker, none runs as the sandbox's
  uid but the victim placed there), the victims (one as root, one as the sandbox's own uid) live;
- a real resources server (`rollmarket verifier serve`) still answers.

The attacks create only new, uniquely named files and rewrite existing ones with their own
bytes, so running this file against an older, weaker python_eval (to see these tests fail there)
damages nothing; a finalizer removes whatever such a run left.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from rollmarket.agents.tools import run_tool
from rollmarket.agents.tools.python_eval import PythonEval, SandboxLimits
from rollmarket.agents.workspace import task_workspace
from rollmarket.contracts import ToolOutcome, ToolResult
from test_resources_server import file_task, post, seed, start_server

PREFIX = f"rollmarket_escape_{uuid.uuid4().hex[:12]}"
"""Every file or process an attack makes carries this in its name or command line."""
SECRET = f"canary-secret-{uuid.uuid4().hex}"
"""In the victims' environments and the canary file: must never appear in a tool's output."""
SANDBOX_UID = 65534
INTERPRETER = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
STDLIB = os.path.realpath(os.path.dirname(os.__file__))
DYNLOAD = os.path.realpath(next(p for p in sys.path if os.path.basename(p) == "lib-dynload"))
SITE_PACKAGES = sorted({os.path.realpath(p) for p in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib"),
                                                       os.path.join(STDLIB, "site-packages")) if os.path.isdir(p)})
INSTALL_TREES = [STDLIB, *[p for p in SITE_PACKAGES if not p.startswith(STDLIB + "/")]]
HOST_HOME = os.path.expanduser("~")
OUTSIDE_DIRS = sorted({"/tmp", "/dev/shm", "/var/tmp", HOST_HOME, STDLIB, DYNLOAD, *SITE_PACKAGES,
                       str(Path(__file__).resolve().parents[1])})
"""Where an escaped write would most likely land; each is searched for PREFIX after every call."""


# --- judges ------------------------------------------------------------------------------------

_IN_EVENTS = {0x2: "modify", 0x4: "attrib", 0x8: "close_write", 0x40: "moved_from", 0x80: "moved_to",
              0x100: "create", 0x200: "delete", 0x400: "delete_self", 0x800: "move_self", 0x4000: "overflow"}


class InstallWatch:
    """inotify on every directory of the Python installation's trees: any change shows as an event."""

    def __init__(self, roots: list[str]):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.paths: dict[int, str] = {}
        mask = sum(_IN_EVENTS) - 0x4000 | 0x01000000 | 0x02000000  # IN_ONLYDIR | IN_DONT_FOLLOW
        for root in roots:
            for dirpath, _dirs, _files in os.walk(root):
                wd = self.libc.inotify_add_watch(self.fd, dirpath.encode(), mask)
                assert wd >= 0, (dirpath, os.strerror(ctypes.get_errno()))
                self.paths[wd] = dirpath

    def changes(self) -> list[str]:
        """What changed since the last call, as 'event path' lines."""
        found = []
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return found
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16: offset + 16 + length].rstrip(b"\0").decode(errors="replace")
                kinds = [kind for bit, kind in _IN_EVENTS.items() if mask & bit]
                found.append(f"{'/'.join(kinds)} {os.path.join(self.paths.get(wd, '?'), name)}")
                offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)


def install_digest() -> str:
    """sha256 over (path, inode, size, mtime, ctime, mode) of every entry of the installation's trees
    (ctime cannot be set back, so a write that restores mtime still shows) and the content of every
    .py file of the standard library. About 2 s here; taken at the start and the end of the module."""
    digest = hashlib.sha256()
    listing = subprocess.run(["find", *INSTALL_TREES, "-printf", r"%p\0%i\0%s\0%T@\0%C@\0%m\n"],
                             capture_output=True, check=True).stdout
    digest.update(listing)
    for dirpath, dirnames, filenames in os.walk(STDLIB):
        dirnames[:] = sorted(d for d in dirnames if os.path.join(dirpath, d) not in SITE_PACKAGES)
        for name in sorted(filenames):
            if name.endswith(".py"):
                digest.update(Path(dirpath, name).read_bytes())
    return digest.hexdigest()


def _status(pid: str) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def processes_with(needle: str) -> list[int]:
    """Pids whose command line contains `needle`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def processes_of_uid(uid: int) -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and _status(e).get("Uid", "").split()[:1] == [str(uid)]}


def descends_from(pid: int, ancestors: set[int]) -> bool:
    """Whether `pid`'s chain of parents reaches one of `ancestors`."""
    for _ in range(64):
        parent = int(_status(str(pid)).get("PPid", "0") or 0)
        if parent in ancestors:
            return True
        if parent <= 1:
            return False
        pid = parent
    return False


@dataclass
class Judges:
    canary: Path
    tcp: socket.socket
    udp: socket.socket
    unix: socket.socket
    abstract: socket.socket
    victims: list[subprocess.Popen]
    server: object
    watch: InstallWatch
    digest: str
    canary_listing: set[str] = field(default_factory=set)
    calls: int = 0

    def next_marker(self) -> str:
        """A name for the next call, unique in the session (fixed width: no marker contains another)."""
        self.calls += 1
        return f"{PREFIX}_{self.calls:04d}"

    def peek_marker(self) -> str:
        """The marker the next call will get."""
        return f"{PREFIX}_{self.calls + 1:04d}"

    def prelude(self, marker: str) -> str:
        """What each hostile program knows: every target's name, and a helper that reports."""
        values = dict(MARKER=marker, CANARY=str(self.canary), CANARY_FILE=str(self.canary / "secret.txt"),
                      TCP_PORT=self.tcp.getsockname()[1], UDP_PORT=self.udp.getsockname()[1],
                      UNIX_PATH=self.unix.getsockname(), ABSTRACT=self.abstract.getsockname(),
                      TEST_PID=os.getpid(), SERVER_PID=self.server.proc.pid,
                      VICTIM_PIDS=[v.pid for v in self.victims], STDLIB=STDLIB, DYNLOAD=DYNLOAD,
                      SITE_PACKAGES=SITE_PACKAGES, HOST_HOME=HOST_HOME)
        lines = [f"# {marker}"] + [f"{name} = {value!r}" for name, value in values.items()]
        lines.append(textwrap.dedent("""
            def attempt(what, action):
                try:
                    action()
                    print("ESCAPED:", what)
                except BaseException as exc:
                    print("held:", what, type(exc).__name__)
            """))
        return "\n".join(lines) + "\n"

    def run(self, code: str, *, audit_hook: bool, context=None, timeout_s: float = 10) -> ToolResult:
        """Run `code` (after the prelude) in python_eval and judge everything from outside."""
        marker = self.next_marker()
        tool = PythonEval(SandboxLimits(timeout_s=timeout_s, audit_hook=audit_hook))
        before = processes_of_uid(SANDBOX_UID)
        result = tool({"code": self.prelude(marker) + textwrap.dedent(code)}, context)
        self.check(marker, result.content, before)
        return result

    def check(self, marker: str, output: str = "", before: set[int] | None = None) -> None:
        """Everything outside is as it was; `output` (what the code printed) holds no secret.
        What this call left outside is removed before the verdict, so a failure names only its own call."""
        problems = []
        if SECRET in output or "root:x:0:0" in output:
            problems.append(f"the output holds a secret: {output}")
        if changes := self.watch.changes():
            problems.append(f"the Python installation changed: {changes[:10]}")
        if escaped := [str(p) for d in OUTSIDE_DIRS for p in Path(d).glob(f"*{marker}*")]:
            problems.append(f"files appeared outside the task directory: {escaped}")
        if (listing := {p.name for p in self.canary.iterdir()}) != self.canary_listing:
            problems.append(f"the canary directory changed: {sorted(listing ^ self.canary_listing)}")
        if (self.canary / "secret.txt").read_text() != SECRET:
            problems.append("the canary file changed")
        for listener in (self.tcp, self.udp, self.unix, self.abstract):
            if select.select([listener], [], [], 0)[0]:
                problems.append(f"a listener of the test saw a connection or a datagram: {listener}")
        if survivors := processes_with(marker):
            problems.append(f"processes outlived the call: {survivors}")
        # Of the sandbox's uid, new since the call began and started by this test or its server (other
        # test runs on a shared machine may have sandboxes of their own):
        new = processes_of_uid(SANDBOX_UID) - {v.pid for v in self.victims} - (before or set())
        ours, marked = {os.getpid(), self.server.proc.pid}, set(processes_with(PREFIX))
        if strays := {pid for pid in new if pid in marked or descends_from(pid, ours)}:
            problems.append(f"processes of the sandbox's uid outlived the call: {strays}")
        if killed := [v.pid for v in self.victims if v.poll() is not None]:
            problems.append(f"victim processes were killed: {killed}")
        try:
            if httpx.get(self.server.url + "/healthz", timeout=30).status_code != 200:
                problems.append("the resources server does not answer")
        except httpx.HTTPError as exc:
            problems.append(f"the resources server does not answer: {exc}")
        self.reset(marker)
        assert problems == [], "\n".join(problems)

    def reset(self, marker: str) -> None:
        """Undo what a call with `marker` may have done outside (only a weaker sandbox lets it)."""
        _cleanup_escapes(marker)
        for path in self.canary.iterdir():
            if path.name not in self.canary_listing:
                _remove(path)
        (self.canary / "secret.txt").write_text(SECRET)
        for listener in (self.tcp, self.unix, self.abstract):
            while select.select([listener], [], [], 0)[0]:
                listener.accept()[0].close()
        while select.select([self.udp], [], [], 0)[0]:
            self.udp.recv(65536)
        for pid in processes_with(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.watch.changes()  # the removals above are not the next call's doing


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _cleanup_escapes(marker: str = PREFIX) -> None:
    """Remove what a run against a weaker python_eval may have left (never anything of ours otherwise)."""
    for directory in OUTSIDE_DIRS:
        for path in Path(directory).glob(f"*{marker}*"):
            _remove(path)
    for directory in (DYNLOAD, STDLIB):
        stray = Path(directory, "sitecustomize.py")
        if stray.exists() and marker in stray.read_text(errors="replace"):
            stray.unlink()


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    canary = Path(tmp_path_factory.mktemp("canary"))
    canary.chmod(0o777)  # world-writable: only the sandbox's view of the file system can keep it out
    (canary / "secret.txt").write_text(SECRET)
    (canary / "secret.txt").chmod(0o666)
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(canary / "listen.sock"))
    os.chmod(canary / "listen.sock", 0o777)
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0{PREFIX}_abstract".encode())
    abstract.listen()
    for listener in (tcp, udp, unix, abstract):
        listener.setblocking(False)
    env = {"PATH": os.defpath, "ROLLMARKET_CANARY": SECRET}
    victims = [subprocess.Popen(["sleep", "600"], env=env),
               subprocess.Popen(["sleep", "600"], env=env, user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[])]
    server = start_server(tmp_path_factory.mktemp("sandbox-server") / "tmp")
    watch = InstallWatch(INSTALL_TREES)
    found = Judges(canary, tcp, udp, unix, abstract, victims, server, watch, install_digest())
    found.canary_listing = {p.name for p in canary.iterdir()}
    try:
        yield found
        assert install_digest() == found.digest, "the Python installation changed during the module"
    finally:
        _cleanup_escapes()
        watch.close()
        server.stop()
        for victim in victims:
            victim.kill()
            victim.wait()
        for listener in (tcp, udp, unix, abstract):
            listener.close()


HOOK = pytest.mark.parametrize("audit_hook", [True, False], ids=["hook", "kernel-only"])


def _escaped(result: ToolResult) -> list[str]:
    return [line for line in result.content.splitlines() if line.startswith("ESCAPED")]


# --- the file system ---------------------------------------------------------------------------


@HOOK
def test_writes_relative_to_directory_descriptors(judges, audit_hook):
    """The audit events of these calls carry no full path: only the mount namespace keeps them in."""
    code = """
        import os, stat
        for target in (STDLIB, DYNLOAD, *SITE_PACKAGES, "/", "/dev", "/dev/shm", "/proc", "/task/..", CANARY, "/tmp",
                       HOST_HOME):
            try:
                fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            name = MARKER + "_" + str(fd)
            attempt("create in " + target,
                    lambda: os.close(os.open(name + ".py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)))
            attempt("mkdir in " + target, lambda: os.mkdir(name + "_dir", dir_fd=fd))
            attempt("symlink in " + target, lambda: os.symlink("/task", name + "_link", dir_fd=fd))
            attempt("mkfifo in " + target, lambda: os.mkfifo(name + "_fifo", dir_fd=fd))
            attempt("mknod in " + target,
                    lambda: os.mknod(name + "_null", 0o666 | stat.S_IFCHR, os.makedev(1, 3), dir_fd=fd))
            attempt("rename into " + target, lambda: os.rename("/task/x", name + "_moved", dst_dir_fd=fd))
        """
    with task_workspace({"x": "x"}) as context:
        result = judges.run(code, audit_hook=audit_hook, context=context)
    assert "held: create in " + STDLIB in result.content, result.content
    assert _escaped(result) == []


@HOOK
def test_mknod_mkfifo_and_absolute_writes_outside(judges, audit_hook):
    code = """
        import os, stat
        for directory in (STDLIB, DYNLOAD, *SITE_PACKAGES, "/tmp", "/dev/shm", "/var/tmp", HOST_HOME, CANARY, "/"):
            path = os.path.join(directory, MARKER)
            attempt("write " + path, lambda: open(path + ".txt", "w").write("x"))
            attempt("mkfifo " + path, lambda: os.mkfifo(path + "_fifo"))
            attempt("mknod " + path, lambda: os.mknod(path + "_zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5)))
            attempt("mkdir " + path, lambda: os.mkdir(path + "_dir"))
        attempt("read the canary", lambda: print(open(CANARY_FILE).read()))
        attempt("append to the canary", lambda: open(CANARY_FILE, "a").write("x"))
        """
    result = judges.run(code, audit_hook=audit_hook)
    assert "held: mkfifo /tmp/" + PREFIX in result.content, result.content
    assert _escaped(result) == []


@HOOK
def test_the_installation_cannot_be_changed_and_nothing_persists(judges, audit_hook):
    """Rewrite os.py and encodings/__init__.py (with their own bytes: harmless even where it
    succeeds), plant a module and a sitecustomize; then the next call and a fresh interpreter
    outside must see none of it, and the task directory of the next call is fresh."""
    marker = judges.peek_marker()
    module, shm = marker + "_planted", marker + "_shm"
    code = f"""
        import os, encodings
        def rewrite(path):  # the same bytes and the same mtime: where it succeeds, only the ctime shows it
            before = os.stat(path)
            with open(path, "r+b") as f:
                data = f.read()
                f.seek(0)
                f.write(data)
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        def plant(directory, name, content, by_dir_fd):
            if by_dir_fd:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                os.write(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd), content)
            else:
                open(os.path.join(directory, name), "xb").write(content)
        attempt("rewrite os.py", lambda: rewrite(os.__file__))
        attempt("rewrite encodings/__init__.py", lambda: rewrite(encodings.__file__))
        for directory in (STDLIB, DYNLOAD, *SITE_PACKAGES):
            for by_dir_fd in (False, True):
                attempt(f"plant a module in {{directory}} ({{by_dir_fd}})",
                        lambda: plant(directory, "{module}.py", b"PLANTED = True\\n", by_dir_fd))
        for directory in (DYNLOAD, STDLIB):
            attempt("plant sitecustomize in " + directory,
                    lambda: plant(directory, "sitecustomize.py", b"PLANTED = {marker!r}\\n", True))
        open("left-behind.txt", "w").write("x")
        attempt("write /dev/shm", lambda: open("/dev/shm/{shm}", "w").write("x"))
        """
    with task_workspace({"notes.txt": "n"}) as context:
        first = judges.run(code, audit_hook=audit_hook, context=context)
        assert _escaped(first) == [], first.content
        assert "held: rewrite os.py" in first.content, first.content
        second = judges.run(f"""
            import os, importlib.util
            print(sorted(os.listdir(".")))
            print(importlib.util.find_spec("{module}"), importlib.util.find_spec("sitecustomize"))
            print(os.path.exists("/dev/shm/{shm}"))
            """, audit_hook=audit_hook, context=context)
    assert second.content.splitlines()[-3:] == ["['notes.txt']", "None None", "False"], second.content
    outside = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                              f"print(u.find_spec('{module}'), u.find_spec('sitecustomize'))"],
                             capture_output=True, text=True, cwd="/")
    assert outside.stdout.strip() == "None None", outside.stdout + outside.stderr
    assert install_digest() == judges.digest


@HOOK
def test_proc_tricks(judges, audit_hook):
    code = """
        import os
        try:
            print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        except OSError:
            pass
        attempt("write through /proc/self/root", lambda: open(f"/proc/self/root/tmp/{MARKER}_self", "w").write("x"))
        for pid in (*VICTIM_PIDS, TEST_PID, SERVER_PID, 1):
            attempt(f"environ of {pid}", lambda: print(open(f"/proc/{pid}/environ", "rb").read()))
            attempt(f"root of {pid}", lambda: print(os.listdir(f"/proc/{pid}/root/")))
            attempt(f"write through the root of {pid}",
                    lambda: open(f"/proc/{pid}/root/tmp/{MARKER}_{pid}", "w").write("x"))
            attempt(f"write through the root of {pid} to the canary",
                    lambda: open(f"/proc/{pid}/root{CANARY}/{MARKER}_{pid}", "w").write("x"))
        attempt("read the canary through /proc/1/root", lambda: print(open(f"/proc/1/root{CANARY_FILE}").read()))
        fd = os.open(STDLIB, os.O_RDONLY | os.O_DIRECTORY)
        attempt("write through /proc/self/fd", lambda: open(f"/proc/self/fd/{fd}/{MARKER}.py", "w").write("x"))
        attempt("write the memory of pid 1", lambda: open("/proc/1/mem", "r+b"))
        attempt("read the host's passwd", lambda: print(open("/proc/1/root/etc/passwd").read()))
        """
    result = judges.run(code, audit_hook=audit_hook)
    assert _escaped(result) == [], result.content
    pids = next((line for line in result.content.splitlines() if line.startswith("pids")), None)
    if pids is not None:  # without the hook /proc is listable: only the sandbox's own PID namespace
        assert eval(pids.split(" ", 1)[1]) in ([1, 2], [2], [1]), pids  # noqa: S307 - a list of ints we printed


# --- processes and signals ---------------------------------------------------------------------


@HOOK
def test_signals_and_pidfds_reach_no_one(judges, audit_hook):
    code = """
        import os, signal
        for pid in {*VICTIM_PIDS, TEST_PID, SERVER_PID, os.getppid(), 1} - {0, os.getpid()}:
            attempt(f"kill {pid}", lambda: os.kill(pid, signal.SIGKILL))
            def by_pidfd():
                fd = os.pidfd_open(pid)
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            attempt(f"pidfd {pid}", by_pidfd)
        attempt("kill every process", lambda: os.kill(-1, signal.SIGKILL))
        print("still here")
        """
    result = judges.run(code, audit_hook=audit_hook)
    assert judges.server.proc.poll() is None
    assert "still here" in result.content, result.content


@HOOK
def test_a_fork_bomb_gets_no_process_at_all(judges, audit_hook):
    """A bounded bomb: RLIMIT_NPROC binds the unprivileged uid, so not one fork succeeds."""
    code = """
        import os, time
        forked = 0
        for _ in range(50):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                forked += 1
            except BaseException as exc:
                print("fork failed:", type(exc).__name__)
                break
        print("forked", forked)
        """
    started = time.monotonic()
    result = judges.run(code, audit_hook=audit_hook, timeout_s=20)
    assert "forked 0" in result.content, result.content
    assert time.monotonic() - started < 15


@HOOK
def test_the_code_runs_unprivileged_seen_from_outside(judges, audit_hook):
    """While the code sleeps, the test reads its process from /proc: uid and gid 65534 on the host,
    no capabilities, no_new_privs, namespaces of its own, a file system that shows nothing of the
    host's but the interpreter, read-only everywhere but the task directory."""
    code = ("import os, time\nattempt('setuid 0', lambda: os.setuid(0))\nopen('ready', 'w').close()\n"
            "while not os.path.exists('go'):\n    time.sleep(0.01)\nprint('went')\n")
    marker = judges.peek_marker()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(judges.run, code, audit_hook=audit_hook, timeout_s=30)
        deadline = time.monotonic() + 60
        target = None
        while target is None and time.monotonic() < deadline and not future.done():
            for pid in processes_with(marker):  # the interpreter, once the code runs (its cwd holds 'ready')
                try:
                    if os.readlink(f"/proc/{pid}/exe") == INTERPRETER and os.path.exists(f"/proc/{pid}/cwd/ready"):
                        target = pid
                except OSError:
                    pass
            time.sleep(0.02)
        assert target is not None, "the sandboxed interpreter was not found"
        status = _status(str(target))
        mounts = Path(f"/proc/{target}/mountinfo").read_text().splitlines()
        namespaces = {n: os.readlink(f"/proc/{target}/ns/{n}") for n in ("net", "pid", "mnt", "ipc", "uts")}
        visible = sorted(os.listdir(f"/proc/{target}/root/"))
        Path(f"/proc/{target}/cwd/go").touch()  # from outside, into the sandbox's task directory: the code ends
        result = future.result(timeout=120)
    assert result.content.endswith("went"), result.content
    assert status["Uid"].split() == [str(SANDBOX_UID)] * 4 and status["Gid"].split() == [str(SANDBOX_UID)] * 4
    assert status["Groups"].split() in ([], [str(SANDBOX_UID)])
    assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapAmb"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1"
    for name, link in namespaces.items():
        assert link != os.readlink(f"/proc/self/ns/{name}"), f"shares the test's {name} namespace"
    assert not {"etc", "home", "tmp", "var", "work", "opt", "srv", "run", "sys", "boot", "mnt"} & set(visible), visible
    for line in mounts:
        fields = line.split()
        mount_point, options = fields[4], fields[5].split(",")
        if mount_point == "/task" or mount_point.startswith("/dev/"):
            continue  # the task's tmpfs, and device nodes (read-only mounts cannot stop writes to /dev/null)
        assert "ro" in options, f"{mount_point} is writable: {line}"
    assert any(line.split()[4] == "/task" for line in mounts)


# --- the network -------------------------------------------------------------------------------


@HOOK
def test_the_network_is_unreachable(judges, audit_hook):
    code = """
        import socket
        attempt("tcp to the test", lambda: socket.create_connection(("127.0.0.1", TCP_PORT), timeout=2))
        def udp():
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", UDP_PORT))
        attempt("udp to the test", udp)
        def unix(address):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            s.connect(address)
        attempt("unix socket of the test", lambda: unix(UNIX_PATH))
        attempt("abstract unix socket of the test", lambda: unix(ABSTRACT))
        attempt("resolve a name", lambda: socket.getaddrinfo("localhost", 80))
        """
    result = judges.run(code, audit_hook=audit_hook)
    for what in ("tcp to the test", "unix socket of the test", "abstract unix socket of the test"):
        assert f"held: {what}" in result.content, result.content
    # A datagram sent into the sandbox's own loopback "succeeds" there; the judges saw none arrive.
    assert [line for line in _escaped(result) if "udp" not in line] == []


# --- the resources server ----------------------------------------------------------------------


def test_hostile_calls_through_the_resources_server(judges):
    """The server's own python_eval (defaults, hook on) against its own process: it keeps answering."""
    session = seed(judges.server.url, file_task(0))
    hostile = ["import os, signal; os.kill(os.getppid(), signal.SIGKILL)",
               f"import os, signal; signal.pidfd_send_signal(os.pidfd_open({judges.server.proc.pid}), signal.SIGKILL)",
               "import os\nwhile True:\n    os.fork()",
               "x = [bytearray(2**20) for _ in range(10**6)]",
               f"open('/proc/{judges.server.proc.pid}/root/tmp/{PREFIX}_server', 'w').write('x')"]
    for code in hostile:
        response = post(judges.server.url, "/python_eval", {"code": code}, session=session)
        assert response.status_code == 200, response.text
        assert ToolResult.model_validate_json(response.content).outcome is not ToolOutcome.ok
        judges.check(PREFIX + "_server")
    fine = post(judges.server.url, "/python_eval", {"code": "print(open('mine-0.txt').read())"}, session=session)
    assert ToolResult.model_validate_json(fine.content).content == "secret 0"


# --- read_file: the kernel keeps the open inside -----------------------------------------------

SWAPPER = r"""
import os, sys, time
workdir, secret_dir, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
inside = os.path.join(workdir, "real")
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    n += 1
    # "race": a regular file, then a symlink to the secret; "sub": a link to a directory inside, then outside
    with open(os.path.join(workdir, f".f{n}"), "w") as f:
        f.write("public")
    os.rename(os.path.join(workdir, f".f{n}"), os.path.join(workdir, "race"))
    os.symlink(inside, os.path.join(workdir, f".d{n}"))
    os.rename(os.path.join(workdir, f".d{n}"), os.path.join(workdir, "sub"))
    os.symlink(os.path.join(secret_dir, "secret.txt"), os.path.join(workdir, f".l{n}"))
    os.rename(os.path.join(workdir, f".l{n}"), os.path.join(workdir, "race"))
    os.symlink(secret_dir, os.path.join(workdir, f".o{n}"))
    os.rename(os.path.join(workdir, f".o{n}"), os.path.join(workdir, "sub"))
"""


@pytest.fixture(params=["openat2", "component-walk"])
def resolver(request, monkeypatch):
    """Both ways open_below confines an open: openat2, and the walk used where the kernel lacks it."""
    if request.param == "component-walk":
        from rollmarket.agents import workspace

        monkeypatch.setattr(workspace, "_openat2_call", lambda: None, raising=False)
    return request.param


def test_read_file_wins_no_symlink_race(tmp_path, resolver):
    """A concurrent writer swaps a file for a symlink to a secret, and a directory for a link out,
    as fast as it can while read_file reads: no read ever returns the secret."""
    secret_dir = tmp_path / "outside"
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text(SECRET)
    with task_workspace({"race": "public", "real/secret.txt": "public"}) as context:
        (context.workdir / "sub").symlink_to(context.workdir / "real")
        swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(context.workdir), str(secret_dir), "3"])
        try:
            outcomes = set()
            reads = 0
            while swapper.poll() is None:
                for path in ("race", "sub/secret.txt"):
                    result = run_tool("read_file", {"path": path}, context)
                    assert SECRET not in result.content, f"read {path} returned the secret after {reads} reads"
                    outcomes.add((path, result.outcome))
                    reads += 1
        finally:
            swapper.kill()
            swapper.wait()
    assert ("race", ToolOutcome.ok) in outcomes and ("race", ToolOutcome.refused) in outcomes, outcomes
    assert reads > 100


def test_read_file_refuses_a_hard_link_to_an_outside_file(tmp_path, resolver):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    with task_workspace({"notes.txt": "n"}) as context:
        os.link(secret, context.workdir / "linked.txt")
        result = run_tool("read_file", {"path": "linked.txt"}, context)
        assert result.outcome is ToolOutcome.refused and SECRET not in result.content, result.content
        assert run_tool("read_file", {"path": "notes.txt"}, context).content == "n"


def test_read_file_refuses_fifos_and_devices_without_blocking(tmp_path):
    with task_workspace({"notes.txt": "n"}) as context:
        os.mkfifo(context.workdir / "pipe")
        os.mknod(context.workdir / "zero", 0o666 | 0o020000, os.makedev(1, 5))
        started = time.monotonic()
        for name in ("pipe", "zero"):
            result = run_tool("read_file", {"path": name}, context)
            assert result.content == f"error: not a file: {name}", result.content
        assert time.monotonic() - started < 5


@HOOK
def test_python_eval_gets_no_outside_file_through_the_task_directory(judges, tmp_path, audit_hook):
    """A symlink or a hard link in the task directory pointing at an outside secret: the sandbox
    gets a copy of the directory with the link as a link (leading nowhere inside) and refuses a
    hard-linked file outright."""
    secret = judges.canary / "secret.txt"
    with task_workspace({"notes.txt": "n"}) as context:
        (context.workdir / "out").symlink_to(secret)
        result = judges.run("attempt('read the link', lambda: print(open('out').read()))", audit_hook=audit_hook,
                            context=context)
        assert _escaped(result) == [], result.content
        copy = tmp_path / "secret-copy.txt"  # a hard link needs the same file system as the task directory
        copy.write_text(SECRET)
        os.link(copy, context.workdir / "hard.txt")
        result = judges.run("print(open('hard.txt').read())", audit_hook=audit_hook, context=context)
        assert result.outcome is ToolOutcome.refused and "hard links" in result.content, result.content


# --- limits of the sandbox ---------------------------------------------------------------------


def test_the_task_directory_is_bounded(judges):
    code = "open('big', 'wb').write(b'x' * (900 * 1024))\nopen('big2', 'wb').write(b'x' * (900 * 1024))"
    tool = PythonEval(SandboxLimits(timeout_s=10, disk_bytes=1024 * 1024))
    result = tool({"code": code})
    assert result.outcome is ToolOutcome.resource_limit and "No space left" in result.content, result.content
    with task_workspace({"a.txt": "x" * 600 * 1024, "b.txt": "y" * 600 * 1024}) as context:
        too_big = tool({"code": "print(1)"}, context)
    assert too_big.outcome is ToolOutcome.resource_limit and "exceed" in too_big.content
    judges.check(PREFIX + "_limits")


# --- when the sandbox cannot be set up ---------------------------------------------------------


FAKE_BWRAP = """#!/bin/sh
echo called >> "{log}"
echo "bwrap: No permissions to create new namespace, likely because the kernel does not allow \
non-privileged user namespaces." >&2
exit 1
"""


def test_without_bubblewrap_every_call_is_refused_and_says_how_to_fix_it(tmp_path):
    missing = PythonEval(SandboxLimits(bwrap=str(tmp_path / "no-such-bwrap")))
    result = missing({"code": f"open('/tmp/{PREFIX}_unavailable', 'w')"})
    assert result.outcome is ToolOutcome.unavailable
    assert "bubblewrap is not installed" in result.content and "apt-get install bubblewrap" in result.content
    log = tmp_path / "bwrap.log"
    fake = tmp_path / "bwrap"
    fake.write_text(FAKE_BWRAP.format(log=log))
    fake.chmod(0o755)
    refused = PythonEval(SandboxLimits(bwrap=str(fake)))
    for _ in range(3):
        result = refused({"code": "print(1)"})
        assert result.outcome is ToolOutcome.unavailable, result.content
        assert "No permissions to create new namespace" in result.content
        assert "ROLLMARKET_UNSAFE_PYTHON_EVAL" in result.content
    assert len(log.read_text().splitlines()) == 1, "the probe runs once per process"
    assert not Path(f"/tmp/{PREFIX}_unavailable").exists()


UNSAFE_RUN = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
from rollmarket.agents.tools.python_eval import PythonEval, SandboxLimits
tool = PythonEval(SandboxLimits({args}))
for _ in range(2):
    result = tool({{"code": "print(6 * 7)"}})
    print(result.outcome.value, result.content)
"""


@pytest.mark.parametrize("args,env", [
    ("isolation='unsafe-audit-hook-only'", {}),
    ("bwrap='/nonexistent/bwrap'", {"ROLLMARKET_UNSAFE_PYTHON_EVAL": "1"}),
])
def test_the_weaker_fallback_runs_only_when_named_and_warns(args, env):
    done = subprocess.run([sys.executable, "-c", UNSAFE_RUN.format(args=args)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert done.stdout.splitlines() == ["ok 42", "ok 42"], done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING") and "WITHOUT" in line]
    assert len(warnings) == 1, done.stderr


def test_unknown_isolation_is_a_typed_error():
    with pytest.raises(ValueError, match="isolation"):
        SandboxLimits(isolation="chroot")
