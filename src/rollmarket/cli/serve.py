"""`rollmarket serve-model`: an OpenAI-compatible server over a model directory."""

from __future__ import annotations

import click
from rich.console import Console

from ..serve.settings import ServeSettings
from .options import ModelDir, Refused, precision_list, settings_options

console = Console(stderr=True)
GRAPHS_FIX = ("leave --kv-cache and --decode-graphs at their defaults (auto), or serve on --device cuda for "
              "graphs")


@click.command("serve-model")
@click.argument("model_path", type=ModelDir())
@settings_options(ServeSettings, skip=("model_path",))
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def serve_model(model_path: str, log_level: str, **values) -> None:
    """Serve MODEL_PATH (any Hugging Face causal LM directory) with the OpenAI API.

    /v1/models, /v1/chat/completions and /v1/completions, streaming or not, with logprobs,
    token ids (return_token_ids) and routed experts (return_routed_experts) as vLLM returns them.
    """
    from ..localhost import claim_port

    settings = ServeSettings(model_path=model_path, **{k: v for k, v in values.items() if v is not None})
    precision_list(settings.precision, "--precision")
    sock = claim_port(settings.host, settings.port)  # a taken port fails now, not after loading the model
    import uvicorn

    from ..engines import RolloutEngine
    from ..engines.loading import load_model, resolve_device
    from ..serve import create_serve_app
    from ..serve.engine_process import EngineFace, EngineProcessError, RemoteBatcher, start_engine_process
    from ..serve.settings import wants_engine_process

    engine: RolloutEngine | EngineFace
    batcher: RemoteBatcher | None = None
    if wants_engine_process(settings, resolve_device(settings.device).type):
        try:
            with console.status(f"loading {model_path} at {settings.precision} in the engine process"):
                engine, batcher = start_engine_process(settings)
        except EngineProcessError as exc:
            if exc.settings:
                raise Refused(str(exc), GRAPHS_FIX, param_hint="--kv-cache/--decode-graphs") from None
            raise Refused(str(exc), "check the model directory, --precision and --device", param_hint="MODEL_PATH"
                          ) from None
    else:
        if settings.threads:
            import torch

            torch.set_num_threads(settings.threads)
        with console.status(f"loading {model_path} at {settings.precision}"):
            loaded = load_model(model_path, settings.precision, settings.device)
        try:
            engine = RolloutEngine(loaded, kv=settings.kv_cache, graphs=settings.decode_graphs,
                               step_buckets=settings.step_buckets)
        except ValueError as exc:  # slots for a sliding-window model, graphs without CUDA
            raise Refused(str(exc), GRAPHS_FIX, param_hint="--kv-cache/--decode-graphs") from None
    info = engine.info
    name = settings.served_model_name or info.name
    kind = f"MoE {info.num_moe_layers} layers x {info.num_experts} experts, top-{info.top_k}" if info.is_moe else "dense"
    where = f" in process {batcher.pid}" if batcher is not None else ""
    console.print(f"[bold]rollmarket serve-model[/] {name} ({info.architecture}, {kind}) at "
                  f"{engine.precision.value} on {engine.device}{where}, KV {engine.kv}"
                  f"{' with CUDA graphs' if engine.graphs else ''}")
    console.print(f"OpenAI API on http://{settings.host}:{settings.port}/v1  (model={name!r})")
    app = create_serve_app(engine, settings, batcher)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, access_log=False)
    # torch, transformers and the app leave ~0.5M long-lived objects that every full garbage
    # collection would walk (~0.1-0.2 s, stalling the decode thread and the event loop at random,
    # since requests' short-lived objects trigger them); frozen, they are skipped.
    import gc

    gc.collect()
    gc.freeze()
    uvicorn.Server(config).run(sockets=[sock])
