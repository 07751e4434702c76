"""User glob patterns, checked once before any matcher compiles them.

wcmatch expands `{a,b}` alternatives up front: `{a,b}` twenty times is a million patterns,
which it refuses with `PatternLimitException` (past `MAX_PATTERN_EXPANSIONS`), and a very
long pattern compiles into a very long regex. Both are the caller's mistake, so every route
and tool that takes a glob (search / glob / find patterns and excludes, grep's include and
exclude globs, watch excludes) calls `check_pattern` first and answers `bad_request`.
"""

from __future__ import annotations

from collections.abc import Iterable

from wcmatch import glob as wc_glob
from wcmatch._wcparse import PatternLimitException

from agentbox.workspace.errors import bad_request

#: Longest glob accepted, in characters (a path is at most 4096 bytes on Linux).
MAX_PATTERN_CHARS = 4096
#: Most patterns one glob's `{...}` alternatives may expand to (wcmatch's own default).
MAX_PATTERN_EXPANSIONS = 1000
#: The most permissive flags any caller matches with: what is accepted here compiles there.
_FLAGS = wc_glob.GLOBSTAR | wc_glob.BRACE | wc_glob.DOTGLOB


def check_pattern(operation: str, pattern: str, path: str | None = None) -> None:
    """Refuse a glob no matcher should compile: too long, or too many brace expansions."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise bad_request(operation, f"pattern is longer than {MAX_PATTERN_CHARS} characters", path)
    try:
        wc_glob.compile(pattern, flags=_FLAGS, limit=MAX_PATTERN_EXPANSIONS)
    except PatternLimitException as exc:
        raise bad_request(
            operation, f"pattern expands to more than {MAX_PATTERN_EXPANSIONS} alternatives", path
        ) from exc


def check_patterns(operation: str, patterns: Iterable[str], path: str | None = None) -> None:
    for pattern in patterns:
        check_pattern(operation, pattern, path)
