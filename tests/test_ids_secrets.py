"""ids: prefixed, canonical, strictly increasing. secrets: encrypted at rest, never shown in plaintext."""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from ulid import ULID

from agentbox import ids
from agentbox.ids import PREFIXES, is_id, new_id
from agentbox.secrets import (
    ENCRYPTED_PREFIX,
    KEY_FILE_MODE,
    KEY_FILE_NAME,
    REDACTED,
    KeyFileError,
    NotEncrypted,
    SecretBox,
    WrongKey,
    is_encrypted,
    redact,
)

# ---------------------------------------------------------------- ids


@pytest.mark.parametrize("prefix", sorted(PREFIXES))
def test_new_id_has_prefix_and_canonical_ulid(prefix: str) -> None:
    value = new_id(prefix)
    assert value.startswith(prefix + "_")
    part = value[len(prefix) + 1 :]
    assert len(part) == 26 and part == part.lower()
    assert str(ULID.from_str(part.upper())).lower() == part
    assert is_id(value, prefix)


def test_design_prefixes_are_all_known() -> None:
    assert {"ses", "trn", "evt", "file", "apr", "chg", "cmd", "sbx"} <= PREFIXES


def test_ids_strictly_increase_within_one_millisecond_and_across_many() -> None:
    values = [new_id("evt") for _ in range(20_000)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)
    stamps = [ULID.from_str(value[4:].upper()).milliseconds for value in values]
    # Many ids share a millisecond, so ordering there came from the monotonic rule, not the clock.
    assert len(set(stamps)) < len(stamps)


def test_ids_from_many_threads_are_unique_and_each_thread_sees_them_increase() -> None:
    def make(_: int) -> list[str]:
        return [new_id("cmd") for _ in range(2_000)]

    with ThreadPoolExecutor(max_workers=8) as pool:
        batches = list(pool.map(make, range(8)))
    for batch in batches:
        assert batch == sorted(batch)
    assert len({value for batch in batches for value in batch}) == 8 * 2_000


def test_an_id_never_sorts_before_the_previous_one_even_if_the_clock_steps_back() -> None:
    later = int(ULID.from_timestamp(2_000_000_000.0))
    earlier = int(ULID.from_timestamp(1_000_000_000.0))
    assert ids._after(later, earlier) == later + 1
    assert ids._after(later, later) == later + 1
    assert ids._after(earlier, later) == later


def test_a_carry_out_of_the_random_bits_moves_to_the_next_millisecond() -> None:
    top_of_ms = (123 << 80) | ((1 << 80) - 1)
    nxt = ULID.from_int(ids._after(top_of_ms, 0))
    assert nxt.milliseconds == 124


def test_ulid_space_end_is_refused() -> None:
    with pytest.raises(OverflowError):
        ids._after((1 << 128) - 1, 0)


def test_unknown_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown id prefix"):
        new_id("xyz")
    with pytest.raises(ValueError, match="no underscore"):
        new_id("ses_")
    with pytest.raises(ValueError):
        is_id("ses_01j9z3k8q0x6m2v4c7b5n1d8f0", "nope")


@pytest.mark.parametrize(
    "value",
    [
        "trn_01j9z3k8q0x6m2v4c7b5n1d8f0",  # another kind
        "ses01j9z3k8q0x6m2v4c7b5n1d8f0",  # no underscore
        "ses_01J9Z3K8Q0X6M2V4C7B5N1D8F0",  # not canonical (uppercase)
        "ses_01j9z3k8q0x6m2v4c7b5n1d8f",  # 25 characters
        "ses_01j9z3k8q0x6m2v4c7b5n1d8f00",  # 27 characters
        "ses_01j9z3k8q0x6m2v4c7b5n1d8fu",  # u is not Crockford base32
        "ses_81j9z3k8q0x6m2v4c7b5n1d8f0",  # more than 128 bits
        "ses_",
        "",
        None,
        42,
    ],
)
def test_is_id_refuses(value: object) -> None:
    assert not is_id(value, "ses")


def test_is_id_accepts_largest_ulid() -> None:
    assert is_id("ses_7zzzzzzzzzzzzzzzzzzzzzzzzz", "ses")


# ---------------------------------------------------------------- secrets


def test_round_trip_and_prefix(tmp_path: Path) -> None:
    box = SecretBox(tmp_path)
    token = box.encrypt("hunter2 — ünïcode")
    assert token.startswith(ENCRYPTED_PREFIX) and "hunter2" not in token
    assert is_encrypted(token) and SecretBox.is_encrypted(token)
    assert box.decrypt(token) == "hunter2 — ünïcode"
    assert box.encrypt("same") != box.encrypt("same")  # random IV: equal secrets do not look equal


def test_constructing_a_box_touches_nothing(tmp_path: Path) -> None:
    SecretBox(tmp_path / "home")
    assert not (tmp_path / "home").exists()


def test_key_is_created_0600_under_home_even_with_a_loose_umask(tmp_path: Path) -> None:
    home = tmp_path / "not" / "yet"
    old = os.umask(0)
    try:
        SecretBox(home).encrypt("x")
    finally:
        os.umask(old)
    key = home / KEY_FILE_NAME
    assert stat.S_IMODE(key.stat().st_mode) == KEY_FILE_MODE == 0o600
    assert [p.name for p in home.iterdir()] == [KEY_FILE_NAME]  # no temporary file left behind


def test_key_is_reused_by_later_instances(tmp_path: Path) -> None:
    token = SecretBox(tmp_path).encrypt("s3cret")
    key_before = (tmp_path / KEY_FILE_NAME).read_bytes()
    second = SecretBox(tmp_path)
    assert second.decrypt(token) == "s3cret"
    second.encrypt("more")
    assert (tmp_path / KEY_FILE_NAME).read_bytes() == key_before


def test_concurrent_first_use_agrees_on_one_key(tmp_path: Path) -> None:
    boxes = [SecretBox(tmp_path) for _ in range(16)]
    start = threading.Barrier(len(boxes))

    def encrypt(box: SecretBox) -> str:
        start.wait()
        return box.encrypt("shared")

    with ThreadPoolExecutor(max_workers=len(boxes)) as pool:
        tokens = list(pool.map(encrypt, boxes))
    reader = SecretBox(tmp_path)
    assert all(reader.decrypt(token) == "shared" for token in tokens)
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE_NAME]


def test_wrong_key_is_a_typed_error(tmp_path: Path) -> None:
    token = SecretBox(tmp_path / "a").encrypt("s3cret")
    other = SecretBox(tmp_path / "b")
    other.encrypt("makes b's key")
    with pytest.raises(WrongKey, match="different key"):
        other.decrypt(token)


def test_altered_token_is_wrong_key(tmp_path: Path) -> None:
    box = SecretBox(tmp_path)
    token = box.encrypt("s3cret")
    with pytest.raises(WrongKey):
        box.decrypt(token[:-6] + ("A" if token[-6] != "A" else "B") + token[-5:])


def test_decrypt_without_a_key_file_does_not_invent_one(tmp_path: Path) -> None:
    token = SecretBox(tmp_path / "a").encrypt("s3cret")
    with pytest.raises(KeyFileError, match="no key file"):
        SecretBox(tmp_path / "b").decrypt(token)
    assert not (tmp_path / "b" / KEY_FILE_NAME).exists()


def test_corrupt_key_file_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE_NAME).write_text("not a key\n")
    with pytest.raises(KeyFileError, match="Fernet key"):
        SecretBox(tmp_path).encrypt("x")


def test_decrypting_plaintext_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NotEncrypted):
        SecretBox(tmp_path).decrypt("plain password")


def test_encrypt_and_decrypt_fields(tmp_path: Path) -> None:
    box = SecretBox(tmp_path)
    config = {"kind": "ssh", "host": "h", "password": "pw", "extra": {"api_token": "tok"}, "key": None}
    sealed = box.encrypt_fields(config, {"password", "api_token", "key"})
    assert sealed["host"] == "h" and sealed["key"] is None
    assert is_encrypted(sealed["password"]) and is_encrypted(sealed["extra"]["api_token"])
    assert box.encrypt_fields(sealed, {"password", "api_token"}) == sealed  # idempotent
    assert box.decrypt_fields(sealed, {"password", "api_token", "key"}) == config
    # a hand-written plaintext secret passes through the loader
    assert box.decrypt_fields({"password": "typed"}, {"password"}) == {"password": "typed"}
    assert config["password"] == "pw"  # inputs are not mutated


def test_redact_hides_every_secret_at_any_depth(tmp_path: Path) -> None:
    token = SecretBox(tmp_path).encrypt("PLAIN-3")
    config: dict[str, Any] = {
        "kind": "ssh",
        "password": "PLAIN-1",
        "private_key": token,
        "unset": None,
        "machines": [{"name": "m", "api_token": "PLAIN-2"}],
        "nested": {"password": ""},
    }
    shown = redact(config, {"password", "private_key", "api_token", "unset"})
    assert shown == {
        "kind": "ssh",
        "password": REDACTED,
        "private_key": REDACTED,
        "unset": None,
        "machines": [{"name": "m", "api_token": REDACTED}],
        "nested": {"password": REDACTED},
    }
    assert "PLAIN" not in repr(shown) and ENCRYPTED_PREFIX not in repr(shown)
    assert config["password"] == "PLAIN-1" and config["machines"][0]["api_token"] == "PLAIN-2"
