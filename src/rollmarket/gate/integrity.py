"""Content hashes and ed25519 signatures of sample groups."""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..contracts import SampleGroup, content_hash

_SIGNING_DOMAIN = b"rollmarket.sample_group.sig.v1:"


def hash_matches(group: SampleGroup) -> bool:
    return group.content_hash is not None and group.content_hash == content_hash(group)


def generate_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_key_b64(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(
        encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw
    )
    return base64.b64encode(raw).decode()


class SigningKeyError(ValueError):
    """A signing key file that cannot be written (it exists) or used (not ed25519, open to others)."""

    def __init__(self, path: Path, problem: str, fix: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.fix = path, fix


def write_signing_key(path: Path) -> Ed25519PrivateKey:
    """Make a new key and write it to `path` as unencrypted PKCS#8 PEM, mode 0600 from the start.
    An existing file is never overwritten: it may be the only copy of a key workers are known by."""
    key = generate_signing_key()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SigningKeyError(path, "already exists", "choose another --out, or remove the old key first") from None
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    return key


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """Read a key `write_signing_key` (or `openssl genpkey -algorithm ed25519`) wrote. Like ssh, a
    key that others can read is refused: whoever reads it can sign as this worker."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise SigningKeyError(path, f"is open to other users (mode {mode:04o})", f"chmod 600 {path}")
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(path, f"is not an unencrypted PEM private key ({exc})",
                              "make one with `rollmarket keys generate --out FILE`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(path, f"holds a {type(key).__name__}, not an ed25519 key",
                              "make one with `rollmarket keys generate --out FILE`")
    return key


def sign_hash(digest_hex: str, key: Ed25519PrivateKey) -> str:
    return base64.b64encode(key.sign(_SIGNING_DOMAIN + digest_hex.encode())).decode()


def sign_group(group: SampleGroup, key: Ed25519PrivateKey) -> SampleGroup:
    """A sealed copy of the group (content hash filled in) carrying its signature."""
    sealed = group.sealed()
    digest = sealed.content_hash
    assert digest is not None  # sealed() fills it in
    return sealed.model_copy(update={"signature": sign_hash(digest, key)})


def load_public_key(public_key_b64_text: str) -> Ed25519PublicKey:
    """Parse a base64 raw ed25519 key; raise ValueError when it is not one."""
    try:
        raw = base64.b64decode(public_key_b64_text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not a base64 raw ed25519 public key: {exc}") from None


def signature_valid(digest_hex: str, signature_b64: str, public_key: Ed25519PublicKey) -> bool:
    try:
        public_key.verify(base64.b64decode(signature_b64, validate=True),
                          _SIGNING_DOMAIN + digest_hex.encode())
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True
