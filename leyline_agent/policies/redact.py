"""``redact``: replace every match of the given regular expressions, mode FORGET.

Scans the text content of every message (tool-call arguments are not scanned). Each match becomes
``replacement``; overlapping matches of different patterns merge into one. FORGET: the server
re-prefills from the first redacted token and purges the old span from its cache, so the secret's
influence on later tokens' KV is gone too (AMORTIZE would keep it).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from leyline_agent.directive import Mode
from leyline_agent.policies.protocol import Conversation, Edit
from leyline_agent.policies.registry import register_policy


@register_policy("redact")
class Redact(BaseModel):
    """Replace regex matches in message contents."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    patterns: list[str] = Field(min_length=1, description="Python regular expressions")
    replacement: str = "[redacted]"
    roles: list[str] | None = Field(default=None, description="only these roles (default: all)")

    @field_validator("patterns")
    @classmethod
    def _compile(cls, v: list[str]) -> list[str]:
        for p in v:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"pattern {p!r} is not a regular expression: {e}") from e
        return v

    def __call__(self, conversation: Conversation) -> list[Edit]:
        compiled = [re.compile(p) for p in self.patterns]
        edits = []
        for i, message in enumerate(conversation.messages):
            if self.roles is not None and message.get("role") not in self.roles:
                continue
            text = conversation.text(i)
            spans = sorted(
                m.span() for rx in compiled for m in rx.finditer(text) if m.end() > m.start()
            )
            merged: list[list[int]] = []
            for s, e in spans:
                if merged and s <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], e)
                else:
                    merged.append([s, e])
            edits += [
                Edit(
                    index=i,
                    span=(s, e),
                    replacement=self.replacement,
                    mode=Mode.FORGET,
                    reason="redact",
                )
                for s, e in merged
            ]
        return edits
