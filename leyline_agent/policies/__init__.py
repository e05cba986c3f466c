"""Policies: small deterministic plug-ins that decide what to edit in a conversation.

Built-ins: ``none``, ``stale_tool_outputs``, ``token_budget``, ``observation_window``, ``redact``,
``clear_thinking``, ``clear_tool_uses``.
Third-party policies register with :func:`register_policy` or the ``leyline_agent.policies``
entry-point group. See ``docs/policies.md``.
"""

from __future__ import annotations

from leyline_agent.messages import OBSERVATION_KEY, is_observation, message_text
from leyline_agent.policies.clear_thinking import ClearThinking
from leyline_agent.policies.clear_tool_uses import ClearToolUses
from leyline_agent.policies.edits import EditResult, apply_edits
from leyline_agent.policies.none import NonePolicy
from leyline_agent.policies.observation_window import ObservationWindow
from leyline_agent.policies.protocol import Conversation, Edit, Policy, PolicyError, carry_edits
from leyline_agent.policies.redact import Redact
from leyline_agent.policies.registry import (
    ENTRY_POINT_GROUP,
    available_policies,
    get_policy,
    parse_policy,
    register_policy,
)
from leyline_agent.policies.stale_tool_outputs import StaleToolOutputs
from leyline_agent.policies.token_budget import TokenBudget

__all__ = [
    "ENTRY_POINT_GROUP",
    "OBSERVATION_KEY",
    "ClearThinking",
    "ClearToolUses",
    "Conversation",
    "Edit",
    "EditResult",
    "NonePolicy",
    "ObservationWindow",
    "Policy",
    "PolicyError",
    "Redact",
    "StaleToolOutputs",
    "TokenBudget",
    "apply_edits",
    "available_policies",
    "carry_edits",
    "get_policy",
    "is_observation",
    "message_text",
    "parse_policy",
    "register_policy",
]
