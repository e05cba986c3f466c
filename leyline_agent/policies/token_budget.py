"""``token_budget``: evict the oldest tool outputs until the messages fit in ``max_tokens``.

Observations are evicted a whole agent step at a time, oldest first, exactly as
``stale_tool_outputs`` evicts them (same stub, same ``{n}``), until the sum of the messages' token
counts (chat markup included, each evicted output counted at its stub's size) is at most
``max_tokens``. Only observations are evicted: a conversation whose other messages alone exceed the
budget stays over it. Eviction is monotone: a step evicted on the previous turn
(``Conversation.previous``) stays evicted, also when the agent shrinks an earlier message itself
(froggy rewrites its system prompt with the latest test output) and the prompt would fit again, so
an evicted output never comes back verbatim (which would cost a re-prefill from it on). Mode
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
        def saved(group: list[int]) -> int:
            before = sum(conversation.token_counts[i] for i in group)
            return before - conversation.count_tokens(self.stub.format(n=len(group)))

        groups = conversation.observation_groups()
        # NOTE: its own stubs only (a chain of policies may pass on the others' edits too).
        done = {e.index for e in conversation.previous if e.reason == "token_budget"}
        evicted = [bool(done.intersection(g)) for g in groups]  # evicted before: stays evicted
        total = conversation.total_tokens - sum(
            saved(g) for g, e in zip(groups, evicted, strict=True) if e
        )
        for k, group in enumerate(groups):
            if total <= self.max_tokens:
                break
            if not evicted[k]:
                total -= saved(group)
                evicted[k] = True
        evict = [g for g, e in zip(groups, evicted, strict=True) if e]
        return stub_edits(conversation, evict, self.stub, "token_budget")
