"""Policy plug-ins: the ``Policy`` protocol, ``Edit``, the ``Conversation`` view and the registry.

A policy looks at the whole conversation an agent is about to send and returns edits (replace a
message's content or a character span of it, or drop a message), each with the mode the server
should execute it with. It must be deterministic and do no I/O: the wrapper calls it on every turn
with the full incoming message list and diffs the result against what the server already holds,
so an edit that is returned identically on every turn costs nothing after the first time.

Observations are the environment's answers to the agent: ``role: "tool"`` messages, and plain
``user`` messages flagged with ``"leyline_observation": True`` (text-based agents; the trace
loaders set the flag). Policies treat both alike.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import entry_points
from typing import Any, NamedTuple, Protocol, Self, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from leyline_agent.directive import Mode

OBSERVATION_KEY = "leyline_observation"
ENTRY_POINT_GROUP = "leyline_agent.policies"


class PolicyError(ValueError):
    """A policy name, its parameters, or the edits it returned are invalid."""


def is_observation(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` is an environment observation (tool output)."""
    return message.get("role") == "tool" or bool(message.get(OBSERVATION_KEY))


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as one string (``None`` -> ``""``; text parts joined with spaces, as
    SGLang joins them for string-content chat templates)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return " ".join(
        p if isinstance(p, str) else str(p.get("text", ""))
        for p in content
        if isinstance(p, str) or p.get("type") == "text"
    )


def stronger(a: Mode | None, b: Mode | None) -> Mode | None:
    """The stronger of two modes (FORGET > AMORTIZE > None)."""
    if Mode.FORGET in (a, b):
        return Mode.FORGET
    return a or b


class Edit(BaseModel):
    """One change to the conversation.

    Attributes:
        index: message index in the incoming list.
        span: ``(start, end)`` character span of the message's text to replace; ``None`` replaces
            the whole content.
        replacement: new text; ``None`` (only with ``span=None``) drops the message.
        mode: how the server executes the resulting directive (AMORTIZE keeps downstream KV,
            FORGET re-prefills so the old content's influence is gone).
        reason: a short label for reports (usually the policy's name).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    span: tuple[int, int] | None = None
    replacement: str | None
    mode: Mode = Mode.AMORTIZE
    reason: str = ""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.span is not None:
            if self.replacement is None:
                raise ValueError("a span edit needs a replacement text (None drops whole messages)")
            if not 0 <= self.span[0] <= self.span[1]:
                raise ValueError(f"span {self.span} must satisfy 0 <= start <= end")
        return self


@dataclass(frozen=True)
class Conversation:
    """What a policy sees: the full incoming message list of one turn.

    Attributes:
        messages: the messages as the agent sent them (do not mutate).
        token_counts: tokens of each message's span in the rendered prompt (chat-template markup
            included; the template's preamble and generation prompt are in no message).
        turn: index of this request in the conversation (0 for the first).
        count_tokens: tokens in a text with the model's tokenizer (to size a stub).
    """

    messages: Sequence[Mapping[str, Any]]
    token_counts: Sequence[int]
    turn: int = 0
    count_tokens: Callable[[str], int] = field(default=lambda text: len(text.encode()) // 4 + 1)

    def __post_init__(self) -> None:
        if len(self.token_counts) != len(self.messages):
            raise ValueError(
                f"{len(self.token_counts)} token counts for {len(self.messages)} messages"
            )

    def text(self, index: int) -> str:
        """Message ``index``'s content as a string."""
        return message_text(self.messages[index])

    @cached_property
    def observations(self) -> tuple[int, ...]:
        """Indices of observation messages, oldest first."""
        return tuple(i for i, m in enumerate(self.messages) if is_observation(m))

    @cached_property
    def steps(self) -> tuple[int, ...]:
        """Per message, the number of assistant messages before it (its agent step)."""
        out, n = [], 0
        for m in self.messages:
            out.append(n)
            n += m.get("role") == "assistant"
        return tuple(out)

    @property
    def num_steps(self) -> int:
        """Number of assistant messages (agent actions) so far."""
        return sum(m.get("role") == "assistant" for m in self.messages)

    @property
    def total_tokens(self) -> int:
        """Sum of the messages' token counts."""
        return sum(self.token_counts)

    def observation_groups(self) -> list[list[int]]:
        """Observations grouped by the agent step they answer, oldest first.

        A group holds the outputs of one assistant message (several for parallel tool calls).
        """
        groups: dict[int, list[int]] = {}
        for i in self.observations:
            groups.setdefault(self.steps[i], []).append(i)
        return list(groups.values())


class Policy(Protocol):
    """Decides the edits of one turn.

    Called with the full incoming conversation of each turn; returns edits whose indices refer to
    ``conversation.messages``. Deterministic and free of I/O; return the same edit for the same
    message on every later turn (a stub must not change once written) so the server reuses it.
    """

    def __call__(self, conversation: Conversation) -> Sequence[Edit]: ...


class EditResult(NamedTuple):
    """``apply_edits``' result.

    messages: the edited list (dropped messages removed).
    sources: per edited message, its index in the incoming list.
    modes: per incoming index that an edit touched, the strongest mode among its edits.
    """

    messages: list[dict[str, Any]]
    sources: list[int]
    modes: dict[int, Mode]


def apply_edits(messages: Sequence[Mapping[str, Any]], edits: Sequence[Edit]) -> EditResult:
    """Apply edits to a message list (the input is not modified).

    An edit changes a message's ``content`` and nothing else: ``role``, ``tool_call_id``,
    ``name``, ``tool_calls`` and every other key stay as they were. Content keeps its type:

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
            mode = stronger(mode, e.mode)
        modes[i] = mode or Mode.AMORTIZE
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
        text = message_text(message)
        ordered = sorted(mine, key=lambda e: e.span)  # type: ignore[arg-type, return-value]
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.span[1] > b.span[0]:  # type: ignore[index]
                raise PolicyError(f"message {i}: overlapping edit spans {a.span} and {b.span}")
        if ordered[-1].span[1] > len(text):  # type: ignore[index]
            raise PolicyError(f"message {i}: span {ordered[-1].span} past its {len(text)} chars")
        content = message.get("content")
        if isinstance(content, list):
            new_content: Any = _edit_parts(content, ordered)
        else:
            new_content = _edit_text(text, ordered)
        out.append({**message, "content": new_content})
        sources.append(i)
    return EditResult(out, sources, modes)


def _edit_text(text: str, ordered: Sequence[Edit]) -> str:
    """``text`` with non-overlapping span edits (sorted by span) applied."""
    for e in reversed(ordered):
        s, t = e.span  # type: ignore[misc]
        text = text[:s] + e.replacement + text[t:]  # type: ignore[operator]
    return text


def _is_text_part(part: Any) -> bool:
    return isinstance(part, str) or part.get("type") == "text"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _edit_parts(parts: list[Any], ordered: Sequence[Edit]) -> list[Any]:
    """Span edits (over ``message_text``'s join of the text parts) applied to a parts list."""
    texts = [i for i, p in enumerate(parts) if _is_text_part(p)]
    bounds, start = [], 0
    for i in texts:
        n = len(message_text({"content": [parts[i]]}))
        bounds.append((i, start, start + n))
        start += n + 1  # the joining space
    owner = []
    for e in ordered:
        s, t = e.span  # type: ignore[misc]
        inside = [(i, a) for i, a, b in bounds if a <= s and t <= b]
        owner.append(inside[0] if inside else None)
    if not texts or None in owner:  # a span crosses a part boundary: merge the text parts
        merged = _text_part(_edit_text(message_text({"content": parts}), ordered))
        first = texts[0] if texts else 0
        rest = [p for i, p in enumerate(parts) if i not in texts]
        return [*rest[:first], merged, *rest[first:]]
    out = list(parts)
    for i, a in dict.fromkeys(owner):  # type: ignore[misc]
        shifted = [
            e.model_copy(update={"span": (e.span[0] - a, e.span[1] - a)})  # type: ignore[index]
            for e, o in zip(ordered, owner, strict=True)
            if o == (i, a)
        ]
        text = _edit_text(message_text({"content": [parts[i]]}), shifted)
        out[i] = text if isinstance(parts[i], str) else {**parts[i], "text": text}
    return out


# --- registry ---------------------------------------------------------------------------------

PolicyFactory = Callable[..., Policy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class (or factory) decorator: make a policy available by ``name``.

    Third-party packages can instead declare an entry point in the ``leyline_agent.policies``
    group (``name = "package.module:Factory"``); it is loaded on first lookup.
    """

    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise PolicyError(f"policy {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def _entry_point(name: str) -> PolicyFactory | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            factory = ep.load()
            _REGISTRY.setdefault(name, factory)
            return factory
    return None


def available_policies() -> list[str]:
    """Names of registered and entry-point policies."""
    return sorted({*_REGISTRY, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def _factory(name: str) -> PolicyFactory:
    factory = _REGISTRY.get(name) or _entry_point(name)
    if factory is None:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(available_policies())}")
    return factory


def _parameters(factory: PolicyFactory) -> dict[str, Any]:
    """Accepted keyword parameters and their annotations."""
    if isinstance(factory, type) and issubclass(factory, BaseModel):
        return {k: f.annotation for k, f in factory.model_fields.items()}
    target = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    hints = get_type_hints(target)
    params = inspect.signature(factory).parameters
    return {k: hints.get(k, Any) for k, p in params.items() if p.kind is not p.VAR_POSITIONAL}


def _is_sequence_type(annotation: Any) -> bool:
    types = [annotation, *get_args(annotation)]
    return any(get_origin(t) in (list, tuple, set, frozenset, Sequence) for t in types)


def get_policy(name: str, **params: Any) -> Policy:
    """A policy instance by registered name.

    Raises:
        PolicyError: unknown name or invalid parameters.
    """
    factory = _factory(name)
    try:
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return factory.model_validate(params)  # type: ignore[return-value]
        accepted = _parameters(factory)
        unknown = set(params) - set(accepted)
        if unknown:
            raise PolicyError(f"policy {name!r}: unknown parameters {sorted(unknown)}")
        typed = {k: TypeAdapter(accepted[k]).validate_python(v) for k, v in params.items()}
        return factory(**typed)
    except ValidationError as e:
        raise PolicyError(f"policy {name!r}: invalid parameters: {e}") from e


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_policy(spec: str | Policy | None) -> Policy:
    """A policy from ``"name"`` or ``"name:key=value,key=value"`` (or an instance, returned as is).

    Values are typed by the policy's parameter annotations (``keep_last=2`` is an int). A
    value starting with ``[`` or ``{`` is parsed as JSON unless the parameter is a ``str``; a list
    parameter accepts a JSON list
    (``patterns=["sk-\\w+","ghp_\\w+"]``), a repeated key (``patterns=a,patterns=b``) or a single
    value. Commas inside brackets (``\\d{1,3}``) do not split parameters. ``None`` or ``""``
    means ``none``.

    Raises:
        PolicyError: unknown policy, unknown or invalid parameter, or a malformed spec.
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return get_policy("none")
    if not isinstance(spec, str):
        return spec
    name, _, rest = spec.strip().partition(":")
    factory = _factory(name.strip())
    accepted = _parameters(factory)
    params: dict[str, Any] = {}
    for item in _split_top_level(rest, ",") if rest.strip() else []:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise PolicyError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        if key not in accepted:
            raise PolicyError(
                f"policy {name!r} has no parameter {key!r}; accepted: {', '.join(accepted)}"
            )
        value: Any = raw
        if raw.strip()[:1] in "[{" and accepted[key] is not str:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as e:
                raise PolicyError(f"policy spec {spec!r}: {key}={raw!r} is not JSON: {e}") from e
        if _is_sequence_type(accepted[key]):
            prev = params.get(key, [])
            params[key] = [*prev, *(value if isinstance(value, list) else [value])]
        elif key in params:
            raise PolicyError(f"policy spec {spec!r}: {key!r} given twice")
        else:
            params[key] = value
    return get_policy(name.strip(), **params)
