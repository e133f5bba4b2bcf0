"""The model a worker samples from: an embedded engine served on loopback, or a server elsewhere.

Either way the agent loop talks to it over the OpenAI API, so the worker runs the same code
against `rollmarket serve-model`, the capture proxy or vLLM. The host also answers what the
exchange needs to know: the engine's identity, numerics, fingerprint and loaded checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field, model_validator

from ..contracts import PolicyManifest
from .canary import DEFAULT_TOLERANCE, CanaryCheck, CanaryError, check_server


class HostError(RuntimeError):
    """The model could not be loaded, served or identified."""


class ReloadRefused(HostError):
    """The published checkpoint is not what the manifest says (digest) or cannot be reached."""


class ReloadUnverified(ReloadRefused):
    """The server was told to load the checkpoint, but its canary logprobs are not the checkpoint's:
    it did not really reload (or cannot be asked). The worker does not ack."""

    def __init__(self, message: str, check: "CanaryCheck | None" = None):
        super().__init__(message)
        self.check = check


ServerReload = Literal["none", "vllm-inplace", "restart"]
"""How a worker gets its server onto a new policy: `none` (it cannot: the operator restarts the
server), `vllm-inplace` (vLLM's in-place weight reload, VLLM_SERVER_DEV_MODE=1) or `restart` (the
worker runs the server itself, `--serve-cmd`, and restarts it: ManagedHost)."""


def local_checkpoint(policy: PolicyManifest) -> Path:
    """The policy's checkpoint directory, whose files' digest is the manifest's; ReloadRefused if not."""
    from ..engines.provenance import checkpoint_digest

    uri = policy.checkpoint_uri or ""
    path = Path(uri[len("file://"):] if uri.startswith("file://") else uri)
    if not uri or not path.is_dir():
        raise ReloadRefused(f"policy v{policy.policy_version}: checkpoint {uri!r} is not a local directory")
    try:
        on_disk = checkpoint_digest(path)
    except Exception as exc:  # unreadable weights are a refusal, not a crash
        raise ReloadRefused(f"policy v{policy.policy_version}: {exc}") from None
    if on_disk != policy.checkpoint_digest:
        raise ReloadRefused(f"policy v{policy.policy_version}: {path} has digest {on_disk[:12]}…, "
                            f"the manifest says {policy.checkpoint_digest[:12]}…")
    return path


@dataclass(frozen=True)
class EngineIdentity:
    """What the WorkerManifest and every SampleGroup say about the engine."""

    engine_name: str
    engine_version: str
    engine_fingerprint: str
    device_type: str
    precision: str
    quantization: str
    tokenizer_hash: str
    checkpoint_digest: str
    max_context_tokens: int
    returns_routed_experts: bool
    model_name: str


class EmbeddedHost:
    """Loads a model directory into a RolloutEngine and serves it on a loopback port.

    A reload loads the new checkpoint, checks its digest against the manifest, and restarts the
    loopback server on the new engine (the worker holds no lease while it reloads).
    """

    def __init__(self, model_path: str | Path, precision: str = "bf16", device: str = "cpu",
                 *, threads: int | None = None, max_batch_seqs: int = 32):
        self.precision = precision
        self.device = device
        self.max_batch_seqs = max_batch_seqs
        if threads:
            import torch

            torch.set_num_threads(threads)
        self._server = None
        self.url = ""
        self.engine = self._load(Path(model_path))
        self._serve()

    def _load(self, path: Path):
        from ..engines import ModelLoadError, RolloutEngine

        try:
            return RolloutEngine.from_path(path, self.precision, self.device)
        except (ModelLoadError, ValueError, OSError) as exc:
            raise HostError(f"could not load {path}: {exc}") from None

    def _serve(self) -> None:
        from ..localhost import ServerDidNotStart, ThreadedServer, free_port
        from ..serve import create_serve_app
        from ..serve.settings import ServeSettings

        port = free_port()
        settings = ServeSettings(model_path=self.engine.info.path, precision=self.precision, port=port,
                                 max_batch_seqs=self.max_batch_seqs)
        self._server = ThreadedServer(create_serve_app(self.engine, settings), port, name="embedded model server")
        try:
            self._server.start()
        except ServerDidNotStart as exc:
            raise HostError(str(exc)) from None
        self.url = f"http://127.0.0.1:{port}/v1"

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def identity(self) -> EngineIdentity:
        from .. import __version__

        engine = self.engine
        return EngineIdentity(
            engine_name=engine.name, engine_version=__version__, engine_fingerprint=engine.fingerprint(),
            device_type=engine.loaded.device.type, precision=engine.precision.value,
            quantization=engine.precision.quantization, tokenizer_hash=engine.info.tokenizer_hash,
            checkpoint_digest=engine.info.checkpoint_digest, max_context_tokens=engine.info.max_context_tokens,
            returns_routed_experts=engine.info.is_moe, model_name=engine.info.name,
        )

    def load(self, policy: PolicyManifest) -> EngineIdentity:
        """Make the engine run `policy`'s checkpoint; raises ReloadRefused when it cannot."""
        if self.engine.info.checkpoint_digest == policy.checkpoint_digest:
            return self.identity()
        path = local_checkpoint(policy)
        engine = self._load(path)
        if engine.info.checkpoint_digest != policy.checkpoint_digest:
            raise ReloadRefused("the checkpoint changed while it was loading")
        self._stop_server()
        self.engine = engine
        self._serve()
        return self.identity()

    def close(self) -> None:
        self._stop_server()


class RemoteHost:
    """A model served elsewhere (any OpenAI-compatible server).

    Its identity comes from `GET /v1/engine` when the server is `rollmarket serve-model` (or the
    capture proxy in front of one). Other servers (vLLM, SGLang) don't report their checkpoint,
    so pass `model_dir` (the same directory the server loaded) for the tokenizer hash and digest.

    With `server_reload="none"` the worker cannot load weights: it acks a policy only when the
    server already runs that checkpoint. With `"vllm-inplace"` it reloads vLLM in place (vLLM's
    dev-mode `POST /collective_rpc` → `reload_weights(weights_path=…)`, then
    `/reset_prefix_cache`), and acks only after two checks: the directory's digest is the
    manifest's, and the server's canary logprobs are that directory's (`canary.py`). On vLLM 0.32's
    CPU build the in-place reload answers 200 but leaves the model broken (docs/vllm.md): the
    canary refuses it, and `--serve-cmd` (a managed restart) is the way that works there.
    """

    def __init__(self, url: str, *, model_dir: str | Path | None = None, precision: str = "bf16",
                 api_key: str | None = None, server_reload: ServerReload = "none",
                 canary_tolerance: float = DEFAULT_TOLERANCE):
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.model_dir = Path(model_dir) if model_dir else None
        self.precision = precision
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.server_reload = server_reload
        self.canary_tolerance = canary_tolerance
        self.last_check: CanaryCheck | None = None
        """The canary check behind the last ack (any server_reload but "none")."""
        if server_reload != "none" and self.model_dir is None:
            raise HostError("a server reload needs --model-dir (the directory the server runs now)")

    def identity(self) -> EngineIdentity:
        base = self.url[: -len("/v1")]
        try:
            answer = httpx.get(base + "/v1/engine", headers=self.headers, timeout=30)
            info = answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        if info and "checkpoint_digest" in info:
            return EngineIdentity(
                engine_name=info["engine_name"], engine_version=str(info.get("engine_version", "remote")),
                engine_fingerprint=info["engine_fingerprint"], device_type=info.get("device", "remote"),
                precision=info["precision"], quantization=info.get("quantization", "none"),
                tokenizer_hash=info["tokenizer_hash"], checkpoint_digest=info["checkpoint_digest"],
                max_context_tokens=int(info.get("max_context_tokens", 4096)),
                returns_routed_experts=bool(info.get("moe_layers")), model_name=info.get("model", ""),
            )
        if self.model_dir is None:
            raise HostError(f"{base} does not report /v1/engine; pass --model-dir (the directory it serves)")
        from ..engines.provenance import checkpoint_digest, model_config, tokenizer_hash

        config = model_config(self.model_dir)
        digest = checkpoint_digest(self.model_dir)
        served = self._served_model()
        # vLLM's model cards say `owned_by: vllm` and its /version answers: the groups name the
        # engine that sampled them (other servers stay "openai-compatible").
        engine = "vllm" if served.get("owned_by") == "vllm" else "openai-compatible"
        return EngineIdentity(
            engine_name=engine, engine_version=self._server_version() if engine == "vllm" else "unknown",
            engine_fingerprint="remote:" + hashlib.sha256(f"{base}:{digest}".encode()).hexdigest()[:32],
            device_type="remote", precision=self.precision,
            quantization="fp8-e4m3-per-channel" if self.precision == "fp8" else "none",
            tokenizer_hash=tokenizer_hash(self.model_dir), checkpoint_digest=digest,
            max_context_tokens=int(served.get("max_model_len") or config.get("max_position_embeddings", 4096)),
            returns_routed_experts=False, model_name=served.get("id") or self.model_dir.name,
        )

    def _served_model(self) -> dict:
        """The server's one model card from `GET /v1/models` ({} when it does not answer): its `id`
        is the name requests must pass (vLLM's --served-model-name, not the directory's name) and
        vLLM's `max_model_len` is the context it accepts (its --max-model-len, often below the
        config's max_position_embeddings)."""
        try:
            answer = httpx.get(self.url + "/models", headers=self.headers, timeout=30)
            cards = answer.json().get("data") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return {}
        return cards[0] if isinstance(cards, list) and len(cards) == 1 and isinstance(cards[0], dict) else {}

    def _server_version(self) -> str:
        """vLLM's version from its `GET /version` ("unknown" when it does not answer)."""
        try:
            answer = httpx.get(self.url[: -len("/v1")] + "/version", headers=self.headers, timeout=30)
            version = answer.json().get("version") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return "unknown"
        return str(version) if version else "unknown"

    def load(self, policy: PolicyManifest) -> EngineIdentity:
        """Make the server run `policy`'s checkpoint; ReloadRefused (ReloadUnverified when the
        server's numbers are not the checkpoint's) when it cannot."""
        identity = self.identity()
        if self.server_reload == "none":
            if identity.checkpoint_digest != policy.checkpoint_digest:
                raise ReloadRefused(f"the server at {self.url} runs {identity.checkpoint_digest[:12]}…, policy "
                                    f"v{policy.policy_version} needs {policy.checkpoint_digest[:12]}…; reload the "
                                    "server with that checkpoint (or let the worker: --serve-cmd)")
            return identity
        path = self.model_dir
        if identity.checkpoint_digest != policy.checkpoint_digest:
            path = local_checkpoint(policy)
            self._switch(path, policy)
        self.last_check = self._verify(policy, path)
        self.model_dir = path  # only now: a server that failed the check is asked to reload again next time
        return self.identity()

    def _switch(self, path: Path, policy: PolicyManifest) -> None:
        """vLLM reloads `path`'s weights into its running model, then forgets KV blocks the old weights computed."""
        from ..engines.provenance import model_config_hash, tokenizer_hash

        # In place only the weights change: vLLM keeps the tokenizer and the architecture it started with.
        if tokenizer_hash(path) != tokenizer_hash(self.model_dir) or model_config_hash(path) != model_config_hash(
                self.model_dir):
            raise ReloadRefused(f"policy v{policy.policy_version}: {path} has another tokenizer or model "
                                "config; an in-place reload changes only weights (restart the server)")
        base = self.url[: -len("/v1")]
        calls = [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}),
                 ("/reset_prefix_cache", None)]
        for route, body in calls:
            try:
                answer = httpx.post(base + route, json=body, headers=self.headers, timeout=600)
            except httpx.HTTPError as exc:
                raise ReloadRefused(f"{base}{route}: {exc}") from None
            if answer.status_code == 404:
                raise ReloadRefused(f"{base}{route} is missing: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                                    "(its weight-reload endpoints)")
            if answer.status_code != 200:
                raise ReloadRefused(f"{base}{route} answered {answer.status_code}: {answer.text[:300]}")

    def _verify(self, policy: PolicyManifest, path: Path) -> CanaryCheck:
        """The server's canary logprobs are `path`'s, whose digest is the policy's; else ReloadUnverified."""
        from ..engines.provenance import checkpoint_digest

        if checkpoint_digest(path) != policy.checkpoint_digest:
            raise ReloadRefused(f"policy v{policy.policy_version}: {path} changed while loading")
        try:
            check = check_server(self.url, self._served_model().get("id") or path.name, path,
                                 tolerance=self.canary_tolerance, headers=self.headers)
        except CanaryError as exc:
            raise ReloadUnverified(f"policy v{policy.policy_version}: the canary could not be scored: {exc}") from None
        if not check.passed:
            raise ReloadUnverified(
                f"policy v{policy.policy_version}: the server's canary logprobs are not {path}'s "
                f"(mean |Δ| {check.mean_abs_delta:.3f} > {check.tolerance}); it did not load the checkpoint", check)
        return check

    def close(self) -> None:
        pass


class ManagedHost(RemoteHost):
    """An OpenAI-compatible server (vLLM) that the worker runs itself and restarts on each new policy.

    `serve_cmd` is the server's command line with `{model}` (the checkpoint directory) and `{port}`
    (a free loopback port the worker picks) in it. A reload stops the server (SIGTERM to its
    process group, SIGKILL after `stop_s`), starts it on the new directory, waits until
    `GET /v1/models` answers, and then checks it like any reload: the directory's digest and the
    canary (`canary.py`) before the ack. `close()` stops it; a worker killed with SIGKILL leaves it
    running (it has its own process group).
    """

    def __init__(self, serve_cmd: str, model_dir: str | Path, *, precision: str = "bf16",
                 canary_tolerance: float = DEFAULT_TOLERANCE, ready_s: float = 600.0, stop_s: float = 30.0,
                 log: Path | None = None):
        if "{model}" not in serve_cmd or "{port}" not in serve_cmd:
            raise HostError("--serve-cmd must contain {model} and {port}")
        super().__init__("http://127.0.0.1:1/v1", model_dir=model_dir, precision=precision,  # _start sets the url
                         server_reload="restart", canary_tolerance=canary_tolerance)
        self.serve_cmd, self.ready_s, self.stop_s = serve_cmd, ready_s, stop_s
        self.log = log or Path(tempfile.mkstemp(prefix="rollmarket-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0
        """Seconds the last start took until the server answered."""
        self._start(self.model_dir)

    def _start(self, path: Path) -> None:
        from ..localhost import die_with_parent, free_port

        port = free_port()
        argv = [part.format(model=path, port=port) for part in shlex.split(self.serve_cmd)]
        started = time.monotonic()
        with open(self.log, "ab") as log:
            # Its own process group: vLLM forks engine processes, and a stop must reach them all. A
            # worker killed with -9 cannot stop it: SIGTERM on the worker's death lets vLLM take its
            # engine processes down with it.
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent(signal.SIGTERM))
        self.url = f"http://127.0.0.1:{port}/v1"
        while time.monotonic() - started < self.ready_s:
            if self.proc.poll() is not None:
                raise HostError(f"the server exited with {self.proc.returncode}: {self._log_tail()}")
            try:
                if httpx.get(self.url + "/models", timeout=5).status_code == 200:
                    self.started_s = time.monotonic() - started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._stop()
        raise HostError(f"the server did not answer {self.url}/models in {self.ready_s:.0f}s: {self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:]

    def _stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(self.stop_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _switch(self, path: Path, policy: PolicyManifest) -> None:
        self._stop()
        try:
            self._start(path)
        except HostError as exc:
            raise ReloadRefused(f"policy v{policy.policy_version}: {exc}") from None

    def close(self) -> None:
        self._stop()


class HostSpec(BaseModel):
    """Which model a worker samples from: `--model PATH` (embedded), `--model-url URL` or `--serve-cmd
    CMD` (a server it runs itself), exactly one.

    A record rather than a host so that it can travel (to Ray actors) and be saved; `open()` loads."""

    model_path: str | None = Field(None, description="Model directory to load and serve on loopback.")
    model_url: str | None = Field(None, description="An OpenAI-compatible server to sample from.")
    model_dir: str | None = Field(None, description="With model_url to a server without /v1/engine: its directory.")
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "bf16"
    device: str = "cpu"
    threads: int | None = Field(None, ge=1, description="torch CPU threads of the embedded engine.")
    serve_cmd: str | None = Field(
        None, description="Or: run this server command ({model} and {port} filled in) on model_dir and "
                          "restart it on each new policy (a managed vLLM).")
    server_reload: Literal["none", "vllm-inplace"] = Field(
        "none", description="With model_url: how the server gets onto a new policy (`vllm-inplace`: vLLM's "
                            "in-place reload, checked by the canary before the ack; `none`: refuse until it runs it).")
    canary_tolerance: float = Field(
        DEFAULT_TOLERANCE, gt=0, description="Mean |Δlogp| between the server's canary logprobs and the "
                                             "checkpoint's under which a reload counts as done.")

    @model_validator(mode="after")
    def _one_model(self) -> "HostSpec":
        if sum(map(bool, (self.model_path, self.model_url, self.serve_cmd))) != 1:
            raise ValueError("give exactly one of --model PATH, --model-url URL or --serve-cmd CMD")
        if self.server_reload != "none" and not (self.model_url and self.model_dir):
            raise ValueError("--server-reload needs --model-url and --model-dir (the directory the server runs now)")
        if self.serve_cmd and not self.model_dir:
            raise ValueError("--serve-cmd needs --model-dir (the checkpoint to start the server on)")
        return self

    @property
    def label(self) -> str:
        return self.model_path or self.model_url or self.serve_cmd or ""

    def open(self) -> EmbeddedHost | RemoteHost:
        """Load (embedded), start (managed) or reach (remote) the model; HostError when it cannot."""
        if self.model_path:
            return EmbeddedHost(self.model_path, self.precision, self.device, threads=self.threads)
        if self.serve_cmd:
            return ManagedHost(self.serve_cmd, self.model_dir, precision=self.precision,
                               canary_tolerance=self.canary_tolerance)
        return RemoteHost(self.model_url, model_dir=self.model_dir, precision=self.precision,
                          server_reload=self.server_reload, canary_tolerance=self.canary_tolerance)
