"""``none``: no edits (the agent's messages go to the server as they are)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from leyline_agent.policies.protocol import Conversation, Edit
from leyline_agent.policies.registry import register_policy


@register_policy("none")
class NonePolicy(BaseModel):
    """Edit nothing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __call__(self, conversation: Conversation) -> list[Edit]:
        return []
