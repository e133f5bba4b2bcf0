"""The kernel sandbox python_eval runs in: bubblewrap (`bwrap`) namespaces around one interpreter.

`find_bubblewrap()` looks once at this machine and returns a `Bubblewrap` that knows what to bind
into the sandbox; `Bubblewrap.argv(...)` is the command line of one call. What the sandbox holds:

- a root that is an empty read-only tmpfs, into which only these are bound, read-only: the
  interpreter binary, its standard library (lib-dynload included) with the installation's
  `site-packages` covered by an empty read-only tmpfs, the shared libraries the interpreter and
  the allowed extension modules link (found with `ldd`), and the time-zone database;
- a minimal `/dev` (null, zero, full, random, urandom, tty, a private devpts) and a fresh `/proc`
  of the sandbox's own PID namespace, both read-only;
- `/task`: a private tmpfs of bounded size, the only writable place. The task's files are copied
  into it by the child from a memfd the parent fills, so nothing the code writes lands on the host;
- fresh network (loopback only), PID, IPC, UTS and cgroup namespaces, a new session, death with the
  parent, no capabilities, and an unprivileged uid/gid: as root, bwrap keeps only CAP_SETUID and
  CAP_SETGID and the child drops to SANDBOX_UID/SANDBOX_GID (a real host uid, so RLIMIT_NPROC
  binds) before it reads anything of the task; otherwise bwrap maps SANDBOX_UID to the caller's
  own uid inside a user namespace and forbids nested ones.

docs/security.md has the threat model and what each layer stops.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from . import python_eval_child as child

SANDBOX_UID = 65534
"""The uid the code runs as (`nobody` on Debian): owns nothing on the host."""
SANDBOX_GID = 65534
TASK_DIR = "/task"
"""The task directory inside the sandbox: the working directory, HOME and TMPDIR of the code."""
ZONEINFO = "/usr/share/zoneinfo"
"""The time-zone database, bound when present (the `zoneinfo` module reads it)."""
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; `make sandbox` does it) "
                "and, when not running as root, allow unprivileged user namespaces")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up on this machine; the message says why."""


@dataclass(frozen=True)
class Bubblewrap:
    """What one machine's sandbox binds, found by `find_bubblewrap`."""

    bwrap: str
    """The bwrap executable."""
    interpreter: str
    """Real path of the Python binary that runs inside."""
    read_only: tuple[str, ...]
    """Host paths bound read-only at the same path inside (files or directories)."""
    hidden: tuple[str, ...]
    """Directories inside `read_only` ones covered by an empty read-only tmpfs (site-packages)."""
    drop_root: bool
    """True when running as root: no user namespace; the child drops to SANDBOX_UID itself."""

    def parents(self) -> list[str]:
        """The directories above the bound paths, top down (they exist only as empty mount points)."""
        found = {str(parent) for path in self.read_only for parent in Path(path).parents if str(parent) != "/"}
        return sorted(found - set(self.read_only), key=lambda p: (p.count("/"), p))

    def argv(self, disk_bytes: int, env: dict[str, str], info_fd: int) -> list[str]:
        """The bwrap command line up to (and including) the interpreter path. bwrap writes the host
        pid of the sandbox's init process to `info_fd` (JSON, `child-pid`) before the code starts."""
        argv = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", "--new-session", "--die-with-parent", "--cap-drop", "ALL",
                "--info-fd", str(info_fd)]
        if self.drop_root:
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            argv += ["--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)]
        argv.append("--clearenv")
        for name, value in env.items():
            argv += ["--setenv", name, value]
        for directory in self.parents():
            # bwrap would create these with the mode of the host's (/root is 0700): say 0755 first.
            argv += ["--perms", "0755", "--dir", directory]
        for path in self.read_only:
            argv += ["--ro-bind", path, path]
        for path in self.hidden:
            argv += ["--tmpfs", path, "--remount-ro", path]
        argv += ["--dev", "/dev", "--proc", "/proc",
                 "--size", str(disk_bytes), "--perms", "0777", "--tmpfs", TASK_DIR, "--chdir", TASK_DIR,
                 "--remount-ro", "/dev", "--remount-ro", "/proc", "--remount-ro", "/",
                 "--", self.interpreter]
        return argv


def _stdlib_dirs() -> tuple[str, str]:
    """(stdlib, lib-dynload) of the running interpreter's installation, as real paths."""
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    dynload = next((p for p in sys.path if os.path.basename(p) == "lib-dynload" and os.path.isdir(p)),
                   sysconfig.get_config_var("DESTSHARED") or os.path.join(stdlib, "lib-dynload"))
    return stdlib, os.path.realpath(dynload)


def _extension_modules(dynload: str) -> list[str]:
    """The extension modules of lib-dynload the audit hook does not block (their libraries get bound)."""
    found = []
    for name in sorted(os.listdir(dynload)):
        if name.endswith(".so") and name.split(".", 1)[0] not in child._BLOCKED_MODULES:
            found.append(os.path.join(dynload, name))
    return found


_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


def _linked_libraries(binaries: list[str]) -> list[str]:
    """The shared libraries `binaries` load, as the dynamic loader finds them (paths from `ldd`)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("ldd is not installed (it lists the libraries to bind into the sandbox)")
    done = subprocess.run([ldd, *binaries], capture_output=True, text=True, timeout=120, check=False,
                          env={"PATH": os.defpath, "LC_ALL": "C"})
    libraries = set()
    for line in done.stdout.splitlines():
        match = _LDD_LINE.match(line)
        if match and os.path.exists(match.group(1)):
            libraries.add(match.group(1))
    if not libraries:
        raise SandboxUnavailable(f"ldd found no libraries for {binaries[0]}: {done.stderr.strip()[-300:]}")
    return sorted(libraries)


@functools.cache
def find_bubblewrap(bwrap: str = "bwrap") -> Bubblewrap:
    """This machine's sandbox set-up with the bwrap program `bwrap` (a name on PATH or a path), or
    SandboxUnavailable saying what is missing. Looked up once per process and program; whether the
    sandbox really starts is python_eval's probe (it runs a check inside)."""
    program = shutil.which(bwrap)
    if program is None:
        raise SandboxUnavailable(f"bubblewrap is not installed ({bwrap!r} not found)")
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib, dynload = _stdlib_dirs()
    read_only = [interpreter, stdlib]
    if not dynload.startswith(stdlib + "/"):
        read_only.append(dynload)
    read_only += _linked_libraries([interpreter, *_extension_modules(dynload)])
    if os.path.isdir(ZONEINFO):
        read_only.append(os.path.realpath(ZONEINFO))
    hidden = tuple(path for name in ("site-packages", "dist-packages")
                   if os.path.isdir(path := os.path.join(stdlib, name)))
    return Bubblewrap(bwrap=program, interpreter=interpreter, read_only=tuple(dict.fromkeys(read_only)),
                      hidden=hidden, drop_root=os.geteuid() == 0)


def host_namespaces() -> dict[str, int]:
    """Inode of each of this process's namespaces (the sandbox's must all differ)."""
    return {name: os.stat(f"/proc/self/ns/{name}").st_ino for name in ("net", "pid", "mnt", "ipc", "uts")}


def probe_code(namespaces: dict[str, int], user_namespace: bool) -> str:
    """A program that, run inside the sandbox without the audit hook, prints 'ok' when the kernel
    isolation really holds there, else 'failed: <what>'.

    Whether uid 65534 inside is unprivileged on the host: without a user namespace (the root
    set-up) the uid map is the identity, so 65534 is the host's 65534; inside a user namespace
    (`user_namespace`, set up by bwrap for a caller that is not root) the map leads to the caller's
    own uid, the only one an unprivileged process can map, and the caller checks it is not root.
    """
    return f"""
import os
problems = []
if os.getresuid() != ({SANDBOX_UID},) * 3 or os.getresgid() != ({SANDBOX_GID},) * 3:
    problems.append(f"uid/gid are {{os.getresuid()}}/{{os.getresgid()}}")
if set(os.getgroups()) - {{{SANDBOX_GID}}}:
    problems.append(f"supplementary groups {{os.getgroups()}}")
identity = [line.split() for line in open("/proc/self/uid_map")] == [["0", "0", "4294967295"]]
if identity == {user_namespace!r}:
    problems.append("expected " + ("a" if {user_namespace!r} else "no") + " user namespace")
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
for field in ("CapPrm", "CapEff", "CapAmb"):
    if int(status[field], 16):
        problems.append(field + " is not empty")
if status["NoNewPrivs"].strip() != "1":
    problems.append("no_new_privs is not set")
for name, host in {namespaces!r}.items():
    if os.stat("/proc/self/ns/" + name).st_ino == host:
        problems.append("shares the host's " + name + " namespace")
for path in ("/probe", "/dev/probe", "/proc/probe"):
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        problems.append(path + " is writable")
    except OSError:
        pass
open("written", "w").close()
print("ok" if not problems else "failed: " + "; ".join(problems))
"""
