"""Knowledge bases: the folders of a machine's workspace a session treats as its own.

Every machine has the `workspace` knowledge base, its whole workspace root. The operator adds
more (`[[knowledge_bases]]`, per machine) and a session registers its own (`knowledge_bases`
on the session), each a folder inside the workspace root. A session then *selects* some of
them (`knowledge_base_ids`; by default every one registered, `workspace` first):

- relative paths in `read`, `list`, `search`, `edit`, `write`, `glob`, `grep` and the default
  working directory of `exec` are taken from the first selected knowledge base's root (`.` is
  that root), so they never drift with anything else;
- a path inside a selected knowledge base is the session's own (read freely, written as the
  tier says); any other path is external, as a path outside the workspace is: full tiers
  only, asked on every read in full-ask. That includes a registered knowledge base the
  session did not select, even where it lies inside a selected one: the deepest knowledge
  base holding a path decides, in reads, walks (`find.walk_again`) and `search` alike;
- `search` looks only in the selected knowledge bases, and its `knowledgeBaseIds` narrows
  that further; `edit`'s `destinationKnowledgeBaseId` moves into another selected one.

`Selection` is what a session has, independent of any machine; `Scope` is that selection
laid over one machine's root, which is what the tools consult.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentbox.config import WORKSPACE_KNOWLEDGE_BASE, KnowledgeBaseSpec, knowledge_base_spec
from agentbox.workspace.fileops import below, within

Source = Literal["workspace", "config", "session"]
#: Knowledge bases one session registers of its own (besides the workspace and configured ones).
MAX_SESSION_KNOWLEDGE_BASES = 16


class ScopeError(ValueError):
    """A knowledge base named that the session has not selected; the message says which it has."""


@dataclass(frozen=True)
class KnowledgeBase:
    id: str
    root: str
    """Its folder as an absolute path on the machine."""
    name: str
    source: Source


@dataclass(frozen=True)
class Scope:
    """A session's knowledge bases on one machine: every registered one, and the selected ids
    (at least one; the first is where relative paths start)."""

    registered: tuple[KnowledgeBase, ...]
    selected: tuple[str, ...]

    @property
    def base(self) -> KnowledgeBase:
        return self.by_id(self.selected[0])

    @property
    def chosen(self) -> list[KnowledgeBase]:
        """The selected knowledge bases, in selection order."""
        return [self.by_id(kb_id) for kb_id in self.selected]

    def by_id(self, kb_id: str) -> KnowledgeBase:
        return next(kb for kb in self.registered if kb.id == kb_id)

    def absolute(self, path: str) -> str:
        """`path` as the machine's absolute path: a relative one from the base's root."""
        return path if path.startswith("/") else posixpath.normpath(posixpath.join(self.base.root, path))

    def holder(self, inside: str) -> KnowledgeBase | None:
        """The deepest registered knowledge base holding `inside` (an absolute, resolved path)."""
        holding = [kb for kb in self.registered if within(kb.root, inside)]
        return max(holding, key=lambda kb: len(kb.root.rstrip("/")), default=None)

    def contains(self, inside: str) -> bool:
        """Whether `inside` is the session's own: its deepest knowledge base is selected."""
        kb = self.holder(inside)
        return kb is not None and kb.id in self.selected

    def unselected_below(self, folder: str) -> list[str]:
        """The roots of the knowledge bases below `folder` the session did not select."""
        return [kb.root for kb in self.registered if kb.id not in self.selected and below(folder, kb.root)]

    def narrowed(self, ids: Sequence[str] | None) -> list[KnowledgeBase]:
        """The selected knowledge bases `ids` names (all of them for None); a query can only
        narrow what the session selected, so any other id is a `ScopeError`."""
        if ids is None:
            return self.chosen
        unknown = [kb_id for kb_id in ids if kb_id not in self.selected]
        if unknown:
            raise ScopeError(
                f"knowledge base {unknown[0]!r} is not one this session selected; "
                f"it has {', '.join(self.selected)}"
            )
        return [self.by_id(kb_id) for kb_id in dict.fromkeys(ids)]

    def describe(self) -> list[str]:
        """One line per selected knowledge base, for the system prompt."""
        return [f"{kb.id}: {kb.root}" + (f" ({kb.name})" if kb.name else "") for kb in self.chosen]


@dataclass(frozen=True)
class Selection:
    """What a session has, machine-independent: the configured knowledge bases of its machine,
    its own, and which it selected (None: all of them, `workspace` first)."""

    configured: tuple[KnowledgeBaseSpec, ...] = ()
    registered: tuple[KnowledgeBaseSpec, ...] = ()
    selected: tuple[str, ...] | None = None

    def scope(self, root: str) -> Scope:
        workspace = KnowledgeBase(WORKSPACE_KNOWLEDGE_BASE, root, "", "workspace")
        kbs = (
            workspace,
            *(laid(spec, root, "config") for spec in self.configured),
            *(laid(spec, root, "session") for spec in self.registered),
        )
        chosen = self.selected or tuple(kb.id for kb in kbs)
        return Scope(kbs, chosen)

    def ids(self) -> list[str]:
        return [WORKSPACE_KNOWLEDGE_BASE, *(s.id for s in self.configured), *(s.id for s in self.registered)]


def laid(spec: KnowledgeBaseSpec, root: str, source: Source) -> KnowledgeBase:
    return KnowledgeBase(spec.id, posixpath.join(root, spec.path), spec.name, source)


def selection(
    configured: Iterable[KnowledgeBaseSpec],
    machine: str | None,
    registered: Iterable[KnowledgeBaseSpec] = (),
    selected: Sequence[str] | None = None,
) -> Selection:
    """A session's selection, checked: ids are unique across configured and registered ones,
    and every selected id is one of them (a `ScopeError` otherwise)."""
    chosen = Selection(
        tuple(spec for spec in configured if spec.on(machine)),
        tuple(registered),
        tuple(selected) if selected is not None else None,
    )
    known = chosen.ids()
    twice = next((kb_id for i, kb_id in enumerate(known) if kb_id in known[:i]), None)
    if twice is not None:
        raise ScopeError(f"knowledge base id {twice!r} is already taken on this machine")
    if selected is not None:
        if not selected:
            raise ScopeError("knowledge_base_ids selects at least one knowledge base")
        unknown = [kb_id for kb_id in selected if kb_id not in known]
        if unknown:
            raise ScopeError(
                f"knowledge base {unknown[0]!r} does not exist here; there are {', '.join(known)}"
            )
        if len(set(selected)) != len(selected):
            raise ScopeError("knowledge_base_ids names a knowledge base twice")
    return chosen


def session_selection(
    configured: Iterable[KnowledgeBaseSpec],
    machine: str | None,
    registered: Sequence[Any],
    selected: Sequence[str] | None,
) -> Selection:
    """A session's `knowledge_bases` ([{id, path, name}]) and `knowledge_base_ids` as the API
    and the store give them, checked (`ValueError` subclasses name what is wrong)."""
    if not isinstance(registered, list | tuple):
        raise ScopeError("knowledge_bases must be a list of {id, path, name}")
    if len(registered) > MAX_SESSION_KNOWLEDGE_BASES:
        raise ScopeError(f"a session registers at most {MAX_SESSION_KNOWLEDGE_BASES} knowledge bases")
    specs = [knowledge_base_spec(entry, f"knowledge_bases[{n}]") for n, entry in enumerate(registered)]
    if selected is not None and (
        not isinstance(selected, list | tuple) or not all(isinstance(kb_id, str) for kb_id in selected)
    ):
        raise ScopeError("knowledge_base_ids must be a list of knowledge base ids, or null for all")
    return selection(configured, machine, specs, selected)
