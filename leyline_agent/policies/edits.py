"""Applying a policy's edits to a message list: ``apply_edits`` -> ``EditResult``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from leyline_agent.directive import Mode
from leyline_agent.messages import content_text, is_text_part, message_text
from leyline_agent.policies.protocol import Edit, PolicyError


class EditResult(NamedTuple):
    """``apply_edits``' result.

    messages: the edited list (dropped messages removed).
    sources: per edited message, its index in the incoming list.
    modes: per incoming index that an edit touched, the strongest mode among its edits.
    """

    messages: list[dict[str, Any]]
    sources: list[int]
    modes: dict[int, Mode]


class _Span(NamedTuple):
    """A span edit: characters ``[start, end)`` of a message's text become ``text``."""

    start: int
    end: int
    text: str


def apply_edits(messages: Sequence[Mapping[str, Any]], edits: Sequence[Edit]) -> EditResult:
    """Apply edits to a message list (the input is not modified).

    An edit changes a message's ``content`` (or, with ``key="reasoning_content"``, its
    ``reasoning_content`` string) and nothing else: ``role``, ``tool_call_id``, ``name``,
    ``tool_calls`` and every other key stay as they were. Content keeps its type:

    - a string stays a string (``None`` content replaced as a whole becomes the replacement);
    - multi-part content (a list) stays a list. A whole-content replacement becomes one text part
      (``[{"type": "text", "text": replacement}]``; the replacement stands for every part). Span
      edits refer to the parts' text joined with spaces (``message_text``); each text part keeps
      its place when every span lies inside one part, otherwise the text parts are merged into
      one text part at the first one's place (the joined text is what SGLang renders for a
      string-content template, so the prompt outside the spans is unchanged), and non-text
      parts keep theirs.

    Raises:
        PolicyError: an index or span out of range, overlapping spans on one message, or a
            whole-message edit combined with another edit of the same message.
    """
    by_index: dict[int, list[Edit]] = {}
    for e in edits:
        if e.index >= len(messages):
            raise PolicyError(f"edit of message {e.index}, but there are {len(messages)} messages")
        by_index.setdefault(e.index, []).append(e)
    out: list[dict[str, Any]] = []
    sources: list[int] = []
    modes: dict[int, Mode] = {}
    for i, message in enumerate(messages):
        mine = by_index.get(i)
        if not mine:
            out.append(dict(message))
            sources.append(i)
            continue
        mode: Mode | None = None
        for e in mine:
            mode = Mode.strongest(mode, e.mode)
        modes[i] = mode or Mode.AMORTIZE
        reasoning = [e for e in mine if e.key == "reasoning_content"]
        if reasoning:
            message = _edit_reasoning(i, message, reasoning)
            mine = [e for e in mine if e.key == "content"]
            if not mine:
                out.append(dict(message))
                sources.append(i)
                continue
        whole = [e for e in mine if e.span is None]
        if whole and len(mine) > 1:
            raise PolicyError(f"message {i}: a whole-message edit cannot be combined with others")
        if whole:
            if whole[0].replacement is not None:
                text = whole[0].replacement
                content = [_text_part(text)] if isinstance(message.get("content"), list) else text
                out.append({**message, "content": content})
                sources.append(i)
            continue
        # NOTE: Edit's validator guarantees a span edit has a replacement text.
        spans = sorted(
            (_Span(*e.span, e.replacement or "") for e in mine if e.span is not None),
            key=lambda s: (s.start, s.end),
        )
        for a, b in zip(spans, spans[1:], strict=False):
            if a.end > b.start:
                raise PolicyError(
                    f"message {i}: overlapping edit spans {a.start, a.end} and {b.start, b.end}"
                )
        text = message_text(message)
        if spans[-1].end > len(text):
            last = spans[-1]
            raise PolicyError(
                f"message {i}: span {last.start, last.end} past its {len(text)} chars"
            )
        parts = message.get("content")
        new_content: str | list[Any]
        if isinstance(parts, list):
            new_content = _edit_parts(parts, spans)
        else:
            new_content = _edit_text(text, spans)
        out.append({**message, "content": new_content})
        sources.append(i)
    return EditResult(out, sources, modes)


def _edit_reasoning(i: int, message: Mapping[str, Any], edits: Sequence[Edit]) -> dict[str, Any]:
    """``message`` with edits of its ``reasoning_content`` (a string) applied."""
    text = message.get("reasoning_content")
    if not isinstance(text, str):
        raise PolicyError(f"message {i}: reasoning_content edited, but it has none (a string)")
    whole = [e for e in edits if e.span is None]
    if whole:
        if len(edits) > 1:
            raise PolicyError(f"message {i}: a whole reasoning_content edit cannot be combined")
        return {**message, "reasoning_content": whole[0].replacement or ""}
    spans = sorted(
        (_Span(*e.span, e.replacement or "") for e in edits if e.span is not None),
        key=lambda s: (s.start, s.end),
    )
    for a, b in zip(spans, spans[1:], strict=False):
        if a.end > b.start:
            raise PolicyError(f"message {i}: overlapping reasoning_content edit spans")
    if spans[-1].end > len(text):
        raise PolicyError(f"message {i}: span past its reasoning_content's {len(text)} chars")
    return {**message, "reasoning_content": _edit_text(text, spans)}


def _edit_text(text: str, spans: Sequence[_Span]) -> str:
    """``text`` with non-overlapping span edits (sorted) applied."""
    for s in reversed(spans):
        text = text[: s.start] + s.text + text[s.end :]
    return text


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _edit_parts(parts: list[Any], spans: Sequence[_Span]) -> list[Any]:
    """Span edits (over ``content_text``'s join of the text parts) applied to a parts list."""
    texts = [i for i, p in enumerate(parts) if is_text_part(p)]
    bounds, start = [], 0
    for i in texts:
        n = len(content_text([parts[i]]))
        bounds.append((i, start, start + n))
        start += n + 1  # the joining space
    owner: list[tuple[int, int] | None] = []
    for s in spans:
        inside = [(i, a) for i, a, b in bounds if a <= s.start and s.end <= b]
        owner.append(inside[0] if inside else None)
    if not texts or None in owner:  # a span crosses a part boundary: merge the text parts
        merged = _text_part(_edit_text(content_text(parts), spans))
        first = texts[0] if texts else 0
        rest = [p for i, p in enumerate(parts) if i not in texts]
        return [*rest[:first], merged, *rest[first:]]
    out = list(parts)
    for key in dict.fromkeys(owner):
        if key is None:
            continue
        i, a = key
        shifted = [
            _Span(s.start - a, s.end - a, s.text)
            for s, o in zip(spans, owner, strict=True)
            if o == key
        ]
        text = _edit_text(content_text([parts[i]]), shifted)
        out[i] = text if isinstance(parts[i], str) else {**parts[i], "text": text}
    return out
