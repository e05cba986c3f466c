"""``leyline eval debug-gym``: debug-gym's mini_nightmare with the agent's LLM calls through the
Leyline proxy (see ``docs/debug_gym.md``).

- ``spec.py``: the run's arguments (``EvalSpec``), ``TaskResult`` (arms: ``leyline_agent.arms``).
- ``venv.py``: debug-gym's own venv (created once, installed offline from PyPI, reused).
- ``grammar.py``: constrained, read-only tool calls for random weights (EBNF per request).
- ``backend.py``: the backend (embedded, ``--backend``, ``--llm-url``) and the in-process proxy.
- ``driver.py``: runs inside debug-gym's venv (imports nothing from Leyline); the 1.3.0 fixes.
- ``process.py``: ``driver.py`` as a subprocess in that venv (environment, events, ``prepare``).
- ``runner.py``: arm by arm: proxy, driver, the proxy's per-session totals (``accounting``).
- ``report.py``: totals per arm, table, ``results.json``, ``tokens.png``, the headline JSON.
"""
