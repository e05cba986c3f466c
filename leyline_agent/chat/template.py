"""Chat templates compiled in the jinja2 environment transformers renders them in.

Sandboxed (``ImmutableSandboxedEnvironment``), ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, ``{% generation %}`` blocks accepted, ``tojson`` without HTML
escaping (with ``indent``/``separators``/``sort_keys``), ``raise_exception`` and ``strftime_now``.
The sandbox's answers are the same, reached faster (``_ChatTemplateEnvironment``): a template
reads message fields (``message.role``) on every message of every prefix the renderer renders.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' ``{% generation %}…{% endgeneration %}`` blocks (rendered as-is)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the same results, faster on what templates do most.

    ``x.name`` on a plain ``dict`` that has no attribute ``name`` is ``x["name"]`` (or undefined),
    as jinja2 finds it after a failed ``getattr``; and whether an attribute is safe depends only
    on the object's type and the name (``is_internal_attribute``, ``modifies_known_mutable`` test
    ``isinstance`` and the name), so the answer is remembered per ``(type, name)``."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except LookupError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = self._safe[key] = super().is_safe_attribute(obj, attr, value)
        return safe


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in transformers' jinja2 environment."""
    env = _ChatTemplateEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
