"""Live benchmarks run through the Leyline proxy (``leyline eval ...``).

- ``debug_gym``: debug-gym's mini_nightmare tasks, the agent's LLM calls going through the proxy
  (``leyline eval debug-gym``; see ``docs/debug_gym.md``).
"""
