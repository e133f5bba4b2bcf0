"""Task directories on disk: a task's files written into a fresh temporary directory that the tools
work in; reading below it with the kernel keeping the read inside (`open_below`); and its content
packed for python_eval's sandbox (`pack_task_files`) or copied for the unsafe fallback
(`scratch_copy`).

The context managers delete what they made on exit, even when the code inside left files it had
made unreadable.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import marshal
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path, PurePosixPath
from typing import Any

from .tool import ToolContext


class UnsafeTaskPath(ValueError):
    """A task's file path that would land outside its directory (absolute, `..`, empty)."""


def check_task_path(path: str) -> PurePosixPath:
    """`path` as a relative path that stays inside the task directory, or UnsafeTaskPath."""
    pure = PurePosixPath(path)
    if not path or "\0" in path or pure.is_absolute() or ".." in pure.parts or pure == PurePosixPath("."):
        raise UnsafeTaskPath(f"task file path must be relative and stay inside the task directory: {path!r}")
    return pure


@contextmanager
def task_workspace(files: Mapping[str, str], state: dict[str, Any] | None = None) -> Iterator[ToolContext]:
    """A ToolContext whose workdir is a fresh directory holding `files` (relative path -> text).

    The directory always exists (empty when the task has no files) and is deleted on exit.
    Paths are checked before anything is written: an unsafe one raises UnsafeTaskPath.
    """
    checked = [(check_task_path(path), text) for path, text in files.items()]
    root = Path(tempfile.mkdtemp(prefix="rollmarket-task-")).resolve()
    try:
        for path, text in checked:
            target = root.joinpath(*path.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        yield ToolContext(workdir=root, state={} if state is None else state)
    finally:
        remove_tree(root)


@contextmanager
def scratch_copy(source: Path | None) -> Iterator[Path]:
    """A fresh directory holding a copy of `source` (symlinks copied as links, not followed), deleted on exit."""
    root = Path(tempfile.mkdtemp(prefix="rollmarket-scratch-")).resolve()
    try:
        if source is not None:
            shutil.copytree(source, root, symlinks=True, dirs_exist_ok=True)
        yield root
    finally:
        remove_tree(root)


def remove_tree(root: Path) -> None:
    """Delete `root`; when that fails, give back the owner permissions that code in it took away, and retry."""
    try:
        shutil.rmtree(root)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    with suppress(OSError):
        os.chmod(root, stat.S_IRWXU)
    for dirpath, dirnames, _files in os.walk(root):
        for name in dirnames:  # top-down: each directory is opened up before the walk enters it
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                with suppress(OSError):
                    os.chmod(path, stat.S_IRWXU)
    shutil.rmtree(root, ignore_errors=True)


# --- reading below a directory, confined by the kernel ------------------------------------------

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437
"""openat2(2)'s number, the same on every Linux architecture (it came after the unified table)."""
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
"""O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused as 'not a file' after the open)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.cache
def _openat2_call():
    """libc's syscall(2) set up for openat2, or None where the kernel lacks it (ENOSYS: Linux < 5.6,
    or a seccomp filter that hides it); then `open_below` walks the path one component at a time."""
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(_OpenHow), ctypes.c_size_t]
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_BENEATH)
        probe = call(_SYS_OPENAT2, fd, b".", ctypes.byref(how), ctypes.sizeof(how))
        if probe < 0:
            return None if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM) else call
        os.close(probe)
        return call
    finally:
        os.close(fd)


def _open_with_openat2(call, root_fd: int, parts: tuple[str, ...]) -> int:
    how = _OpenHow(_READ_FLAGS, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
    fd = call(_SYS_OPENAT2, root_fd, "/".join(parts).encode("utf-8", "surrogateescape"), ctypes.byref(how),
              ctypes.sizeof(how))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), "/".join(parts))
    return fd


def _open_by_components(root_fd: int, parts: tuple[str, ...]) -> int:
    """The same confinement without openat2: each directory opened relative to the previous one's
    descriptor with O_NOFOLLOW (a symlink anywhere fails with ELOOP), staying on the root's device."""
    device = os.fstat(root_fd).st_dev
    current = root_fd
    try:
        for name in parts[:-1]:
            following = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
            if current != root_fd:
                os.close(current)
            current = following
            if os.fstat(current).st_dev != device:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/".join(parts))
        fd = os.open(parts[-1], _READ_FLAGS | os.O_NOFOLLOW, dir_fd=current)
        if os.fstat(fd).st_dev != device:
            os.close(fd)
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/".join(parts))
        return fd
    finally:
        if current != root_fd:
            os.close(current)


def open_below(root: Path, path: PurePosixPath) -> int:
    """A read-only descriptor of `path` (relative, no `..`; see `check_task_path`) below `root`,
    opened so that the kernel keeps the whole resolution inside `root`: no symlink is followed
    (ELOOP), nothing leaves `root` (EXDEV), no mount is crossed. A concurrent writer that swaps a
    component for a symlink cannot redirect the open, because nothing is checked before it.

    Uses openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)
    where the kernel has it, else a walk of O_NOFOLLOW opens relative to directory descriptors.
    The caller checks what it opened (fstat: a regular file, one link). Raises OSError.
    """
    parts = check_task_path(str(path)).parts
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        call = _openat2_call()
        if call is not None:
            return _open_with_openat2(call, root_fd, parts)
        return _open_by_components(root_fd, parts)
    finally:
        os.close(root_fd)


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes from `fd`, until end of file."""
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, min(limit - size, 1 << 20))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


# --- the task's files for python_eval's sandbox ---------------------------------------------------


class TaskFilesError(ValueError):
    """The task directory cannot be handed to the sandbox; `too_large` says whether it is its size."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


def pack_task_files(source: Path, max_bytes: int) -> bytes:
    """The content of `source` (directories, regular files, symlinks as links) as one marshalled
    list of (relative path, kind 'd'/'f'/'l', mode, content), parents before children, which the
    sandboxed child writes into its private tmpfs. Read with O_NOFOLLOW relative to directory
    descriptors, so a concurrent swap cannot pull an outside file in. TaskFilesError for a file that
    has other hard links or is not a file, directory or symlink, and when the files exceed `max_bytes`.
    """
    entries: list[tuple[str, str, int, bytes | str]] = []
    total = 0

    def walk(dir_fd: int, prefix: str) -> None:
        nonlocal total
        for name in sorted(os.listdir(dir_fd)):
            relative = prefix + name
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode):
                entries.append((relative, "l", 0, os.readlink(name, dir_fd=dir_fd)))
            elif stat.S_ISDIR(info.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                try:
                    entries.append((relative, "d", stat.S_IMODE(os.fstat(fd).st_mode) & 0o777, b""))
                    walk(fd, relative + "/")
                finally:
                    os.close(fd)
            elif stat.S_ISREG(info.st_mode):
                fd = os.open(name, _READ_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
                try:
                    opened = os.fstat(fd)
                    if not stat.S_ISREG(opened.st_mode) or opened.st_nlink != 1:
                        raise TaskFilesError(f"the task directory holds a file with other hard links: {relative}")
                    content = read_at_most(fd, max_bytes - total + 1)
                finally:
                    os.close(fd)
                total += len(content)
                if total > max_bytes:
                    raise TaskFilesError(f"the task's files exceed the sandbox's {max_bytes} bytes", too_large=True)
                entries.append((relative, "f", stat.S_IMODE(opened.st_mode) & 0o777, content))
            else:
                raise TaskFilesError(f"the task directory holds something that is not a file: {relative}")

    root_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walk(root_fd, "")
    finally:
        os.close(root_fd)
    return marshal.dumps(entries)
