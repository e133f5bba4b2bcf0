"""`rollmarket keys`: ed25519 keys that workers sign their groups with (docs/security.md)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

console = Console(stderr=True)


@click.group("keys")
def keys() -> None:
    """Make and inspect the ed25519 keys workers sign submissions with."""


@keys.command("generate")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="File to write the private key to (PEM, mode 0600; never overwritten).")
def keys_generate(out: Path) -> None:
    """Write a new private key to --out and print its public key (base64, as in WorkerManifest.public_key).

    Give the file to `rollmarket worker --signing-key`; the worker registers the public key and signs
    every group's content hash with the private one.
    """
    from ..gate.integrity import public_key_b64, write_signing_key

    key = write_signing_key(out)
    console.print(f"wrote a new ed25519 signing key to [bold]{out}[/] (mode 0600); its public key:", highlight=False)
    click.echo(public_key_b64(key))


@keys.command("public")
@click.argument("key_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def keys_public(key_file: Path) -> None:
    """Print the public key (base64) of the private key in KEY_FILE."""
    from ..gate.integrity import load_signing_key, public_key_b64

    click.echo(public_key_b64(load_signing_key(key_file)))
