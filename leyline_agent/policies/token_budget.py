"""``token_budget``: evict the oldest tool outputs until the messages fit in ``max_tokens``.

Observations are evicted a whole agent step at a time, oldest first, exactly as
``stale_tool_outputs`` evicts them (same stub, same ``{n}``), until the sum of the messages' token
counts (chat markup included, each evicted output counted at its stub's size) is at most
``max_tokens``. Only observations are evicted: a conversation whose other messages alone exceed the
budget stays over it. While the conversation only grows between turns, an evicted step stays
evicted; if the agent shrinks an earlier message itself (froggy rewrites its system prompt), the
prompt may fit again and an evicted step comes back verbatim (a re-prefill from it on). Mode
AMORTIZE.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.policies.protocol import Conversation, Edit
from leyline_agent.policies.registry import register_policy
from leyline_agent.policies.stubs import DEFAULT_STUB, StubTemplate, stub_edits


@register_policy("token_budget")
class TokenBudget(BaseModel):
    """Stub the oldest agent steps' outputs until the conversation is within ``max_tokens``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(ge=0, description="budget for the sum of per-message token counts")
    stub: StubTemplate = DEFAULT_STUB

    def __call__(self, conversation: Conversation) -> list[Edit]:
        total = conversation.total_tokens
        evict: list[list[int]] = []
        for group in conversation.observation_groups():
            if total <= self.max_tokens:
                break
            before = sum(conversation.token_counts[i] for i in group)
            after = conversation.count_tokens(self.stub.format(n=len(group)))
            total -= before - after
            evict.append(group)
        return stub_edits(conversation, evict, self.stub, "token_budget")
