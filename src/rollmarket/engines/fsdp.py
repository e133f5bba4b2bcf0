"""FSDP2 teacher forcing: the trainer engine with its weights sharded over a process group.

Each decoder layer is its own ``fully_shard`` unit and the root holds the rest (embeddings, the
final norm, the lm-head, tied or not), so a rank holds 1/world of the weights and all-gathers one
layer at a time during the forward pass. Teacher forcing is the single-process engine's code
(``TrainerEngine._forward``: right-padded batch, router capture, chunked lm-head) registered as a
forward method of the FSDP root, so the root's hooks gather its parameters around the whole call,
lm-head chunks included. Forward only, under ``no_grad``.

Two ways in:

* ``FSDPTrainerEngine`` inside a process group someone else started (the trainer);
* ``score_with_fsdp`` / ``fingerprint_with_fsdp``, which spawn ``world_size`` processes on this
  host (gloo on CPU, NCCL with one process per GPU) and return rank 0's answer.

Importing this module starts nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .fingerprint import canonical_pairs, fingerprint_from_logprobs
from .loading import LoadedModel, load_model
from .precision import Precision, parse_precision
from .provenance import ModelLoadError
from .routing import _decoder_layers
from .teacher import TeacherForced, TrainerEngine

_FORWARD_METHOD = "_rollmarket_teacher_force"


def shard_model(model: torch.nn.Module, mesh, *, layout: "ShardLayout | None" = None) -> torch.nn.Module:
    """Apply FSDP2 to every decoder layer, then to the root; returns the model (now sharded).

    Call it after ``apply_precision`` (``load_model`` does), with no ``MixedPrecisionPolicy``:
    FSDP then shards, stores and all-gathers exactly the tensors the single-process engine
    computes with, rounded (and for fp8 quantized) by the same function, so the two agree bit
    for bit at every profile. A policy with ``param_dtype`` over float32 shards gathers the same
    bf16 values today, but only because its cast happens to round like ``apply_precision``; it
    would also keep float32 shards and all-gather twice the bytes, which a forward-only engine
    has no use for. (A training engine keeps float32 master weights and needs the policy.)

    ``layout`` (default: ``ShardLayout()``, every unit freed after its forward) says which units
    keep their gathered weights from forward to backward and how far ahead gathers are issued.
    """
    from torch.distributed.fsdp import fully_shard

    layout = layout or ShardLayout()
    layers = _decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no model.layers to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=layout.reshard_layers)
    fully_shard(model, mesh=mesh, reshard_after_forward=layout.reshard_root)
    if layout.prefetch:
        # Explicit prefetch: layer i's pre-forward hook issues the all-gathers of the next
        # ``prefetch`` layers (and the backward's of the previous ones), so the copy engine runs
        # ahead of compute even when the CPU does not (activation checkpointing, small layers).
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(list(layers[i + 1:i + 1 + layout.prefetch]))
            layer.set_modules_to_backward_prefetch(list(layers[max(0, i - layout.prefetch):i][::-1]))
    return model


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How an FSDP2 model spends memory for overlap (``shard_model``).

    The defaults free every unit's gathered weights after its forward (least memory: what a
    forward-only engine wants). A training step gathers each unit again in the backward; keeping
    the root (embeddings and lm-head: the largest single unit of a small model with a 152k
    vocabulary) or every layer gathered from forward to backward trades that second all-gather for
    the unit's full weights in memory (ZeRO-2 style for the layers).
    """

    reshard_layers: bool = True
    """Free each decoder layer's gathered weights after its forward (gather again in backward)."""
    reshard_root: bool = True
    """Free the root's (embeddings, final norm, lm-head) gathered weights after its forward."""
    prefetch: int = 0
    """Decoder layers whose all-gathers a layer issues ahead of itself (0: FSDP2's implicit order)."""


KEPT_PREFETCH = ShardLayout(reshard_layers=False, reshard_root=False, prefetch=1)
"""The training layout (the learner's policy with ``trainer.fsdp_keep_gathered``): every unit kept
gathered from forward to backward, one layer prefetched (docs/benchmarks.md, "The learner step")."""


def _plan_batches(pairs: list[tuple[np.ndarray, np.ndarray]], max_batch_tokens: int) -> list[list[int]]:
    """The same packing as ``TrainerEngine.score_batch``: in order, padded size ≤ the budget (as
    indices into ``pairs``, so replayed experts travel with their pairs)."""
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i, (prompt_P, response_T) in enumerate(pairs):
        length = prompt_P.size + response_T.size
        if batch and max(longest, length) * (len(batch) + 1) > max_batch_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, length)
    if batch:
        batches.append(batch)
    return batches


def _as_arrays(pairs: list[tuple], max_context_tokens: int, replays: list | None = None
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """int64 arrays, with the single-process engine's checks (run before any collective)."""
    if replays is not None and len(replays) != len(pairs):
        raise ValueError(f"{len(replays)} replayed expert arrays for {len(pairs)} pairs")
    out = []
    for i, (prompt, response) in enumerate(pairs):
        prompt_P = np.asarray(prompt, dtype=np.int64).reshape(-1)
        response_T = np.asarray(response, dtype=np.int64).reshape(-1)
        if prompt_P.size == 0:
            raise ValueError("teacher forcing needs at least one prompt token")
        length = prompt_P.size + response_T.size
        if length > max_context_tokens:
            raise ValueError(f"prompt + response of {length} tokens exceeds the context of "
                             f"{max_context_tokens}")
        if replays is not None and replays[i] is not None and len(replays[i]) != response_T.size:
            raise ValueError(f"{len(replays[i])} rows of replayed experts for {response_T.size} response tokens")
        out.append((prompt_P, response_T))
    return out


def assign_to_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Indices of the pairs each rank scores: longest first onto the least-loaded rank.

    Every rank computes the same assignment from the same lengths; each rank's list is sorted
    so a rank scores its pairs in input order.
    """
    load = [0] * world_size
    owners: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[rank].append(i)
        load[rank] += lengths[i]
    return [sorted(ix) for ix in owners]


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("FSDPTrainerEngine needs an initialized torch.distributed process "
                           "group; use score_with_fsdp() to start one")


class FSDPTrainerEngine:
    """``TrainerEngine`` over an FSDP2-sharded model, inside an initialized process group.

    Every rank constructs it and makes the same calls in the same order (they are collective).
    ``score_batch`` takes the same pairs on every rank, splits them, and returns all results in
    input order on rank 0 (an empty list elsewhere). ``score_local`` scores each rank's own
    pairs and returns them on that rank, which is what a data-parallel trainer wants.
    """

    name = "rollmarket-teacher-fsdp"

    def __init__(self, loaded: LoadedModel, *, mesh=None, chunk: int = 1024,
                 max_batch_tokens: int = 16384, sharded: bool = False):
        """``sharded``: ``loaded.model`` already went through ``shard_model`` over ``mesh`` (the
        learner's policy, which scores π_old with the weights it trains)."""
        _require_process_group()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import register_fsdp_forward_method

        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if mesh is None:
            device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
            mesh = init_device_mesh(device_type, (self.world_size,))
        self.mesh = mesh
        device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
                  else torch.device(mesh.device_type))
        model = loaded.model if sharded else shard_model(loaded.model, mesh)
        self.loaded = dataclasses.replace(loaded, model=model, device=device)
        self.info = self.loaded.info
        self._local = TrainerEngine(self.loaded, chunk=chunk, max_batch_tokens=max_batch_tokens)
        setattr(model, _FORWARD_METHOD, self._local._forward)
        register_fsdp_forward_method(model, _FORWARD_METHOD)
        self._fingerprint: str | None = None

    @classmethod
    def from_path(cls, path, precision: str | Precision = "fp32", *, mesh=None, **kw
                  ) -> "FSDPTrainerEngine":
        """Load on the CPU at the profile, then shard: ``fully_shard`` moves each rank's shard to
        the mesh's device, so no rank ever holds the whole model on the GPU."""
        _require_process_group()
        return cls(load_model(path, precision, "cpu"), mesh=mesh, **kw)

    @property
    def precision(self) -> Precision:
        return self.loaded.precision

    @property
    def device(self) -> torch.device:
        return self.loaded.device

    def _all_max(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    @torch.no_grad()
    def score_local(self, pairs: list[tuple], *, temperature: float = 1.0,
                    replayed_experts: list[np.ndarray | None] | None = None) -> list[TeacherForced]:
        """Score this rank's pairs (each rank may pass different ones, or none).

        ``replayed_experts``: router replay (R3) per pair, as ``TrainerEngine.score_batch`` takes it.

        Ranks run the same number of forward passes (FSDP's all-gathers are collective): a rank
        with fewer micro-batches runs one-token passes until the others are done. Bad input on
        any rank makes every rank raise, so no rank is left waiting in a collective.
        """
        error = None
        try:
            arrays = _as_arrays(pairs, self.info.max_context_tokens, replayed_experts)
        except ValueError as exc:
            error, arrays = exc, []
        batches = _plan_batches(arrays, self._local.max_batch_tokens)
        rounds, failed = self._all_max([float(len(batches)), float(error is not None)])
        if failed:
            raise error or ValueError("another rank rejected its teacher-forcing input")
        forward = getattr(self.loaded.model, _FORWARD_METHOD)
        out: list[TeacherForced] = []
        for batch in batches:
            replays = None if replayed_experts is None else [replayed_experts[i] for i in batch]
            out.extend(forward([arrays[i] for i in batch], temperature, replays))
        idle = [(np.zeros(1, np.int64), np.zeros(1, np.int64))]
        for _ in range(int(rounds) - len(batches)):
            forward(idle, temperature)
        return out

    @torch.no_grad()
    def score_batch(self, pairs: list[tuple], *, temperature: float = 1.0,
                    replayed_experts: list[np.ndarray | None] | None = None) -> list[TeacherForced]:
        """Every rank passes the same pairs (and replayed experts, if any); rank 0 gets all results
        in input order."""
        error = None
        try:
            arrays = _as_arrays(pairs, self.info.max_context_tokens, replayed_experts)
        except ValueError as exc:
            error, arrays = exc, []
        lengths = [p.size + r.size for p, r in arrays]
        facts = [float(len(arrays)), float(sum(lengths)), float(temperature), float(replayed_experts is not None)]
        highs = self._all_max(facts + [-x for x in facts] + [float(error is not None)])
        if highs[-1]:
            raise error or ValueError("another rank rejected its teacher-forcing input")
        if highs[:4] != [-x for x in highs[4:8]]:
            raise ValueError("score_batch is collective: every rank must pass the same pairs and "
                             "temperature (use score_local for per-rank inputs)")
        mine = assign_to_ranks(lengths, self.world_size)[self.rank]
        results = self.score_local([arrays[i] for i in mine], temperature=temperature,
                                   replayed_experts=None if replayed_experts is None
                                   else [replayed_experts[i] for i in mine])
        gathered: list | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object((mine, results), gathered, dst=0)
        if self.rank != 0:
            return []
        ordered: list[TeacherForced | None] = [None] * len(arrays)
        for indices, scored in gathered:  # type: ignore[union-attr]
            for i, tf in zip(indices, scored):
                ordered[i] = tf
        return ordered  # type: ignore[return-value]

    @torch.no_grad()
    def score(self, prompt_ids_P, response_ids_T, *, temperature: float = 1.0) -> TeacherForced | None:
        out = self.score_batch([(prompt_ids_P, response_ids_T)], temperature=temperature)
        return out[0] if out else None

    def fingerprint(self) -> str:
        """The single-process engine's fingerprint recipe, on every rank.

        Every rank scores the whole canonical set as one batch, exactly as ``TrainerEngine``
        does; the gathered weights are the single-process engine's bit for bit, so when the
        kernels agree the fingerprint does too (it measures numerics, not how weights travel).
        """
        if self._fingerprint is None:
            scored = self.score_local(canonical_pairs(self.loaded.tokenizer))
            self._fingerprint = fingerprint_from_logprobs([tf.logprobs_T for tf in scored])
        return self._fingerprint


# ---------------------------------------------------------------- launcher (spawns processes)


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _worker(rank: int, world_size: int, backend: str, port: int, model_path: str, precision: str,
            job: str, payload: dict, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      NCCL_NVLS_ENABLE="0")  # NVLink multicast stays off on the lent GPUs
    init: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        init["device_id"] = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=payload.get("timeout_s", 600)), **init)
    try:
        engine = FSDPTrainerEngine.from_path(model_path, precision, chunk=payload["chunk"],
                                             max_batch_tokens=payload["max_batch_tokens"])
        result: object
        if job == "score":
            result = engine.score_batch(payload["pairs"], temperature=payload["temperature"],
                                        replayed_experts=payload.get("replayed_experts"))
        else:
            result = engine.fingerprint()
        if rank == 0:
            Path(result_path).write_bytes(pickle.dumps(result))
        # A rank that leaves while a peer still reads its last message makes gloo abort the peer.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # gloo's threads can call std::terminate from C++ destructors at interpreter exit ("terminate
    # called without an active exception", seen under load); the result is on disk, so leave
    # without running them.
    os._exit(0)


def _checked_root(model_path) -> Path:
    root = Path(model_path)
    if not (root / "config.json").exists():
        raise ModelLoadError(f"{root} has no config.json; expected a Hugging Face model directory")
    return root


def _launch(model_path, precision, job: str, payload: dict, world_size: int, backend: str | None):
    root = _checked_root(model_path)
    profile = parse_precision(precision)
    backend = backend or _default_backend()
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"nccl with world_size={world_size} needs that many GPUs; "
                         f"{torch.cuda.device_count()} visible")
    from torch import multiprocessing as tmp

    from ..localhost import free_port

    with tempfile.TemporaryDirectory(prefix="rollmarket-fsdp-") as scratch:
        result_path = Path(scratch) / "rank0.pkl"
        tmp.spawn(_worker, nprocs=world_size, join=True,
                  args=(world_size, backend, free_port(), str(root.resolve()), profile.value, job,
                        payload, str(result_path)))
        return pickle.loads(result_path.read_bytes())


def score_with_fsdp(model_path, precision: str | Precision, pairs: list[tuple], *,
                    world_size: int = 2, backend: str | None = None, temperature: float = 1.0,
                    chunk: int = 1024, max_batch_tokens: int = 16384,
                    replayed_experts: list[np.ndarray | None] | None = None) -> list[TeacherForced]:
    """Teacher-force ``pairs`` on ``world_size`` spawned FSDP ranks; results in input order.

    ``replayed_experts``: router replay (R3) per pair, as ``TrainerEngine.score_batch`` takes it.
    ``backend`` defaults to NCCL (one process per GPU) when CUDA is available, else gloo on the
    CPU. Input is checked here, before any process starts.
    """
    config = json.loads((_checked_root(model_path) / "config.json").read_text())
    # The same default as ``loading.describe``, so the check here is the engine's own.
    arrays = _as_arrays(pairs, int(config.get("max_position_embeddings", 4096)), replayed_experts)
    payload = dict(pairs=arrays, temperature=float(temperature), chunk=chunk,
                   max_batch_tokens=max_batch_tokens, replayed_experts=replayed_experts)
    return _launch(model_path, precision, "score", payload, world_size, backend)


def fingerprint_with_fsdp(model_path, precision: str | Precision, *, world_size: int = 2,
                          backend: str | None = None) -> str:
    """The numerical fingerprint of the FSDP engine (see ``FSDPTrainerEngine.fingerprint``)."""
    payload = dict(chunk=1024, max_batch_tokens=16384)
    return _launch(model_path, precision, "fingerprint", payload, world_size, backend)
