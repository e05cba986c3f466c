"""The benchmarks of ``leyline bench``, run from an installed package.

- ``splice/``: a splice plus the next request vs re-prefilling the edited sequence, per length
  (``measure.py``, ``memory.py``, ``report.py``).
- ``fidelity/``: full context vs AMORTIZE vs FORGET on a trained tiny MLA model (task, training,
  divergence, architectures, drift, report).
"""
