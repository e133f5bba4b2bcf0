"""The learner: the trainable policy, its teacher forcing, one optimizer step, its checkpoints.

The trainer engine that scores fetched groups (`score`) is the same nn.Module the optimizer
updates, wrapped by `TrainerEngine` (chunked log-softmax, routed-expert capture): the logprobs the
gate sees are exactly π_old, the policy the step starts from, at the trainer's numerics.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..engines import TrainerEngine
from ..engines.fsdp import FSDPTrainerEngine
from ..engines.loading import LoadedModel, load_model
from ..engines.provenance import checkpoint_digest
from ..engines.routing import RouterReplay, moe_routers, replay_problem, replayable
from ..engines.teacher import TeacherForced
from ..observatory.dense import dense_summary
from ..observatory.offpolicy import FIGURE_NAMES, flatten_padded, offpolicy_figures
from .batch import Batch, Datum, collate
from .config import TrainConfig, TrainConfigError
from . import failpoints
from .corrections import masked_is, sequence_tis, token_tis
from .failpoints import Failpoint
from .head import CHUNK, policy_token_stats
from .losses import LossConfig, policy_loss
from .sharded import TOKEN_STATS_METHOD, full_value, global_loss_scale, is_sharded, shard_policy
from .planning import decode_fn, make_detector
from .transforms import SepaSchedule, TransformConfig, entropy_metrics, token_advantages

TRAINER_STATE = "trainer"
"""Sub-directory of a checkpoint with what only the trainer needs (optimizer, counters, adapters).
Workers read only the top level (`*.safetensors`, config, tokenizer), so it stays out of the digest."""


class Learner:
    """The policy being trained, on one device or sharded by FSDP2 over ``mesh`` (train/sharded.py).

    With a mesh every rank constructs it, passes its own rows to ``step`` (with the same mini-batch
    layout on every rank: train/ranks.py deals them) and makes the same calls in the same order; the
    update is the one a single process would take on all the rows, ``weights()`` gathers the whole
    tensors on every rank, ``score`` is collective (every rank passes the same pairs; rank 0 gets the
    results) and ``save`` gathers the weights and the optimizer state to rank 0, which alone writes
    the checkpoint, in the single-process layout. ``step``'s metrics are the whole batch's on every
    rank (each rank's rows and figures gathered: ``_pooled``)."""

    def __init__(self, config: TrainConfig, *, resume_from: Path | None = None, mesh=None):
        self.config = config
        self.mesh = mesh
        torch.manual_seed(config.seed)
        torch.set_num_threads(config.model.threads)
        self.base_path = Path(config.model.path)
        # Full fine-tuning resumes from the checkpoint's weights; LoRA from the base plus its adapters.
        start = resume_from if resume_from is not None and not config.lora.enabled else self.base_path
        # Sharded, each rank loads on the CPU and ``fully_shard`` moves its shard to the mesh's device.
        self.loaded: LoadedModel = load_model(start, "fp32", "cpu" if mesh is not None else config.model.device)
        if config.trainer.router_replay and not self.loaded.info.is_moe:
            raise TrainConfigError(f"trainer.router_replay needs an MoE model; {config.model.path} is dense",
                                   fix="set trainer.router_replay = false")
        self.reference = None
        if config.algorithm.kl_coef > 0:  # the starting policy, frozen
            base = self.loaded.model if start == self.base_path else load_model(
                self.base_path, "fp32", self.loaded.device).model
            self.reference = copy.deepcopy(base).eval().requires_grad_(False)
        model = self.loaded.model
        if config.trainer.activation_checkpointing:  # active in train() mode only: the update, not π_old
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.lora.enabled:
            from .lora import apply_lora

            model = apply_lora(model, config.lora)
        self.model = model.eval()
        if mesh is None:
            self.engine: TrainerEngine | FSDPTrainerEngine = TrainerEngine(replace(self.loaded, model=self.model))
        else:
            device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
                      else torch.device(mesh.device_type))
            from ..engines.fsdp import KEPT_PREFETCH

            # The policy trains (forward, then backward): keeping its gathered weights saves the
            # backward's all-gathers. The frozen reference only runs forwards, so it frees them.
            shard_policy(self.model, mesh, policy_token_stats,
                         layout=KEPT_PREFETCH if config.trainer.fsdp_keep_gathered else None)
            if self.reference is not None:
                shard_policy(self.reference, mesh, policy_token_stats)
            self.loaded = replace(self.loaded, device=device)
            self.engine = FSDPTrainerEngine(replace(self.loaded, model=self.model), mesh=mesh, sharded=True)
        self.chunk = CHUNK
        params = [p for p in self.model.parameters() if p.requires_grad]
        o = config.optim
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas)
        a = config.algorithm
        self.sepa = SepaSchedule(steps=a.sepa_steps, delay_steps=a.sepa_delay_steps,
                                 correct_rate_gate=a.sepa_correct_rate_gate)
        self.planner = make_detector(a.planning_detector, a.planning_grams)
        self.steps_done = 0
        if resume_from is not None:
            self._restore(resume_from)

    @property
    def pad_id(self) -> int:
        tok = self.loaded.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else self.loaded.info.eos_token_ids[0])

    # -- teacher forcing ----------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, pairs: list[tuple[np.ndarray, np.ndarray]], temperature: float,
              replayed_experts: list[np.ndarray | None] | None = None) -> list[TeacherForced]:
        """π_old's logprobs, entropies and routed experts of each (prompt, response) pair, routed
        through ``replayed_experts`` where given (router replay). Sharded: collective, every rank
        passes the same pairs and rank 0 gets the results (the others an empty list)."""
        self.model.eval()
        return self.engine.score_batch(pairs, temperature=temperature, replayed_experts=replayed_experts)

    def replay_input(self, experts_TLK: np.ndarray | None, produced_T: np.ndarray) -> np.ndarray | None:
        """A trajectory's routed experts as router replay uses them (``OWN_ROUTING`` on tokens the
        policy did not produce); None, so the trainer routes it itself, when there are none or they
        do not fit this model (a worker's bad array must not stop the step)."""
        experts_TLK = replayable(experts_TLK, produced_T)
        if experts_TLK is None or replay_problem(experts_TLK, moe_routers(self.model)) is not None:
            return None
        return experts_TLK

    # -- one optimizer step ---------------------------------------------------------------------------

    def _correction(self, log_ratio_BT, mask_BT):
        c = self.config.correction
        if c.kind == "token_tis":
            return token_tis(log_ratio_BT, mask_BT, cap=c.cap)
        if c.kind == "sequence_tis":
            return sequence_tis(log_ratio_BT, mask_BT, cap=c.cap)
        return masked_is(log_ratio_BT, mask_BT, token_bounds=c.token_bounds, sequence_bounds=c.sequence_bounds,
                         geo_mean_bounds=c.geo_mean_bounds)

    @staticmethod
    def _replay(model: torch.nn.Module, batch: Batch):
        """Router replay of the batch's routed experts on `model` (the policy or the reference, so
        both score the tokens through the same experts); nothing without them."""
        if batch.replay_BSLK is None:
            return contextlib.nullcontext()
        return RouterReplay(model, batch.replay_BSLK.flatten(0, 1))

    def _token_stats(self, model: torch.nn.Module, batch: Batch, temperature: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] logprobs (differentiable where `model`'s weights are) and detached entropies of
        `batch`'s tokens under `model` at ``temperature``, the distribution the engine sampled from;
        through the sharded model's registered method under FSDP.

        Only the slots of ``mask_BT`` are scored, so the other slots hold 0, which every use masks out."""
        device = self.loaded.device
        B, T = batch.mask_BT.shape
        at_N = batch.mask_BT.flatten().nonzero().squeeze(-1)
        stats = getattr(model, TOKEN_STATS_METHOD) if is_sharded(model) else partial(policy_token_stats, model)
        with self._replay(model, batch):
            logprobs_N, entropies_N = stats(batch.ids_BS.to(device), batch.attention_BS.to(device),
                                            at_N.to(device), temperature, self.chunk)
        zeros_BT = torch.zeros(B * T)
        return (zeros_BT.index_put((at_N,), logprobs_N.float().cpu()).view(B, T),
                zeros_BT.index_put((at_N,), entropies_N.detach().float().cpu()).view(B, T))

    def _planning_mask(self, data: list[Datum], shape: torch.Size) -> torch.Tensor | None:
        """[B, T] 1 on response tokens the planning detector marks, in the batch's slot layout; None
        without a detector."""
        if self.planner is None:
            return None
        decode = decode_fn(self.loaded.tokenizer)
        plan_BT = torch.zeros(shape)
        for b, d in enumerate(data):
            P, R = len(d.prompt_token_ids_P), len(d.response_token_ids_T)
            plan_T = self.planner.mask(np.asarray(d.response_token_ids_T).tolist(), decode)
            plan_BT[b, P - 1:P - 1 + R] = torch.from_numpy(plan_T.astype(np.float32))
        return plan_BT

    def sepa_metrics(self) -> dict[str, float | None]:
        """``sepa_lambda`` (the λ this step's update uses) and ``sepa_gate_open``; None unless the
        transform is gtpo_sepa, where they mean something."""
        if self.config.algorithm.transform != "gtpo_sepa":
            return {"sepa_lambda": None, "sepa_gate_open": None}
        return self.sepa.metrics(self.steps_done)

    def step(self, data: list[Datum], temperature: float, *,
             minibatches: list[int] | None = None) -> dict[str, float | None]:
        """Optimizer step(s) on `data`, one per mini-batch (``algorithm.updates_per_batch``); the
        metrics describe the whole step (verl names).

        ``minibatches`` (sharded: this rank's share, train/ranks.py ``deal``): the sizes of the
        consecutive mini-batches `data` holds, instead of splitting it here; a 0 is one padding row
        (no loss tokens) that only keeps this rank in step with the others' collectives.

        IS correction (config.correction) applies to sequences with `corrected` set: weights from
        Δ = logπ_old − logπ_behaviour, the trainer's own logprobs against what the rollout engine
        reported, which covers both engine numerics and policy lag. π_old is the policy before the
        first mini-batch's update, for every mini-batch.

        With several mini-batches, each metric is the whole step's figure (docs/metrics.md):
        per-token means (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/kl_ref``) are token-weighted
        over mini-batches; ``actor/pg_loss`` and ``loss`` weight each mini-batch by what its
        aggregation divides by (tokens for token-mean, sequences with a token for the seq-mean modes,
        rows for seq-mean-token-sum-norm), which is the aggregation over the whole batch of each
        token's loss at its own update; ``actor/entropy`` and the entropy metrics come from every
        token's entropy at its own update, over the whole batch; ``actor/grad_norm`` is the mean over
        mini-batches of the pre-clip norm (verl's reduction); the correction is computed once, on the
        whole batch, before any update.
        """
        cfg = self.config
        a = cfg.algorithm
        loss_config = LossConfig(kind=a.loss, clip_low=a.clip_low, clip_high=a.clip_high,
                                 cispo_cap=1 + a.clip_high, aggregation=a.aggregation,
                                 norm_len=a.norm_length(cfg.rollout, cfg.agent), kl_coef=a.kl_coef,
                                 kl_kind=a.kl_kind)
        transform = TransformConfig(mode=a.transform)
        if transform.needs_planning and self.planner is None:  # AlgorithmSection refuses this too
            raise TrainConfigError(f"algorithm.transform {a.transform!r} needs planning tokens",
                                   fix='set algorithm.planning_detector = "strategic_grams"')
        batch = collate(data, self.pad_id)
        mask_BT = batch.mask_BT
        planning_BT = self._planning_mask(data, mask_BT.shape)
        sizes = minibatches or [len(rows) for rows in np.array_split(np.arange(len(data)),
                                                                      min(a.updates_per_batch, len(data)))]
        ends = np.cumsum([max(1, size) for size in sizes])
        minibatches = [np.arange(end - max(1, size), end) for size, end in zip(sizes, ends)]
        old_BT = batch.old_BT
        if old_BT is None:  # π_old before any update: every mini-batch's ratio is against the same policy
            with torch.no_grad():
                old_BT = self._token_stats(self.model, batch, temperature)[0]
        ref_BT = None
        if self.reference is not None:
            with torch.no_grad():
                ref_BT = self._token_stats(self.reference, batch, temperature)[0]
        delta_BT = (old_BT - batch.behaviour_BT) * mask_BT
        corr = self._correction(delta_BT, mask_BT)
        corrected_BT = batch.corrected_B[:, None].expand_as(mask_BT)
        weights_BT = torch.where(corrected_BT, corr.weights_BT, torch.ones_like(corr.weights_BT))
        loss_mask_BT = torch.where(corrected_BT, corr.mask_BT.float(), mask_BT)
        lam = self.sepa.lambda_at(self.steps_done)
        sepa = self.sepa_metrics()

        entropies_BT = torch.zeros_like(mask_BT)
        per_token, per_agg, grad_norms = _WeightedMeans(), _WeightedMeans(), []
        self.model.train()
        for rows, size in zip(minibatches, sizes):
            rows_t = torch.from_numpy(rows)
            sub = _rows(batch, rows_t)
            logprobs_BT, entropies_BT[rows_t] = self._token_stats(self.model, sub, temperature)
            adv_BT, _ = token_advantages(
                sub.advantages_B, entropies_BT[rows_t], sub.mask_BT, transform,
                planning_mask_BT=None if planning_BT is None else planning_BT[rows_t], sepa_lambda=lam)
            sub_loss_mask_BT = loss_mask_BT[rows_t]
            loss, loss_metrics = policy_loss(
                logprobs_BT, old_BT[rows_t], adv_BT, sub_loss_mask_BT, loss_config,
                is_weights_BT=weights_BT[rows_t] if bool(sub.corrected_B.any()) else None,
                ref_logprobs_BT=None if ref_BT is None else ref_BT[rows_t])
            tokens_B = sub_loss_mask_BT.sum(dim=1)
            divides_by = 0.0 if size == 0 else {  # a padding row weighs nothing
                "token-mean": float(tokens_B.sum()), "seq-mean-token-sum-norm": float(len(rows))}.get(
                a.aggregation, float((tokens_B > 0).sum()))
            self.optimizer.zero_grad(set_to_none=True)
            (loss * global_loss_scale(divides_by, self.loaded.device)).backward()
            failpoints.reach(Failpoint.in_optimizer_step)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], cfg.optim.grad_clip)
            self.optimizer.step()
            grad_norms.append(float(full_value(grad_norm)))
            per_token.add(float(tokens_B.sum()), {k: loss_metrics[k] for k in
                                                  ("actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_ref")})
            per_agg.add(divides_by, {"actor/pg_loss": loss_metrics["actor/pg_loss"], "loss": float(loss.detach())})
        self.model.eval()
        self.steps_done += 1
        figures_old_BT = batch.old_BT if batch.old_BT is not None else batch.behaviour_BT
        behaviour_BT, corrected_B = batch.behaviour_BT, batch.corrected_B
        if self.mesh is not None:  # the figures over every rank's rows, as one process takes them
            keep_B = torch.ones(len(data), dtype=torch.bool)
            for rows, size in zip(minibatches, sizes):
                keep_B[rows] = size > 0  # a padding row is no row of the batch
            (entropies_BT, mask_BT, planning_BT, delta_BT, figures_old_BT, behaviour_BT, corrected_B) = _pooled(
                [entropies_BT, mask_BT, planning_BT, delta_BT, figures_old_BT, behaviour_BT, corrected_B], keep_B)
            per_token, per_agg = _pooled_means(per_token), _pooled_means(per_agg)
            corr = self._correction(delta_BT, mask_BT)
        n_valid = mask_BT.sum()
        metrics: dict[str, float | None] = {
            **corr.metrics, **per_token.means(), **per_agg.means(),
            **entropy_metrics(entropies_BT, mask_BT, planning_BT),
            "actor/entropy": float((entropies_BT * mask_BT).sum() / n_valid) if n_valid else None,
            "actor/grad_norm": float(np.mean(grad_norms)),
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "actor/num_minibatches": len(minibatches),
        }
        metrics.update({
            "rollout_corr/mean_abs_delta": float(delta_BT.abs().sum() / n_valid.clamp(min=1)),
            "rollout_corr/max_abs_delta": float(delta_BT.abs().max()) if delta_BT.numel() else None,
            "rollout_corr/corrected_fraction": float(corrected_B.float().mean()),
            **self._mismatch_figures(figures_old_BT, behaviour_BT, mask_BT),
            **sepa,
        })
        return metrics

    def _mismatch_figures(self, old_BT: torch.Tensor, behaviour_BT: torch.Tensor,
                          mask_BT: torch.Tensor) -> dict[str, float | None]:
        """verl's `rollout_corr/*` figures over every datum of the step (logπ_old, the datums' own
        or else the behaviour's, vs logπ_behaviour), and our token ESS beside them
        (`rollout_corr/token_ess`). The `rollout_is_*` ones use the correction's C and level, and are
        None where no IS correction can apply (masked_is, never)."""
        c = self.config.correction
        mask_BT = mask_BT.bool().numpy()
        trainer_N, lengths_B = flatten_padded(old_BT.double().numpy(), mask_BT)
        rollout_N, _ = flatten_padded(behaviour_BT.double().numpy(), mask_BT)
        figures = offpolicy_figures(rollout_N, trainer_N, lengths_B, is_threshold=c.cap,
                                    is_level="sequence" if c.kind == "sequence_tis" else "token").metrics()
        if c.kind == "masked_is" or c.when == "never":
            figures.update({f"rollout_corr/{k}": None for k in FIGURE_NAMES if k.startswith("rollout_is_")})
        return {**figures, "rollout_corr/token_ess": dense_summary(rollout_N, trainer_N).token_ess}

    # -- checkpoints --------------------------------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """Full-model weights under the base model's names (LoRA adapters merged in); with a mesh,
        gathered on every rank (all ranks call it)."""
        from .lora import merged_state_dict

        # Also without adapters: it writes the checkpoint's own key layout (transformers 5 keeps MoE
        # experts fused in memory and splits them on save), tied weights once, as save_pretrained does.
        return merged_state_dict(self.model)

    @property
    def rank(self) -> int:
        """This process's rank in the mesh (0 in one process)."""
        return torch.distributed.get_rank() if self.mesh is not None else 0

    def _trainable_names(self) -> list[str]:
        """The optimizer's parameters by name, in its order (the indices of its state dict)."""
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def optimizer_state(self) -> dict:
        """The optimizer's state dict as one process has it (parameters by index); sharded, gathered
        whole to rank 0 (collective; the other ranks get {}), so a checkpoint's optimizer.pt is the
        same file whatever the number of ranks that wrote or read it."""
        if self.mesh is None:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        index = {name: i for i, name in enumerate(self._trainable_names())}
        return {"state": {index[name]: value for name, value in full["state"].items()},
                "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in full["param_groups"]]}

    def evaluation_policy(self, weights: Path) -> "Learner":
        """What held-out evaluation serves (``.loaded``, ``.model``) for the checkpoint at `weights`,
        which holds this learner's current weights: the learner itself (train/ranks.py loads a copy)."""
        return self

    def save(self, target: Path, *, version: int, extra_state: dict, save_optimizer: bool = True,
             extra_files: dict[str, str] | None = None) -> str:
        """Write a checkpoint directory workers can load, atomically: a partial directory, every file
        fsynced, then one rename. A crash leaves either the whole checkpoint or a `.vNNNN.partial`
        directory that `latest_checkpoint` never picks (and resume removes).

        `extra_files` (name → text) go into the checkpoint's `trainer/` directory beside state.json.
        Returns the digest (sha256 over the *.safetensors files, what workers check).
        """
        from safetensors.torch import save_file

        from ..runs import fsync_dir

        # Sharded, every rank gathers (collective) and rank 0 alone writes.
        weights = self.weights()
        optimizer = self.optimizer_state() if save_optimizer else None
        adapters = ({k: full_value(v.detach()).cpu().contiguous() for k, v in self.model.named_parameters()
                     if v.requires_grad} if self.config.lora.enabled else None)
        if self.rank != 0:
            return ""
        partial = target.with_name(f".{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for item in self.base_path.iterdir():  # config, tokenizer, chat template, generation config
            if item.is_file() and item.suffix not in (".safetensors", ".bin") and item.name != "README.md":
                shutil.copy2(item, partial / item.name)
        save_file(weights, str(partial / "model.safetensors"),
                  metadata={"format": "pt", "policy_version": str(version)})
        failpoints.reach(Failpoint.in_checkpoint_write)
        state_dir = partial / TRAINER_STATE
        state_dir.mkdir()
        if optimizer is not None:
            torch.save(optimizer, state_dir / "optimizer.pt")
        if adapters is not None:
            save_file(adapters, str(state_dir / "adapters.safetensors"))
        for name, text in (extra_files or {}).items():
            (state_dir / name).write_text(text)
        state = {**extra_state, "version": version, "steps_done": self.steps_done,
                 "sepa_gate_open": self.sepa.gate_open, "torch_rng": torch.get_rng_state().tolist()}
        (state_dir / "state.json").write_text(json.dumps(state))
        for directory in (state_dir, partial):  # durable before the rename makes them the checkpoint
            for item in directory.iterdir():
                if item.is_file():
                    fd = os.open(item, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            fsync_dir(directory)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        fsync_dir(target.parent)
        return checkpoint_digest(target)

    def _restore(self, checkpoint: Path) -> None:
        from safetensors.torch import load_file

        state_dir = checkpoint / TRAINER_STATE
        if self.config.lora.enabled:
            adapters = load_file(str(state_dir / "adapters.safetensors"))
            missing = set(adapters) - {k for k, _ in self.model.named_parameters()}
            if missing:
                raise ValueError(f"{checkpoint}: adapter weights {sorted(missing)[:3]} do not fit this model")
            self.model.load_state_dict(adapters, strict=False)
        if (state_dir / "optimizer.pt").exists():
            saved = torch.load(state_dir / "optimizer.pt", weights_only=True)
            if self.mesh is None:
                self.optimizer.load_state_dict(saved)
            else:  # every rank reads the whole state and keeps its shard of it
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                set_optimizer_state_dict(self.model, self.optimizer, _by_name(saved, self._trainable_names()),
                                         options=StateDictOptions(full_state_dict=True))
        state = json.loads((state_dir / "state.json").read_text())
        self.steps_done = int(state["steps_done"])
        self.sepa.gate_open = bool(state.get("sepa_gate_open", self.sepa.gate_open))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))


def _by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state dict by parameter index (``optimizer.pt``) keyed by parameter name, as
    torch.distributed.checkpoint's full state dicts are."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def read_state(checkpoint: Path) -> dict:
    """The counters a checkpoint was saved with (its trainer/state.json)."""
    return json.loads((checkpoint / TRAINER_STATE / "state.json").read_text())


class _WeightedMeans:
    """Weighted means of per-mini-batch figures: Σ_k w_k·x_k / Σ_k w_k; None where any x_k is None
    (the figure does not apply) or the weights sum to 0."""

    def __init__(self) -> None:
        self.weights: list[float] = []
        self.values: dict[str, list[float | None]] = {}

    def add(self, weight: float, values: dict[str, float | None]) -> None:
        self.weights.append(weight)
        for key, value in values.items():
            self.values.setdefault(key, []).append(value)

    def means(self) -> dict[str, float | None]:
        total = sum(self.weights)
        return {key: None if total <= 0 or any(v is None for v in vs)
                else sum(w * v for w, v in zip(self.weights, vs)) / total
                for key, vs in self.values.items()}


def _pooled(tensors: list[torch.Tensor | None], keep_B: torch.Tensor) -> list[torch.Tensor | None]:
    """Every rank's kept rows of each [B] or [B, T] tensor, rank by rank, the token axis padded with 0
    to the longest rank's (what every use masks out). Collective; the figures that come from them
    do not depend on the rows' order."""
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, [None if t is None else t[keep_B] for t in tensors])
    out: list[torch.Tensor | None] = []
    for parts in zip(*everyone):
        if parts[0] is None:
            out.append(None)
            continue
        if parts[0].dim() == 2:
            T = max(p.shape[1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts]
        out.append(torch.cat(parts))
    return out


def _pooled_means(means: "_WeightedMeans") -> "_WeightedMeans":
    """Every rank's weighted figures as one: a mini-batch's figure is the weighted mean of its ranks',
    so pooling every (weight, figure) pair gives the single process's means. Collective."""
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (means.weights, means.values))
    pooled = _WeightedMeans()
    for weights, values in everyone:
        for i, weight in enumerate(weights):
            pooled.add(weight, {key: figures[i] for key, figures in values.items()})
    return pooled


def _rows(batch: Batch, rows_t) -> Batch:
    return Batch(batch.ids_BS[rows_t], batch.attention_BS[rows_t], batch.mask_BT[rows_t], batch.behaviour_BT[rows_t],
                 None if batch.old_BT is None else batch.old_BT[rows_t], batch.advantages_B[rows_t],
                 batch.corrected_B[rows_t], None if batch.replay_BSLK is None else batch.replay_BSLK[rows_t])
