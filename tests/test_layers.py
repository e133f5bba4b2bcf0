"""The layers (docs/layers.md) beyond what import-linter checks (`make lint`, pyproject's
[tool.importlinter]): no package reaches into another's private names, and the import-linter
contracts cover every package of src/rollmarket and match the table in docs/layers.md.

A private name is one with a single leading underscore (`_helper`, `_private_module`); dunders are
public. Within one top-level package (rollmarket.exchange and everything under it) private names
are shared freely; across packages they are not, so a package can change its insides without
breaking another.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "rollmarket"


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@dataclass(frozen=True)
class Reach:
    """One use of another package's private name."""

    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


def module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The top-level package: rollmarket.exchange.stores.sqlite -> rollmarket.exchange."""
    return ".".join(module.split(".")[:2])


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_reaches(path: Path, src: Path = SRC) -> list[Reach]:
    """Every place `path` (a file under `src`, the rollmarket package) names a private module or
    attribute of another rollmarket package."""
    module = module_name(path, src)
    own = package_of(module)
    rel = str(path.relative_to(src.parent))
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Reach] = []
    foreign: set[str] = set()  # local names bound to something imported from another package

    def other(target: str) -> bool:
        return target.startswith("rollmarket.") and package_of(target) != own

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = absolute(node, module, path.name == "__init__.py")
            if not other(target):
                continue
            if any(is_private(part) for part in target.split(".")):
                found.append(Reach(rel, node.lineno, f"from {target} import ..."))
            for alias in node.names:
                if is_private(alias.name):
                    found.append(Reach(rel, node.lineno, f"from {target} import {alias.name}"))
                foreign.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not other(alias.name):
                    continue
                if any(is_private(part) for part in alias.name.split(".")):
                    found.append(Reach(rel, node.lineno, f"import {alias.name}"))
                foreign.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and is_private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in foreign):
            found.append(Reach(rel, node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def test_no_package_reaches_into_another_s_private_names():
    offenders = [str(r) for path in sorted(SRC.rglob("*.py")) for r in private_reaches(path)]
    assert not offenders, "private names used across packages:\n" + "\n".join(offenders)


def test_the_checker_sees_each_kind_of_reach(tmp_path):
    """The walker itself: each way of reaching in is caught, and the same things within one package
    or of public names are not."""
    package = tmp_path / "rollmarket"
    (package / "exchange").mkdir(parents=True)
    (package / "gate").mkdir()
    (package / "gate" / "__init__.py").write_text("from .integrity import _domain\n")  # its own: fine
    source = package / "exchange" / "app.py"
    source.write_text(
        "from ..gate.integrity import _domain, sign_hash\n"
        "from ..gate import integrity\n"
        "from ..gate._hidden import thing\n"
        "import rollmarket.gate.integrity as integ\n"
        "from .store import _own\n"
        "x = integrity._domain + integ._key + integrity.public\n"
    )
    assert private_reaches(package / "gate" / "__init__.py", package) == []
    assert {r.what for r in private_reaches(source, package)} == {
        "from rollmarket.gate.integrity import _domain",
        "from rollmarket.gate._hidden import ...",
        "integrity._domain",
        "integ._key",
    }


# -- the import-linter contracts and docs/layers.md ------------------------------------------------


def contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["name"]: contract for contract in config["contracts"]}


def top_level_packages() -> set[str]:
    return {f"rollmarket.{p.stem if p.is_file() else p.name}" for p in SRC.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem not in ("__init__",
                                                                                                      "__main__"))}


def documented_layers() -> dict[str, set[str]]:
    """docs/layers.md's table: layer -> packages (`| core | `rollmarket.gate` … |`)."""
    layers: dict[str, set[str]] = {}
    for line in (ROOT / "docs" / "layers.md").read_text().splitlines():
        match = re.match(r"\|\s*(core|ml|apps)\s*\|(.*)\|\s*$", line)
        if match:
            layers[match.group(1)] = set(re.findall(r"`(rollmarket\.[a-z_]+)`", match.group(2)))
    return layers


def test_every_package_sits_in_exactly_one_layer_and_the_contracts_say_the_same():
    layers = documented_layers()
    assert set(layers) == {"core", "ml", "apps"}, layers
    placed = [p for packages in layers.values() for p in packages]
    assert sorted(placed) == sorted(set(placed)), "a package is in two layers"
    assert set(placed) == top_level_packages()
    core = contracts()["The core never imports torch or the ML layer"]
    assert set(core["source_modules"]) == layers["core"]
    assert {m for m in core["forbidden_modules"] if m.startswith("rollmarket.")} == layers["ml"]
    assert {"torch", "transformers", "tokenizers", "safetensors", "peft"} <= set(core["forbidden_modules"])
    no_cli = contracts()["Library code never imports the CLI"]
    assert set(no_cli["source_modules"]) == layers["core"] | layers["ml"]
    assert no_cli["forbidden_modules"] == ["rollmarket.cli"]
