"""The policy contract: ``Policy`` looks at a ``Conversation`` and returns ``Edit``s.

A policy looks at the whole conversation an agent is about to send and returns edits (replace a
message's content or a character span of it, or drop a message), each with the mode the server
should execute it with. It must be deterministic and do no I/O: the wrapper calls it on every turn
with the full incoming message list and diffs the result against what the server already holds,
so an edit that is returned identically on every turn costs nothing after the first time.

Observations are the environment's answers to the agent (``messages.is_observation``): ``role:
"tool"`` messages, and plain ``user`` messages flagged with ``"leyline_observation": True``
(text-based agents; the trace loaders set the flag). Policies treat both alike.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol, Self, overload

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from leyline_agent.directive import Mode
from leyline_agent.messages import is_observation, message_text


class PolicyError(ValueError):
    """A policy name, its parameters, or the edits it returned are invalid."""


class Edit(BaseModel):
    """One change to the conversation.

    Attributes:
        index: message index in the incoming list.
        span: ``(start, end)`` character span of the message's text to replace; ``None`` replaces
            the whole content.
        replacement: new text; ``None`` (only with ``span=None``) drops the message.
        key: the text the edit changes: the message's ``content`` (default), or its
            ``reasoning_content`` (an assistant message's reasoning, sent back by clients such as
            litellm; a string, with ``span`` over it; ``replacement`` required).
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
    key: Literal["content", "reasoning_content"] = "content"

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.key != "content" and self.replacement is None:
            raise ValueError(f"an edit of {self.key} needs a replacement text")
        if self.span is not None:
            if self.replacement is None:
                raise ValueError("a span edit needs a replacement text (None drops whole messages)")
            if not 0 <= self.span[0] <= self.span[1]:
                raise ValueError(f"span {self.span} must satisfy 0 <= start <= end")
        return self


class LazyTokenCounts(Sequence[int]):
    """``Conversation.token_counts`` from a render made when a policy first reads a count (a
    policy that reads none, such as ``stale_tool_outputs``, costs no render): ``spans()`` gives
    every message's ``(start, end)`` token span."""

    def __init__(self, n: int, spans: Callable[[], Sequence[tuple[int, int]]]) -> None:
        self._n, self._spans = n, spans
        self._counts: list[int] | None = None

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if self._counts is None:
            self._counts = [e - s for s, e in self._spans()]
        return self._counts[i]


@dataclass(frozen=True)
class Conversation:
    """What a policy sees: the full incoming message list of one turn.

    Attributes:
        messages: the messages as the agent sent them (do not mutate).
        token_counts: tokens of each message's span in the rendered prompt (chat-template markup
            included; the template's preamble and generation prompt are in no message).
        turn: index of this request in the conversation (0 for the first).
        count_tokens: tokens in a text with the model's tokenizer (to size a stub).
        previous: the edits this policy returned on the previous turn, for the messages the agent
            sent again unchanged, re-indexed to ``messages`` (``carry_edits``; the wrapper fills
            it). A policy whose decisions must not be undone (an evicted output stays evicted)
            reads it; the others ignore it.
    """

    messages: Sequence[Mapping[str, Any]]
    token_counts: Sequence[int]
    turn: int = 0
    count_tokens: Callable[[str], int] = field(default=lambda text: len(text.encode()) // 4 + 1)
    previous: Sequence[Edit] = ()

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


def carry_edits(
    before: Sequence[Mapping[str, Any]],
    edits: Sequence[Edit],
    after: Sequence[Mapping[str, Any]],
) -> list[Edit]:
    """``edits`` of the message list ``before``, re-indexed to ``after``: an edit follows its
    message when the agent sent it again unchanged (equal, at the same index or, where messages
    were inserted or dropped, where ``difflib`` aligns it); edits of changed or dropped messages
    are left out."""
    if not edits:
        return []
    same = [e for e in edits if e.index < len(after) and _equal(before[e.index], after[e.index])]
    if len(same) == len(edits):
        return list(edits)
    moved: dict[int, int] = {}
    keys_b = [_KEYS.encode(m) for m in before]
    keys_a = [_KEYS.encode(m) for m in after]
    matcher = difflib.SequenceMatcher(None, keys_b, keys_a, autojunk=False)
    for i, j, n in matcher.get_matching_blocks():
        moved.update((i + k, j + k) for k in range(n))
    return [e.model_copy(update={"index": moved[e.index]}) for e in edits if e.index in moved]


def _equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a is b or a == b


_KEYS = json.JSONEncoder(sort_keys=True, default=str)


class Policy(Protocol):
    """Decides the edits of one turn.

    Called with the full incoming conversation of each turn; returns edits whose indices refer to
    ``conversation.messages``. Deterministic and free of I/O; return the same edit for the same
    message on every later turn (a stub must not change once written) so the server reuses it.
    """

    def __call__(self, conversation: Conversation) -> Sequence[Edit]: ...


@dataclass(frozen=True)
class Chain:
    """Several policies as one: each one's edits in order, an edit of a message (and key) that an
    earlier policy already edits left out. Each sees the same conversation, ``previous`` included
    (policies keep their own decisions by their ``reason``)."""

    policies: tuple[Policy, ...]

    def __call__(self, conversation: Conversation) -> list[Edit]:
        out: list[Edit] = []
        for policy in self.policies:
            taken = {(e.index, e.key) for e in out}
            out += [e for e in policy(conversation) if (e.index, e.key) not in taken]
        return out


def check_template(text: str, **placeholders: Any) -> str:
    """Validate a stub template for a policy parameter: ``text.format(**placeholders)`` must work
    (it may use those names and nothing else). Returns ``text``.

    Raises:
        ValueError: another placeholder, a positional one, or a malformed format string.
    """
    try:
        text.format(**placeholders)
    except (KeyError, IndexError, ValueError) as e:
        names = ", ".join(f"{{{k}}}" for k in placeholders)
        raise ValueError(f"{text!r} may only use the placeholders {names}: {e}") from e
    return text


def template_check(**placeholders: Any) -> AfterValidator:
    """``check_template(value, **placeholders)`` as a validator of a policy's template parameter
    (``Annotated[str, template_check(n=1)]``)."""
    return AfterValidator(lambda text: check_template(text, **placeholders))
