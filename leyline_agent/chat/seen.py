"""What a session's last request's messages were found to be, so that the next request, which
resends them all, is checked and converted only from the first message that differs.

A chat client resends the whole history on every turn. Checking each message
(``request.request_error``: its shape and its text's Unicode), serving it (``openai.served_message``)
and reading its ``cache_control`` markers (``markers.message_marks``) cost microseconds per
message: milliseconds per turn at 30k tokens, on every turn, for messages already checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from leyline_agent.chat.locality import common_messages
from leyline_agent.chat.render_state import frozen
from leyline_agent.chat.spans import Message


class SeenMessages:
    """The last accepted request's messages (frozen copies), their served forms and their
    ``cache_control`` markers, index by index.

    Every fact kept is a function of one message alone (its checks passed, its served form, its
    markers), so a message equal (``==``, as ``render_cache`` compares them) to the one at its
    index last time has the same facts, whatever else the request holds. The copies are frozen:
    a client that mutates a message it sent cannot make a stale fact look current.
    """

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.served: list[dict[str, Any]] = []
        self.marks: list[list[Mapping[str, Any]]] = []

    def known(self, messages: Any) -> int:
        """How many leading messages of ``messages`` (a request's, not yet checked) were seen."""
        if not isinstance(messages, list):
            return 0
        return common_messages(self.messages, messages)

    def update(
        self,
        messages: Sequence[Message],
        known: int,
        served: list[dict[str, Any]],
        marks: list[list[Mapping[str, Any]]],
    ) -> None:
        """Remember a checked request: its first ``known`` messages are the seen ones; ``served``
        and ``marks`` hold every message's facts."""
        self.messages = [*self.messages[:known], *map(frozen, messages[known:])]
        self.served, self.marks = served, marks
