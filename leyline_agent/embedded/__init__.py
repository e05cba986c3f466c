"""The embedded default model: a tiny DeepSeek-V2 (``model.py``) with tiktoken's o200k_base as a
Hugging Face tokenizer and a ChatML template (``tokenizer.py``, ``chatml.jinja``), in one cached
directory, ``model.default_model_dir()``. Imports neither torch nor sglang."""
