"""Content hashes and ed25519 signatures of sample groups."""

from __future__ import annotations

import base64
import binascii

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


def sign_hash(digest_hex: str, key: Ed25519PrivateKey) -> str:
    return base64.b64encode(key.sign(_SIGNING_DOMAIN + digest_hex.encode())).decode()


def sign_group(group: SampleGroup, key: Ed25519PrivateKey) -> SampleGroup:
    """A sealed copy of the group (content hash filled in) carrying its signature."""
    sealed = group.sealed()
    return sealed.model_copy(update={"signature": sign_hash(sealed.content_hash, key)})


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
