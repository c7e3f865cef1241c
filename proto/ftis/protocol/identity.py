"""Node identities: Ed25519 key pairs (library ``cryptography``) and node ids.

The node id is derived from the public key, so it cannot be chosen freely:
``node_id = hex(SHA-256(raw_public_key))[:32]`` (128 bits).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

NODE_ID_HEX_CHARS = 32


def node_id_from_public_key(public_key: bytes) -> str:
    """Node id of a raw 32-byte Ed25519 public key (32 lowercase hex characters).

    Raises:
        ValueError: if ``public_key`` is not 32 bytes.
    """
    if len(public_key) != 32:
        raise ValueError(f"Ed25519 public key must be 32 bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).hexdigest()[:NODE_ID_HEX_CHARS]


@dataclass(frozen=True)
class NodeIdentity:
    """An Ed25519 key pair and the node id derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> NodeIdentity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> NodeIdentity:
        """Load the PEM private key at ``path``, or create one there with mode 0600.

        The parent folder is created with mode 0700. An existing key file whose
        permissions are wider than 0600 is tightened to 0600 (POSIX only).

        Raises:
            ValueError: if the file exists but is not an unencrypted Ed25519 PEM key.
        """
        path = Path(path)
        if path.exists():
            if os.name == "posix" and path.stat().st_mode & 0o077:
                path.chmod(0o600)
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"{path} does not hold an Ed25519 private key")
            return cls(key)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        identity = cls.generate()
        pem = identity.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return identity

    @property
    def public_key(self) -> bytes:
        """Raw 32-byte public key."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def node_id(self) -> str:
        return node_id_from_public_key(self.public_key)

    def sign(self, message: bytes) -> bytes:
        """64-byte Ed25519 signature of ``message``."""
        return self.private_key.sign(message)


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``."""
    from cryptography.exceptions import InvalidSignature

    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
