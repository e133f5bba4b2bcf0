"""Training text: gold trajectories rendered through the chat template, loss on assistant tokens only.

An assistant span runs from just after `<|im_start|>assistant\\n` through its `<|im_end|>`, so
the model learns to start tool calls and answers there and to stop; system, user and tool
tokens are context only.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from ..tasks import Task, World
from .template import render_chat
from .tokenizer import IM_END

ASSISTANT_OPEN = "<|im_start|>assistant\n"


@dataclass(frozen=True)
class Example:
    """One training sequence."""

    task_id: str
    family: str
    input_ids_T: list[int]
    loss_mask_T: list[int]  # 1 where the token is produced by the assistant (trained on)


def render(task: Task) -> str:
    """The whole gold conversation of `task` as chat-template text."""
    return render_chat(task.messages + task.gold, task.tools)


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of every assistant turn's content and closing `<|im_end|>`."""
    spans = []
    start = text.find(ASSISTANT_OPEN)
    while start != -1:
        begin = start + len(ASSISTANT_OPEN)
        end = text.find(IM_END, begin)
        end = len(text) if end == -1 else end + len(IM_END)
        spans.append((begin, end))
        start = text.find(ASSISTANT_OPEN, end)
    return spans


def encode(task: Task, tokenizer: PreTrainedTokenizerFast, max_len: int = 1024) -> Example:
    """Tokenize the rendered gold conversation and mark its assistant tokens."""
    text = render(task)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    spans = assistant_spans(text)
    mask = [int(any(b <= s and e <= end for b, end in spans)) for s, e in enc["offset_mapping"]]
    return Example(task.id, task.family, enc["input_ids"][:max_len], mask[:max_len])


def tokenizer_texts(tasks: list[Task], world: World) -> list[str]:
    """What the BPE is trained on: rendered trajectories, the search corpus and the files."""
    texts = [render(t) for t in tasks]
    texts += [f"{d.title}: {d.text}" for d in world.docs]
    texts += list(world.files.values())
    return texts
