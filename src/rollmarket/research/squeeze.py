"""LoRA rank analysis ("squeeze") of a trained adapter: how much of each update a smaller rank keeps.

A LoRA layer adds ΔW = s·B·A to a frozen weight (A is r × in, B is out × r, s = alpha / r, as
train/lora.py and peft define it), so ΔW has rank at most r. Its singular values come from two thin
QR factorizations and one r × r SVD, without forming the out × in matrix:

    B = Q_B R_B,  Aᵀ = Q_A R_A   ⇒   ΔW = s · Q_B (R_B R_Aᵀ) Q_Aᵀ,

and since Q_B and Q_A have orthonormal columns, the singular values of ΔW are s times those of the
small core R_B R_Aᵀ. The energy kept by rank k is E(k) = Σ_{i≤k} σ_i² / Σ_i σ_i² (the share of
‖ΔW‖²_F the best rank-k approximation keeps, by Eckart–Young), and a module's rank is the smallest k
with E(k) ≥ the retention (the research guide's `[squeeze] min_variance_retention`, 0.95 by default).

One rank serves every module when an adapter is retrained, so the recommended rank is the largest
module rank: every module then keeps at least the retention. The median module rank and the rank at
which the mean energy over modules reaches the retention (the rule of the guide's own tool) are
reported beside it; both can leave some modules below the retention.

Reads the adapters a LoRA run saves with each checkpoint (`checkpoints/vNNNN/trainer/
adapters.safetensors`) with numpy only: no torch, no model.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_RETENTION = 0.95
REPORT = "squeeze.json"
ADAPTERS = Path("trainer") / "adapters.safetensors"
_TOLERANCE = 1e-12  # E(r) is 1 up to rounding; a retention of 1.0 must still find rank r


class SqueezeSettings(BaseModel):
    """`rollmarket squeeze`'s defaults, kept with a run's settings (`[squeeze]` in the TOML)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_variance_retention: float = Field(
        DEFAULT_RETENTION, gt=0, le=1,
        description="Share of each LoRA update's energy (Σσ²) the recommended rank must keep.")
    """Share of each LoRA update's energy (Σσ²) the recommended rank must keep."""


class SqueezeError(Exception):
    """A run that cannot be squeezed, or a bad setting; `fix` says what to do."""

    fix: str | None = None


class NotARun(SqueezeError):
    fix = "pass a directory `rollmarket train` wrote (it holds config.json and checkpoints/)"


class NoCheckpoint(SqueezeError):
    fix = "train for at least one step; each step writes checkpoints/vNNNN"


class NoAdapter(SqueezeError):
    fix = "squeeze analyses LoRA runs (lora.enabled = true); a full fine-tune has no adapter"


class BadRetention(SqueezeError):
    fix = "give a share of the energy in (0, 1], e.g. --retention 0.95"


def check_retention(retention: float) -> float:
    """The retention as a float in (0, 1], or BadRetention."""
    try:
        value = float(retention)
    except (TypeError, ValueError):
        raise BadRetention(f"retention {retention!r} is not a number") from None
    if not (0 < value <= 1):  # NaN fails too
        raise BadRetention(f"retention {value} is outside (0, 1]")
    return value


def lora_singular_values(a_RI: np.ndarray, b_OR: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Singular values of scale·B·A, largest first, r of them (zeros past the true rank).

    A is r × in and B is out × r, as peft stores lora_A / lora_B. Computed in float64 from the r × r
    core of two QR factorizations; the out × in product is never formed.
    """
    a_RI, b_OR = np.asarray(a_RI, dtype=np.float64), np.asarray(b_OR, dtype=np.float64)
    if a_RI.ndim != 2 or b_OR.ndim != 2 or a_RI.shape[0] != b_OR.shape[1]:
        raise ValueError(f"A {a_RI.shape} and B {b_OR.shape} are not r × in and out × r")
    r = a_RI.shape[0]
    _, rb = np.linalg.qr(b_OR)        # B = Q_B R_B, R_B min(out, r) × r
    _, ra = np.linalg.qr(a_RI.T)      # Aᵀ = Q_A R_A, R_A min(in, r) × r
    sigma = np.linalg.svd(rb @ ra.T, compute_uv=False) * abs(scale)
    return np.concatenate([sigma, np.zeros(r - sigma.size)])


def energy_kept(sigma_R: np.ndarray) -> list[float] | None:
    """E(k) for k = 1…r: the share of Σσ² the first k singular values hold; None for a zero update."""
    power_R = np.square(np.asarray(sigma_R, dtype=np.float64))
    total = power_R.sum()
    if total <= 0:
        return None
    return [float(x) for x in np.minimum(np.cumsum(power_R) / total, 1.0)]


def rank_for(energy: list[float] | None, retention: float) -> int | None:
    """The smallest k with E(k) ≥ retention; None where there is no update to keep."""
    if energy is None:
        return None
    return next(k for k, e in enumerate(energy, start=1) if e >= retention - _TOLERANCE)


@dataclass
class ModuleSqueeze:
    """One adapted module's update."""

    module: str
    """Module name in the model (e.g. model.layers.0.self_attn.q_proj)."""
    shape: list[int]
    """ΔW's [out, in]."""
    singular_values: list[float]
    """σ_1 ≥ … ≥ σ_r of ΔW = scale·B·A."""
    energy: list[float] | None
    """E(k) for k = 1…r; None when ΔW is zero (an adapter B still at its initial zeros)."""
    rank: int | None
    """Smallest k with E(k) ≥ the retention; None when ΔW is zero."""


@dataclass
class SqueezeReport:
    """What `rollmarket squeeze` prints and writes to RUN/squeeze.json."""

    run_dir: str
    checkpoint: str
    lora_r: int
    lora_alpha: float
    scale: float
    retention: float
    modules: list[ModuleSqueeze]
    recommended_rank: int | None
    """The largest module rank: every module keeps at least the retention. None: no module moved."""
    median_rank: float | None
    mean_energy_rank: int | None
    """Smallest k at which the mean E(k) over the modules reaches the retention (the guide's tool's rule)."""
    mean_energy: list[float] | None
    min_energy: list[float] | None
    zero_modules: int
    """Modules whose update is zero, left out of the ranks above."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def analyse(adapters: dict[str, tuple[np.ndarray, np.ndarray]], *, r: int, alpha: float, retention: float,
            run_dir: str = "", checkpoint: str = "") -> SqueezeReport:
    """Squeeze every module of `adapters` (module name → (A r × in, B out × r))."""
    retention = check_retention(retention)
    scale = alpha / r
    modules = []
    for name, (a_RI, b_OR) in sorted(adapters.items()):
        sigma_R = lora_singular_values(a_RI, b_OR, scale)
        energy = energy_kept(sigma_R)
        modules.append(ModuleSqueeze(module=name, shape=[int(b_OR.shape[0]), int(a_RI.shape[1])],
                                     singular_values=[float(x) for x in sigma_R], energy=energy,
                                     rank=rank_for(energy, retention)))
    moved = [m for m in modules if m.energy is not None]
    ranks = [m.rank for m in moved]
    mean_energy = [statistics.fmean(col) for col in zip(*(m.energy for m in moved))] if moved else None
    min_energy = [min(col) for col in zip(*(m.energy for m in moved))] if moved else None
    return SqueezeReport(
        run_dir=run_dir, checkpoint=checkpoint, lora_r=r, lora_alpha=alpha, scale=scale, retention=retention,
        modules=modules, recommended_rank=max(ranks) if ranks else None,
        median_rank=float(statistics.median(ranks)) if ranks else None,
        mean_energy_rank=rank_for(mean_energy, retention), mean_energy=mean_energy, min_energy=min_energy,
        zero_modules=len(modules) - len(moved))


def read_adapters(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module name → (A, B) from an adapters.safetensors the trainer wrote (peft's parameter names:
    base_model.model.<module>.lora_A.<adapter>.weight)."""
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                module = key.split(marker, 1)[0].removeprefix("base_model.model.")
                pairs.setdefault(module, {})[part] = value
    broken = sorted(m for m, p in pairs.items() if set(p) != {"lora_A", "lora_B"})
    if broken:
        raise NoAdapter(f"{path}: modules without both lora_A and lora_B: {broken[:3]}")
    if not pairs:
        raise NoAdapter(f"{path} holds no lora_A / lora_B weights")
    return {m: (p["lora_A"], p["lora_B"]) for m, p in pairs.items()}


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (its trainer state written), as train/loop.py picks it."""
    root = run_dir / "checkpoints"
    done = sorted(p for p in root.glob("v[0-9]*") if (p / "trainer" / "state.json").exists()) if root.is_dir() else []
    return done[-1] if done else None


def squeeze_run(run_dir: Path, *, retention: float | None = None, checkpoint: str | None = None) -> SqueezeReport:
    """Squeeze the adapter of a LoRA training run (its newest checkpoint, or `checkpoint`, e.g. v0002).

    The retention defaults to the run's `squeeze.min_variance_retention` (0.95 when the run predates
    that setting). Raises NotARun, NoCheckpoint, NoAdapter or BadRetention, and writes nothing.
    """
    run_dir = Path(run_dir)
    if retention is not None:
        retention = check_retention(retention)
    config_path = run_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise NotARun(f"{run_dir} is not a training run directory (no readable config.json)") from None
    lora = config.get("lora") or {}
    if not lora.get("enabled"):
        raise NoAdapter(f"{run_dir} is a full fine-tune (lora.enabled is false): there is no adapter to squeeze")
    if checkpoint is not None:
        chosen = run_dir / "checkpoints" / checkpoint
        if not (chosen / "trainer" / "state.json").exists():
            raise NoCheckpoint(f"{run_dir} has no complete checkpoint {checkpoint!r}")
    else:
        chosen = latest_checkpoint(run_dir)
        if chosen is None:
            raise NoCheckpoint(f"{run_dir} has no checkpoint yet")
    if not (chosen / ADAPTERS).exists():
        raise NoAdapter(f"{chosen} has no {ADAPTERS}")
    if retention is None:
        retention = check_retention((config.get("squeeze") or {}).get("min_variance_retention", DEFAULT_RETENTION))
    r, alpha = int(lora["r"]), float(lora["alpha"])
    return analyse(read_adapters(chosen / ADAPTERS), r=r, alpha=alpha, retention=retention,
                   run_dir=str(run_dir), checkpoint=chosen.name)


def write_report(report: SqueezeReport, run_dir: Path) -> Path:
    """RUN/squeeze.json, written atomically."""
    from ..runs import atomic_write_text

    target = Path(run_dir) / REPORT
    atomic_write_text(target, report.to_json())
    return target


def energy_columns(r: int) -> list[int]:
    """The ranks a table shows: all of 1…r up to 8, else powers of two and r."""
    if r <= 8:
        return list(range(1, r + 1))
    return sorted({2 ** i for i in range(int(math.log2(r)) + 1)} | {r})
