"""OpenAI-compatible HTTP serving over the engine: app, protocol models, streams, metrics, CLI.

The only layer that imports FastAPI/uvicorn; the engine below never imports it.
"""

__all__: list[str] = []
