"""Render an OpenAI-style message list to token ids with the model's own chat template.

The template is a Hugging Face chat template (jinja2), rendered the way transformers renders it
(``leyline_agent.chat.template``; the special tokens are template variables) after normalising
messages and tools as SGLang's chat endpoint does (``leyline_agent.chat.sglang``); the whole prompt
string is then encoded at once without adding special tokens, as the server does. No transformers
import.

Message spans: message ``k`` owns the characters from where the rendering of ``messages[:k]``
stops agreeing with the full rendering to where that of ``messages[:k+1]`` does (where the shorter
rendering diverges, no later than where a probe message in ``k``'s place does; and never inside a
message's content, as found in order in the full text), and the tokens whose first character
falls there. Spans tile the prompt: the tokens before ``spans[0]`` are the
template's preamble, those after ``spans[-1]`` the generation prompt. A token that straddles a
boundary belongs to the message it starts in. The spans are a best effort for templates that render
a message differently depending on what follows; nothing downstream relies on them for correctness.

A full render costs one template rendering per message prefix; ``render_cache.IncrementalRenderer``
returns the same result re-rendering and re-encoding only what changed since an earlier render.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from sys import maxsize
from typing import Any, NamedTuple

import jinja2
from tokenizers import Tokenizer

from leyline_agent.chat.sglang import sglang_messages, sglang_tools
from leyline_agent.chat.template import compile_template

Message = Mapping[str, Any]
_PROBE = "\ue000"  # a private-use character no real message starts with

_SPECIAL_TOKEN_VARS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Rendered(NamedTuple):
    """A rendered prompt.

    tokens: the prompt's token ids.
    spans: ``(start, end)`` token span of every message, in order; contiguous
        (``spans[k][1] == spans[k + 1][0]``).
    text: the prompt string the tokens encode.
    """

    tokens: list[int]
    spans: list[tuple[int, int]]
    text: str = ""


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _content_text(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


class Found(NamedTuple):
    """Where a message's content was found in the prompt text (``at < 0``: not found).

    need: the text must agree up to here for a search from the same position to find the same
        (``end`` for a verbatim match; past any text for a stripped match or none).
    """

    at: int
    end: int
    need: int


def content_positions(messages: Sequence[Message], text: str, pos: int = 0) -> list[Found | None]:
    """Each message's content found in ``text`` in order from ``pos`` (stripped where the verbatim
    content is absent); None for an empty content."""
    found: list[Found | None] = []
    for m in messages:
        c = _content_text(m)
        if not c:
            found.append(None)
            continue
        at = text.find(c, pos)
        if at >= 0:
            found.append(Found(at, at + len(c), at + len(c)))
        else:
            c = c.strip()
            at = text.find(c, pos) if c else -1
            found.append(Found(at, at + len(c), maxsize) if at >= 0 else Found(-1, -1, maxsize))
        if at >= 0:
            pos = at + len(c)
    return found


def clamp_bounds(
    bounds: list[int], found: Sequence[Found | None], text_len: int, start: int = 0
) -> None:
    """``clamp_to_contents`` on precomputed ``content_positions``, from boundary ``start`` on."""
    for k in range(start, len(bounds)):
        prev = found[k - 1] if k else None
        lo = prev.end if prev is not None and prev.at >= 0 else 0
        cur = found[k] if k < len(found) else None
        hi = cur.at if cur is not None and cur.at >= 0 else text_len
        if k:
            lo = max(lo, bounds[k - 1])
        bounds[k] = min(max(bounds[k], lo), max(hi, lo))


def clamp_to_contents(bounds: list[int], messages: Sequence[Message], text: str) -> None:
    """Keep each boundary between the previous message's content and the next one's.

    Where a template renders a message differently depending on what follows, the prefix
    renderings disagree with the full one early and the boundaries collapse; the contents,
    found in order in the full text, bound them (contents the template altered are skipped).
    """
    clamp_bounds(bounds, content_positions(messages, text), len(text))


def token_spans(starts: Sequence[int], bounds: Sequence[int]) -> list[tuple[int, int]]:
    """Token span of every message: the tokens whose first character (``starts``, sorted) falls
    between consecutive character ``bounds``."""
    at = [bisect_left(starts, b) for b in bounds]
    return [(at[k], at[k + 1]) for k in range(len(bounds) - 1)]


class Renderer:
    """A tokenizer plus a chat template.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (the model's ``tokenizer.json``).
        chat_template: the jinja2 source, or ``{name: source}`` (``"tool_use"`` is chosen when
            tools are given and present, else ``"default"``).
        template_vars: extra template variables (``bos_token``, ``eos_token``, …).
        source: where it was loaded from (for messages).
        sglang_compat: hand the template messages and tools normalised as SGLang's chat endpoint
            does (``sglang_messages``, ``sglang_tools``), so the tokens equal the server's.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | Mapping[str, str],
        template_vars: Mapping[str, Any] | None = None,
        source: str = "",
        sglang_compat: bool = True,
    ) -> None:
        templates = {"default": chat_template} if isinstance(chat_template, str) else chat_template
        if "default" not in templates and len(templates) != 1:
            raise ValueError(f"{source}: several chat templates and none named 'default'")
        self.tokenizer = tokenizer
        self.source = source
        self.chat_templates = dict(templates)
        self._templates = {name: compile_template(src) for name, src in templates.items()}
        self._vars = dict(template_vars or {})
        self.sglang_compat = sglang_compat

    @cached_property
    def incremental_checks(self) -> tuple[bool, frozenset[int]]:
        """Whether the chat template is local, and the special tokens after which a text can be
        encoded in two pieces: what ``IncrementalRenderer`` may reuse (computed once)."""
        from leyline_agent.render_cache import cut_token_ids, is_local

        return is_local(self), cut_token_ids(self.tokenizer)

    def _template(self, tools: Sequence[Any] | None) -> jinja2.Template:
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        return self._templates.get("default") or next(iter(self._templates.values()))

    def render_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt string (what ``apply_chat_template(..., tokenize=False, **template_kwargs)``
        returns; ``template_kwargs`` are extra template variables, as SGLang's
        ``chat_template_kwargs``).

        Raises:
            jinja2.TemplateError: the template rejects the conversation (``raise_exception``).
        """
        return self._render_normalized(
            *self._normalized(messages, tools), add_generation_prompt, template_kwargs
        )

    def _normalized(
        self, messages: Sequence[Message], tools: Sequence[Any] | None
    ) -> tuple[list[Message], Sequence[Any] | None]:
        if self.sglang_compat:
            return sglang_messages(messages), sglang_tools(tools)
        return list(messages), tools

    def _render_normalized(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        return self._template(tools).render(
            messages=list(messages),
            tools=list(tools) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self._vars, **(template_kwargs or {})},
        )

    def _try_render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None,
        normalized: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str | None:
        try:
            if normalized:
                return self._render_normalized(messages, tools, False, template_kwargs)
            return self.render_text(messages, tools, False, template_kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError):
            return None  # a prefix the template rejects only loses a boundary

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Rendered:
        """Token ids of the prompt and the token span of every message (see module docstring).

        Costs one template rendering per message (each prefix of the conversation) and one
        encoding of the whole prompt.

        Raises:
            jinja2.TemplateError: the template rejects the full conversation.
        """
        text = self.render_text(messages, tools, add_generation_prompt, template_kwargs)
        bounds = self.raw_bounds(messages, tools, text, template_kwargs)
        clamp_to_contents(bounds, messages, text)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return Rendered(list(enc.ids), token_spans([s for s, _ in enc.offsets], bounds), text)

    def raw_bounds(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None,
        text: str,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Character boundaries of the messages in ``text`` (their rendering), before
        ``clamp_to_contents``: ``n + 1`` non-decreasing offsets (see module docstring)."""
        n = len(messages)
        bounds = [0] * (n + 1)
        # NOTE: normalisation is per message, so the normalised prefixes are normalised once.
        try:
            norm: list[Message] | None
            norm, norm_tools = self._normalized(messages, tools)
        except (TypeError, ValueError, LookupError, AttributeError):
            norm, norm_tools = None, tools  # render prefix by prefix: some still render

        def render_prefix(k: int, probe: Message | None = None) -> str | None:
            extra = [probe] if probe is not None else []
            if norm is None:
                return self._try_render([*messages[:k], *extra], tools, False, template_kwargs)
            if extra and self.sglang_compat:
                extra = sglang_messages(extra)
            return self._try_render([*norm[:k], *extra], norm_tools, True, template_kwargs)

        for k in range(n + 1):
            b = bounds[k - 1] if k else 0
            prefix = render_prefix(k)
            if prefix is None:
                bounds[k] = len(text) if k == n else b
                continue
            lcp = _common_prefix_len(prefix, text)
            if lcp < len(prefix) and k < n:
                # The shorter rendering diverges (a default system prompt, a block closed only
                # after the last message): the agreement may run on into message k's content by
                # coincidence. A probe message in k's place pins where k's content starts.
                probe = {"role": messages[k].get("role"), "content": _PROBE}
                if "tool_call_id" in messages[k]:
                    probe["tool_call_id"] = messages[k]["tool_call_id"]
                probed = render_prefix(k, probe)
                if probed is not None:
                    lcp = min(lcp, _common_prefix_len(probed, text))
            bounds[k] = max(b, lcp)
        return bounds

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings become their ids; no BOS/EOS added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        """Number of tokens in ``text``."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | dict[str, str]:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(model_dir / "chat_template.json").get(
        "chat_template"
    )
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"{model_dir}: no chat template (looked for chat_template.jinja, "
            "tokenizer_config.json's chat_template, chat_template.json)"
        )
    return template


@lru_cache(maxsize=8)
def _load(model_dir: str, sglang_compat: bool) -> Renderer:
    path = Path(model_dir)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"{path}: no tokenizer.json (Leyline needs a fast tokenizer saved by transformers)"
        )
    config = _read_json(path / "tokenizer_config.json")
    specials = _read_json(path / "special_tokens_map.json")
    template_vars: dict[str, Any] = {}
    for name in _SPECIAL_TOKEN_VARS:
        value = _token_str(config.get(name)) or _token_str(specials.get(name))
        if value is not None:
            template_vars[name] = value
    return Renderer(
        Tokenizer.from_file(str(tokenizer_file)),
        _chat_template(path, config),
        template_vars,
        source=str(path),
        sglang_compat=sglang_compat,
    )


def load_renderer(model_path: str | Path | None = None, *, sglang_compat: bool = True) -> Renderer:
    """The renderer of a model directory, or of the embedded default model (``None``).

    A model directory needs ``tokenizer.json`` and a chat template (``chat_template.jinja``,
    ``tokenizer_config.json``'s ``chat_template``, or ``chat_template.json``). Loaded renderers
    are cached per directory (loading a 200k-token vocabulary takes about 2 s). With
    ``sglang_compat`` (default) messages and tools are normalised as SGLang's chat endpoint does
    before the template sees them (see ``sglang_messages``), so the tokens equal the server's.

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
        ValueError: no chat template.
    """
    if model_path is None:
        from leyline_agent.tokenizer import default_tokenizer_dir

        model_path = default_tokenizer_dir()
    return _load(str(Path(model_path).resolve()), sglang_compat)
