"""OpenAI-compatible server (`rimuru serve`): FastAPI + uvicorn over an async wrapper of the engine."""

from rimuru.serve.async_engine import AsyncEngine, RequestStream

__all__ = ["AsyncEngine", "RequestStream"]
