"""``observation_window``: keep the last ``n`` observations verbatim, mask the older ones.

Observation masking as agent frameworks do it (SWE-agent's ``last_n_observations`` history
processor): each older observation's content becomes ``placeholder`` with ``{lines}`` = its number
of lines, so the agent still sees that an output was there and how long it was. Counted per
observation (not per agent step). A masked observation never changes again while the agent only
appends (or drops whole old observations: the window counts back from the newest). Mode AMORTIZE.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.policies.protocol import Conversation, Edit, template_check
from leyline_agent.policies.registry import register_policy

DEFAULT_PLACEHOLDER = "Old environment output: ({lines} lines omitted)"


@register_policy("observation_window")
class ObservationWindow(BaseModel):
    """Mask every observation but the last ``n``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n: int = Field(default=5, ge=0, description="observations kept verbatim")
    placeholder: Annotated[str, template_check(lines=1)] = Field(
        default=DEFAULT_PLACEHOLDER, description="{lines} = masked lines"
    )

    def __call__(self, conversation: Conversation) -> list[Edit]:
        obs = conversation.observations
        masked = obs[: max(len(obs) - self.n, 0)]
        return [
            Edit(
                index=i,
                replacement=self.placeholder.format(lines=len(conversation.text(i).splitlines())),
                reason="observation_window",
            )
            for i in masked
        ]
