"""Names of the observatory's engines, parsed once: `[fsdp-]<precision>[+replay]` for a trainer.

    fp32             the single-process trainer engine at fp32
    fsdp-bf16        FSDP2 over --fsdp-world-size ranks at bf16
    bf16+replay      router replay (R3): the MoE layers route each policy token to the experts the
    fsdp-bf16+replay rollout engine chose; the trainer's router still gives the gate weights

Imports no torch, so the CLI and the dashboard can check names cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FSDP_PREFIX = "fsdp-"
REPLAY_SUFFIX = "+replay"


class EngineNameError(ValueError):
    """A trainer engine name that is not `[fsdp-]<precision>[+replay]`."""

    fix = "name trainer engines like fp32,fsdp-bf16,bf16+replay (or add --router-replay for every +replay twin)"


class ReplayUnavailable(ValueError):
    """Router replay was asked where it cannot run: a dense model, or rollouts without routed experts."""


@dataclass(frozen=True)
class TrainerName:
    """One trainer engine of the matrix, as its name says."""

    name: str
    precision: str
    fsdp: bool
    replay: bool

    @property
    def base(self) -> str:
        """The same engine without replay (`fsdp-bf16+replay` -> `fsdp-bf16`)."""
        return self.name.removesuffix(REPLAY_SUFFIX)


def parse_trainer(name: str) -> TrainerName:
    """`[fsdp-]<precision>[+replay]` -> TrainerName; EngineNameError for anything else."""
    body = name.removesuffix(REPLAY_SUFFIX)
    precision = body.removeprefix(FSDP_PREFIX)
    if precision not in PRECISIONS:
        raise EngineNameError(f"unknown trainer engine {name!r}: expected [fsdp-]<precision>[+replay] with a "
                              f"precision of {', '.join(PRECISIONS)}")
    return TrainerName(name=name, precision=precision, fsdp=body != precision, replay=body != name)


def with_replay_twins(names: list[str]) -> list[str]:
    """Each trainer engine followed by its `+replay` twin (kept once; the order is the matrix's columns)."""
    out: list[str] = []
    for name in names:
        for each in (parse_trainer(name).base, parse_trainer(name).base + REPLAY_SUFFIX):
            if each not in out:
                out.append(each)
    return out
