"""Mixed-quality demonstrations: the data that gives `tiny-start` room for reinforcement learning.

tiny-moe is fine-tuned on gold trajectories only, so it is peaked: its groups tie and RL has
little to turn into accuracy. tiny-start is tiny-moe fine-tuned further on demonstrations from a
mix of demonstrators, like a base model that has seen careful and careless solvers:

    tool user   (share `tool_share`)  the gold trajectory: call the tools, answer with their result.
    guesser     (the rest)            answers at once, without a tool, with a plausible wrong value
                                      (a number near the right one, or another name of the same kind).

Which demonstrator wrote an example is drawn independently for every copy of every task, so it
carries no information about the task: the model learns to call a tool with probability about
`tool_share` on any prompt, train or held out. Sampled pass@1 is then about `tool_share` times the
tool path's accuracy while pass@k climbs towards 1 — the headroom RL can turn into pass@1 by
making the tool call the habit. Guesses are never right by construction (they differ from the
expected answer under the task's verifier), so the only way to a reward is the tool path.
`plain` tasks need no tool and keep their gold answers.
"""

from __future__ import annotations

import random

from ..tasks import Task, World, check_answer

TOOL_FAMILIES = ("calculator", "lookup", "chain")


def _wrong_number(expected: str, rng: random.Random) -> str:
    """A number of the same size as `expected` that is not it: off by 2-25%, or a near integer."""
    value = float(expected.replace(",", ""))
    for _ in range(20):
        if abs(value) >= 20:
            guess = round(value * (1 + rng.choice([-1, 1]) * rng.uniform(0.02, 0.25)))
        else:
            guess = round(value) + rng.choice([-3, -2, -1, 1, 2, 3])
        if guess != value:
            return str(guess)
    return str(round(value) + 1)


def _wrong_name(expected: str, world: World, rng: random.Random) -> str:
    """Another name of the same kind as `expected` (a person, town, company or region)."""
    pools = [[p.name for p in world.people], [t.name for t in world.towns], [c.name for c in world.companies],
             [r for r in {t.region for t in world.towns}]]
    pool = next((p for p in pools if expected in p), [p.name for p in world.people])
    choices = [x for x in pool if x.lower() != expected.lower()]
    return rng.choice(choices)


def guess_answer(task: Task, world: World, rng: random.Random) -> str:
    """The guesser's wrong answer to `task` (checked wrong under the task's verifier)."""
    guess = (_wrong_number(task.expected, rng) if task.verifier == "numeric"
             else _wrong_name(task.expected, world, rng))
    if check_answer(task.verifier, guess, task.expected):  # cannot happen by construction; never ship it
        raise AssertionError(f"guess {guess!r} passes task {task.id}")
    return guess


def mixed_demonstrations(tasks: list[Task], world: World, *, tool_share: float, copies: int,
                         seed: int) -> list[Task]:
    """`copies` demonstrations of every task, each by the tool user with probability `tool_share`
    and by the guesser otherwise (an independent draw per copy); `plain` tasks keep their gold."""
    rng = random.Random(seed)
    out: list[Task] = []
    for task in tasks:
        for _ in range(copies):
            if task.family not in TOOL_FAMILIES or rng.random() < tool_share:
                out.append(task)
            else:
                out.append(task.model_copy(update={
                    "gold": [{"role": "assistant", "content": guess_answer(task, world, rng)}]}))
    return out
