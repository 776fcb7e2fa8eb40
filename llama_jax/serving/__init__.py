"""Serving: the OpenAI API's request fields, the FastAPI application with its chat page, the runs through the engine
as JSON or server-sent events, and its Prometheus metrics. Imports inference and below (the ``serve`` extra)."""

from llama_jax.core.lazy import exports

_PUBLIC = {
  "create_app": "llama_jax.serving.app",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = exports(__name__, _PUBLIC)
