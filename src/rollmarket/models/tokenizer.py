"""Train the byte-level BPE tokenizer of the tiny models (the Qwen2/Qwen3 recipe, small vocab).

Byte-level BPE with Qwen's pre-tokenizer split (digits one at a time, punctuation runs kept
together), no normalizer, so `decode(encode(text)) == text` for any string. The special tokens
come first, at fixed ids, and are never split.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .template import CHAT_TEMPLATE

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# (content, special): Qwen3 marks the tool/think tags non-special, so decoding with
# skip_special_tokens=True keeps them and a tool call survives; all are single ids either way.
ADDED_TOKENS: list[tuple[str, bool]] = [
    (PAD, True), (IM_START, True), (IM_END, True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
# Qwen2's split pattern (one digit per pre-token).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
MODEL_MAX_LENGTH = 4096


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1536) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it with the chat template and special tokens."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Re-add with the right `special` flags (the trainer registers all as special).
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a trained `tokenizers.Tokenizer`."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        extra_special_tokens=[t for t, s in ADDED_TOKENS if s and t not in (PAD, IM_END)],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        padding_side="left",
    )


def special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """The id of every added token, by its text."""
    return {t: tokenizer.convert_tokens_to_ids(t) for t, _ in ADDED_TOKENS}


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir) -> None:
    """Write tokenizer.json + tokenizer_config.json, the chat template inside the latter.

    `tokenizer_class` is written as `PreTrainedTokenizerFast` so transformers 4.x loads it too.
    """
    import json
    from pathlib import Path

    out = Path(out_dir)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
