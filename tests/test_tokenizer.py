"""The embedded default tokenizer: o200k_base as Hugging Face tokenizer files, in the embedded
model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.embedded import tokenizer as tk
from leyline_agent.embedded.model import default_model_dir

tiktoken = pytest.importorskip("tiktoken")


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def hf(tok_dir: Path) -> Tokenizer:
    # load_renderer() reads tok_dir/tokenizer.json once per session (shared with other tests)
    renderer = load_renderer()
    assert renderer.source == str(tok_dir.resolve())
    return renderer.tokenizer


@pytest.fixture(scope="module")
def oracle() -> tiktoken.Encoding:
    from tiktoken.load import load_tiktoken_bpe

    return tiktoken.Encoding(
        "o200k_base_local",
        pat_str=tk.O200K_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(str(tk.o200k_file())),
        special_tokens={content: i for i, content in tk.special_tokens().items()},
    )


def test_pattern_is_tiktokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiktoken_ext import openai_public

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: {})  # no download
    assert tk.O200K_PATTERN == openai_public.o200k_base()["pat_str"]


def test_special_tokens_at_exact_ids(hf: Tokenizer) -> None:
    assert hf.get_vocab_size() == tk.DEFAULT_VOCAB_SIZE
    assert hf.token_to_id("<|endoftext|>") == 199999
    assert hf.token_to_id("<|im_start|>") == 200000
    assert hf.token_to_id("<|im_end|>") == tk.DEFAULT_EOS_TOKEN_ID == 200001
    assert hf.token_to_id("<|endofprompt|>") == 200018
    ids = hf.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 200000 and ids[-1] == 200001
    assert hf.decode([200000], skip_special_tokens=False) == "<|im_start|>"


def test_directory_files(tok_dir: Path) -> None:
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tk.CHAT_TEMPLATE
    assert config["eos_token"] == "<|im_end|>"
    specials = json.loads((tok_dir / "special_tokens_map.json").read_text())
    assert specials["eos_token"] == "<|im_end|>"
    assert default_model_dir() == tok_dir  # cached
    config = json.loads((tok_dir / "config.json").read_text())
    assert config["vocab_size"] == tk.DEFAULT_VOCAB_SIZE
    assert config["eos_token_id"] == tk.DEFAULT_EOS_TOKEN_ID


SAMPLES = [
    "Hello, world!",
    "It's   a test's\n\n\tfoo  \r\n",
    "数学 über naïve café 😀👍🏽 ١٢٣ Ⅻ",
    "def f(x):\n    return x**2  # comment\r\n\n\n",
    "    leading and trailing    ",
    "1234567890 3.14159 1e-9 0xDEADBEEF",
    "WE'RE SHOUTING'S and CamelCaseWords HTTPServer",
    "<|endoftext|> between <|endofprompt|> specials",
    "diff --git a/x.py b/x.py\n@@ -1,3 +1,4 @@\n-    x = 1\n+    x = 2\n",
    "\u0301combining\u0301 \u200bzero width",
    "",
]


def test_matches_tiktoken_on_samples(hf: Tokenizer, oracle: tiktoken.Encoding) -> None:
    here = Path(tk.__file__).read_text()  # names specials such as <|reserved_199998|>
    for text in [*SAMPLES, here, here[::-1]]:
        assert hf.encode(text, add_special_tokens=False).ids == oracle.encode(
            text, allowed_special="all"
        ), text[:60]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.text(
        alphabet=st.sampled_from(list("aZé中ßx 1\n\t\r'!?.-_😀\u0301"))
        | st.characters(exclude_categories=("Cs",)),
        max_size=80,
    )
)
def test_matches_tiktoken_property(hf: Tokenizer, oracle: tiktoken.Encoding, text: str) -> None:
    ours = hf.encode(text, add_special_tokens=False).ids
    assert ours == oracle.encode(text, allowed_special="all"), text


def test_recover_merges_small() -> None:
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"abc": 4, b"bc": 5, b"abcbc": 6}
    assert tk.recover_merges(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"b", b"c"), (b"abc", b"bc")]
    with pytest.raises(ValueError, match="not reachable"):
        tk.recover_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_builds_once_into_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def fake_build(ranks_path: Path, dest: Path) -> None:
        calls.append(dest)
        dest.write_text("{}")

    monkeypatch.setenv("LEYLINE_CACHE", str(tmp_path))
    monkeypatch.setattr(tk, "build_tokenizer_json", fake_build)
    first = default_model_dir()
    second = default_model_dir()
    assert first == second and first.parent == tmp_path / "embedded"
    assert len(calls) == 1
    assert sorted(p.name for p in first.iterdir()) == [
        "config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert [p.name for p in (tmp_path / "embedded").iterdir()] == [first.name]  # no temp left


def test_transformers_loads_it_without_the_mistral_regex_warning(
    tok_dir: Path, oracle: tiktoken.Encoding, capfd: pytest.CaptureFixture[str]
) -> None:
    """SGLang loads the tokenizer with ``AutoTokenizer``; transformers 5 warned "incorrect regex
    pattern ... incorrect tokenization" for a config.json without ``transformers_version`` (its
    check for old Mistral tokenizers). Ours is o200k's: no warning, and the ids it gives are
    tiktoken's."""
    import logging

    transformers = pytest.importorskip("transformers")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    finally:
        logger.removeHandler(handler)
    said = capfd.readouterr().err + "".join(r.getMessage() for r in records)
    assert "incorrect regex" not in said and "fix_mistral_regex" not in said
    assert json.loads((tok_dir / "config.json").read_text())["transformers_version"]
    for text in SAMPLES:
        assert tok.encode(text, add_special_tokens=False) == oracle.encode(
            text, allowed_special="all"
        ), text[:60]
