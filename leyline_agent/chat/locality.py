"""When the incremental renderer may reuse work: template locality (text) and cut points (tokens).

Text. A template is *local* when every message's rendering depends only on itself, the previous
message, what follows it, ``messages[0]`` and the tools (ChatML: the system block, tool outputs
grouped under one ``user`` turn). Then, with the first ``m`` messages unchanged (``m >= 3``), the
text up to message ``m - 1``'s raw boundary is the old one and the rest is cut from a render of the
window ``[messages[0], messages[m-2], *messages[m-1:]]`` (boundaries by the same prefix renders, on
the window: ``splice_window``). Locality is decided once per renderer (``is_local``): a static
screen of the template source (no ``namespace``, ``length``, ``revindex``, ...) and a probe check
(windowed == full render on synthetic conversations with and without tools, system message,
parallel and consecutive tool calls, edits).

Tokens. Pre-tokenization never crosses a special token: the tokenizer splits the text at added
tokens first and encodes the pieces independently. So where two texts agree up to the end of a
special token, the ids up to it are shared. This holds when no special token has
``lstrip``/``rstrip``/``single_word`` set, none overlaps another (no suffix of one is a prefix or
infix of another), and the pre-tokenizer has no first-piece-only behaviour (``Metaspace`` with
``prepend_scheme: first``): ``cut_token_ids``, checked once per tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from leyline_agent.chat.spans import Message

if TYPE_CHECKING:
    from leyline_agent.chat.render import Renderer

# The static screen. Message-relative forms are allowed (ChatML: the previous and next message,
# whether this is the first); any other use of the loop index or of the list as a whole (its
# length, filters over it, negative or sliced indexing, a second loop over it), a namespace
# (state carried across messages) or the clock makes a template non-local.
_ALLOWED = re.compile(
    r"messages\s*\[\s*(0|loop\.index0\s*[-+]\s*1)\s*\]|loop\.index0\s*(==|>|!=)\s*0\b"
)
_NONLOCAL = re.compile(
    r"namespace|length|loop\.(?!first\b|last\b)|messages\s*[\[|]|strftime|reverse"
)
_LOOPS = re.compile(r"\bin\s+messages\b")


def _screened(source: str) -> bool:
    """The template source passes the static screen (see above)."""
    return len(_LOOPS.findall(source)) <= 1 and not _NONLOCAL.search(_ALLOWED.sub("", source))


def common_messages(a: Sequence[Message], b: Sequence[Message], start: int = 0) -> int:
    """How many messages from ``start`` on the lists have in common (equal, in order)."""
    n = min(len(a), len(b))
    i = start
    while i < n and (a[i] is b[i] or a[i] == b[i]):
        i += 1
    return i - start


def _probe_conversations() -> list[list[dict[str, Any]]]:
    def call(i: int) -> dict[str, Any]:
        args = json.dumps({"path": f"f{i}.py"})
        return {"id": f"c{i}", "type": "function", "function": {"name": "view", "arguments": args}}

    body: list[dict[str, Any]] = [{"role": "user", "content": "Fix the test."}]
    for i in range(2):
        body.append({"role": "assistant", "content": f"step {i}", "tool_calls": [call(i)]})
        body.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}\nx"})
    body.append({"role": "assistant", "content": "", "tool_calls": [call(7), call(8)]})
    body += [{"role": "tool", "tool_call_id": f"c{i}", "content": ""} for i in (7, 8)]
    body += [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "ok"}]
    body += [
        {"role": "user", "content": "a"},
        {"role": "tool", "tool_call_id": "c9", "content": "b"},
    ]
    return [[{"role": "system", "content": "Be careful."}, *body], body]


def full_text(
    renderer: Renderer, messages: Sequence[Message], tools: Sequence[Any] | None, agp: bool
) -> tuple[str, list[int]]:
    """The prompt text and its raw boundaries, rendered in full."""
    text = renderer.render_text(messages, tools, agp)
    return text, renderer.raw_bounds(messages, tools, text)


def splice_window(
    old_text: str, old_raw: list[int], m: int, text_w: str, raw_w: list[int]
) -> tuple[str, list[int]]:
    """Text and raw boundaries of a list whose first ``m >= 3`` messages are the old ones', from
    the old render and the render of the window ``[msgs[0], msgs[m-2], *msgs[m-1:]]``: the old
    text up to message ``m - 1``, then the window's from its third message on."""
    cut, cut_w = old_raw[m - 1], raw_w[2]
    return old_text[:cut] + text_w[cut_w:], old_raw[: m - 1] + [cut + b - cut_w for b in raw_w[2:]]


def is_local(renderer: Renderer) -> bool:
    """The renderer's chat templates pass the static screen and the probe check."""
    sources = renderer.chat_templates.values()
    if not all(_screened(src) for src in sources):
        return False
    tools = [{"type": "function", "function": {"name": "view", "parameters": {}}}]
    try:
        return all(_probe(renderer, c, t) for c in _probe_conversations() for t in (None, tools))
    except Exception:  # noqa: BLE001 - a template that rejects the probes is not known local
        return False


def _probe(renderer: Renderer, conv: Sequence[Message], tools: list[Any] | None) -> bool:
    """Windowed == full render for appends of one and two messages at every length, and for an
    edit and a removal at every position of the whole conversation."""
    full = [full_text(renderer, conv[:n], tools, True) for n in range(len(conv) + 1)]
    n = len(conv)
    cases: list[tuple[int, Sequence[Message], tuple[str, list[int]]]] = [
        (k, conv[:j], full[j]) for j in range(4, n + 1) for k in (j - 2, j - 1) if k >= 3
    ]
    for m in range(3, n):
        new: Sequence[Message]
        for new in (
            [*conv[:m], {**conv[m], "content": "changed"}, *conv[m + 1 :]],
            [*conv[:m], *conv[m + 1 :]],
        ):
            cases.append((n, new, full_text(renderer, new, tools, True)))
    for k, new, expected in cases:
        m = common_messages(conv[:k], new)
        window = [new[0], new[m - 2], *new[m - 1 :]]
        got = splice_window(*full[k], m, *full_text(renderer, window, tools, True))
        if got != expected:
            return False
    return True


def cut_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Special tokens after which a text can be encoded in two pieces (empty: none)."""
    added = tokenizer.get_added_tokens_decoder()
    if any(a.lstrip or a.rstrip or a.single_word for a in added.values()):
        return frozenset()
    pre = tokenizer.pre_tokenizer
    if pre is not None and re.search(
        r'"prepend_scheme"\s*:\s*"first"', pre.__getstate__().decode()
    ):
        return frozenset()
    specials = {i: a.content for i, a in added.items() if a.special and a.content}
    contents = [a.content for a in added.values() if a.content]
    for a in contents:
        for b in contents:
            if a != b and (a in b or any(a.endswith(b[:j]) for j in range(1, len(b)))):
                return frozenset()
    return frozenset(specials)
