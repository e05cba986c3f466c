"""What ``IncrementalRenderer`` remembers of a render (``RenderState``), and the copies of the
messages it keeps (``frozen``)."""

from __future__ import annotations

from copy import deepcopy
from typing import Any, NamedTuple

from leyline_agent.chat.spans import Found, Message, Rendered
from leyline_agent.chat.starts import Starts


class RenderState(NamedTuple):
    """One remembered render of ``IncrementalRenderer`` (``render_cache.py``)."""

    messages: list[Message]
    tools: list[Any] | None
    add_generation_prompt: bool
    text: str
    raw: list[int]  # boundaries before clamping
    tokens: list[int]
    starts: Starts  # first character of every token
    cuts: list[int]  # token indices right after a special token (sorted)
    rendered: Rendered
    bounds: list[int]  # clamped
    found: list[Found | None]  # content_positions
    need: list[int]  # running maximum of found[k].need (0 for None)
    pos: list[int]  # search position before each message, then after the last
    # the tokens list this render copied runs of, and those runs: (index there, index in
    # ``tokens``, count) (``IncrementalRenderer.copied``)
    copied: tuple[list[int], list[tuple[int, int, int]]] | None = None


def frozen(message: Message) -> Message:
    """A copy the caller cannot change by mutating its message (nested values copied)."""
    return {
        k: v if isinstance(v, str | int | float | None) else deepcopy(v) for k, v in message.items()
    }
