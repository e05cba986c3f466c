"""The embedded default tokenizer: tiktoken's ``o200k_base`` as Hugging Face tokenizer files.

``write_tokenizer(dir)`` writes ``tokenizer.json`` (byte-level BPE, o200k's split regex),
``tokenizer_config.json`` (with a Qwen2.5-style ChatML ``chat_template``, ``chatml.jinja``) and
``special_tokens_map.json``; ``model.default_model_dir()`` puts them beside the embedded model's
``config.json``, the one directory that the wrapper and the server load. The BPE ranks come from
the ``o200k_base.tiktoken`` file that ships inside the ``tml_renderers`` wheel, so no network and
no transformers are needed. The conversion (``load_ranks``, ``recover_merges``,
``build_tokenizer_json``) is tiktoken's generic one; only the constants are o200k's.

Id layout (``DEFAULT_VOCAB_SIZE`` = 200064 ids, every one of them a token):

==================  =========================================================
ids                 tokens
==================  =========================================================
0 .. 199997         o200k_base's BPE ranks (the id of a token is its rank)
199998              ``<|reserved_199998|>`` (o200k leaves this id unused)
199999              ``<|endoftext|>`` (o200k's own id; pad token)
200000, 200001      ``<|im_start|>``, ``<|im_end|>`` (eos)
200018              ``<|endofprompt|>`` (o200k's own id)
other 200002..      ``<|reserved_<id>|>`` placeholders up to the model's vocab size
==================  =========================================================

``<tool_call>``/``<tool_response>`` stay plain text (SGLang's ``qwen25`` tool-call parser matches
the text).
"""

from __future__ import annotations

import base64
import hashlib
import json
from importlib import resources
from pathlib import Path

DEFAULT_VOCAB_SIZE = 200064
DEFAULT_EOS_TOKEN_ID = 200001
ENDOFTEXT, IM_START, IM_END, ENDOFPROMPT = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
)
SPECIAL_TOKENS: dict[int, str] = {
    199999: ENDOFTEXT,
    200000: IM_START,
    200001: IM_END,
    200018: ENDOFPROMPT,
}
O200K_NUM_RANKS = 199998

# o200k_base's pre-tokenizer regex, exactly as tiktoken defines it (tiktoken_ext/openai_public.py).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Qwen2.5's ChatML template (``chatml.jinja``, package data), made robust to OpenAI-shaped
# messages: ``content`` may be None or a list of text parts (joined with spaces, as SGLang joins
# them for string-content templates), and tool-call ``arguments`` may be an object (emitted with
# ``tojson``; SGLang parses JSON strings into objects first) or a string (emitted verbatim), so the
# model sees ``"arguments": {...}``.
CHAT_TEMPLATE = (
    resources.files("leyline_agent.embedded").joinpath("chatml.jinja").read_text("utf-8").strip()
)

_BUILD_VERSION = "1"


def o200k_file() -> Path:
    """Path of ``o200k_base.tiktoken`` inside the installed ``tml_renderers`` package.

    Raises:
        FileNotFoundError: ``tml-renderers`` is not installed or lacks the file.
    """
    try:
        path = Path(str(resources.files("tml_renderers") / "data" / "o200k_base.tiktoken"))
    except ModuleNotFoundError as e:
        raise FileNotFoundError(
            "the embedded tokenizer needs the `tml-renderers` package (pip install tml-renderers)"
        ) from e
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall tml-renderers")
    return path


def load_ranks(path: Path) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file: one ``base64(token) rank`` pair per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges, in rank order, from tiktoken's mergeable ranks.

    The standard recovery: a token of rank ``r`` is what byte-pair encoding of its own bytes,
    restricted to merges of rank ``< r``, reduces to two parts; those two parts are its merge.

    Raises:
        ValueError: a multi-byte token does not reduce to exactly two parts (not a BPE vocabulary).
    """
    merges: list[tuple[bytes, bytes]] = []
    get = ranks.get
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = rank, -1
            for i in range(len(parts) - 1):
                r = get(parts[i] + parts[i + 1])
                if r is not None and r < best:
                    best, at = r, i
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not reachable by BPE merges")
        merges.append((parts[0], parts[1]))
    return merges


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def special_tokens() -> dict[int, str]:
    """Every id from o200k's last rank to ``DEFAULT_VOCAB_SIZE``: the specials and placeholders."""
    return {
        i: SPECIAL_TOKENS.get(i, f"<|reserved_{i}|>")
        for i in range(O200K_NUM_RANKS, DEFAULT_VOCAB_SIZE)
    }


def build_tokenizer_json(ranks_path: Path, dest: Path) -> None:
    """Write ``tokenizer.json`` for o200k_base (+ ChatML specials) to ``dest``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = load_ranks(ranks_path)
    if len(ranks) != O200K_NUM_RANKS or max(ranks.values()) != O200K_NUM_RANKS - 1:
        raise ValueError(f"{ranks_path} is not o200k_base ({len(ranks)} ranks)")
    byte_char = _bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    vocab = {enc(tok): rank for tok, rank in ranks.items()}
    specials = special_tokens()
    # NOTE: specials live in the BPE vocab at their exact ids first; registering them as added
    # tokens afterwards then keeps those ids (added tokens otherwise get appended ids).
    vocab.update({content: i for i, content in specials.items()})
    merges = [(enc(a), enc(b)) for a, b in recover_merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
    for i, content in specials.items():
        if tok.token_to_id(content) != i:
            raise RuntimeError(f"special token {content} landed on {tok.token_to_id(content)}")
    tok.save(str(dest))


def tokenizer_config() -> dict[str, object]:
    """``tokenizer_config.json`` contents (transformers' ``PreTrainedTokenizerFast``)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }


TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json", "tokenizer_config.json")


def build_key() -> str:
    """Changes with the template, this builder and the ranks file (part of the cache key)."""
    h = hashlib.sha256()
    h.update(_BUILD_VERSION.encode())
    h.update(CHAT_TEMPLATE.encode())
    h.update(str(o200k_file().stat().st_size).encode())
    return h.hexdigest()[:12]


def write_tokenizer(directory: Path) -> None:
    """Write ``TOKENIZER_FILES`` into ``directory`` (about 5 s: the merges are recovered).

    ``tokenizer_config.json`` is written last: its presence marks a complete directory.

    Raises:
        FileNotFoundError: ``tml-renderers`` (the source of the ranks file) is not installed.
    """
    build_tokenizer_json(o200k_file(), directory / "tokenizer.json")
    special_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT}
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
