"""Build and run the server: engine -> AsyncEngine -> FastAPI app -> uvicorn."""

from __future__ import annotations

from pathlib import Path

from rimuru.serve.app import create_app
from rimuru.serve.async_engine import AsyncEngine


def build_app(engine, *, served_model_name: str | None = None, model_root: str | None = None):
    """The FastAPI app over an engine object with the rimuru.LLM step interface."""
    return create_app(AsyncEngine(engine), served_model_name=served_model_name, model_root=model_root)


def serve(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          log_level: str = "info", **llm_options) -> None:
    """Load the model with ``rimuru.LLM(model_dir, **llm_options)`` and serve it until interrupted."""
    import uvicorn

    from rimuru.engine.llm import LLM

    engine = LLM(str(model_dir), **llm_options)
    app = build_app(engine, served_model_name=served_model_name, model_root=str(model_dir))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
