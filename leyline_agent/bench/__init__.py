"""Engine-level benchmarks run from an installed package (``leyline bench splice``).

- ``splice/``: a splice plus the next request vs re-prefilling the edited sequence, per length
  (``measure.py``, ``memory.py``, ``report.py``).

The experiments that need a source checkout (``leyline bench fidelity``) live in ``experiments/``.
"""
