"""The architectures of the two shipped models, as Hugging Face configs.

Both are real Qwen3 / Qwen3-MoE architectures shrunk to a few MB so that a 2-core CPU trains
each in minutes and every engine in the project can run them in tests.
"""

from __future__ import annotations

from transformers import GenerationConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

MODEL_NAMES = ("tiny-dense", "tiny-moe", "tiny-start")
"""tiny-start is tiny-moe fine-tuned on mixed-quality demonstrations (headroom.py): the RL starting point."""

# Shared by both: the attention stack.
HIDDEN = 128
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 4096
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Dense MLP width; MoE experts and routing.
INTERMEDIATE = 512
EXPERTS = 8
TOP_K = 2
MOE_INTERMEDIATE = 128
ROUTER_AUX_LOSS_COEF = 0.01


def _common(vocab_size: int, pad_id: int, eos_id: int) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS,
        rope_parameters=dict(ROPE), rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        pad_token_id=pad_id, bos_token_id=None, eos_token_id=eos_id, dtype="float32",
    )


def dense_config(vocab_size: int, pad_id: int, eos_id: int) -> Qwen3Config:
    """tiny-dense: Qwen3ForCausalLM, 4 layers, GQA 4/2 heads, SwiGLU 512, tied embeddings."""
    return Qwen3Config(**_common(vocab_size, pad_id, eos_id), intermediate_size=INTERMEDIATE,
                       architectures=["Qwen3ForCausalLM"])


def moe_config(vocab_size: int, pad_id: int, eos_id: int) -> Qwen3MoeConfig:
    """tiny-moe: Qwen3MoeForCausalLM, 4 sparse layers of 8 experts, top-2, normalised top-k weights."""
    return Qwen3MoeConfig(
        **_common(vocab_size, pad_id, eos_id), intermediate_size=INTERMEDIATE,
        moe_intermediate_size=MOE_INTERMEDIATE, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=ROUTER_AUX_LOSS_COEF, output_router_logits=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def make_config(name: str, vocab_size: int, pad_id: int, eos_id: int) -> PretrainedConfig:
    """The config of model `name` (one of MODEL_NAMES)."""
    if name == "tiny-dense":
        return dense_config(vocab_size, pad_id, eos_id)
    if name in ("tiny-moe", "tiny-start"):
        return moe_config(vocab_size, pad_id, eos_id)
    raise ValueError(f"unknown model {name!r}; expected one of {MODEL_NAMES}")


def generation_config(pad_id: int, eos_ids: list[int]) -> GenerationConfig:
    """Greedy by default; stops at `<|im_end|>` or `<|endoftext|>`."""
    return GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None,
                            do_sample=False, max_new_tokens=256)
