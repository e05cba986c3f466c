"""Re-rendering a conversation whose first message changed in place, from a small window.

Agents such as debug-gym's froggy rewrite the first message on every turn (the task plus the
latest test report), so the incremental renderer's common message prefix is empty. For a local
template (``chat.locality``) whose later messages do not depend on the first message's content
(*head-local*: ChatML reads only its role), the rest of the prompt is the old one: with the old
list's messages ``1..`` unchanged, the text up to message 2 is cut from a render of the window
``[new0, old1, old2]`` and the old text from message 2 on follows (``splice_head``; raw
boundaries likewise). ``head_local(renderer)`` decides it once per renderer: the template is local
and a probe check (windowed == full render for content edits of the first message, with and
without tools and system message, at several lengths) passes. The same property lets a tail
window render a long first message as the short ``STAND_IN``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from leyline_agent.chat.locality import _probe_conversations, full_text
from leyline_agent.chat.spans import Message

if TYPE_CHECKING:
    from leyline_agent.chat.render import Renderer

_DECIDED: WeakKeyDictionary[Renderer, bool] = WeakKeyDictionary()
STAND_IN = "changed\nDate: 2"  # a first message's content the probe renders (see render_cache)


def content_only(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """``new`` differs from ``old`` in its ``content`` only (same keys, the rest equal)."""
    return old.keys() == new.keys() and all(old[k] == new[k] for k in old if k != "content")


def splice_head(
    old_text: str, old_raw: list[int], text_w: str, raw_w: list[int]
) -> tuple[str, list[int]]:
    """Text and raw boundaries of ``[new0, *old[1:]]`` (``len(old) >= 3``) from the old render and
    the render of the window ``[new0, old1, old2]``: the window's text up to message 2, then the
    old text from message 2 on."""
    cut, cut_w = old_raw[2], raw_w[2]
    return text_w[:cut_w] + old_text[cut:], raw_w[:2] + [b - cut + cut_w for b in old_raw[2:]]


def head_local(renderer: Renderer) -> bool:
    """Whether ``splice_head`` reproduces full renders for ``renderer`` (decided once)."""
    hit = _DECIDED.get(renderer)
    if hit is None:
        hit = _DECIDED[renderer] = renderer.incremental_checks[0] and _probe_all(renderer)
    return hit


def _probe_all(renderer: Renderer) -> bool:
    tools = [{"type": "function", "function": {"name": "view", "parameters": {}}}]
    try:
        return all(
            _probe(renderer, conv, t) for conv in _probe_conversations() for t in (None, tools)
        )
    except Exception:  # noqa: BLE001 - a template that rejects the probes is not known local
        return False


def _probe(renderer: Renderer, conv: Sequence[Message], tools: list[Any] | None) -> bool:
    for n in sorted({3, 4, 6, len(conv)}):
        old = list(conv[:n])
        old_text, old_raw = full_text(renderer, old, tools, True)
        for content in (STAND_IN, "", old[0].get("content", "") + " x"):
            new = [{**old[0], "content": content}, *old[1:]]
            window = full_text(renderer, new[:3], tools, True)
            if splice_head(old_text, old_raw, *window) != full_text(renderer, new, tools, True):
                return False
    return True
