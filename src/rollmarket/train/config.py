"""Settings of `rollmarket train`: one TOML file, every key overridable from the command line.

    rollmarket train configs/train-lookup.toml loop.steps=40 optim.lr=5e-5 local.workers='["bf16"]'
    rollmarket train --list-keys        # every key with its type, default and help

The resolved settings (file + overrides + defaults) are saved as `config.json` in the run
directory; a resumed run reads them back from there, so a resume cannot silently change them.
`validate` checks what the settings name (model directory, suite, precisions) before a run
directory is made.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..gate import GateConfig
from ..research.squeeze import SqueezeSettings
from .lora import LoraSettings
from .losses import RENAMED_AGGREGATIONS
from .planning import PlanningConfigError, check_grams


LIST_KEYS_HINT = "`rollmarket train --list-keys` lists every key with its type and default"


class TrainConfigError(ValueError):
    """The config file or an override is malformed, names an unknown key or has a bad value, or
    the settings name something that does not exist. `fix` says how to fix it, when known."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSection(_Section):
    path: str = Field("models/tiny-moe", description="Hugging Face model directory the policy starts from.")
    device: str = Field("cpu", description="Trainer device: cpu, cuda, cuda:1 …")
    threads: int = Field(1, ge=1, description="torch CPU threads of the trainer (1 is fastest on a busy 2-core box).")


class RolloutSection(_Section):
    suite: str = Field("lookup", description="Shipped task suite (train split feeds jobs, heldout split evaluation).")
    groups_per_step: int = Field(8, ge=1, description="Groups (tasks) the trainer uses per optimizer step.")
    group_size: int = Field(4, ge=2, description="Agent runs per task (G); advantages are taken within a group.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the trainer scores logits / temperature.")
    max_tokens: int = Field(96, ge=1, description="Tokens per model turn.")
    precisions: list[str] = Field(
        default_factory=lambda: ["bf16", "fp8"],
        description="Rollout precisions the jobs ask for, round robin over a step's jobs "
                    "(each needs a worker that offers it).")
    seed: int = Field(0, description="Task-order seed: which training tasks each step's jobs carry, in which order.")
    sampling_seed: int | None = Field(
        None, description="Sampling seed of the rollout jobs and of the held-out pass@k samples; None: the same "
                          "as rollout.seed. Vary it alone for \"same tasks, new samples\" replicates.")
    curriculum: str | None = Field(
        None, description="A curriculum file (`rollmarket curriculum`): sample only its kept training tasks, "
                          "uniformly (keep) or by its weights (weight); None: every training task in turn.")
    curriculum_digest: str | None = Field(
        None, description="The digest of the curriculum's content, recorded when a run begins (its copy is "
                          "curriculum.json in the run directory, which a resumed run uses); set, a curriculum file "
                          "with other content is refused.")

    @property
    def sampling(self) -> int:
        """The sampling seed in effect (rollout.sampling_seed, else rollout.seed)."""
        return self.seed if self.sampling_seed is None else self.sampling_seed


class AlgorithmSection(_Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "maxrl"] = Field("grpo", description="Group advantage mode.")
    transform: Literal["none", "gtpo", "gtpo_hicra", "gtpo_sepa"] = Field(
        "none", description="Token transform on the trainer's own entropies. gtpo_hicra and gtpo_sepa need "
                            "planning tokens: set planning_detector.")
    planning_detector: Literal["none", "strategic_grams"] = Field(
        "none", description="How planning tokens are found (gtpo_hicra, gtpo_sepa, plan_entropy_*): "
                            "strategic_grams marks the response tokens that span a planning_grams phrase.")
    planning_grams: list[str] | None = Field(
        None, description="strategic_grams: the phrases (case-insensitive, whole words); unset: the shipped "
                          "list (retrain's 18 strategic grams, docs/training.md).")
    sepa_steps: int = Field(0, ge=0, description="gtpo_sepa: length of λ's linear ramp (0 keeps λ = 0).")
    sepa_delay_steps: int = Field(0, ge=0, description="gtpo_sepa: steps before the ramp starts.")
    sepa_correct_rate_gate: float = Field(0.0, ge=0, le=1, description="gtpo_sepa: correct rate that opens λ's gate.")
    loss: Literal["ppo_clip", "cispo", "reinforce"] = Field("ppo_clip", description="Policy-gradient estimator.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO clip ε_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO clip ε_high (DAPO clip-higher).")
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How token losses reduce to the batch loss (verl's loss_agg_mode names).")
    norm_len: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm's constant length; unset: the generation budget "
                                "rollout.max_tokens × agent.max_turns.")
    kl_coef: float = Field(0.0, ge=0, description="KL to the starting policy; 0 keeps no reference model.")
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3", description="KL estimator (k1 gives no gradient in expectation; docs/training.md).")
    updates_per_batch: int = Field(
        1, ge=1, description="Optimizer steps per fetched batch (mini-batches); above 1 the PPO ratio moves "
                             "away from 1 and clipping matters.")

    @field_validator("aggregation", mode="before")
    @classmethod
    def _renamed_aggregation(cls, value: Any) -> Any:
        if isinstance(value, str) and value in RENAMED_AGGREGATIONS:
            new = RENAMED_AGGREGATIONS[value]
            raise TrainConfigError(f"algorithm.aggregation {value!r} was renamed {new!r} (verl's loss_agg_mode "
                                   f"names)", fix=f"write algorithm.aggregation = \"{new}\"")
        return value

    @field_validator("planning_grams")
    @classmethod
    def _grams(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        try:
            return list(check_grams(value))
        except PlanningConfigError as exc:
            raise TrainConfigError(f"algorithm.planning_grams: {exc}",
                                   fix="give at least one phrase, or leave planning_grams unset for the "
                                       "shipped list") from None

    @model_validator(mode="after")
    def _planning(self) -> "AlgorithmSection":
        if self.transform in ("gtpo_hicra", "gtpo_sepa") and self.planning_detector == "none":
            raise TrainConfigError(
                f"algorithm.transform = {self.transform!r} needs planning tokens, and "
                f"algorithm.planning_detector is 'none'",
                fix="set algorithm.planning_detector = \"strategic_grams\" (optionally algorithm.planning_grams), "
                    "or use transform = \"gtpo\"")
        return self

    def norm_length(self, rollout: "RolloutSection", agent: "AgentSection") -> int:
        """seq-mean-token-sum-norm's constant: ``norm_len``, else the generation budget, the most
        policy tokens a trajectory can have (max_tokens per model turn × max_turns turns; tool
        output and template glue between turns are masked out of the loss)."""
        return self.norm_len if self.norm_len is not None else rollout.max_tokens * agent.max_turns


class RewardSection(_Section):
    shuffle: Literal["none", "batch"] = Field(
        "none", description="batch: the shuffled-reward control: each step's rewards are permuted across all "
                            "its groups' runs before the advantages (seeded by rollout.sampling_seed and the "
                            "step), so rewards say nothing about their responses; none: each run keeps its own.")


class CorrectionSection(_Section):
    when: Literal["gate", "always", "never"] = Field(
        "gate", description="gate: IS correction on for groups the gate marks train_with_correction (and "
                            "replayed groups); always / never: for every group.")
    kind: Literal["token_tis", "sequence_tis", "masked_is"] = Field(
        "token_tis", description="Correction applied to exp(logπ_old − logπ_behaviour).")
    cap: float = Field(2.0, gt=0, description="TIS cap C.")
    token_bounds: tuple[float, float] | None = Field(None, description="masked_is: per-token ratio bounds.")
    sequence_bounds: tuple[float, float] | None = Field(None, description="masked_is: sequence ratio bounds.")
    geo_mean_bounds: tuple[float, float] | None = Field(
        (0.5, 2.0), description="masked_is: geometric-mean ratio bounds.")


class TrainerSection(_Section):
    router_replay: bool = Field(
        False, description="Router replay (R3): the trainer's MoE layers route each policy token to the experts "
                            "the rollout engine chose (the groups' routed_experts), when scoring π_old and in the "
                            "update; the gate weights still come from the trainer's router. Off: it routes itself.")
    activation_checkpointing: bool = Field(
        False, description="Keep only each decoder layer's input in the update's forward and recompute the layer in "
                           "the backward (transformers' gradient checkpointing): the body's activations drop from "
                           "every layer's to one layer's, for one more forward of the body.")
    fsdp_keep_gathered: bool = Field(
        True, description="With the learner sharded by FSDP2: keep each unit's gathered weights from the update's "
                          "forward to its backward and all-gather the next layer ahead (one all-gather of the "
                          "weights a step instead of two; ZeRO-2-like memory: the full weights are resident while a "
                          "step runs). Off: free them after each forward (least memory, more communication). "
                          "docs/benchmarks.md measures both.")
    learner_ranks: int = Field(
        1, ge=1, description="Processes the learner trains over (FSDP2, data parallel, weights and optimizer "
                             "sharded): rank i on cuda:i with NCCL when model.device is CUDA, else gloo on the CPU. "
                             "Rank 0 runs the loop and writes the run; the others are started by it "
                             "(docs/training.md, \"Several GPUs\").")


class OptimSection(_Section):
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")


class LoopSection(_Section):
    steps: int = Field(20, ge=1, description="Optimizer steps (policy versions published).")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: wait for the reload quorum before the next step's jobs; async: keep "
                            "workers busy and accept groups up to max_staleness versions old.")
    max_staleness: int = Field(1, ge=0, description="async: oldest group lag accepted for training.")
    quorum: int | None = Field(None, ge=1, description="Reload acks that activate a version (None: the exchange's rule).")
    quorum_timeout_s: float = Field(300.0, gt=0, description="sync: longest wait for a reload quorum.")
    fetch_timeout_s: float = Field(600.0, gt=0, description="Longest wait for one step's groups.")
    replay: bool = Field(False, description="Train on groups the gate sends to replay (with IS correction).")
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept on disk (the newest).")
    save_optimizer: bool = Field(True, description="Save optimizer state with each checkpoint (resume).")


class EvalSection(_Section):
    every: int = Field(10, ge=0, description="Evaluate every N steps, and before the first and after the last; 0: only those two.")
    tasks: int = Field(50, ge=0, description="Held-out tasks (the first N of the heldout split); 0 turns evaluation off.")
    samples: int = Field(4, ge=1, description="Samples per task at `temperature` for pass@k (k ≤ samples); 16 or "
                                              "more for any claim (`rollmarket stats` calls fewer INCONCLUSIVE).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the pass@k samples.")
    max_turns: int = Field(4, ge=1, description="Agent turns per evaluation run.")


class AgentSection(_Section):
    max_turns: int = Field(4, ge=1, description="Agent turns per run (workers get it as --max-steps).")


@dataclass(frozen=True)
class WorkerSpec:
    """One `local.workers` entry: ``PRECISION`` or ``PRECISION@lagK``.

    ``bf16@lag3`` is a bf16 worker that runs up to 3 policy versions behind the published one
    before it reloads (a slow host; `rollmarket worker --reload-lag 3`): its groups really come
    from older policies, so the gate sees their lag and the trainer their mismatch.
    """

    precision: str
    reload_lag: int = 0

    @classmethod
    def parse(cls, text: str) -> "WorkerSpec":
        """``"bf16"`` → (bf16, 0); ``"bf16@lag3"`` → (bf16, 3). Raises TrainConfigError on anything else."""
        precision, sep, option = text.partition("@")
        fix = 'write PRECISION or PRECISION@lagK with K a whole number ≥ 0, e.g. "bf16" or "bf16@lag3"'
        if not precision:
            raise TrainConfigError(f"local.workers entry {text!r} names no precision", fix=fix)
        if not sep:
            return cls(precision)
        if not option.startswith("lag"):
            raise TrainConfigError(f"local.workers entry {text!r}: unknown option {option!r} after '@'", fix=fix)
        digits = option.removeprefix("lag")
        if not (digits.isascii() and digits.isdigit()):
            raise TrainConfigError(f"local.workers entry {text!r}: the lag {digits!r} is not a whole number ≥ 0",
                                   fix=fix)
        return cls(precision, int(digits))

    def __str__(self) -> str:
        return f"{self.precision}@lag{self.reload_lag}" if self.reload_lag else self.precision


class LocalSection(_Section):
    workers: list[str] = Field(
        default_factory=lambda: ["bf16", "fp8"],
        description="--local: one in-process worker per entry, PRECISION or PRECISION@lagK (a worker that runs "
                    "up to K policy versions behind the published one before it reloads, like a slow host).")
    threads: int = Field(1, ge=1, description="--local: torch threads per worker engine.")
    lease_ttl_s: float = Field(60.0, gt=0, description="--local: the exchange's lease TTL.")

    @field_validator("workers")
    @classmethod
    def _specs(cls, value: list[str]) -> list[str]:
        for text in value:
            WorkerSpec.parse(text)
        return value

    @property
    def specs(self) -> list[WorkerSpec]:
        """The workers as parsed entries."""
        return [WorkerSpec.parse(text) for text in self.workers]


class ExchangeSection(_Section):
    url: str | None = Field(None, description="Exchange base URL (several replicas' URLs separated by commas fail "
                                              "over); None with --local starts one in-process.")
    token_env: str = Field("ROLLMARKET_TRAINER_TOKEN", description="Environment variable holding the trainer token.")
    trainer_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.:\-]{1,128}$",
        description="This trainer's id in decisions, feedback and the exchange's served marks; None: "
                    "trainer-<run id>, one per run (two runs sharing an id hide each other's groups).")
    wait_s: float = Field(300.0, ge=0, description="How long to wait for an exchange that does not answer "
                                                   "at start before giving up.")
    require_signatures: bool = Field(
        False, description="Publish policies that take only signed groups, from workers started with "
                           "--signing-key (docs/security.md); not with --local.")


class LoggingSection(_Section):
    trackers: list[Literal["wandb", "tensorboard"]] | None = Field(
        None, description="Mirrors of metrics.jsonl and the rollouts (W&B offline by default, TensorBoard); "
                          "None: every one installed (W&B not when wandb_mode or WANDB_MODE is disabled); []: none.")
    wandb_project: str = Field("rollmarket", description="W&B project.")
    wandb_mode: Literal["offline", "online", "disabled"] = Field("offline", description="W&B mode.")
    generations_every: int = Field(1, ge=0, description="Write generations.jsonl rows every N steps; 0: never.")
    token_logprobs: bool = Field(
        True, description="With each generations.jsonl row, write the trainer's teacher-forced logprob of every "
                          "response token to token_logprobs.jsonl (the dashboard colours tokens by Δlogp); ~8 bytes "
                          "a token.")


class LabelsSection(_Section):
    condition: str | None = Field(
        None, max_length=128, description="Label written into every metrics row and the summary (`rollmarket "
                                          "campaign` sets it to the run's condition).")
    seed: int | None = Field(
        None, description="Label written into every metrics row and the summary (`rollmarket campaign` sets it "
                          "to the run's campaign seed).")


class TrainConfig(_Section):
    """Everything `rollmarket train` does. Defaults give a quick CPU run on the tiny MoE model."""

    model: ModelSection = ModelSection()
    rollout: RolloutSection = RolloutSection()
    agent: AgentSection = AgentSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    reward: RewardSection = RewardSection()
    correction: CorrectionSection = CorrectionSection()
    optim: OptimSection = OptimSection()
    trainer: TrainerSection = TrainerSection()
    lora: LoraSettings = LoraSettings()
    squeeze: SqueezeSettings = SqueezeSettings()
    loop: LoopSection = LoopSection()
    gate: GateConfig = GateConfig()
    eval: EvalSection = EvalSection()
    local: LocalSection = LocalSection()
    exchange: ExchangeSection = ExchangeSection()
    logging: LoggingSection = LoggingSection()
    labels: LabelsSection = LabelsSection()
    runs_root: str = Field("runs", description="Run directories go under here.")
    seed: int = Field(0, description="torch seed of the trainer (init of LoRA adapters, dropout).")

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        if self.correction.kind == "masked_is" and not (
                self.correction.token_bounds or self.correction.sequence_bounds or self.correction.geo_mean_bounds):
            raise ValueError("correction.kind = masked_is needs at least one of token_bounds, sequence_bounds, "
                             "geo_mean_bounds")
        return self


@dataclass(frozen=True)
class ConfigKey:
    """One settable key of TrainConfig, as `rollmarket train --list-keys` prints it."""

    key: str
    """Dotted path, e.g. loop.steps."""
    type: str
    """The value's type, e.g. int, list[str], grpo|dr_grpo|rloo|maxrl."""
    default: str
    """The default as a TOML value ("unset" for None)."""
    help: str


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _type_name(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "|".join(str(a) for a in get_args(annotation))
    if isinstance(annotation, type) and not get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _toml_value(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)


def config_keys(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[ConfigKey]:
    """Every leaf key of `model` (sections flattened to dotted paths), in declaration order."""
    keys: list[ConfigKey] = []
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            keys += config_keys(section, f"{prefix}{name}.")
            continue
        keys.append(ConfigKey(f"{prefix}{name}", _type_name(field.annotation),
                              _toml_value(field.get_default(call_default_factory=True)), field.description or ""))
    return keys


def _known_paths(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    """Every key and section path of `model`: what an unknown key is compared with."""
    paths: list[str] = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        section = _section(field.annotation)
        if section is not None:
            paths += _known_paths(section, f"{prefix}{name}.")
    return paths


def _check_override_key(keys: list[str], text: str) -> None:
    """Raise TrainConfigError unless the dotted key of override `text` is a key of TrainConfig."""
    model: type[BaseModel] = TrainConfig
    for depth, key in enumerate(keys):
        field = model.model_fields.get(key)
        if field is None:
            raise _unknown_key_error(".".join(keys), f" (override {text})")
        section = _section(field.annotation)
        if section is None and depth < len(keys) - 1:
            raise TrainConfigError(f"override {text!r}: {'.'.join(keys[:depth + 1])} is a value, not a section",
                                   fix=LIST_KEYS_HINT)
        model = section or model


def _unknown_keys(data: dict, model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    unknown: list[str] = []
    for name, value in data.items():
        field = model.model_fields.get(name)
        if field is None:
            unknown.append(prefix + str(name))
            continue
        section = _section(field.annotation)
        if section is not None and isinstance(value, dict):
            unknown += _unknown_keys(value, section, f"{prefix}{name}.")
    return unknown


def _unknown_key_error(key: str, where: str) -> TrainConfigError:
    close = difflib.get_close_matches(key, _known_paths(), n=1, cutoff=0.6)
    guess = f"; did you mean {close[0]}?" if close else ""
    return TrainConfigError(f"unknown key {key}{where}{guess}", fix=LIST_KEYS_HINT)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` → (["a", "b"], value), the value read as a TOML value (a bare word is a string)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise TrainConfigError(f"override {text!r} is not KEY=VALUE", fix="write it as e.g. optim.lr=1e-4")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string such as loop.mode=async
    return [part.strip() for part in key.split(".")], value


def resolve(path: Path | str | None, overrides: list[str] = (), base: dict | None = None) -> TrainConfig:
    """The config from `base` (a saved config.json's dict), else the TOML file, with overrides applied.

    An unknown key (in the file or an override) raises TrainConfigError naming the closest known
    key; a bad value names the key, the value and the type it should have."""
    data: dict = copy.deepcopy(base) if base else {}  # overrides write into nested sections
    if base is None and path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise TrainConfigError(f"cannot read {path}: {exc.strerror}",
                                   fix="pass a TOML file such as configs/train-lookup.toml, or only KEY=VALUE "
                                       "overrides") from None
        except tomllib.TOMLDecodeError as exc:
            raise TrainConfigError(f"{path} is not valid TOML: {exc}") from None
    for key in _unknown_keys(data):
        raise _unknown_key_error(key, f" in {path}" if path is not None else " in the saved config")
    for text in overrides:
        keys, value = parse_override(text)
        _check_override_key(keys, text)
        node = data
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise TrainConfigError(f"override {text!r}: {key} is a value, not a section", fix=LIST_KEYS_HINT)
            node = child
        node[keys[-1]] = value
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        problems, fixes = [], []
        for error in exc.errors():
            where = ".".join(map(str, error["loc"]))
            cause = (error.get("ctx") or {}).get("error")
            if isinstance(cause, TrainConfigError):  # our own check: its message names the key, its fix is specific
                problems.append(str(cause))
                fixes += [cause.fix] if cause.fix else []
                continue
            if not where:
                problems.append(error["msg"].removeprefix("Value error, "))
                continue
            problems.append(f"bad value for {where} ({json.dumps(error['input'], default=str)}): {error['msg']}")
        raise TrainConfigError("; ".join(problems), fix="; ".join(fixes) or LIST_KEYS_HINT) from None


def validate(config: TrainConfig, *, local: bool, token: str | None = None) -> None:
    """Check what `config` names before anything is made: the model directory, the suite and its
    splits, the precisions, and without `local` the exchange's URL and token. Raises
    TrainConfigError."""
    from ..engines.precision import Precision
    from ..tasks.suites import UnknownSuite, check_suite

    model = Path(config.model.path)
    if not (model / "config.json").is_file():
        raise TrainConfigError(f"model.path {model}: no Hugging Face model directory there (no config.json)",
                               fix="run from the repository root, or set model.path=DIR")
    try:
        check_suite(config.rollout.suite, "train")
        check_suite(config.rollout.suite, "heldout")
    except UnknownSuite as exc:
        raise TrainConfigError(f"rollout.suite: {exc}", fix="`rollmarket suites ls` lists the suites") from None
    if config.rollout.curriculum is not None:
        from ..tasks.curriculum import CurriculumError, load_curriculum
        from ..tasks.suites import load_suite

        try:
            load_curriculum(config.rollout.curriculum, config.rollout.curriculum_digest).select(
                load_suite(config.rollout.suite, "train"))
        except CurriculumError as exc:
            raise TrainConfigError(f"rollout.curriculum: {exc}", fix=exc.fix) from None
    if config.trainer.learner_ranks > 1:  # one GPU per rank on CUDA: refused before the run exists
        from .ranks import rank_backend

        rank_backend(config)
    known = [p.value for p in Precision]
    local_precisions = [spec.precision for spec in config.local.specs]
    for key, names in (("rollout.precisions", config.rollout.precisions),
                       ("local.workers", local_precisions if local else [])):
        bad = [p for p in names if p not in known]
        if bad or (key == "rollout.precisions" and not names):
            raise TrainConfigError(f"{key}: unknown precision(s) {bad}" if bad else f"{key} is empty",
                                   fix=f"choose from {', '.join(known)}")
    if local:
        lagging = [str(spec) for spec in config.local.specs if spec.reload_lag]
        if lagging and config.loop.mode == "sync":
            raise TrainConfigError(
                f"local.workers {lagging} lag behind the policy, and loop.mode is 'sync': a sync trainer takes "
                f"only groups of its own version, so theirs would never be used and their jobs never done",
                fix="set loop.mode=async, or drop the @lag entries")
        missing = [p for p in config.rollout.precisions if p not in local_precisions]
        if missing:
            raise TrainConfigError(f"rollout.precisions {missing} have no worker in local.workers "
                                   f"{config.local.workers}: their jobs would never run",
                                   fix="add them to local.workers or drop them from rollout.precisions")
        if config.exchange.require_signatures:
            raise TrainConfigError("exchange.require_signatures: --local workers hold no signing keys, so no "
                                   "group would be accepted",
                                   fix="drop it, or run workers with --signing-key against exchange.url")
        return
    if not config.exchange.url:
        raise TrainConfigError("exchange.url is not set", fix="pass exchange.url=http://HOST:PORT or --local")
    if not (token or os.environ.get(config.exchange.token_env)):
        raise TrainConfigError(f"${config.exchange.token_env} is not set",
                               fix="export it with the exchange's trainer token, or pass --local")
