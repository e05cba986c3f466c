"""Canary for the SGLang pin: every SGLang internal the plugin touches (``compat.py``) still exists.

Classes and functions must import; attributes must exist on the class, as an annotated field, or
as a ``self.<name> = ...`` assignment in one of its classes' source (instance attributes).
"""

from __future__ import annotations

import inspect
import re
import types

import pytest
from requires import require_sglang

from leyline_agent.backends.sglang import compat


def _has_attribute(owner: object, attr: str) -> bool:
    if hasattr(owner, attr):
        return True
    if isinstance(owner, types.ModuleType) or not isinstance(owner, type):
        return False
    assigned = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=\n]+)?=[^=]")
    # a line of a tuple target: ``(\n    self.max_req_len,\n    self.max_req_input_len,\n) = ...``
    unpacked = re.compile(rf"^\s*self\.{re.escape(attr)},\s*$", re.MULTILINE)
    for cls in owner.__mro__:
        if attr in getattr(cls, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if assigned.search(source) or unpacked.search(source):
            return True
    return False


@pytest.mark.parametrize("name", sorted(compat.SYMBOLS))
def test_symbol_exists(name: str) -> None:
    require_sglang()
    assert compat.resolve(name) is not None


@pytest.mark.parametrize(
    ("owner", "attr"),
    [(o, a) for o, attrs in sorted(compat.ATTRIBUTES.items()) for a in attrs],
    ids=lambda v: str(v),
)
def test_attribute_exists(owner: str, attr: str) -> None:
    require_sglang()
    assert _has_attribute(compat.resolve(owner), attr), f"{compat.SYMBOLS[owner]} has no {attr}"


def test_unknown_names_say_where_to_add_them() -> None:
    with pytest.raises(AttributeError, match="add it to SYMBOLS"):
        compat.NotAnSGLangThing  # noqa: B018
    assert set(compat.ATTRIBUTES) <= set(compat.SYMBOLS)


def test_the_canary_can_fail() -> None:
    require_sglang()
    assert not _has_attribute(compat.resolve("RadixCache"), "no_such_attribute")
    assert not _has_attribute(compat.resolve("tokenizer_control_mixin"), "_NO_SUCH_SPECS")
