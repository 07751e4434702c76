"""Secret fields of machine configuration (passwords, private keys, API tokens), encrypted at rest.

The same key seals a session's secrets (its model `api_key`, MCP header and secret-looking
MCP env values; see `agentbox.store.sessions`), so the database never holds them in plaintext.

Seed 004: secret fields are stored encrypted, decrypted when the configuration is loaded,
and ordinary queries never return plaintext. A stored secret is `enc:<Fernet token>`, so a
loader can tell an encrypted value from one a person typed into `agentbox.toml` by hand.
The key is one Fernet key in `AGENTBOX_HOME/secret.key`, created mode 0600 on first use and
reused after; losing it loses every stored secret, which is the point of keeping it apart
from the database.

Every way this module fails:

    SecretError
    ├── KeyFileError     the key file is missing (when decrypting) or not a Fernet key
    ├── NotEncrypted     `decrypt` was given a value without the `enc:` prefix
    └── WrongKey         the value was encrypted under another key, or altered since
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet, InvalidToken

#: Marks a stored value as a Fernet token rather than plaintext.
ENCRYPTED_PREFIX = "enc:"

#: Name of the key file under AGENTBOX_HOME.
KEY_FILE_NAME = "secret.key"

#: Permission bits of the key file: owner read/write only.
KEY_FILE_MODE = 0o600

#: What `redact` shows instead of a secret value.
REDACTED = "********"


class SecretError(Exception):
    pass


class KeyFileError(SecretError):
    pass


class NotEncrypted(SecretError):
    pass


class WrongKey(SecretError):
    pass


def is_encrypted(value: object) -> bool:
    """Whether `value` is a stored secret (`enc:...`) rather than plaintext."""
    return isinstance(value, str) and value.startswith(ENCRYPTED_PREFIX)


class SecretBox:
    """Encrypts and decrypts secret values with the key under `home`.

    The key file is read (or created) on first use, not in the constructor, so building a
    SecretBox never touches the disk.
    """

    is_encrypted = staticmethod(is_encrypted)

    def __init__(self, home: Path) -> None:
        self.key_path = Path(home) / KEY_FILE_NAME
        self._fernet: Fernet | None = None
        self._lock = threading.Lock()

    def encrypt(self, text: str) -> str:
        """`enc:<token>` for `text`; a new token each call (Fernet uses a random IV)."""
        token = self._key(create=True).encrypt(text.encode("utf-8"))
        return ENCRYPTED_PREFIX + token.decode("ascii")

    def decrypt(self, token: str) -> str:
        """The plaintext of a value made by `encrypt`."""
        if not is_encrypted(token):
            raise NotEncrypted(f"value is not an encrypted secret (no {ENCRYPTED_PREFIX!r} prefix)")
        fernet = self._key(create=False)
        try:
            return fernet.decrypt(token[len(ENCRYPTED_PREFIX) :].encode("ascii")).decode("utf-8")
        except (InvalidToken, UnicodeError) as exc:
            raise WrongKey(
                f"cannot decrypt secret: it was encrypted under a different key than {self.key_path} "
                "or altered since"
            ) from exc

    def encrypt_fields(self, config: Mapping[str, Any], secret_fields: set[str]) -> dict[str, Any]:
        """A copy of `config` with every plaintext secret field encrypted (at any depth).

        Values already encrypted and `None` are kept as they are, so this is idempotent.
        """

        def seal(value: Any) -> Any:
            if isinstance(value, str) and not is_encrypted(value):
                return self.encrypt(value)
            return value

        return _map_fields(config, secret_fields, seal)

    def decrypt_fields(self, config: Mapping[str, Any], secret_fields: set[str]) -> dict[str, Any]:
        """A copy of `config` with every encrypted secret field decrypted (at any depth).

        Plaintext values pass through: a person may have typed a password into the TOML file.
        """

        def unseal(value: Any) -> Any:
            return self.decrypt(value) if is_encrypted(value) else value

        return _map_fields(config, secret_fields, unseal)

    def _key(self, *, create: bool) -> Fernet:
        with self._lock:
            if self._fernet is None:
                self._fernet = Fernet(_load_key(self.key_path, create=create))
            return self._fernet


def redact(config: Mapping[str, Any], secret_fields: set[str]) -> dict[str, Any]:
    """A copy of `config` for ordinary queries: every set secret field becomes `REDACTED`.

    Applies at any depth (nested tables, lists of tables). Encrypted values are hidden too;
    `None` stays `None` so a reader can still see that a secret is not set.
    """
    return _map_fields(config, secret_fields, lambda value: value if value is None else REDACTED)


def _map_fields(config: Mapping[str, Any], fields: set[str], change: Any) -> dict[str, Any]:
    def walk(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {key: change(item) if key in fields else walk(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [walk(item) for item in value]
        return value

    result: dict[str, Any] = walk(config)
    return result


def _load_key(path: Path, *, create: bool) -> bytes:
    """The key in `path`; when `create` and there is none, a new one written there first."""
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        if not create:
            raise KeyFileError(
                f"no key file at {path}: secrets encrypted earlier cannot be read without it"
            ) from None
        key = _create_key(path)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from exc
    try:
        Fernet(key)
    except ValueError as exc:
        raise KeyFileError(f"key file {path} does not hold a Fernet key") from exc
    return key


def _create_key(path: Path) -> bytes:
    """Write a new key to `path` unless another process got there first; return the key in it.

    The key is written to a private temporary file and hard-linked into place, so no reader
    ever sees a half-written key and two concurrent creators agree on one key.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Fernet.generate_key()
    temp = path.with_name(f".{path.name}.{os.urandom(8).hex()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, KEY_FILE_MODE)
    try:
        os.fchmod(fd, KEY_FILE_MODE)  # the umask cannot widen 0600, but a narrower one must not matter
        os.write(fd, key + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temp, path)
    except FileExistsError:
        return path.read_bytes().strip()
    finally:
        temp.unlink()
    return key
