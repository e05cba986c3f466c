"""``leyline bench fidelity``: full context vs AMORTIZE vs FORGET on a trained tiny MLA
(DeepSeek-V2) or GQA (Llama) model (paper §4.3; docs/fidelity.md). Needs torch, transformers and
the sglang extra at run time.

- ``task.py``: the synthetic task (facts in removable chunks, used downstream); pure Python.
- ``train.py``: trains the model of ``TrainSpec.arch`` on CPU (seeded) or reuses it from
  ``$LEYLINE_CACHE``.
- ``divergence.py``: the three paths through a real ``leyline serve``, per case.
- ``architectures.py``: the attention shapes of four MLA models and their served configs;
  ``arch_check.py``: splice mechanics on them.
- ``drift.py``: rope-band drift of composed splices.
- ``report.py``: tables (with an MLA-vs-GQA table), ``results.json``, ``fidelity.png``.

Each module but ``task.py`` and ``report.py`` also runs on its own:
``python -m leyline_agent.bench.fidelity.<module>``.
"""
