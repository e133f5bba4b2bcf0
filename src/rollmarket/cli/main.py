"""The `rollmarket` command. The library stays quiet; this is where output happens.

Subcommands load lazily: `rollmarket --help` imports click and this table only, and a command
imports its own module when it runs, so the services that need no model (exchange, proxy,
verifier, dashboard) never load torch. The boundary in `RollmarketGroup.main` turns expected
errors into one line (cli/errors.py).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

import click

from .. import __version__
from .errors import debug_requested, explain


class LazyCommand:
    """Where a subcommand lives, and the first sentence of its help for `rollmarket --help`
    (tests/test_cli.py checks it against the command's own help)."""

    def __init__(self, module: str, attribute: str, summary: str):
        self.module, self.attribute, self.summary = module, attribute, summary

    def load(self) -> click.Command:
        return getattr(importlib.import_module(self.module), self.attribute)

    def short_help(self, limit: int) -> str:
        """What click would list for the command, cut to `limit` the same way."""
        return click.Command(self.attribute, help=self.summary).get_short_help_str(limit)


COMMANDS: dict[str, LazyCommand] = {
    "agent": LazyCommand("rollmarket.cli.agent", "agent", "Serve the agent loop over HTTP."),
    "campaign": LazyCommand("rollmarket.cli.campaign", "campaign",
                            "Run conditions × seeds from one TOML file, each run a `rollmarket train --local` process."),
    "captures": LazyCommand("rollmarket.cli.proxy", "captures", "Read what a capture proxy recorded."),
    "collect": LazyCommand("rollmarket.cli.agents", "collect_command",
                           "Run every task K times against a model server and write one AgentTrajectory per line."),
    "compare": LazyCommand("rollmarket.cli.stats", "compare_command",
                           "Compare any training runs with others, paired by seed, and give verdicts."),
    "curriculum": LazyCommand("rollmarket.cli.evals", "curriculum_command",
                              "Pick training tasks from a reward profile: drop the solved and the hopeless, keep "
                              "the learnable."),
    "dashboard": LazyCommand("rollmarket.cli.dashboard", "dashboard",
                             "The dashboard: every run, training curves and rollouts, campaigns, the observatory, "
                             "the marketplace and the open questions."),
    "demo": LazyCommand("rollmarket.cli.demo", "demo",
                        "Run the main job: train the starting model through a real exchange with real worker "
                        "processes at several precisions, one of them a slow host whose rollouts drift (it lags "
                        "behind the policy), printing a line per step (ETA, reward, the gate's decisions and what "
                        "each did, each worker's mismatch) and held-out pass@1 before and after with 95% "
                        "intervals."),
    "diff": LazyCommand("rollmarket.cli.diff", "diff",
                        "Two training runs side by side: the settings that differ and their headline metrics."),
    "eval": LazyCommand("rollmarket.cli.evals", "eval_group",
                        "Score stored rollouts again and compare two models' evals by task and by seed."),
    "exchange": LazyCommand("rollmarket.cli.exchange", "exchange", "Run and inspect a rollout exchange."),
    "explain": LazyCommand("rollmarket.cli.explain", "explain",
                           "A dry run of a train config or campaign file: what would run, jobs, tokens, evaluation "
                           "cost and an estimate of time."),
    "keys": LazyCommand("rollmarket.cli.keys", "keys",
                        "Make and inspect the ed25519 keys workers sign submissions with."),
    "models": LazyCommand("rollmarket.cli.models", "models",
                          "Build and inspect the tiny shipped models (tiny-dense, tiny-moe, tiny-start)."),
    "observe": LazyCommand("rollmarket.cli.observe", "observe",
                           "Sample agent runs on each rollout engine, teacher-force the same token ids on each "
                           "trainer engine, and write per-trajectory reports, the matrix with bootstrap intervals, "
                           "length scaling and agent divergence to runs/<stamp>-<id>/."),
    "pool": LazyCommand("rollmarket.cli.pool", "pool",
                        "Run rollout workers as Ray actors on an existing Ray cluster, restart those that die, "
                        "and scale while they run."),
    "probe": LazyCommand("rollmarket.cli.probe", "probe",
                         "Ask an OpenAI-compatible endpoint what it gives an RL user: token ids, logprobs, "
                         "routed experts, seeds, tool calls, streaming."),
    "profile": LazyCommand("rollmarket.cli.profile", "profile",
                           "Profile ROLLOUTS (JSONL, one AgentTrajectory per line): per-task and global pass@k for "
                           "k in 1, 4, 16 (unbiased), majority@k, and the mean, median and std of the reward."),
    "proxy": LazyCommand("rollmarket.cli.proxy", "proxy",
                         "Forward OpenAI-compatible calls to an upstream server and record token ids, logprobs and "
                         "experts."),
    "schema": LazyCommand("rollmarket.cli.schema", "schema", "Write the JSON Schema of every contract."),
    "serve-model": LazyCommand("rollmarket.cli.serve", "serve_model",
                               "Serve MODEL_PATH (any Hugging Face causal LM directory) with the OpenAI API."),
    "squeeze": LazyCommand("rollmarket.cli.squeeze", "squeeze",
                           "Analyse the rank of RUN's LoRA adapter: the singular values of each module's update "
                           "scale·B·A, the energy (Σσ²) kept by rank 1…r, the smallest rank that keeps the "
                           "retention, and the rank to retrain with (the largest module rank); writes "
                           "RUN/squeeze.json."),
    "stats": LazyCommand("rollmarket.cli.stats", "stats_command",
                         "Compare every condition of a campaign with its baseline, seed by seed, and give verdicts."),
    "suites": LazyCommand("rollmarket.cli.suites", "suites",
                          "List, show, rebuild and export the shipped task suites (JSONL of TaskSpec lines)."),
    "train": LazyCommand("rollmarket.cli.train", "train_command",
                         "Train a policy through the exchange (GRPO family): CONFIG.toml plus KEY=VALUE overrides."),
    "verifier": LazyCommand("rollmarket.cli.verifier", "verifier", "Serve the verifiers and tools over HTTP."),
    "worker": LazyCommand("rollmarket.cli.agents", "worker_command",
                          "Run a rollout worker: lease jobs from an exchange, run the agent, verify, submit groups."),
}


class RollmarketGroup(click.Group):
    """A group whose subcommands load on use, with the CLI's one error boundary."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS:
            return COMMANDS[name].load()
        return super().get_command(ctx, name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in self.list_commands(ctx):
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            if close:
                ctx.fail(f"no such command {name!r}; did you mean {close[0]!r}?")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # click's own listing, from the table: listing loads no command module.
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [(name, COMMANDS[name].short_help(limit) if name in COMMANDS
                 else super().get_command(ctx, name).get_short_help_str(limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Run the command; an expected error prints one line and exits 2 (usage) or 1."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except BrokenPipeError:
            # `rollmarket ... | head`: stdout closed early; say nothing more on it.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except Exception as exc:  # the one boundary: an expected error becomes one line, a bug re-raises
            found = explain(exc)
            if found is None or debug_requested():
                raise
            line, code = found
            click.echo(line, err=True)
            sys.exit(code)
        sys.exit(rv if type(rv) is int else 0)


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        os.environ["ROLLMARKET_DEBUG"] = "1"  # processes this command starts inherit it
    return value


@click.group(cls=RollmarketGroup, context_settings={"help_option_names": ["-h", "--help"],
                                                    "max_content_width": 110})
@click.version_option(__version__, prog_name="rollmarket")
@click.option("--debug", is_flag=True, envvar="ROLLMARKET_DEBUG", expose_value=False, callback=_set_debug,
              is_eager=True, help="Show the full traceback of errors that are otherwise reported in one line "
                                  "[env var: ROLLMARKET_DEBUG=1].")
def main() -> None:
    """rollmarket: a rollout exchange, an off-policy gate and a mismatch observatory for RL of LLMs."""


if __name__ == "__main__":
    main()
