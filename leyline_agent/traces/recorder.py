"""``leyline proxy --record DIR``: write each session's turns as the JSONL traces that
``jsonl.py`` reads back."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote


class RecordKey(Protocol):
    """What names a session's file: ``proxy.identity.SessionKey`` is one."""

    @property
    def tenant(self) -> str: ...

    @property
    def public_id(self) -> str: ...


class TraceRecorder:
    """``--record DIR``: one JSONL file per session, one line per finished turn.

    Line: ``{"session": id, "tenant": t, "turn": n, "messages": [...], "tools": [...]}`` with the
    message list as the agent sent it (before the policy). ``leyline_agent.traces.load(DIR)``
    reads each file back as one trace (the JSONL loader's one-request-per-line shape). The file
    name is ``<tenant>+<public id>``, each percent-escaped (reversible, and ``+`` never occurs in
    an escaped part, so two sessions never share a file), e.g. ``default+dg-1a2b-none-config``;
    past 160 characters it is cut and 16 hex digits of its SHA-256 are appended.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: RecordKey) -> Path:
        stem = (
            f"{quote(key.tenant, safe='')}+{quote(key.public_id, safe='')}"  # "+" is always escaped
        )
        if len(stem) > 160:
            stem = stem[:140] + "-" + hashlib.sha256(stem.encode()).hexdigest()[:16]
        return self.directory / (stem + ".jsonl")

    def write(
        self,
        key: RecordKey,
        turn: int,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
    ) -> None:
        line = {"session": key.public_id, "tenant": key.tenant, "turn": turn}
        line["messages"] = list(messages)
        if tools:
            line["tools"] = list(tools)
        with self.path(key).open("a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
