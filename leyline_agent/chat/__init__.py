"""Chat requests and chat templates: what the client sends (``openai.py``), what SGLang does with
it before and around templating (``sglang.py``, ``request.py``), and rendering it to token ids
with message spans (``render.py``, ``spans.py``, ``render_cache.py``, ``locality.py``,
``model_dir.py``, ``template.py``)."""
