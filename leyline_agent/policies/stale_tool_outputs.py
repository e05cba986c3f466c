"""``stale_tool_outputs``: tool outputs older than the last ``keep_last`` agent steps become a stub.

The paper's rule. An agent step is one assistant message; its outputs are the observations that
follow it (several for parallel tool calls). Once a step is more than ``keep_last`` steps old, its
outputs are evicted: the first output's content becomes ``stub`` with ``{n}`` = the number of
outputs of that step (1 for a single call; k for k parallel calls), and the step's other outputs
become empty (they stay, so that every tool call keeps its answer). A step's outputs are complete
before it can go stale, so a stub never changes once written and the server reuses its KV on every
later turn. Mode AMORTIZE.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.policies.protocol import Conversation, Edit
from leyline_agent.policies.registry import register_policy
from leyline_agent.policies.stubs import DEFAULT_STUB, StubTemplate, stub_edits


@register_policy("stale_tool_outputs")
class StaleToolOutputs(BaseModel):
    """Stub the outputs of every agent step except the last ``keep_last``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keep_last: int = Field(default=2, ge=0, description="agent steps whose outputs stay verbatim")
    stub: StubTemplate = DEFAULT_STUB

    def __call__(self, conversation: Conversation) -> list[Edit]:
        last_stale = conversation.num_steps - self.keep_last
        groups = [
            g for g in conversation.observation_groups() if conversation.steps[g[0]] <= last_stale
        ]
        return stub_edits(conversation, groups, self.stub, "stale_tool_outputs")
