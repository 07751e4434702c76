"""Identifiers: a type prefix and a ULID, e.g. `ses_01j9z3k8q0x6m2v4c7b5n1d8f0`.

The prefix tells a reader (and a log grep) what kind of thing an id names; the ULID makes
ids sort by creation time, so `ORDER BY id` is creation order and a page cursor is just the
last id seen. The ULID part is written in lowercase Crockford base32 (26 characters); ids
are compared as exact strings, so only that canonical form is an id (`is_id` refuses the
uppercase spelling).

A session id is also a directory name (`sessions/<id>/` under AGENTBOX_HOME), and callers may
name their own sessions (`default`, `s1`), so `is_session_id` accepts more than `ses_` ids:
1-128 letters, digits, `_`, `.`, `-`, starting with a letter or digit (`SESSION_ID_RULE`),
matched whole (no `..`, no `/`, no trailing newline). The registry checks it once, where an
id becomes a path; the HTTP layer and the CLI ask the same function for their messages.

Within one process ids are strictly increasing, even when many are made in the same
millisecond or the wall clock steps back: each new ULID is at least the previous one + 1.
"""

from __future__ import annotations

import re
import threading
from typing import TypeGuard

from ulid import ULID

SESSION = "ses"
TURN = "trn"
EVENT = "evt"
FILE = "file"
APPROVAL = "apr"
CHANGE_SET = "chg"
COMMAND = "cmd"
SANDBOX = "sbx"
SUBAGENT = "sub"

#: Every prefix an id may carry. Adding a kind of id is adding a constant above and a name here.
PREFIXES = frozenset({SESSION, TURN, EVENT, FILE, APPROVAL, CHANGE_SET, COMMAND, SANDBOX, SUBAGENT})

#: Characters of the ULID part: 26 of lowercase Crockford base32 (no i, l, o, u); the first
#: one is at most 7 because a ULID holds 128 bits.
_ULID_PART = re.compile(r"[0-7][0-9a-hjkmnp-tv-z]{25}")

_ULID_MAX = (1 << 128) - 1

#: A session id as a directory name: see the module docstring.
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
#: What `is_session_id` accepts, in words (for error messages).
SESSION_ID_RULE = "1-128 letters, digits, '_', '.', '-', starting with a letter or digit"

_lock = threading.Lock()
_last = 0


def new_id(prefix: str) -> str:
    """A new id `<prefix>_<ulid>`; `prefix` is one of `PREFIXES`, without the underscore."""
    _check_prefix(prefix)
    global _last
    with _lock:
        _last = _after(_last, int(ULID()))
        value = _last
    return f"{prefix}_{str(ULID.from_int(value)).lower()}"


def is_id(value: object, prefix: str) -> bool:
    """Whether `value` is an id of the kind `prefix`, in the canonical (lowercase) form."""
    _check_prefix(prefix)
    if not isinstance(value, str) or not value.startswith(prefix + "_"):
        return False
    return _ULID_PART.fullmatch(value[len(prefix) + 1 :]) is not None


def is_session_id(value: object) -> TypeGuard[str]:
    """Whether `value` may name a session (and so a directory under the home): matched whole."""
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


def _after(previous: int, candidate: int) -> int:
    """`candidate`, or `previous + 1` when the candidate would not sort after `previous`.

    Same-millisecond ULIDs carry random bits, and the wall clock can step back; either would
    break creation order without this. A carry out of the random part moves the id into the
    next millisecond, which still sorts correctly.
    """
    if candidate > previous:
        return candidate
    if previous >= _ULID_MAX:
        raise OverflowError("ULID space exhausted")
    return previous + 1


def _check_prefix(prefix: str) -> None:
    if prefix not in PREFIXES:
        raise ValueError(f"unknown id prefix {prefix!r}; expected one of {sorted(PREFIXES)} (no underscore)")
