"""The child side of python_eval: drop to the sandbox user, unpack the task's files, set the limits,
install the audit hook, run the model's code.

The parent runs this file's text, compiled under SANDBOX_FILENAME, with
`python -I -S -B -c BOOTSTRAP <this text> <settings> <code>`, inside the bubblewrap sandbox (see
sandbox.py) or, only when explicitly opted in, in a throwaway host directory. Importing the
module does nothing but define names (the parent reads the EXIT_* constants from it); the work
happens in `main`, only when the text runs as `__main__`.

The audit hook (PEP 578) is the second layer, inside the interpreter: it refuses network access,
starting processes, native code (ctypes, extension modules from outside the Python installation),
and files outside the working directory (reading is also allowed in the Python installation,
which imports need). Hooks cannot be removed once added. Everything the hook uses is bound as a
default argument when it is made (C functions, frozensets, strings), so code that reaches a
hook frame through a traceback finds nothing to rewire, and code that replaces `builtins` or
`os` functions does not change what the hook calls. CPython's documentation says audit hooks are
not a sandbox, and some file-system calls carry no full path in their events (paths relative to a
directory descriptor, mknod, mkfifo): the kernel layer is what holds when the hook is passed.

Exit status tells the parent how the code ended (EXIT_*); the last line on stderr says why.
"""

from __future__ import annotations

EXIT_ERROR = 81
"""The code raised (or exited non-zero)."""
EXIT_REFUSED = 82
"""The code died of a sandbox refusal (SandboxRefused, possibly wrapped by a library)."""
EXIT_MEMORY = 83
"""MemoryError: the address-space limit."""
EXIT_FILE_SIZE = 84
"""A write past the file-size limit (EFBIG) or past the sandbox's disk (ENOSPC)."""
EXIT_SETUP = 85
"""The sandbox could not be set up (the uid drop did not hold); the code did not run."""
CODE_FILENAME = "<python_eval>"
"""The filename the model's code is compiled under; tracebacks' line numbers refer to it."""
STATUS_PREFIX = "[python_eval] "
"""Starts the stderr line that says how the code ended."""
SANDBOX_FILENAME = "<rollmarket-sandbox>"
"""The filename this module is compiled under in the child: it marks the hook's own functions."""
BOOTSTRAP = f"import sys; exec(compile(sys.argv[1], {SANDBOX_FILENAME!r}, 'exec'))"
"""The `-c` program: runs the text passed as its first argument as this module."""

_ALLOWED_DEVICES = frozenset({"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"})
_EXTRA_READ_ROOTS = ("/usr/share/zoneinfo",)
_PATH_EVENTS = frozenset({
    "open", "os.listdir", "os.scandir", "os.chdir", "os.getxattr", "os.listxattr",  # reads
    "os.mkdir", "os.remove", "os.rmdir", "os.truncate", "os.utime", "os.chmod", "os.chown", "os.chflags",
    "os.setxattr", "os.removexattr", "os.rename",  # writes
})
_READ_EVENTS = frozenset({"os.listdir", "os.scandir", "os.chdir", "os.getxattr", "os.listxattr"})
_DIR_FD_LAST = frozenset({"os.mkdir", "os.remove", "os.rmdir", "os.utime", "os.chmod", "os.chown"})
_PROCESS_EVENTS = frozenset({"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system", "subprocess.Popen"})
_DENIED_EVENTS = frozenset({
    "os.link", "os.symlink",  # a link swapped between the hook's check and the open would escape
    "resource.setrlimit", "resource.prlimit",  # the limits stay as set
    "sys.settrace", "sys.setprofile", "sys._current_frames",  # a tracer could rewrite the hook's locals
    "sys.monitoring.register_callback",  # the same, from Python 3.12
    "cpython.PyInterpreterState_New",  # a subinterpreter would start without this hook
    "sqlite3.connect",  # sqlite opens files (ATTACH) without audit events
})
_DENIED_PREFIXES = ("ctypes.", "syslog.")
_BLOCKED_MODULES = frozenset({
    "_ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_multiprocessing", "_xxsubinterpreters",
    "_xxinterpchannels", "_testcapi", "_testinternalcapi", "_testbuffer", "_testclinic", "_testimportmultiple",
    "_testmultiphase", "_xxtestfuzz", "readline", "nis", "spwd", "ossaudiodev", "_tkinter", "_curses",
    "_curses_panel",
    "_thread",  # imported at start-up, so only a re-import (to get the real start_new_thread back) gets here
})
_WRITE_FLAGS = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000  # O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND (Linux)
_S_IFMT, _S_IFLNK, _S_IFCHR, _S_IFBLK = 0o170000, 0o120000, 0o020000, 0o060000


class SandboxRefused(PermissionError):
    """Raised by the audit hook for an action the sandbox does not allow."""


def _make_resolver():
    import posix

    def resolve(path, _lstat=posix.lstat, _readlink=posix.readlink, _getcwd=posix.getcwd, _OSError=OSError,
                _Refused=SandboxRefused, _as_str=str.__str__, _decode=bytes.decode, _TypeError=TypeError,
                _S_IFMT=_S_IFMT, _S_IFLNK=_S_IFLNK):
        """(real absolute path, st_mode or None) of `path`, symlinks followed like the kernel would."""
        if path is None:
            path = "."
        try:
            path = _as_str(path)  # an exact str copy: a str subclass's own methods never run here
        except _TypeError:
            path = _decode(path, "utf-8", "surrogateescape")
        if not path.startswith("/"):
            path = _getcwd() + "/" + path
        pending = path.split("/")
        pending.reverse()
        resolved, mode, hops = "", None, 0
        while pending:
            name = pending.pop()
            if name == "" or name == ".":
                continue
            if name == "..":
                resolved, mode = resolved.rpartition("/")[0], None
                continue
            candidate = resolved + "/" + name
            try:
                mode = _lstat(candidate).st_mode
            except _OSError:
                resolved, mode = candidate, None
                continue
            if mode & _S_IFMT == _S_IFLNK:
                hops += 1
                if hops > 40:
                    raise _Refused("sandbox: too many levels of symbolic links: " + path)
                target = _readlink(candidate)
                if target.startswith("/"):
                    resolved = ""
                parts = target.split("/")
                parts.reverse()
                pending += parts
                mode = None
                continue
            resolved = candidate
        return (resolved or "/"), mode

    return resolve


def _make_hook(root: str, read_roots: tuple[str, ...]):
    import posix

    resolve = _make_resolver()
    own_pid, own_group, function_type = posix.getpid(), posix.getpgrp(), type(_make_resolver)

    def hook(event, args, _root=root, _read_roots=read_roots, _resolve=resolve, _own_pid=own_pid,
             _own_group=own_group, _Refused=SandboxRefused, _type=type, _str=str, _int=int,
             _as_str=str.__str__, _function=function_type, _filename=SANDBOX_FILENAME,
             _paths=_PATH_EVENTS, _reads=_READ_EVENTS, _dir_fd_last=_DIR_FD_LAST, _processes=_PROCESS_EVENTS,
             _denied=_DENIED_EVENTS, _denied_prefixes=_DENIED_PREFIXES, _blocked=_BLOCKED_MODULES,
             _AF_UNIX=1, _devices=_ALLOWED_DEVICES, _write_flags=_WRITE_FLAGS, _S_IFMT=_S_IFMT, _S_IFCHR=_S_IFCHR,
             _S_IFBLK=_S_IFBLK):
        if event in _paths:
            if event == "open":
                path, mode, flags = args
                if _type(path) is _int:
                    return  # an fd the code already holds
                write = (_type(mode) is _str and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) \
                    or (_type(flags) is _int and flags & _write_flags != 0)
                paths = (path,)
            elif event == "os.rename":
                if args[2] != -1 or args[3] != -1:
                    raise _Refused("sandbox: dir_fd is not allowed (os.rename)")
                write, paths = True, (args[0], args[1])
            else:
                if event in _dir_fd_last and args[-1] != -1:
                    raise _Refused("sandbox: dir_fd is not allowed (" + event + ")")
                write, paths = event not in _reads, (args[0],)
            for path in paths:
                if _type(path) is _int:
                    continue
                real, st_mode = _resolve(path)
                if real in _devices:
                    continue
                if st_mode is not None and (st_mode & _S_IFMT == _S_IFCHR or st_mode & _S_IFMT == _S_IFBLK):
                    raise _Refused("sandbox: device files are not allowed: " + real)
                if real == _root or real.startswith(_root + "/"):
                    continue
                if not write:
                    inside = False
                    for allowed in _read_roots:
                        if real == allowed or real.startswith(allowed + "/"):
                            inside = True
                            break
                    if inside:
                        continue
                what = "writing" if write else "reading"
                raise _Refused(f"sandbox: {what} outside the working directory is not allowed: {real}")
        elif event == "import":
            name, filename = args[0], args[1]
            name = _as_str(name)
            if name.rpartition(".")[2] in _blocked:
                raise _Refused("sandbox: module " + name + " is not available")
            if filename is not None:  # a native extension is being loaded from a file
                real = _resolve(filename)[0]
                for allowed in _read_roots:
                    if real.startswith(allowed + "/"):
                        return
                raise _Refused("sandbox: loading native code from " + real + " is not allowed")
        elif event in _processes:
            raise _Refused("sandbox: starting processes is not allowed (" + event + ")")
        elif event == "socket.__new__" and args[1] == _AF_UNIX:
            return  # unconnected local sockets: socket.socketpair(), which asyncio's event loop needs
        elif event.startswith("socket."):
            raise _Refused("sandbox: network access is not allowed (" + event + ")")
        elif event in _denied or event.startswith(_denied_prefixes):
            raise _Refused("sandbox: " + event + " is not allowed")
        elif event == "os.kill":
            if args[0] != 0 and args[0] != _own_pid:
                raise _Refused("sandbox: signalling other processes is not allowed (os.kill)")
        elif event == "os.killpg":
            if args[0] != 0 and args[0] != _own_group:
                raise _Refused("sandbox: signalling other processes is not allowed (os.killpg)")
        elif event == "object.__setattr__" or event == "object.__delattr__":
            target, attribute = args[0], args[1]
            if _type(target) is _function and attribute in ("__code__", "__defaults__", "__kwdefaults__") \
                    and target.__code__.co_filename == _filename:
                raise _Refused("sandbox: the sandbox's own functions cannot be changed")

    return hook


def _no_fork_exec(*_args: object, _Refused: type = SandboxRefused) -> None:
    raise _Refused("sandbox: starting processes is not allowed (_posixsubprocess.fork_exec)")


def _no_thread(*_args: object, _Refused: type = SandboxRefused) -> None:
    raise _Refused("sandbox: threads are not allowed")


def _cause_chain(exc: BaseException | None):
    seen = 0
    while exc is not None and seen < 20:
        yield exc
        exc = exc.__cause__ or exc.__context__
        seen += 1


def _status(exc: BaseException) -> int:
    import errno

    chain = list(_cause_chain(exc))
    if any(isinstance(e, SandboxRefused) for e in chain):
        return EXIT_REFUSED
    if isinstance(exc, MemoryError):
        return EXIT_MEMORY
    if isinstance(exc, OSError) and exc.errno in (errno.EFBIG, errno.ENOSPC):
        return EXIT_FILE_SIZE
    return EXIT_ERROR


def _unpack(files_fd: int) -> None:
    """Write the task's files, sent by the parent as a marshalled list of (relative path, kind, mode,
    content) through `files_fd`, into the working directory (the sandbox's private tmpfs)."""
    import marshal
    import os

    chunks = []
    while chunk := os.read(files_fd, 1 << 20):
        chunks.append(chunk)
    os.close(files_fd)
    directories = []
    for path, kind, mode, content in marshal.loads(b"".join(chunks)):
        if kind == "d":
            os.mkdir(path, 0o700)
            directories.append((path, mode))
        elif kind == "l":
            os.symlink(content, path)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            os.close(fd)
    for path, mode in reversed(directories):  # deepest first, so a read-only parent is set last
        os.chmod(path, mode)


def _describe(exc: BaseException) -> str:
    """'ZeroDivisionError: division by zero (line 3)': the line in the model's code where it happened."""
    line = exc.lineno if isinstance(exc, SyntaxError) and exc.filename == CODE_FILENAME else None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == CODE_FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    message = str(exc.msg if isinstance(exc, SyntaxError) else exc)
    if isinstance(exc, SandboxRefused):
        text = message
    else:
        text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return " ".join((text + (f" (line {line})" if line else "")).split())


def main() -> None:
    import os
    import resource
    import sys

    memory, cpu_s, file_bytes, open_files, audit, uid, gid, files_fd = (int(x) for x in sys.argv[2].split(","))
    code = sys.argv[3]
    sys.argv = [CODE_FILENAME]
    if uid >= 0:  # in the bubblewrap sandbox as root: become the unprivileged user before anything else
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
            os._exit(EXIT_SETUP)
    if files_fd >= 0:
        _unpack(files_fd)
    for limit, soft, hard in ((resource.RLIMIT_AS, memory, memory), (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
                              (resource.RLIMIT_FSIZE, file_bytes, file_bytes),
                              (resource.RLIMIT_NOFILE, open_files, open_files),
                              (resource.RLIMIT_NPROC, 0, 0), (resource.RLIMIT_CORE, 0, 0)):
        current = resource.getrlimit(limit)[1]
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(limit, (soft, hard))
    sys.stdout.reconfigure(line_buffering=True, errors="backslashreplace")  # type: ignore[union-attr]
    sys.stderr.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]

    if audit:
        import _posixsubprocess
        import _thread

        # subprocess and threading stay importable (asyncio imports both) but their primitives, which
        # raise no audit event, are replaced; re-importing the modules is refused by the hook. Threads
        # go too: RLIMIT_NPROC stops them only when not root, and code should run the same everywhere.
        _posixsubprocess.fork_exec = _no_fork_exec  # type: ignore[assignment]
        for name in ("start_new_thread", "start_new", "start_joinable_thread"):
            if hasattr(_thread, name):
                setattr(_thread, name, _no_thread)
        root = os.path.realpath(os.getcwd())
        read_roots = tuple(sorted({os.path.realpath(p) for p in sys.path if p} | set(_EXTRA_READ_ROOTS)))
        sys.addaudithook(_make_hook(root, read_roots))

    module = type(sys)("__main__")
    module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    status, why = 0, ""
    try:
        exec(compile(code, CODE_FILENAME, "exec", dont_inherit=True), module.__dict__)  # noqa: S102 - the point
    except SystemExit as exc:
        if exc.code not in (None, 0):
            status, why = EXIT_ERROR, f"SystemExit: {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - every way the code ends is reported
        status, why = _status(exc), _describe(exc)
    if why:  # after the except block, so warnings from releasing the exception come before it
        sys.stderr.write("\n" + STATUS_PREFIX + why + "\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    main()
