"""Rendering message lists with chat templates, and per-message token spans."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.sglang import sglang_messages, sglang_tools
from leyline_agent.embedded.model import default_model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "view",
            "description": "Show a file <with> 'quotes' & ünïcode",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def call(i: int, args: str | dict) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": "view", "arguments": args}}


CONVERSATIONS = {
    "plain": [{"role": "user", "content": "hi there"}],
    "system": [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks <b>"},
    ],
    "tools": [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Fix test.py"},
        {"role": "assistant", "content": None, "tool_calls": [call(1, '{"path": "test.py"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "1 import os\n2 x = 1\n"},
        {
            "role": "assistant",
            "content": "Two at once.",
            "tool_calls": [call(2, {"path": "a.py"}), call(3, '{"path": "b.py"}')],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "A"},
        {"role": "tool", "tool_call_id": "c3", "content": "B\n"},
    ],
    "tools_no_system": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call(1, "{}")]},
        {"role": "tool", "tool_call_id": "c1", "content": ""},
    ],
    "parts": [
        {"role": "system", "content": [{"type": "text", "text": "part one. "}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ],
}


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return load_renderer()


def check_spans(renderer: Renderer, messages: list[dict], tools: list | None) -> None:
    r = renderer.render(messages, tools)
    assert r.tokens == renderer.encode(r.text)
    assert renderer.decode(r.tokens) == r.text
    assert len(r.spans) == len(messages)
    assert all(s <= e for s, e in r.spans)
    assert all(a[1] == b[0] for a, b in zip(r.spans, r.spans[1:], strict=False))
    for (s, e), m in zip(r.spans, messages, strict=True):
        content = m["content"] if isinstance(m["content"], str) else None
        if content and content.strip():
            assert content.strip() in renderer.decode(r.tokens[s:e]), (content, s, e)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True], ids=["no_tools", "tools"])
def test_spans_tile_and_hold_their_message(renderer: Renderer, name: str, with_tools: bool) -> None:
    check_spans(renderer, CONVERSATIONS[name], TOOLS if with_tools else None)


def test_prompt_shape(renderer: Renderer) -> None:
    r = renderer.render(CONVERSATIONS["tools"], TOOLS)
    assert r.text.startswith("<|im_start|>system\nYou fix bugs.\n\n# Tools\n")
    # tools as SGLang dumps them; tojson without HTML escaping
    assert json.dumps(sglang_tools(TOOLS)[0], ensure_ascii=False) in r.text
    assert '"defer_loading": null}' in r.text and "<with> 'quotes' &" in r.text
    assert '{"name": "view", "arguments": {"path": "a.py"}}' in r.text  # dict args -> JSON
    assert '{"name": "view", "arguments": {"path": "b.py"}}' in r.text  # JSON string parsed
    assert "<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n\n</tool_response>" in r.text
    assert r.text.endswith("<|im_start|>assistant\n")
    assert r.tokens[-3:] == renderer.encode("<|im_start|>assistant\n")
    no_gen = renderer.render(CONVERSATIONS["tools"], TOOLS, add_generation_prompt=False)
    assert r.text == no_gen.text + "<|im_start|>assistant\n"
    assert no_gen.spans == r.spans


def test_consecutive_tool_messages_split_between_them(renderer: Renderer) -> None:
    r = renderer.render(CONVERSATIONS["tools"], TOOLS)
    s5, e5 = r.spans[5]
    s6, e6 = r.spans[6]
    assert "A" in renderer.decode(r.tokens[s5:e5]) and "B" not in renderer.decode(r.tokens[s5:e5])
    assert renderer.decode(r.tokens[s6:e6]).rstrip().endswith("</tool_response><|im_end|>")


def test_sglang_normalisation() -> None:
    msgs = [
        {"role": "assistant", "content": None, "tool_calls": [call(1, '{"b": 1,  "a": [2]}')]},
        {"role": "assistant", "content": "x", "tool_calls": [call(2, "not json"), call(3, "[1]")]},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "name": None,
            "content": [{"type": "text", "text": "p"}, {"type": "text", "text": "q"}],
        },
        {"role": "user", "content": [{"type": "text", "text": "kept"}]},
    ]
    out = sglang_messages(msgs)
    assert out[0] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "index": None,
                "type": "function",
                "function": {"name": "view", "arguments": {"b": 1, "a": [2]}},
            }
        ],
    }
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == ["not json", "[1]"]
    assert out[2] == {"role": "tool", "tool_call_id": "c1", "content": "p q"}
    assert out[3] == msgs[3]
    assert msgs[0]["content"] is None  # input untouched
    tools = [
        {"type": "function", "function": {"parameters": {}, "name": "f", "extra": 1}},
        {"type": "function", "defer_loading": True, "function": {"name": "g", "strict": True}},
    ]
    assert sglang_tools(tools) == [
        {
            "type": "function",
            "function": {"parameters": {}, "name": "f", "description": None},
            "defer_loading": None,
        },
        {
            "type": "function",
            "function": {
                "name": "g",
                "strict": True,
                "description": None,
                "parameters": None,
                "defer_loading": True,
            },
            "defer_loading": True,
        },
    ]
    assert sglang_tools([]) is None and sglang_tools(None) is None


def test_without_sglang_compat_arguments_stay_verbatim(renderer: Renderer) -> None:
    raw = Renderer(renderer.tokenizer, renderer.chat_templates["default"], sglang_compat=False)
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call(1, '{"a":1}')]}]
    assert '"arguments": {"a":1}}' in raw.render_text(msgs)
    assert '"arguments": {"a": 1}}' in renderer.render_text(msgs)


@pytest.mark.sglang
def test_sglang_normalisation_matches_sglang() -> None:
    # SGLang itself is the oracle (a heavy import: only where the sglang extra is installed).
    pytest.importorskip("sglang")
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import (
        normalize_assistant_tool_call_arguments,
        normalize_tool_content,
    )
    from sglang.srt.parser.jinja_template_utils import (
        detect_jinja_template_content_format,
        process_content_for_template_format,
    )

    from leyline_agent.embedded.tokenizer import CHAT_TEMPLATE

    fmt = detect_jinja_template_content_format(CHAT_TEMPLATE)
    for name, messages in CONVERSATIONS.items():
        req = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": messages, "tools": TOOLS}
        )
        ref = []
        for m in req.messages:
            d = m.model_dump()
            normalize_assistant_tool_call_arguments(d)
            if d.get("content") is None:
                d["content"] = ""
            d = process_content_for_template_format(d, fmt, [], [], [], [])
            d["content"] = normalize_tool_content(d["role"], d.get("content"))
            ref.append(d)
        ours = sglang_messages(messages)
        if fmt == "string":  # SGLang joins text parts for string-content templates; so does ours
            for o in ours:
                if isinstance(o["content"], list):
                    o["content"] = " ".join(p["text"] for p in o["content"])
        assert ours == ref, name
        assert sglang_tools(TOOLS) == [t.model_dump() for t in req.tools]


def test_encode_keeps_special_tokens(renderer: Renderer) -> None:
    assert renderer.encode("<|im_start|>x<|im_end|>")[::2] == [200000, 200001]
    assert renderer.count("hello world") == len(renderer.encode("hello world")) == 2


@pytest.fixture(scope="module")
def hf_tokenizer():  # noqa: ANN201 - transformers is an oracle only
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_matches_transformers_apply_chat_template(
    renderer: Renderer, hf_tokenizer, name: str
) -> None:
    messages = CONVERSATIONS[name]
    for tools in (None, TOOLS):
        for gen in (False, True):
            ref = hf_tokenizer.apply_chat_template(
                sglang_messages(messages),
                tools=sglang_tools(tools),
                tokenize=False,
                add_generation_prompt=gen,
            )
            ours = renderer.render(messages, tools, add_generation_prompt=gen)
            assert ours.text == ref
            assert ours.tokens == hf_tokenizer.encode(ref, add_special_tokens=False)


def test_transformers_agrees_on_the_tokenizer(renderer: Renderer, hf_tokenizer) -> None:
    from leyline_agent.embedded.tokenizer import DEFAULT_EOS_TOKEN_ID, DEFAULT_VOCAB_SIZE

    assert len(hf_tokenizer) == DEFAULT_VOCAB_SIZE
    assert hf_tokenizer.eos_token_id == DEFAULT_EOS_TOKEN_ID
    assert hf_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"]) == [199999, 200000]
    text = Path(__file__).read_text()
    assert hf_tokenizer.encode(text, add_special_tokens=False) == renderer.encode(text)


def make_model_dir(tmp_path: Path, config: dict) -> Path:
    """A model directory with a byte-level tokenizer (no merges) and the given config."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from leyline_agent.embedded.tokenizer import _bytes_to_unicode

    vocab = {c: i for i, c in enumerate(sorted(_bytes_to_unicode().values()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    )
    model = tmp_path / "model"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m.role) }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_model_dir_template_and_special_tokens(tmp_path: Path) -> None:
    model = make_model_dir(
        tmp_path,
        {
            "chat_template": LLAMA_LIKE,
            "bos_token": "<|endoftext|>",
            "eos_token": {"content": "<|im_end|>"},
        },
    )
    r = load_renderer(model)
    messages = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "yo"}]
    out = r.render(messages)
    assert (
        out.text
        == "<|endoftext|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.tokens[0] == r.tokenizer.token_to_id("<|endoftext|>") == 256
    assert out.spans[0][0] == 1  # the BOS is the template's preamble
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        r.render([{"role": "tool", "content": "x"}])
    assert load_renderer(model) is r  # cached per directory


def test_model_dir_template_sources(tmp_path: Path) -> None:
    model = make_model_dir(
        tmp_path,
        {
            "chat_template": [
                {"name": "default", "template": "D"},
                {"name": "tool_use", "template": "T"},
            ]
        },
    )
    r = load_renderer(model)
    assert r.render_text([], None) == "D"
    assert r.render_text([], TOOLS) == "T"
    (model / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Renderer(r.tokenizer, "x").render_text([]) == "x"
    from leyline_agent.chat.model_dir import _load

    _load.cache_clear()
    assert load_renderer(model).render_text([{"role": "user", "content": ""}]) == "J1"


def test_model_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_renderer(tmp_path)
    model = make_model_dir(tmp_path, {})
    with pytest.raises(ValueError, match="no chat template"):
        load_renderer(model)


def test_unstable_template_spans_still_tile(tmp_path: Path) -> None:
    # Earlier messages render differently depending on what follows (like templates that drop
    # reasoning from old turns): spans are a best effort, but still tile and cover the prompt.
    unstable = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if loop.last %}{{ m.content }}{% else %}{{ m.content[:3] }}{% endif %}<|im_end|>\n"
        "{% endfor %}"
    )
    r = load_renderer(make_model_dir(tmp_path, {"chat_template": unstable}))
    messages = [{"role": "user", "content": f"message number {i}"} for i in range(4)]
    out = r.render(messages)
    assert out.tokens == r.encode(out.text)
    assert out.spans[0][0] == 0 and out.spans[-1][1] == len(out.tokens)
    assert all(a[1] == b[0] for a, b in zip(out.spans, out.spans[1:], strict=False))


def test_template_environment_matches_transformers() -> None:
    from leyline_agent.chat.template import compile_template

    t = compile_template(
        "{% for m in messages %}{% generation %}{{ m | tojson(indent=1, sort_keys=true) }}"
        "{% endgeneration %}{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}"
    )
    assert t.render(messages=[{"b": "<ü>", "a": 1}, {}]) == '{\n "a": 1,\n "b": "<ü>"\n}'
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_template("{% set x = [] %}{{ x.append(1) }}").render()
