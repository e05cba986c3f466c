"""The three arms every harness compares (``leyline replay``, ``leyline eval debug-gym``).

=============  ===========================  ====================================================
arm            policy                       what the backend does
=============  ===========================  ====================================================
``none``       ``none``                     the history only grows; radix prefix caching at best
``reprefill``  the policy, ``splice=False``  the edited prompt as is: cache hit up to the first
                                            edit, everything after it re-prefilled
``splice``     the policy, ``splice=True``   the edits as directives (``/leyline/splice``), then
                                            the edited prompt
=============  ===========================  ====================================================
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Arm = Literal["none", "reprefill", "splice"]
ARMS: tuple[Arm, ...] = ("none", "reprefill", "splice")
DEFAULT_POLICY = "stale_tool_outputs:keep_last=2"


class ArmSwitch[P](NamedTuple):
    """What a session of one arm runs: the policy (``"none"`` for the ``none`` arm) and whether
    its edits are spliced."""

    policy: P | str
    splice: bool


def arm_switch[P](arm: Arm, policy: P) -> ArmSwitch[P]:
    """The switches of ``arm`` given the policy of the edit arms (a spec string or a policy)."""
    return ArmSwitch("none" if arm == "none" else policy, arm == "splice")
