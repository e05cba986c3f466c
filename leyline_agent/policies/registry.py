"""The policy registry: names to factories (``register_policy``, entry points) and the spec
parser (``parse_policy("stale_tool_outputs:keep_last=2")``)."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, cast, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError

from leyline_agent.policies.protocol import Policy, PolicyError

ENTRY_POINT_GROUP = "leyline_agent.policies"

PolicyFactory = Callable[..., Policy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class (or factory) decorator: make a policy available by ``name``.

    Third-party packages can instead declare an entry point in the ``leyline_agent.policies``
    group (``name = "package.module:Factory"``); it is loaded on first lookup.
    """

    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise PolicyError(f"policy {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return deco


def _entry_point(name: str) -> PolicyFactory | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            factory = ep.load()
            _REGISTRY.setdefault(name, factory)
            return factory
    return None


def available_policies() -> list[str]:
    """Names of registered and entry-point policies."""
    return sorted({*_REGISTRY, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def _factory(name: str) -> PolicyFactory:
    factory = _REGISTRY.get(name) or _entry_point(name)
    if factory is None:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(available_policies())}")
    return factory


def _parameters(factory: PolicyFactory) -> dict[str, Any]:
    """Accepted keyword parameters and their annotations."""
    if isinstance(factory, type) and issubclass(factory, BaseModel):
        return {k: f.annotation for k, f in factory.model_fields.items()}
    params = inspect.signature(factory, eval_str=True).parameters
    return {
        k: Any if p.annotation is p.empty else p.annotation
        for k, p in params.items()
        if p.kind is not p.VAR_POSITIONAL
    }


def _is_sequence_type(annotation: Any) -> bool:
    types = [annotation, *get_args(annotation)]
    return any(get_origin(t) in (list, tuple, set, frozenset, Sequence) for t in types)


def get_policy(name: str, **params: Any) -> Policy:
    """A policy instance by registered name.

    Raises:
        PolicyError: unknown name or invalid parameters.
    """
    factory = _factory(name)
    model = factory if isinstance(factory, type) and issubclass(factory, BaseModel) else None
    try:
        if model is not None:
            return cast(Policy, model.model_validate(params))
        accepted = _parameters(factory)
        unknown = set(params) - set(accepted)
        if unknown:
            raise PolicyError(f"policy {name!r}: unknown parameters {sorted(unknown)}")
        typed = {k: TypeAdapter(accepted[k]).validate_python(v) for k, v in params.items()}
        return factory(**typed)
    except ValidationError as e:
        raise PolicyError(f"policy {name!r}: invalid parameters: {e}") from e


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_policy(spec: str | Policy | None) -> Policy:
    """A policy from ``"name"`` or ``"name:key=value,key=value"`` (or an instance, returned as is).

    Values are typed by the policy's parameter annotations (``keep_last=2`` is an int). A
    value starting with ``[`` or ``{`` is parsed as JSON unless the parameter is a ``str``; a list
    parameter accepts a JSON list
    (``patterns=["sk-\\w+","ghp_\\w+"]``), a repeated key (``patterns=a,patterns=b``) or a single
    value. Commas inside brackets (``\\d{1,3}``) do not split parameters. ``None`` or ``""``
    means ``none``.

    Raises:
        PolicyError: unknown policy, unknown or invalid parameter, or a malformed spec.
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return get_policy("none")
    if not isinstance(spec, str):
        return spec
    name, _, rest = spec.strip().partition(":")
    factory = _factory(name.strip())
    accepted = _parameters(factory)
    params: dict[str, Any] = {}
    for item in _split_top_level(rest, ",") if rest.strip() else []:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise PolicyError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        if key not in accepted:
            raise PolicyError(
                f"policy {name!r} has no parameter {key!r}; accepted: {', '.join(accepted)}"
            )
        value: Any = raw
        if raw.strip()[:1] in "[{" and accepted[key] is not str:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as e:
                raise PolicyError(f"policy spec {spec!r}: {key}={raw!r} is not JSON: {e}") from e
        if _is_sequence_type(accepted[key]):
            prev = params.get(key, [])
            params[key] = [*prev, *(value if isinstance(value, list) else [value])]
        elif key in params:
            raise PolicyError(f"policy spec {spec!r}: {key!r} given twice")
        else:
            params[key] = value
    return get_policy(name.strip(), **params)
