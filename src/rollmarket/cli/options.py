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
                show_default=not field.repr is False and default not in (None, ""),
                envvar=envvars.get(name), show_envvar=name in envvars, help=help_text,
            )(command)
        return command

    return decorate


def pick(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The values of options made with `prefix`, keyed by field name."""
    return {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix) and v is not None}
