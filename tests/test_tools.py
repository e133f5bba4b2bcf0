"""The agents' tools: the Tool boundary, the registry, each tool, and the python_eval sandbox.

The sandbox tests try real escapes (network to a socket this test listens on, files outside the
directory, fork bombs, endless loops, huge output, memory bombs) and check that each is refused
and leaves nothing behind. The shipped models were trained on the reference tools' schemas and
outputs, so parity with `tasks.tools_ref` is locked here too: do not "fix" a parity test by
changing the expected text without retraining the models.
"""

from __future__ import annotations

import dis
import json
import os
import select
import socket
import sys
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rollmarket.agents.tool import MAX_OUTPUT_CHARS, Tool, ToolContext, ToolFailure
from rollmarket.agents.tools import TOOLS, UnknownTool, get_tool, run_tool, tool_schemas
from rollmarket.agents.tools import python_eval_child as child
from rollmarket.agents.tools.python_eval import PythonEval, SandboxLimits
from rollmarket.agents.tools.read_file import MAX_FILE_BYTES
from rollmarket.agents.workspace import UnsafeTaskPath, task_workspace
from rollmarket.contracts import ToolOutcome
from rollmarket.tasks import tools_ref
from rollmarket.tasks.world import load_world

QUICK = PythonEval(SandboxLimits(timeout_s=1.5))


@pytest.fixture
def workspace():
    with task_workspace({"notes/a.txt": "alpha\nbeta\n\n", "config/s.toml": 'port = 80\n'}) as context:
        yield context


def processes_with(marker: str) -> list[int]:
    """Pids whose command line contains `marker` (the sandboxed code carries it in a comment)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


# --- the Tool boundary -------------------------------------------------------------------------


class _Echo(Tool):
    name: ClassVar[str] = "echo"
    description: ClassVar[str] = "Echo."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"text": {"type": "string"}, "mode": {"enum": ["ok", "fail", "crash"]}},
        "required": ["text"]}

    def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        if arguments.get("mode") == "fail":
            raise ToolFailure("asked to fail", ToolOutcome.refused)
        if arguments.get("mode") == "crash":
            raise RuntimeError("boom")
        return arguments["text"]


@pytest.mark.parametrize("arguments,needle", [
    ('{"text": ', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"mode": "ok"}', "'text' is a required property"),
    ({"text": 5}, "text: 5 is not of type 'string'"),
    (42, "must be a JSON object"),
])
def test_bad_arguments_are_a_result_not_an_exception(arguments, needle):
    result = _Echo()(arguments)
    assert result.outcome is ToolOutcome.bad_arguments
    assert result.content.startswith("error: ") and needle in result.content


def test_json_string_and_dict_arguments_are_the_same_call():
    assert _Echo()('{"text": "hi"}').content == _Echo()({"text": "hi"}).content == "hi"


def test_failures_keep_their_outcome_and_crashes_become_errors():
    failed = _Echo()({"text": "x", "mode": "fail"})
    assert (failed.outcome, failed.content) == (ToolOutcome.refused, "error: asked to fail")
    crashed = _Echo()({"text": "x", "mode": "crash"})
    assert (crashed.outcome, crashed.content) == (ToolOutcome.error, "error: RuntimeError: boom")
    assert crashed.elapsed_s >= 0


def test_long_output_is_cut_and_marked():
    result = _Echo()({"text": "y" * (MAX_OUTPUT_CHARS * 3)})
    assert result.ok and result.truncated and len(result.content) == MAX_OUTPUT_CHARS
    assert result.content.endswith("[output truncated]")
    assert not _Echo()({"text": "short"}).truncated


# --- the registry ------------------------------------------------------------------------------


def test_registry_holds_the_four_tools():
    assert set(TOOLS) == {"calculator", "python_eval", "read_file", "web_search"}
    assert [s["function"]["name"] for s in tool_schemas(["web_search", "calculator"])] == ["web_search", "calculator"]
    assert len(tool_schemas()) == 4


def test_reference_schemas_are_unchanged():
    """The shipped models saw exactly these schemas in their prompts."""
    for name, schema in tools_ref.TOOL_SCHEMAS.items():
        assert get_tool(name).schema() == schema


def test_unknown_tool():
    with pytest.raises(UnknownTool):
        get_tool("rm_rf")
    assert issubclass(UnknownTool, ValueError)
    result = run_tool("rm_rf", {"path": "/"})
    assert result.outcome is ToolOutcome.unknown_tool and result.content == "error: unknown tool: rm_rf"
    assert run_tool(["not", "a", "name"], {}).outcome is ToolOutcome.unknown_tool


# --- calculator --------------------------------------------------------------------------------


def test_calculator_matches_the_reference():
    for expression in ["17 * 23", "1/3", "2^10", "(4 + 6) * 3 - 2", "-7 // 2", "10 % 4", "2 ** -1", "1e3 + 0.5"]:
        result = run_tool("calculator", {"expression": expression})
        assert result.ok and result.content == tools_ref.calculator(expression)
    assert run_tool("calculator", {"expression": "17 * 23"}).content == "391"


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "pi * 2", "x + 1", "(1).__class__", "[1, 2]", "abs(-1)", "1/0",
    "2 ** 100000", "((9 ** 64) ** 64) ** 64", "((((((9**64)**64)**64)**64)**64)**64)", "1" * 201,
])
def test_calculator_refuses_anything_but_arithmetic(expression):
    start = time.monotonic()
    result = run_tool("calculator", {"expression": expression})
    assert result.outcome is ToolOutcome.error and result.content.startswith("error: ")
    assert time.monotonic() - start < 0.5


# --- read_file ---------------------------------------------------------------------------------


def test_read_file_matches_the_reference_on_every_world_file():
    files = load_world().files
    with task_workspace(files) as context:
        for path in files:
            assert run_tool("read_file", {"path": path}, context).content == tools_ref.read_file(path, files)
        one = next(iter(files))
        assert run_tool("read_file", {"path": "./" + one}, context).content == tools_ref.read_file(one, files)
        missing = run_tool("read_file", {"path": "notes/nope.txt"}, context)
        assert (missing.outcome, missing.content) == (ToolOutcome.error, tools_ref.read_file("notes/nope.txt", files))


def test_read_file_refuses_paths_outside_the_directory(workspace, tmp_path):
    """Symlinks are never followed, even one that stays inside: task directories are written from
    text (task_workspace) and hold none, and following none is what keeps a swapped link out."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    (workspace.workdir / "out").symlink_to(secret)
    (workspace.workdir / "inside").symlink_to(workspace.workdir / "notes" / "a.txt")
    (workspace.workdir / "up").symlink_to("..")
    attempts = ["../x", "/etc/passwd", os.path.relpath(secret, workspace.workdir), str(secret), "out", "inside",
                f"up/{tmp_path.name}/secret.txt", "notes/../../x", str(workspace.workdir / "notes" / "a.txt")]
    for path in attempts:
        result = run_tool("read_file", {"path": path}, workspace)
        assert result.outcome is ToolOutcome.refused, path
        assert "SECRET" not in result.content and "root:" not in result.content and "alpha" not in result.content
    assert run_tool("read_file", {"path": "out"}, workspace).content == "error: symbolic links are not followed: out"
    assert run_tool("read_file", {"path": "./notes/a.txt"}, workspace).content == "alpha\nbeta"


def test_read_file_other_failures(workspace):
    assert run_tool("read_file", {"path": "notes"}, workspace).content == "error: not a file: notes"
    assert run_tool("read_file", {"path": "notes/a.txt"}).outcome is ToolOutcome.error  # no task directory
    (workspace.workdir / "big.txt").write_bytes(b"x" * (MAX_FILE_BYTES + 1))
    assert run_tool("read_file", {"path": "big.txt"}, workspace).outcome is ToolOutcome.resource_limit


# --- web_search --------------------------------------------------------------------------------


def test_web_search_finds_a_world_fact_deterministically():
    world = load_world()
    for town in (world.towns[0], world.towns[77]):
        result = run_tool("web_search", {"query": f"{town.name} population"})
        assert result.ok
        assert result.content.splitlines()[0].startswith(f"{town.name}: ")
        assert f"population of {town.population}" in result.content
        assert result.content == tools_ref.web_search(f"{town.name} population", world)
        assert run_tool("web_search", json.dumps({"query": f"{town.name} population"})).content == result.content
    assert len(world.docs) == 456


def test_web_search_edge_cases():
    assert run_tool("web_search", {"query": "qqqxz zzyzx"}).content == "no results"
    assert run_tool("web_search", {"query": "   "}).outcome is ToolOutcome.bad_arguments


# --- workspace ---------------------------------------------------------------------------------


def test_task_workspace_writes_and_removes():
    with task_workspace({"a/b.txt": "x"}) as context:
        root = context.workdir
        assert (root / "a" / "b.txt").read_text() == "x"
    assert not root.exists()
    with task_workspace({}) as context:
        assert context.workdir.is_dir() and not any(context.workdir.iterdir())


@pytest.mark.parametrize("path", ["../x", "/etc/cron.d/x", "a/../../x", "", "."])
def test_task_workspace_refuses_unsafe_paths(path):
    with pytest.raises(UnsafeTaskPath), task_workspace({path: "x"}):
        pass


# --- python_eval: ordinary use -----------------------------------------------------------------


def test_python_eval_prints(workspace):
    result = run_tool("python_eval", {"code": "import json, re, decimal\nprint(6 * 7)"}, workspace)
    assert (result.outcome, result.content) == (ToolOutcome.ok, "42")
    event_loop = "import asyncio\nasync def f():\n    return 3\nprint(asyncio.run(f()))"
    assert run_tool("python_eval", {"code": event_loop}, workspace).content == "3"


def test_python_eval_exception_is_an_error_with_its_line(workspace):
    result = run_tool("python_eval", {"code": "print('before')\nx = 1 / 0"}, workspace)
    assert result.outcome is ToolOutcome.error
    assert result.content.startswith("error: ZeroDivisionError: division by zero (line 2)")
    assert result.content.endswith("before")
    syntax = run_tool("python_eval", {"code": "def f(:"}, workspace)
    assert syntax.outcome is ToolOutcome.error and "SyntaxError" in syntax.content


def test_python_eval_sees_a_throwaway_copy_of_the_task_files(workspace):
    code = "import os\nprint(open('notes/a.txt').read().split()[0])\nopen('notes/a.txt', 'w').write('changed')\n" \
           "os.mkdir('locked'); os.chmod('locked', 0)\nprint(os.getcwd())"
    result = run_tool("python_eval", {"code": code}, workspace)
    assert result.ok, result.content
    first, cwd = result.content.splitlines()
    assert first == "alpha"
    assert Path(cwd) != workspace.workdir and not Path(cwd).exists()
    assert (workspace.workdir / "notes" / "a.txt").read_text() == "alpha\nbeta\n\n"


def test_python_eval_without_task_files():
    assert run_tool("python_eval", {"code": "import os; print(os.listdir('.'))"}).content == "[]"


# --- python_eval: escapes ----------------------------------------------------------------------


def test_infinite_loop_times_out():
    start = time.monotonic()
    result = QUICK({"code": "while True: pass"})
    assert result.outcome is ToolOutcome.timeout and result.content == "error: timed out after 1.5s"
    assert time.monotonic() - start < 1.5 + 2


def test_fork_bomb_is_refused_and_leaves_nothing():
    marker = f"forkbomb-{uuid.uuid4().hex}"
    start = time.monotonic()
    result = QUICK({"code": f"# {marker}\nimport os\nwhile True:\n    os.fork()"})
    assert result.outcome is ToolOutcome.refused and "starting processes is not allowed" in result.content
    assert time.monotonic() - start < 3
    assert processes_with(marker) == []
    for code in ["import subprocess; subprocess.run(['true'])", "import os; os.system('true')",
                 "import os; os.execv('/bin/true', ['true'])", "import pty; pty.fork()",
                 "import os; os.posix_spawn('/bin/true', ['true'], {})"]:
        assert QUICK({"code": code}).outcome is ToolOutcome.refused, code


def test_forked_children_die_with_the_call_even_without_the_audit_hook():
    """The kernel layers alone: RLIMIT_NPROC stops the fork (the sandbox's uid is not root), and
    whatever ran in the sandbox's PID namespace is gone when the call ends."""
    marker = f"children-{uuid.uuid4().hex}"
    code = f"# {marker}\nimport os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        time.sleep(60)\nprint('parent')"
    result = PythonEval(SandboxLimits(timeout_s=3, audit_hook=False))({"code": code})
    assert result.outcome in (ToolOutcome.ok, ToolOutcome.error), result.content
    # The namespace's teardown is asynchronous: wait (on a loaded machine) for the kernel to reap
    # them; a child that escaped would sleep 60 s and outlive the deadline.
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server
    server.close()


def _assert_never_connected(server: socket.socket) -> None:
    readable, _, _ = select.select([server], [], [], 0.3)
    assert not readable, "the sandboxed code reached the listening socket"


def test_network_is_refused(listener, tmp_path):
    port = listener.getsockname()[1]
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # namespaces do not cover filesystem sockets
    local.bind(str(tmp_path / "local.sock"))
    local.listen()
    for code in [f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
                 f"import socket; s = socket.socket(); s.connect(('127.0.0.1', {port}))",
                 f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/')",
                 f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({str(tmp_path / 'local.sock')!r})"]:
        result = QUICK({"code": code})
        assert result.outcome is ToolOutcome.refused and "network access is not allowed" in result.content, code
    _assert_never_connected(listener)
    _assert_never_connected(local)
    local.close()


def test_network_is_unreachable_even_without_the_audit_hook(listener):
    """The sandbox's network namespace has only its own loopback: the host's is another network."""
    port = listener.getsockname()[1]
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    result = PythonEval(SandboxLimits(timeout_s=3, audit_hook=False))({"code": code})
    assert result.outcome is ToolOutcome.error and "ConnectionRefusedError" in result.content, result.content
    _assert_never_connected(listener)


def test_files_outside_the_directory_are_refused(workspace, tmp_path):
    outside = tmp_path / f"escape-{uuid.uuid4().hex}"
    attempts = {
        "open('/etc/passwd').read()": "reading outside",
        f"open({str(outside)!r}, 'w').write('x')": "writing outside",
        "import os; os.chdir('/'); open('etc/passwd').read()": "outside",
        "open('../../../../../../etc/passwd').read()": "reading outside",
        "import os; os.symlink('/etc/passwd', 'p')": "os.symlink",
        "import os; os.listdir('/')": "reading outside",
        f"import os; os.mkdir({str(outside)!r})": "writing outside",
        "from pathlib import Path; Path('/etc/passwd').read_text()": "reading outside",
        "import os; os.open('/etc/passwd', os.O_RDONLY)": "reading outside",
    }
    for code, needle in attempts.items():
        result = run_tool("python_eval", {"code": code}, workspace)
        assert result.outcome is ToolOutcome.refused and needle in result.content, (code, result.content)
        assert "root:" not in result.content
    assert not outside.exists()


def test_symlink_in_the_task_directory_does_not_lead_out(workspace, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    (workspace.workdir / "out").symlink_to(secret)
    result = run_tool("python_eval", {"code": "print(open('out').read())"}, workspace)
    assert result.outcome is ToolOutcome.refused and "SECRET" not in result.content


def test_threads_are_refused_everywhere():
    """RLIMIT_NPROC would stop threads only when not root; the sandbox refuses them on every machine."""
    code = "import threading\nthreading.Thread(target=print, args=('thread',)).start()"
    result = QUICK({"code": code})
    assert result.outcome is ToolOutcome.refused and "threads are not allowed" in result.content


def test_native_code_and_limit_changes_are_refused(workspace):
    lib_dynload = next(p for p in sys.path if p.endswith("lib-dynload"))
    extension = next(Path(lib_dynload).glob("_json*.so"))
    copy_and_load = (f"import shutil, importlib.util\nshutil.copy({str(extension)!r}, '_json.so')\n"
                     "spec = importlib.util.spec_from_file_location('_json', '_json.so')\n"
                     "importlib.util.module_from_spec(spec)")
    for code in ["import ctypes", copy_and_load, "import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
                 "import sys; sys.settrace(lambda *a: None)", "import sqlite3; sqlite3.connect(':memory:')"]:
        result = run_tool("python_eval", {"code": code}, workspace)
        assert result.outcome is ToolOutcome.refused, (code, result.content)


def test_rewiring_python_does_not_rewire_the_hook():
    """Replacing os/posixpath functions, or reaching the hook's frame through a traceback, changes
    nothing: the hook holds its own references to C functions and immutable data."""
    code = """
import os, posixpath
os.lstat = lambda p: None; os.getcwd = lambda: '/'; posixpath.realpath = lambda p, **k: '/tmp/ok'
try:
    open('/etc/passwd')
except PermissionError as exc:
    tb = exc.__traceback__
while tb.tb_next:
    tb = tb.tb_next
hook_locals = tb.tb_frame.f_locals
hook_locals['_root'] = '/'
for attribute, value in (('__code__', (lambda path: ('/tmp/x', None)).__code__), ('__defaults__', None)):
    try:
        setattr(hook_locals['_resolve'], attribute, value)
    except PermissionError:
        print('locked', attribute)
print(open('/etc/passwd').read())
"""
    result = QUICK({"code": code})
    assert result.outcome is ToolOutcome.refused and "root:" not in result.content
    assert "locked __code__" in result.content and "locked __defaults__" in result.content


def test_the_hook_reads_no_globals():
    """Do not "fix" the hook by referring to a module global or a builtin by name: sandboxed code
    can rebind those, so everything it uses is bound as a default argument."""
    hook = child._make_hook("/nowhere", ())
    resolve = hook.__defaults__[list(hook.__code__.co_varnames).index("_resolve") - 2]
    for function in (hook, resolve, child._no_fork_exec):
        loads = [i.argval for i in dis.get_instructions(function) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
        assert loads == [], (function.__name__, loads)


def test_huge_output_is_stopped_with_bounded_memory():
    tracemalloc.start()
    try:
        start = time.monotonic()
        result = QUICK({"code": "while True:\n    print('x' * 10000)"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.outcome is ToolOutcome.resource_limit and result.truncated
    assert result.content.startswith("error: output exceeded") and len(result.content) <= MAX_OUTPUT_CHARS
    assert peak < 4 * 1024 * 1024 and time.monotonic() - start < 3


def test_memory_and_file_size_limits():
    memory = QUICK({"code": "x = bytearray(2**31)"})
    assert memory.outcome is ToolOutcome.resource_limit and "MemoryError" in memory.content
    big_file = QUICK({"code": "open('big', 'wb').write(b'x' * (2 * 1024 * 1024))"})
    assert big_file.outcome is ToolOutcome.resource_limit and "File too large" in big_file.content


def test_python_eval_bad_arguments():
    assert run_tool("python_eval", '{"code": 1}').outcome is ToolOutcome.bad_arguments
    assert run_tool("python_eval", {"code": "print(1)\0"}).outcome is ToolOutcome.bad_arguments
    assert run_tool("python_eval", '{"code": "print(1)", "shell": true}').outcome is ToolOutcome.bad_arguments
