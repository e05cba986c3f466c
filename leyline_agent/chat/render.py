"""Render an OpenAI-style message list to token ids with the model's own chat template.

The template is a Hugging Face chat template (jinja2), rendered the way transformers renders it
(``leyline_agent.chat.template``; the special tokens are template variables) after normalising
messages and tools as SGLang's chat endpoint does (``leyline_agent.chat.sglang``); the whole prompt
string is then encoded at once without adding special tokens, as the server does. No transformers
import. Message spans are defined in ``chat.spans``; a model directory is loaded by
``chat.model_dir.load_renderer``.

A full render costs one template rendering per message prefix; ``render_cache.IncrementalRenderer``
returns the same result re-rendering and re-encoding only what changed since an earlier render.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import jinja2
from tokenizers import Tokenizer

from leyline_agent.chat.locality import cut_token_ids, is_local
from leyline_agent.chat.sglang import sglang_messages, sglang_tools
from leyline_agent.chat.spans import (
    Message,
    Rendered,
    clamp_to_contents,
    common_prefix_len,
    resync,
    token_spans,
)
from leyline_agent.chat.template import compile_template

_PROBE = "\ue000"  # a private-use character no real message starts with


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
    ) -> tuple[Sequence[Message], Sequence[Any] | None]:
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
            norm: Sequence[Message] | None
            norm, norm_tools = self._normalized(messages, tools)
        except (TypeError, ValueError, LookupError, AttributeError):
            norm, norm_tools = None, tools  # render prefix by prefix: some still render

        def render_prefix(k: int, probe: Message | None = None) -> str | None:
            extra: Sequence[Message] = [probe] if probe is not None else []
            if norm is None:
                return self._try_render([*messages[:k], *extra], tools, False, template_kwargs)
            if extra and self.sglang_compat:
                extra = sglang_messages(extra)
            return self._try_render([*norm[:k], *extra], norm_tools, True, template_kwargs)

        # ``anchor``: a prefix rendering's start that ends at bounds[k - 1] in the full text.
        anchor: str | None = None
        for k in range(n + 1):
            b = bounds[k - 1] if k else 0
            prefix = render_prefix(k)
            if prefix is None:
                bounds[k] = len(text) if k == n else b
                anchor = None
                continue
            lcp = common_prefix_len(prefix, text)
            if lcp < len(prefix) and anchor is not None and prefix.startswith(anchor):
                # The rendering stops agreeing inside an earlier message (a template renders it
                # differently once later messages follow: think blocks dropped after a new user
                # query) or at a closing rendered only after the last message. The piece after
                # the anchor is found again after the previous boundary.
                got = resync(prefix[len(anchor) :], text, b, len(text))
                if got is not None:
                    bounds[k] = got[0]
                    anchor = prefix[: len(anchor) + got[1]]
                    continue
            if lcp < len(prefix) and k < n:
                # The shorter rendering diverges (a default system prompt, a block closed only
                # after the last message): the agreement may run on into message k's content by
                # coincidence. A probe message in k's place pins where k's content starts.
                probe = {"role": messages[k].get("role"), "content": _PROBE}
                if "tool_call_id" in messages[k]:
                    probe["tool_call_id"] = messages[k]["tool_call_id"]
                probed = render_prefix(k, probe)
                if probed is not None:
                    lcp = min(lcp, common_prefix_len(probed, text))
            bounds[k] = max(b, lcp)
            anchor = prefix[:lcp] if lcp >= b else None
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
