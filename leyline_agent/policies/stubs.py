"""Stubs: one agent step's observations evicted behind one text (``stale_tool_outputs``,
``token_budget``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated

from pydantic import Field

from leyline_agent.directive import Mode
from leyline_agent.policies.protocol import Conversation, Edit, template_check

DEFAULT_STUB = "[evicted: {n} old tool outputs]"

StubTemplate = Annotated[
    str, Field(description="replacement; {n} = outputs it stands for"), template_check(n=1)
]
"""The ``stub`` parameter of a policy that evicts through ``stub_edits`` (default ``DEFAULT_STUB``)."""


def stub_edits(
    conversation: Conversation, groups: list[list[int]], stub: str, reason: str
) -> list[Edit]:
    """Edits that evict each group of observations (one agent step's outputs) behind one stub:
    the first output becomes ``stub`` with ``{n}`` = the group's size, the others empty."""
    # NOTE: valid by construction (indices from the conversation, text replacements), so built
    # without validation: a long conversation re-states every stub on every turn.
    edits = []
    for group in groups:
        text = stub.format(n=len(group))
        edits.append(_edit(group[0], text, reason))
        edits += [_edit(i, "", reason) for i in group[1:]]
    return edits


@lru_cache(maxsize=1 << 14)
def _edit(index: int, replacement: str, reason: str) -> Edit:
    # NOTE: an ``Edit`` is frozen, so the same stub edit re-stated on every turn is one object.
    return Edit.model_construct(
        index=index, span=None, replacement=replacement, mode=Mode.AMORTIZE, reason=reason
    )
