"""Models served by name (``--model NAME``): the registry and the GGUF conversion of real ones."""

from leyline_agent.models.registry import MODELS, UnknownModel, get_model, resolve

__all__ = ["MODELS", "UnknownModel", "get_model", "resolve"]
