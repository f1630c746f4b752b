"""The routes, one module per endpoint group, each an ``APIRouter`` that ``txl.serve.app`` includes:
``system`` (the page, /health, /metrics, /v1/models), ``sessions`` (/v1/sessions...), ``completions``
(/v1/completions), ``tokenizer`` (/tokenize, /detokenize, /tokenizer_info).
A new endpoint group is a new module here with its router added to ``ROUTERS``."""

from txl.serve.routes import completions, sessions, system, tokenizer

ROUTERS = [system.router, sessions.router, completions.router, tokenizer.router]
