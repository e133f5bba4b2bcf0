"""`rollmarket observe`: the mismatch matrix of rollout engines × trainer engines over the same tokens."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..observatory.console import print_matrix
from ..observatory.engines import PRECISIONS
from .options import ModelDir

console = Console(stderr=True)


_DEFAULT_ROLLOUTS = "fp32,bf16,fp16,fp8"


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@click.command("observe")
@click.option("--model", required=True, type=ModelDir(),
              help="Model directory (e.g. models/tiny-moe, or any Hugging Face model on a GPU).")
@click.option("--suite", default="agent", show_default=True, help="Task suite the agent runs.")
@click.option("--split", default="heldout", show_default=True)
@click.option("--rollout-engines", default=_DEFAULT_ROLLOUTS, show_default=True,
              help="Precision profiles to sample at, comma-separated (left at the default with --from-*: "
                   "only the given sources).")
@click.option("--trainer-engines", default="fp32,bf16,fsdp-bf16", show_default=True,
              help="Engines that teacher-force: a precision, or fsdp-<precision> (FSDP2 over --fsdp-world-size ranks); "
                   "<engine>+replay replays the rollout's routed experts (router replay, R3).")
@click.option("--router-replay", is_flag=True,
              help="Put each trainer engine's +replay twin beside it: every cell with and without router replay.")
@click.option("--n", default=30, show_default=True, type=click.IntRange(1), help="Agent runs per rollout engine.")
@click.option("--lengths", default="128,512,2048", show_default=True,
              help="Length probes: responses sampled to exactly these lengths ('' for none).")
@click.option("--length-n", type=click.IntRange(1), default=None, help="Probes per length [default: --n].")
@click.option("--max-steps", default=6, show_default=True, help="Agent turns per run.")
@click.option("--max-tokens", default=128, show_default=True, help="Tokens per agent turn.")
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or auto.")
@click.option("--concurrency", default=16, show_default=True, help="Agent runs in flight.")
@click.option("--fsdp-world-size", default=2, show_default=True)
@click.option("--from-rollouts", "from_rollouts", multiple=True, metavar="ENGINE=FILE",
              help="Use these agent runs (AgentTrajectory JSONL: collect output, a worker's --rollouts) as "
                   "rollout engine ENGINE instead of sampling. Repeatable.")
@click.option("--from-captures", "from_captures", multiple=True, metavar="ENGINE=STORE",
              help="Use the conversations a capture proxy recorded (`rollmarket proxy --store STORE`, in front of "
                   "vLLM, SGLang or our server) as rollout engine ENGINE. Repeatable.")
@click.option("--rollout-url", "rollout_urls", multiple=True, metavar="ENGINE=URL",
              help="Sample rollout engine ENGINE from an OpenAI-compatible server serving --model (vLLM, SGLang, "
                   "rollmarket serve-model), as `rollmarket worker --model-url` does. Repeatable.")
@click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True)
def observe(model, suite, split, rollout_engines, trainer_engines, router_replay, n, lengths, length_n, max_steps,
            max_tokens, temperature, seed, device, concurrency, fsdp_world_size, from_rollouts, from_captures,
            rollout_urls, runs_dir) -> None:
    """Sample agent runs on each rollout engine, teacher-force the same token ids on each trainer
    engine, and write per-trajectory reports, the matrix with bootstrap intervals, length scaling
    and agent divergence to runs/<stamp>-<id>/. Then: rollmarket dashboard --runs RUNS_DIR."""
    from ..tasks.suites import check_suite

    check_suite(suite, split)
    from ..observatory.engines import parse_trainer
    from ..observatory.runner import ObserveSettings, check_replay, run_observatory
    from ..runs import new_run_dir

    def pairs(items, hint: str) -> dict[str, str]:
        found = {}
        for item in items:
            engine, _, path = item.partition("=")
            if not engine or not path or not Path(path).exists():
                raise click.BadParameter(f"{item!r}: expected ENGINE=PATH with an existing file", param_hint=hint)
            found[engine] = path
        return found

    sources = pairs(from_rollouts, "--from-rollouts")
    captured = pairs(from_captures, "--from-captures")
    urls = {}
    for item in rollout_urls:
        engine, _, url = item.partition("=")
        if not engine or not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{item!r}: expected ENGINE=http(s)://HOST:PORT/v1", param_hint="--rollout-url")
        urls[engine] = url
    elsewhere = [*sources, *captured, *urls]
    rollouts = _csv(rollout_engines) if not elsewhere or rollout_engines != _DEFAULT_ROLLOUTS else []
    for engine in elsewhere:
        if engine not in rollouts:
            rollouts.append(engine)
    for name in _csv(trainer_engines):
        parse_trainer(name)  # EngineNameError: one line naming the bad engine
    try:
        settings = ObserveSettings(
            model=model, suite=suite, split=split, rollout_engines=rollouts, trainer_engines=_csv(trainer_engines),
            router_replay=router_replay, n=n, lengths=[int(x) for x in _csv(lengths)], length_n=length_n,
            max_steps=max_steps, max_tokens=max_tokens, temperature=temperature, seed=seed, device=device,
            concurrency=concurrency, fsdp_world_size=fsdp_world_size, from_rollouts=sources, from_captures=captured,
            rollout_urls=urls)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    bad = [e for e in settings.rollout_engines if e not in PRECISIONS and e not in elsewhere]
    if bad:
        raise click.BadParameter(f"unknown rollout engine(s) {bad}: precisions are {list(PRECISIONS)}; name others "
                                 "with --from-rollouts, --from-captures or --rollout-url")
    check_replay(settings)  # before the run directory exists
    run_dir = new_run_dir(runs_dir)
    console.print(f"[bold]observe[/] {model}: rollout {settings.rollout_engines} × trainer "
                  f"{settings.trainer_engines}, n={n}, lengths {settings.lengths} → {run_dir}", highlight=False)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bars:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(stage, total=total)
            bars.update(tasks[stage], completed=done, total=total)

        matrix = run_observatory(settings, run_dir, progress)
    print_matrix(matrix, console)
    diverged = [d for d in matrix.divergence if d.first_divergent_step is not None]
    if matrix.divergence:
        console.print(f"agent divergence vs {settings.rollout_engines[0]}: {len(diverged)} of "
                      f"{len(matrix.divergence)} runs split", highlight=False)
    console.print(f"wrote {run_dir}/matrix.json and the reports. See it: rollmarket dashboard --runs {runs_dir}",
                  highlight=False)
