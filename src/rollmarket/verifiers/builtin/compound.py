"""`compound`: a reward made of named parts, each scored by another verifier.

args: {"components": [{"name": "answer", "verifier": "numeric", "weight": 0.8, "args": {...}},
                      {"name": "tools", "verifier": "tool_use", "weight": 0.2, "args": {...}}],
       "pass": "all" | "<component name>" | <threshold>}

reward = sum(weight_i * reward_i) / sum(weight_i). components = {name: reward_i}. passed: with
"all" (the default) every part passed; with a name, that part passed; with a number, reward >=
that number. info.parts nests each part's whole result (reward, passed, components, info).
canonical is that of the first part that judges the answer text (not tool_use), else the first.
Each part gets its own `args` (default {}), never the compound's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    get_verifier,
    register_verifier,
    result,
)


class Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="The component's name in the result.")
    verifier: str = Field(min_length=1, description="The verifier that scores it.")
    weight: float = Field(1.0, ge=0, allow_inf_nan=False, description="Its weight in the reward.")
    args: dict[str, Any] = Field(default_factory=dict, description="That verifier's args.")


class CompoundArgs(VerifierArgs):
    components: list[Part] = Field(min_length=1, description="The parts of the reward.")
    pass_: str | float = Field("all", alias="pass", description='"all", a part name, or a reward threshold.')

    @model_validator(mode="after")
    def _consistent(self) -> CompoundArgs:
        names = [p.name for p in self.components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique: {names}")
        if sum(p.weight for p in self.components) <= 0:
            raise ValueError("the weights must not all be 0")
        if isinstance(self.pass_, str) and self.pass_ != "all" and self.pass_ not in names:
            raise ValueError(f"pass {self.pass_!r} is not 'all', a component name or a number")
        return self


@register_verifier
class CompoundVerifier(Verifier):
    name = "compound"
    Args = CompoundArgs
    needs_final_answer = False

    def expected(self, task: TaskSpec, args: CompoundArgs) -> list[tuple[Part, Verifier]]:
        parts = [(part, get_verifier(part.verifier)) for part in args.components]
        for part, verifier in parts:
            try:
                verifier.check(task, part.args)
            except VerifierConfigError as exc:
                raise VerifierConfigError(f"compound component {part.name!r}: {exc}") from None
        return parts

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: CompoundArgs, expected: list[tuple[Part, Verifier]]) -> VerifyResult:
        results: dict[str, VerifyResult] = {
            part.name: verifier.verify(task, answer, tool_calls=tool_calls, args=part.args)
            for part, verifier in expected}
        total = sum(part.weight for part, _ in expected)
        reward = sum(part.weight * results[part.name].reward for part, _ in expected) / total
        if args.pass_ == "all":
            passed = all(r.passed for r in results.values())
        elif isinstance(args.pass_, str):
            passed = results[args.pass_].passed
        else:
            passed = reward >= args.pass_
        judges = [part.name for part, verifier in expected if verifier.judges_answer] or [expected[0][0].name]
        canonical = results[judges[0]].info.get("canonical")
        whys = [f"{name}: {r.info['why']}" for name, r in results.items() if r.info.get("why")]
        return result(reward, passed=passed, components={name: r.reward for name, r in results.items()},
                      canonical=canonical, expected={name: r.info.get("expected") for name, r in results.items()},
                      why="; ".join(whys) if whys and (reward == 0 or not passed) else None,
                      weights={part.name: part.weight for part, _ in expected},
                      parts={name: r.model_dump(mode="json") for name, r in results.items()})
