"""Click options generated from pydantic settings, so every setting is a flag with its help."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import click
from pydantic import BaseModel


def _click_type(annotation: Any) -> Any:
    args = [a for a in get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if base is Path:
        return click.Path(path_type=Path)
    if base in (int, float, str, bool):
        return base
    if hasattr(base, "__args__"):  # Literal[...]
        return click.Choice([str(a) for a in get_args(base)])
    return str


def settings_options(model: type[BaseModel], *, prefix: str = "", skip: tuple[str, ...] = (),
                     envvars: dict[str, str] | None = None):
    """Decorator adding one `--<prefix><field>` option per field of `model` (nested models skipped)."""
    envvars = envvars or {}

    def decorate(command):
        for name, field in reversed(list(model.model_fields.items())):
            annotation = field.annotation
            if name in skip or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                continue
            flag = "--" + (prefix + name).replace("_", "-")
            default = field.get_default(call_default_factory=True)
            help_text = field.description or ""
            if _click_type(annotation) is bool:
                command = click.option(f"{flag}/--no-{(prefix + name).replace('_', '-')}",
                                       prefix + name, default=default, show_default=True,
                                       help=help_text)(command)
                continue
            command = click.option(
                flag, prefix + name, type=_click_type(annotation),
                default=None if default is None else default,
                show_default=field.repr is not False and default not in (None, ""),
                envvar=envvars.get(name), show_envvar=name in envvars, help=help_text,
            )(command)
        return command

    return decorate


def pick(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The values of options made with `prefix`, keyed by field name."""
    return {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix) and v is not None}


def validation_problems(exc) -> str:
    """A pydantic ValidationError of settings made from options, as one line in terms of the options."""
    return "; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')} {e['input']!r}: {e['msg']}"
                     if e["loc"] else e["msg"].removeprefix("Value error, ") for e in exc.errors())


class Refused(click.BadParameter):
    """A bad value with a better fix than "see --help" (the error boundary prints `fix`)."""

    def __init__(self, message: str, fix: str, param_hint: str | None = None):
        super().__init__(message, param_hint=param_hint)
        self.fix = fix


MODEL_DIR_FIX = "pass a Hugging Face model directory such as models/tiny-moe (run from the repository root)"


class ModelDir(click.ParamType):
    """A Hugging Face model directory (one with config.json), checked before anything loads."""

    name = "directory"

    def convert(self, value, param, ctx):
        if value is None:
            return None
        path = Path(value)
        if not path.is_dir():
            raise Refused(f"{value}: no such directory", MODEL_DIR_FIX, param_hint=_hint(param, ctx))
        if not (path / "config.json").is_file():
            raise Refused(f"{value} is not a Hugging Face model directory (no config.json)", MODEL_DIR_FIX,
                          param_hint=_hint(param, ctx))
        return str(value)


def _hint(param, ctx) -> str | None:
    return param.get_error_hint(ctx) if param is not None and ctx is not None else None


def precision_list(value: str, option: str, allowed: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")) -> list[str]:
    """'bf16,fp8' → ['bf16', 'fp8']; an unknown precision is a usage error naming the choices."""
    chosen = [p.strip() for p in value.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in allowed]
    if unknown:
        raise Refused(f"unknown precision(s) {unknown}", f"choose from {', '.join(allowed)}", param_hint=option)
    return chosen
