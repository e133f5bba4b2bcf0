"""Settings of `rollmarket serve-model`: data with a default and one line of help each."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServeSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str = Field(description="Hugging Face model directory to serve.")
    served_model_name: str | None = Field(
        None, description="Name clients pass as `model`; defaults to the directory name.")
    precision: str = Field("bf16", description="Precision profile: fp32, bf16, fp16 or fp8.")
    device: str = Field("auto", description="Torch device: cpu, cuda, cuda:1 or auto.")
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on.")
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads (default: torch's choice); 1 is best on busy shared CPUs.")
    kv_cache: Literal["auto", "slots", "padded"] = Field(
        "auto", description="The decode's KV cache: slots (fixed per-sequence slots, so decode steps have fixed "
                            "shapes that CUDA graphs replay), padded (transformers' DynamicCache, any model) or auto "
                            "(slots unless a layer has a sliding window).")
    decode_graphs: bool | None = Field(
        None, description="Replay decode steps as CUDA graphs (slots only; MoE router capture included). "
                          "Default: on CUDA.")
    step_buckets: bool | None = Field(
        None, description="Run eager slot decode steps (--no-decode-graphs, or where a capture fails) at batch and length "
                          "rounded up to powers of two, so their shapes repeat: on CUDA a shape the process has "
                          "not run yet costs several steps' time. Default: on CUDA.")
    max_batch_seqs: int = Field(32, ge=1, description="Most sequences decoded together in one batch.")
    engine_process: bool | None = Field(
        None, description="Run the model and its decode loop in a process of their own, beside the HTTP "
                          "process (which keeps the tokenizer): steps and requests stop taking turns on one "
                          "interpreter lock. Default: on CUDA (where a decode step is host-bound), off on the CPU.")
    batch_window_ms: float = Field(
        5.0, ge=0, description="How long an idle server waits after the latest request for more (at most 8 windows "
                               "in all) before the first prefill.")
    default_max_tokens: int = Field(
        512, ge=1, description="max_tokens when a request gives none (capped by the context).")
    max_body_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 beyond).")
    max_top_logprobs: int = Field(20, ge=0, description="Largest top_logprobs a request may ask for.")
    responses_kept: int = Field(
        1024, ge=0, description="Stored responses kept for previous_response_id (the oldest go first); 0 keeps none.")
    responses_db: Path | None = Field(
        None, description="SQLite file of the stored responses: previous_response_id then works across a restart "
                          "(kill -9 included); unset keeps them in memory.")
    profile_decode: str | None = Field(
        None, description="Write cProfile statistics of the decode thread to this file when the server stops "
                          "(where a decode step's CPU time goes; read them with python -m pstats).")
    profile_decode_after_steps: int = Field(
        0, ge=0, description="Start --profile-decode's profile at this decode step, past a warm-up's one-time "
                             "costs (graph captures, kernel compiles).")
    return_routed_experts: bool = Field(
        True, description="Return routed experts when a request asks (MoE models); off: the field is ignored.")


def wants_engine_process(settings: ServeSettings, device_type: str) -> bool:
    """Whether serve-model decodes in an engine process: as set, else on CUDA. There a decode step
    is bound by the host, and sharing one interpreter with the HTTP event loop slowed it: on an H200,
    under sustained load, HTTP kept 0.78/0.87/0.89 of the engine alone with the engine process and
    0.64/0.62/0.86 without (tiny-moe, tiny-dense, Qwen3-0.6B shape; docs/benchmarks.md, "Both
    servers"). On the CPU the step is bound by its arithmetic and a second process buys nothing."""
    return settings.engine_process if settings.engine_process is not None else device_type == "cuda"
