"""The real model a simulated worker pretends to sample: `rollmarket train`'s policy, as the worker loaded it.

The fault-path demo's trainer is the real one: it teacher-forces every group it fetches with its own
weights and its gate compares those logprobs with the group's. So a simulated worker's groups carry
what a real engine's would: the task's prompt in the model's tokenizer, and the logprobs the
checkpoint the worker acked gives its tokens (teacher-forced at fp32, as the trainer scores); each
profile then spoils them its own way. The tokens themselves are drawn, not generated (synthetic.py):
the gate judges logprobs, not text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..contracts import TaskSpec
from ..engines.provenance import model_config, tokenizer_hash


class ModelPolicy:
    """The policy's tokenizer and, for a profile that `scores`, the weights of the checkpoint it runs.

    A scoring worker loads the base model when it starts and each checkpoint when it reloads, before
    it acks, as a real worker does, so that no lease waits on torch or weights; the others (one that
    crashes, drops logprobs or sends ids outside the vocabulary) never load torch.
    """

    def __init__(self, model: Path, *, scores: bool):
        from tokenizers import Tokenizer

        self.model = Path(model)
        self.scores = scores
        self.tokenizer_hash = tokenizer_hash(self.model)
        config = model_config(self.model)
        self.vocab_size = int(config["vocab_size"])
        self.max_context_tokens = int(config.get("max_position_embeddings", 4096))
        self._tokenizer = Tokenizer.from_file(str(self.model / "tokenizer.json"))
        self._engine = None
        self._uri: str | None = None
        self.load(str(self.model))
        if scores:  # torch's first forward pass is its slowest: taken now, not under a lease
            self.logprobs(np.ones(1, np.int32), np.ones(1, np.int32))

    def load(self, uri: str) -> None:
        """Run the checkpoint at `uri` from now on."""
        if not self.scores or uri == self._uri:
            return
        from ..engines import TrainerEngine

        try:
            self._engine = TrainerEngine.from_path(uri, "fp32")
            self._uri = uri
        except (OSError, ValueError):
            # The trainer prunes old checkpoints: a worker that falls far enough behind keeps the
            # weights it has, as a lagging host would.
            if self._engine is None:
                raise

    def encode(self, task: TaskSpec) -> np.ndarray:
        """int32 [P]: the task's prompt (or its messages' text) in the policy's tokenizer."""
        text = task.prompt or " ".join(str(m.get("content", "")) for m in task.messages or [])
        ids = self._tokenizer.encode(text or "?").ids[:256]
        return np.asarray(ids or [1], dtype=np.int32)

    def logprobs(self, prompt_P: np.ndarray, response_T: np.ndarray) -> np.ndarray:
        """float32 [T]: the loaded checkpoint's logprob of each response token (temperature 1)."""
        if self._engine is None:
            raise RuntimeError("this worker's profile does not score: it loaded no weights")
        return np.asarray(self._engine.score(prompt_P, response_T).logprobs_T, dtype=np.float32)
