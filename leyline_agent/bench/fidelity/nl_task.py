"""The carried/direct/control task of ``task.py`` in natural language, for a real chat model
(issue 26): ``leyline bench fidelity --model smollm2-135m-instruct --task nl``.

A case is a short agent conversation (plain-text ChatML, tool calls as ``<tool_call>{json}
</tool_call>``, as ``traces.flatten`` makes them):

```
system · user task · assistant: call A · tool: output A · assistant: call B · tool: output B
· assistant: R · user: "What is KEY set to in config/SVC.yaml? Answer with the number only."
· assistant: "KEY: " (the answer's start, given; the model generates the digits)
```

One of the two outputs is the service's config file, which states the fact once (``KEY: VALUE``,
among other keys with other numbers); the other is noise (a directory listing, a git log or a
pytest run, also with numbers). The edit is the policy's own: ``stale_tool_outputs`` keeping the
last 2 steps, which stubs output A (``[evicted: 1 old tool outputs]``) and keeps output B.

| group | the fact is in | R (the last assistant turn) |
|---|---|---|
| carried | output A (stubbed) | restates or uses the value ("I'll set retries to 47 then.") |
| direct | output A (stubbed) | does not mention it: the answer needs the removed output itself |
| carried_ctrl | output B (kept) | restates or uses the value |
| direct_ctrl | output B (kept) | does not mention it |
| used (extra) | output A (stubbed) | names the key, not the value ("I'll keep retries as it is.") |
| used_ctrl (extra) | output B (kept) | names the key, not the value |

``used`` is the synthetic task's ``carried`` (``USE K_j`` with ``X`` = ``MASK``): a later turn
read the fact without restating it, so after the stub only the kept KV of that turn can hold it.

The value is a number that occurs nowhere else in the conversation (checked on the text, digit
boundaries), so in ``direct`` the edited conversation does not hold it at all.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.directive import Directive

GROUPS = ("carried", "direct", "carried_ctrl", "direct_ctrl")
EXTRA_GROUPS = ("used", "used_ctrl")
POLICY = "stale_tool_outputs:keep_last=2"
SERVICES = ("billing", "auth", "search", "ingest", "notifier", "gateway", "scheduler", "reports")
KEYS = (
    "retries", "port", "timeout_seconds", "max_connections", "worker_threads", "batch_size",
    "cache_size_mb", "pool_size", "queue_depth", "shard_count", "replicas", "page_size",
    "max_upload_mb", "heartbeat_seconds",
)  # fmt: skip
PLAIN = ("log_level: info", "enabled: true", "region: eu-west-1", "tls: false", "mode: async")
CARRY = (
    "The config sets {k} to {v}, so I'll keep {k} at {v}.",
    "OK, {k} is {v}. I'll set it to {v} in the deployment too.",
    "I'll set {k} to {v} then, as the config file says.",
    'I\'ll use {k}={v} for the next run.\n<tool_call>{{"name": "bash", "arguments": '
    '{{"command": "export {K}={v}"}}}}</tool_call>',
)
USE = (
    "Noted the {k} value from the config; I'll keep {k} as it is.",
    "OK, I'll leave {k} unchanged, exactly as the config file sets it.",
    "The {k} setting looks fine to me, so I won't change it.",
    "I'll use the same {k} as the config file in the next run.",
)
NEUTRAL = (
    "OK, I have read the config file and the other output.",
    "Both commands ran fine. Let me think about the next step now.",
    "I have looked at both outputs; nothing failed so far.",
    "Good, both commands worked. Let me review what I have so far.",
)
SYSTEM = (
    "You are a helpful coding assistant. You run shell commands with the bash tool and read "
    "their output carefully."
)


@dataclass(frozen=True)
class NLCase:
    """One case: ``full`` / ``edited`` token ids (the rendered conversation before and after the
    policy's stub, with the generation prompt and the answer's start ``KEY: ``, so the first
    generated token is the value's first digit), the directives that turn one into the other, and
    ``fact``: the ``(start, end)`` token span of the line ``KEY: VALUE`` in ``full``."""

    group: str
    index: int
    key: str
    value: int
    full: list[int]
    edited: list[int]
    directives: list[Directive]
    fact: tuple[int, int]
    messages: list[dict[str, Any]] = field(repr=False)
    edited_messages: list[dict[str, Any]] = field(repr=False)


def _call(command: str) -> str:
    body = {"name": "bash", "arguments": {"command": command}}
    return f"<tool_call>{json.dumps(body)}</tool_call>"


def _noise(rng: random.Random) -> tuple[str, str, str]:
    """(command, output, what the assistant calls it) of a noise output with numbers."""
    kind = rng.randrange(3)
    if kind == 0:
        names = rng.sample(["client.py", "handlers.py", "models.py", "util.py", "db.py", "cli.py",
                            "server.py", "tasks.py"], 5)  # fmt: skip
        lines = [f"total {rng.randint(20, 90)}"] + [
            f"-rw-r--r-- 1 dev dev {rng.randint(200, 9000):5d} Mar {rng.randint(1, 28):2d} "
            f"{rng.randint(8, 18):02d}:{rng.randint(0, 59):02d} {n}"
            for n in names
        ]
        return "ls -l src/", "\n".join(lines), "source files"
    if kind == 1:
        msgs = ["Fix flaky test", "Bump dependencies", "Add request logging", "Refactor client",
                "Handle empty payloads", "Tidy imports", "Speed up startup"]  # fmt: skip
        lines = [f"{rng.getrandbits(28):07x} {m}" for m in rng.sample(msgs, 5)]
        return "git log --oneline -5", "\n".join(lines), "git history"
    tests = rng.sample(["test_api", "test_client", "test_models", "test_cli", "test_db"], 3)
    passed = [rng.randint(3, 40) for _ in tests]
    lines = ["============ test session starts ============"]
    lines += [
        f"tests/{t}.py {'.' * min(p, 20)} [{p:3d} passed]"
        for t, p in zip(tests, passed, strict=True)
    ]
    lines.append(
        f"======= {sum(passed)} passed in {rng.randint(1, 9)}.{rng.randint(10, 99)}s ======="
    )
    return "pytest -q", "\n".join(lines), "test results"


def _config(rng: random.Random, svc: str, key: str, value: int) -> str:
    others = rng.sample([k for k in KEYS if k != key], rng.randint(3, 5))
    lines = [f"{k}: {rng.randint(2, 999)}" for k in others] + rng.sample(PLAIN, 2)
    rng.shuffle(lines)
    lines.insert(rng.randint(0, len(lines)), f"{key}: {value}")
    return f"# config/{svc}.yaml\nservice: {svc}\n" + "\n".join(lines)


def conversation(rng: random.Random, group: str) -> tuple[list[dict[str, Any]], str, int, str]:
    """One case's messages (see the module docstring), its key, value and fact line."""
    svc, key = rng.choice(SERVICES), rng.choice(KEYS)
    while True:
        value = rng.randint(10, 999)
        config = _config(rng, svc, key, value)
        command, noise, what = _noise(rng)
        once = re.compile(rf"(?<!\d){value}(?!\d)")
        if len(once.findall(config)) == 1 and not once.search(noise):
            break
    cfg_call, cfg_text = _call(f"cat config/{svc}.yaml"), "Let me read the service configuration."
    noise_call, noise_text = _call(command), f"Let me look at the {what}."
    first = [(cfg_text, cfg_call, config), (noise_text, noise_call, noise)]
    if group.endswith("_ctrl"):
        first.reverse()
    r = rng.choice({"carried": CARRY, "used": USE}.get(group.removesuffix("_ctrl"), NEUTRAL))
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"The {svc} service fails under load. Look at its config "
            "and the code, and tell me what you find.",
        },  # fmt: skip
    ]
    for i, (text, call, output) in enumerate(first):
        msgs.append({"role": "assistant", "content": f"{text}\n{call}"})
        msgs.append({"role": "tool", "content": output, "tool_call_id": f"call_{i}"})
    msgs.append({"role": "assistant", "content": r.format(k=key, v=value, K=key.upper())})
    msgs.append({"role": "user", "content": f"What is {key} set to in config/{svc}.yaml? "
                 "Answer with the number only."})  # fmt: skip
    return msgs, key, value, f"{key}: {value}"


def cases(renderer: Any, n: int, seed: int = 1, groups: Sequence[str] = GROUPS) -> Iterator[NLCase]:
    """``n`` cases per group, the groups in turn (``carried, direct, carried_ctrl, direct_ctrl,
    carried, ...``), deterministic in ``seed`` and ``groups``; ``renderer``: the model's
    ``Renderer``.

    Raises:
        ValueError: an unknown group (``GROUPS``, ``EXTRA_GROUPS``).
        ValueError: the policy left a case unedited, or the fact line is not found once in the
            rendered text (a template that rewrites message text).
    """
    from leyline_agent.policies import parse_policy
    from leyline_agent.policies.edits import apply_edits
    from leyline_agent.policies.protocol import Conversation
    from leyline_agent.token_changes import token_changes

    bad = [g for g in groups if g not in GROUPS + EXTRA_GROUPS]
    if bad or not groups:
        raise ValueError(f"groups {bad or '(none)'}: use {', '.join(GROUPS + EXTRA_GROUPS)}")
    policy = parse_policy(POLICY)
    rng = random.Random(seed)
    for i in range(n):
        for group in groups:
            msgs, key, value, line = conversation(rng, group)
            counts = [len(renderer.encode(str(m["content"]))) + 4 for m in msgs]
            conv = Conversation(
                msgs, counts, turn=i, count_tokens=lambda s: len(renderer.encode(s))
            )
            edited_msgs = apply_edits(msgs, list(policy(conv))).messages
            text = renderer.render_text(msgs) + f"{key}: "
            enc = renderer.tokenizer.encode(text, add_special_tokens=False)
            edited_text = renderer.render_text(edited_msgs) + f"{key}: "
            full, edited = list(enc.ids), renderer.encode(edited_text)
            found = token_changes(full, edited) or []
            ds = [Directive(start=a, end=b, replacement=tuple(edited[c:d])) for a, b, c, d in found]
            at = text.find(line)
            if not ds or at < 0 or text.find(line, at + 1) >= 0:
                raise ValueError(f"case {i} ({group}): no edit, or fact line not found once")
            toks = [j for j, (s, e) in enumerate(enc.offsets) if s < at + len(line) and e > at]
            fact = (toks[0], toks[-1] + 1)
            yield NLCase(group, i, key, value, full, edited, ds, fact, msgs, edited_msgs)


def answer(text: str) -> int | None:
    """The first integer in a generated text (``None`` if there is none)."""
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None
