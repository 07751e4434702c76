"""E2B sandboxes on disk, so they outlive a server restart: one `e2b.json` per session.

The record sits in the session's directory (`sessions/<id>/e2b.json`), so purging the
session (`kill`, or the registry's purge of an inactive one) removes it too. It holds what
E2B knows beyond the session: template and the machine it picked, metadata, lifetime, state, and, sealed with the
home's secret key (`agentbox.secrets`), the envd access token and the env vars. Processes
and watchers are not kept: they end with the server. A record that cannot be read is
skipped and left where it is (logged), never a reason not to start.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.secrets import SecretBox, SecretError

if TYPE_CHECKING:
    from agentbox.e2b.sandboxes import E2BSandbox

log = logging.getLogger(__name__)

#: The record's file name inside a session's directory.
RECORD_NAME = "e2b.json"
#: Bytes a record may have at most when read back (metadata and env vars are small).
MAX_RECORD_BYTES = 1024 * 1024


def save(session_dir: Path, sandbox: E2BSandbox, box: SecretBox) -> None:
    """Write the sandbox's record atomically (a temporary file renamed over the old one)."""
    record = {
        "id": sandbox.id,
        "template": sandbox.template,
        "machine": sandbox.machine,
        "metadata": sandbox.metadata,
        "env": box.encrypt(json.dumps(sandbox.env)),
        "access_token": box.encrypt(sandbox.access_token),
        "started_at": sandbox.started_at.isoformat(),
        "end_at": sandbox.end_at.isoformat(),
        "state": sandbox.state,
    }
    session_dir.mkdir(parents=True, exist_ok=True)
    path = session_dir / RECORD_NAME
    staged = path.with_suffix(".json.part")
    staged.write_text(json.dumps(record))
    os.replace(staged, path)


def load_all(sessions: Path, box: SecretBox) -> list[dict[str, Any]]:
    """Every readable record under `sessions` (the home's `sessions/` directory), unsealed and
    checked: the fields of an `E2BSandbox`."""
    found = []
    for path in sorted(sessions.glob(f"*/{RECORD_NAME}")):
        try:
            found.append(_load(path, box))
        except (OSError, ValueError, KeyError, TypeError, SecretError) as exc:
            log.warning("e2b: skipping the unreadable sandbox record %s: %s", path, exc)
    return found


def _load(path: Path, box: SecretBox) -> dict[str, Any]:
    if path.stat().st_size > MAX_RECORD_BYTES:
        raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
    record: dict[str, Any] = json.loads(path.read_text())
    if record["id"] != path.parent.name:
        raise ValueError(f"the record names sandbox {record['id']!r}, not its directory's")
    env = json.loads(box.decrypt(record["env"]))
    if not isinstance(env, dict) or not isinstance(record["metadata"], dict):
        raise TypeError("env and metadata must be objects")
    if record["state"] not in ("running", "paused"):
        raise ValueError(f"unknown state {record['state']!r}")
    return {
        "id": record["id"],
        "template": str(record["template"]),
        "machine": None if record.get("machine") is None else str(record["machine"]),
        "metadata": {str(k): str(v) for k, v in record["metadata"].items()},
        "env": {str(k): str(v) for k, v in env.items()},
        "access_token": box.decrypt(record["access_token"]),
        "started_at": datetime.fromisoformat(record["started_at"]),
        "end_at": datetime.fromisoformat(record["end_at"]),
        "state": record["state"],
    }
