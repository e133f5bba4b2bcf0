"""Held-out accuracy per task family: the model runs greedily turn by turn, the reference tools
answer its parsed tool calls, and the task's verifier scores the final reply.

A reply with no parseable tool call is the final answer; running out of turns scores wrong.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from ..tasks import Task, World, check_answer, load_world, run_tool
from .template import parse_tool_calls
from .tokenizer import IM_END

MAX_TURNS = 4
MAX_NEW_TOKENS = 64


@dataclass
class Episode:
    task_id: str
    family: str
    correct: bool
    answer: str | None  # final reply (None: ran out of turns)
    tool_calls: list[dict]  # every parsed call, in order


@torch.no_grad()
def run_episodes(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, tasks: list[Task], world: World,
                 max_turns: int = MAX_TURNS, batch_size: int = 32, temperature: float = 0.0) -> list[Episode]:
    """Multi-turn rollouts of `tasks` with the reference tools, `batch_size` at a time per turn
    (left-padded; an unfinished episode gets its next turn in the next round). Greedy at temperature
    0, else sampled (seed torch's generator first for a repeatable draw)."""
    messages = [[dict(m) for m in task.messages] for task in tasks]
    calls_made: list[list[dict]] = [[] for _ in tasks]
    episodes: list[Episode | None] = [None] * len(tasks)
    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.pad_token_id]
    tokenizer.padding_side = "left"
    for _ in range(max_turns):
        active = [i for i, e in enumerate(episodes) if e is None]
        for start in range(0, len(active), batch_size):
            chunk = active[start:start + batch_size]
            prompts = [tokenizer.apply_chat_template(messages[i], tools=tasks[i].tools, add_generation_prompt=True,
                                                     tokenize=False) for i in chunk]
            enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
                else {"do_sample": False}
            out_BT = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos,
                                    pad_token_id=tokenizer.pad_token_id, **sampling)
            for row, i in enumerate(chunk):
                reply = tokenizer.decode(out_BT[row, enc["input_ids"].shape[1]:], skip_special_tokens=False)
                content, calls = parse_tool_calls(reply.split(IM_END)[0].replace(tokenizer.pad_token, ""))
                task = tasks[i]
                if not calls:
                    episodes[i] = Episode(task.id, task.family, check_answer(task.verifier, content, task.expected),
                                          content, calls_made[i])
                    continue
                tool_calls = [{"id": f"call_{len(calls_made[i]) + k}", "type": "function",
                               "function": {"name": c["name"], "arguments": c["arguments"]}}
                              for k, c in enumerate(calls)]
                messages[i].append({"role": "assistant", "content": content, "tool_calls": tool_calls})
                for call, tc in zip(calls, tool_calls):
                    result = run_tool(call["name"], call["arguments"], world=world, files=task.files)
                    messages[i].append({"role": "tool", "tool_call_id": tc["id"], "name": call["name"],
                                        "content": result})
                calls_made[i] += calls
    return [e or Episode(t.id, t.family, False, None, calls_made[i]) for i, (t, e) in enumerate(zip(tasks, episodes))]


def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, tasks: list[Task],
             world: World | None = None, on_task: Callable[[Episode], None] | None = None) -> dict:
    """Per-family accuracy (with n) and the episodes, as a JSON-able dict."""
    world = world or load_world()
    model.eval()
    episodes = run_episodes(model, tokenizer, tasks, world)
    if on_task is not None:
        for episode in episodes:
            on_task(episode)
    by_family: dict[str, list[Episode]] = defaultdict(list)
    for e in episodes:
        by_family[e.family].append(e)
    families = {f: {"accuracy": round(sum(e.correct for e in es) / len(es), 4), "n": len(es),
                    "correct": sum(e.correct for e in es),
                    "mean_tool_calls": round(sum(len(e.tool_calls) for e in es) / len(es), 3)}
                for f, es in sorted(by_family.items())}
    overall = sum(e.correct for e in episodes) / max(len(episodes), 1)
    return {"families": families, "overall": round(overall, 4), "n": len(episodes),
            "episodes": [{"task_id": e.task_id, "correct": e.correct, "answer": e.answer,
                          "tool_calls": json.loads(json.dumps(e.tool_calls))} for e in episodes]}


def sampled_pass_at_k(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, tasks: list[Task], world: World,
                      *, samples: int = 8, temperature: float = 1.0, seed: int = 0) -> dict:
    """Sampled pass@k (k = 1, 2, 4 … ≤ samples; unbiased, Chen et al. 2021) of `tasks`, with the share
    of runs that called a tool and the accuracy of those that did: the headroom RL has to work with."""
    from ..verifiers.profile import pass_at_k

    model.eval()
    torch.manual_seed(seed)
    episodes = run_episodes(model, tokenizer, [t for t in tasks for _ in range(samples)], world,
                            temperature=temperature, batch_size=64)
    correct = [[e.correct for e in episodes[i * samples:(i + 1) * samples]] for i in range(len(tasks))]
    out: dict = {"tasks": len(tasks), "samples": samples, "temperature": temperature, "seed": seed}
    k = 1
    while k <= samples:
        out[f"pass@{k}"] = round(sum(pass_at_k(samples, sum(c), k) for c in correct) / len(tasks), 4)
        k *= 2
    with_tool = [e for e in episodes if e.tool_calls]
    out["tool_rate"] = round(len(with_tool) / len(episodes), 4)
    out["accuracy_given_tool"] = round(sum(e.correct for e in with_tool) / len(with_tool), 4) if with_tool else None
    return out
