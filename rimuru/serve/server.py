"""Build and run the server: engine -> AsyncEngine -> FastAPI app -> uvicorn."""

from __future__ import annotations

import sys
from pathlib import Path

from rimuru.serve.app import create_app
from rimuru.serve.async_engine import AsyncEngine


def build_app(engine, *, served_model_name: str | None = None, model_root: str | None = None):
    """The FastAPI app over an engine object with the rimuru.LLM step interface."""
    return create_app(AsyncEngine(engine), served_model_name=served_model_name, model_root=model_root)


def serve(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          log_level: str = "info", **llm_options) -> int:
    """Load the model with ``rimuru.LLM(model_dir, **llm_options)`` and serve it until interrupted.

    Returns the exit status: 1 when the engine died (e.g. a tensor-parallel rank failed) — clients got 503
    from then on and the server shut down — else 0."""
    import uvicorn

    from rimuru.engine.llm import LLM

    engine = LLM(str(model_dir), **llm_options)
    try:
        app = build_app(engine, served_model_name=served_model_name, model_root=str(model_dir))
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                               timeout_keep_alive=30))
        front: AsyncEngine = app.state.engine
        front.on_fatal = lambda exc: setattr(server, "should_exit", True)
        server.run()
    finally:
        engine.close()
    if front.error is not None:
        print(f"rimuru serve: the engine died: {front.error}", file=sys.stderr)
        return 1
    return 0
