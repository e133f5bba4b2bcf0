"""Engines: rollout (sampling) and trainer (teacher forcing) over any Hugging Face model path.

The exchange never imports this package; workers, the server and the observatory do. Names are
imported lazily so that ``engines.provenance`` (hashing a model directory) does not pull in torch.
"""

from importlib import import_module

_EXPORTS = {
    "engine_fingerprint": "fingerprint",
    "LoadedModel": "loading", "ModelInfo": "loading", "load_model": "loading",
    "ModelLoadError": "provenance", "checkpoint_digest": "provenance",
    "model_config_hash": "provenance", "tokenizer_hash": "provenance",
    "Precision": "precision", "parse_precision": "precision",
    "Generation": "rollout", "RolloutEngine": "rollout", "StepEvent": "rollout",
    "SamplingParams": "sampling",
    "FSDPTrainerEngine": "fsdp", "score_with_fsdp": "fsdp", "fingerprint_with_fsdp": "fsdp",
    "TeacherForced": "teacher", "TrainerEngine": "teacher", "chunked_token_stats": "teacher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
