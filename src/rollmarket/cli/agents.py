"""`rollmarket collect` and `rollmarket worker`: agent runs against a model, on their own or for an exchange."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..worker.canary import DEFAULT_TOLERANCE
from ..worker.runner import WorkerSettings
from .options import ModelDir, Refused, settings_options, validation_problems

console = Console(stderr=True)


def _load_tasks(spec: str):
    """A JSONL file of TaskSpec lines, or a shipped suite as NAME or NAME:SPLIT."""
    from ..tasks.suites import TaskFileError, load_suite, load_tasks, parse_suite_spec, suite_names

    path = Path(spec)
    if path.exists():
        try:
            return load_tasks(path)
        except TaskFileError as exc:
            raise click.BadParameter(str(exc), param_hint="--tasks") from None
    name = spec.partition(":")[0]
    if name in suite_names():
        return load_suite(*parse_suite_spec(spec))
    raise Refused(f"{spec!r} is neither a file nor a suite", f"the suites are {', '.join(suite_names())} "
                  "(NAME or NAME:SPLIT); `rollmarket suites ls` describes them", param_hint="--tasks")


def _check_tasks(tasks) -> None:
    """Refuse, before any run, tasks that could only fail: unknown verifiers, bad verifier args,
    unsafe file paths."""
    from ..verifiers import VERIFIERS
    from ..worker.runner import task_problem

    unknown = sorted({t.verifier for t in tasks} - set(VERIFIERS))
    if unknown:
        raise click.BadParameter(f"unknown verifier(s) {unknown}; known: {sorted(VERIFIERS)}", param_hint="--tasks")
    for task in tasks:
        problem = task_problem(task)
        if problem:
            raise click.BadParameter(f"task {task.task_id}: {problem}", param_hint="--tasks")


@click.command("collect")
@click.option("--tasks", "tasks_spec", required=True,
              help="Tasks: a JSONL file of TaskSpec lines, or a shipped suite NAME[:SPLIT] (split default heldout).")
@click.option("--model-url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.")
@click.option("--model", "model_name", default=None, help="Model name to request (default: the server's first).")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="Bearer key for the model server.")
@click.option("--repeats", "-k", type=click.IntRange(1), default=4, show_default=True, help="Runs per task.")
@click.option("--concurrency", "-c", type=click.IntRange(1), default=8, show_default=True,
              help="Runs in flight at once.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="rollouts JSONL (appended; resumable).")
@click.option("--failures", type=click.Path(path_type=Path), default=None,
              help="Failed runs go here [default: OUT with .failures.jsonl].")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Tokens per turn.")
@click.option("--max-steps", type=int, default=6, show_default=True, help="Turns per run.")
@click.option("--seed", type=int, default=0, show_default=True, help="Base seed (mixed with each task id).")
@click.option("--limit", type=int, default=None, help="Only the first N tasks.")
@click.option("--resources-url", default=None,
              help="Run tools and verifiers on a resources server (`rollmarket verifier serve`).")
@click.option("--extensions/--no-extensions", default=True, show_default=True,
              help="Ask for token ids and routed experts (vLLM/rollmarket extensions); off for plain OpenAI servers.")
@click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True)
def collect_command(tasks_spec, model_url, model_name, api_key, repeats, concurrency, out, failures, temperature,
                    top_p, max_tokens, max_steps, seed, limit, resources_url, extensions, runs_dir) -> None:
    """Run every task K times against a model server and write one AgentTrajectory per line.

    Resumable: rerunning the same command skips runs already in OUT. Then `rollmarket profile OUT`.
    """
    from ..agents import Agent, AgentSettings, ChatModel, LocalToolbox, RemoteToolbox, Sampling
    from ..agents.collect import collect
    from ..runs import code_version, new_run_dir, write_json

    tasks = _load_tasks(tasks_spec)[:limit]
    _check_tasks(tasks)
    failures = failures or out.with_name(out.name.removesuffix(".jsonl") + ".failures.jsonl")
    model = ChatModel(model_url, model_name, api_key=api_key, extensions=extensions)
    name = model.model  # a server that does not answer is a ModelCallError: one line, before the run dir
    if resources_url:
        from ..verifiers.client import ResourcesClient

        def verify(task, run):
            with ResourcesClient(resources_url) as client:
                return client.verify_trajectory(task, run)
        toolbox = RemoteToolbox(resources_url)
    else:
        from ..verifiers import verify_trajectory as verify

        toolbox = LocalToolbox()
    agent = Agent(model, toolbox, AgentSettings(max_steps=max_steps, require_token_ids=False), verify=verify)
    sampling = Sampling(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    run_dir = new_run_dir(runs_dir)
    config = {"tasks": tasks_spec, "num_tasks": len(tasks), "model_url": model_url, "model": name,
              "repeats": repeats, "concurrency": concurrency, "out": str(out), "failures": str(failures),
              "sampling": sampling.__dict__, "max_steps": max_steps, "resources_url": resources_url,
              "code": code_version()}
    write_json(run_dir / "config.json", config)
    console.print(f"[bold]collect[/] {len(tasks)} tasks × {repeats} on {name} at {model_url} → {out}  "
                  f"(run dir {run_dir})", highlight=False)
    with Progress(TextColumn("[bold]runs"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("runs", total=len(tasks) * repeats, info="")

        def on_run(_run, stats) -> None:
            rate = stats.pass_rate
            progress.update(bar, completed=stats.skipped + stats.done + stats.failed,
                            info=f"pass {rate:.2f}" if rate is not None else "" +
                            (f" failed {stats.failed}" if stats.failed else ""))

        stats = collect(agent, tasks, repeats=repeats, out=out, failures=failures, sampling=sampling,
                        concurrency=concurrency, on_run=on_run)
        progress.update(bar, completed=stats.planned)
    summary = {"planned": stats.planned, "skipped": stats.skipped, "done": stats.done, "failed": stats.failed,
               "passed": stats.passed, "pass_rate": stats.pass_rate,
               "mean_reward": stats.reward_sum / stats.done if stats.done else None}
    write_json(run_dir / "summary.json", summary)
    rate = f"{stats.pass_rate:.3f}" if stats.pass_rate is not None else "-"
    console.print(f"{stats.done} new runs ({stats.skipped} already there), {stats.failed} failed → {failures}; "
                  f"pass rate of new runs {rate}. Next: rollmarket profile {out}", highlight=False)
    if stats.failed:
        console.print("[red]some runs failed[/] (the model server errored); rerun the same command to retry them")
        sys.exit(1)


def host_options(command):
    """The model options of `rollmarket worker` and `rollmarket pool`; `host_spec` reads them."""
    for option in reversed([
        click.option("--model", "model_path", type=ModelDir(), default=None,
                     help="Model directory to load and serve on loopback (embedded engine)."),
        click.option("--model-url", default=None, help="Or: an OpenAI-compatible server to sample from."),
        click.option("--model-dir", type=click.Path(exists=True, file_okay=False), default=None,
                     help="With --model-url to a server without /v1/engine (vLLM): the directory it serves."),
        click.option("--precision", default="bf16", show_default=True,
                     type=click.Choice(["fp32", "bf16", "fp16", "fp8"]),
                     help="Precision profile of the embedded engine."),
        click.option("--device", default="cpu", show_default=True, help="Torch device of the embedded engine."),
        click.option("--threads", type=int, default=None, help="torch CPU threads of the embedded engine."),
        click.option("--serve-cmd", default=None,
                     help="Or: run this server command ({model} and {port} filled in) on --model-dir and restart "
                          "it on each new policy, acking after the canary check (a managed vLLM)."),
        click.option("--server-reload", type=click.Choice(["none", "vllm-inplace"]), default="none",
                     show_default=True,
                     help="With --model-url and --model-dir: how the server gets onto a new policy. vllm-inplace: "
                          "vLLM's in-place reload (VLLM_SERVER_DEV_MODE=1), acked after the canary check."),
        click.option("--canary-tolerance", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_TOLERANCE,
                     show_default=True,
                     help="Mean |Δlogp| of the server's canary against the checkpoint under which a reload "
                          "counts as done."),
    ]):
        command = option(command)
    return command


def host_spec(model_path, model_url, model_dir, precision, device, threads, serve_cmd=None, server_reload="none",
              canary_tolerance=DEFAULT_TOLERANCE, *, absolute: bool = False):
    """The HostSpec of the options; `absolute` resolves paths for processes that run elsewhere."""
    from pydantic import ValidationError

    from ..worker.host import HostSpec

    if absolute:
        model_path = model_path and str(Path(model_path).resolve())
        model_dir = model_dir and str(Path(model_dir).resolve())
    try:
        return HostSpec(model_path=model_path, model_url=model_url, model_dir=model_dir, precision=precision,
                        device=device, threads=threads, serve_cmd=serve_cmd, server_reload=server_reload,
                        canary_tolerance=canary_tolerance)
    except ValidationError as exc:
        raise click.UsageError(validation_problems(exc)) from None


def worker_settings(values: dict) -> WorkerSettings:
    """WorkerSettings from the options; a value out of range (e.g. --reload-lag -1) is a usage error."""
    from pydantic import ValidationError

    try:
        return WorkerSettings(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        raise click.UsageError(validation_problems(exc)) from None


@click.command("worker")
@host_options
@settings_options(WorkerSettings)
def worker_command(model_path, model_url, model_dir, precision, device, threads, serve_cmd, server_reload,
                   canary_tolerance, **values) -> None:
    """Run a rollout worker: lease jobs from an exchange, run the agent, verify, submit groups.

    With --model it loads the directory at --precision and serves it on a loopback port; with
    --model-url it samples from that server. On a new policy it loads the checkpoint, checks the
    digest and acks the reload; with --serve-cmd it runs the server (vLLM) itself and restarts it
    on each new checkpoint, acking only when the server's canary logprobs are the checkpoint's.
    Stops on Ctrl-C / SIGTERM.
    """
    from ..worker.host import HostError
    from ..worker.runner import AgentWorker

    spec = host_spec(model_path, model_url, model_dir, precision, device, threads, serve_cmd, server_reload,
                     canary_tolerance)
    settings = worker_settings(values)
    try:
        if settings.signing_key is not None:
            from ..gate.integrity import load_signing_key

            load_signing_key(settings.signing_key)  # a bad key fails before a model loads
        with console.status(f"loading {spec.label}"):
            host = spec.open()
            worker = AgentWorker(settings, host)
    except HostError as exc:
        raise click.ClickException(str(exc)) from None
    ident = worker.identity
    console.print(f"[bold]rollmarket worker[/] {worker.worker_id}: {ident.model_name} ({ident.engine_name}, "
                  f"{ident.precision}) at {host.url} → exchange {settings.exchange}", highlight=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    tally = {"groups": 0, "runs": 0, "passed": 0}

    def show(kind: str, data: dict) -> None:
        if kind == "submitted":
            tally["groups"] += 1
            tally["runs"] += len(data["rewards"])
            tally["passed"] += sum(data["passed"])
            console.print(f"group {tally['groups']}: {data['task_id']} rewards {data['rewards']} "
                          f"({data['tier']}); pass rate so far {tally['passed'] / tally['runs']:.2f}", highlight=False)
        elif kind in ("reload_acked", "reload_refused", "reload_unverified", "reload_violation", "failed",
                      "rejected"):
            console.print(f"{kind}: {data}", highlight=False)

    worker.events.listeners.append(show)
    try:
        worker.run(stop)
    finally:
        host.close()
        worker.events.close()
