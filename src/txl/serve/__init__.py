"""`txl serve`: a model served with its memory (the ``serve`` extra: FastAPI, uvicorn, prometheus-client).

``create_app(config, load)`` builds the app; ``txl serve MODEL`` runs it on uvicorn. Layers, top down:
``app`` (wires them), ``routes/`` (one APIRouter per endpoint group), ``openai`` (the OpenAI formats),
``deps`` (auth, readiness, bodies as FastAPI dependencies), ``protocol`` (pydantic request models, the one
validation), ``middleware`` (errors as JSON, body limit, access log), ``server`` (state, jobs, streaming),
``engine`` (the worker that batches sessions' model work), ``session`` (a session's state, its text carried
over, the store that spills to disk), ``config`` (ServeConfig, the ``[serve]`` section), ``metrics`` and
``page.html`` (the page at ``/``).
"""

from txl.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def create_app(config, load, on_load_error=None):
    from txl.serve.app import create_app as _create_app  # FastAPI is imported only when an app is built

    return _create_app(config, load, on_load_error)
