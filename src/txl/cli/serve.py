"""`txl serve MODEL`: an HTTP server whose sessions keep the model's memory (see txl.serve)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from txl.cli.generate import add_shortcut
    from txl.cli.options import add_config_arguments
    from txl.serve.config import ServeConfig

    p = sub.add_parser(
        "serve", help="serve a model over HTTP: OpenAI-compatible completions and sessions with memory",
        allow_abbrev=False,
        description="Serve a model on 127.0.0.1:8000 (needs pip install 'txl[serve]'). Settings are "
        "--serve.FIELD VALUE, with --host and --port as shortcuts. The page at / colours a document by surprisal.")
    p.add_argument("model", metavar="RUN_DIR|MODEL_DIR|HUB_ID",
                   help="a training run directory (its best checkpoint), a model directory, or a Hub repo id")
    p.add_argument("--revision", default=None, help="Hub repo revision: branch, tag or commit (default main)")
    p.add_argument("--vocab", metavar="FILE", help="vocabulary file, when the checkpoint holds none")
    p.add_argument("--pretokenized", action="store_true",
                   help="word-level text is already split into tokens: split on spaces only")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    add_shortcut(p, "--host", "serve.host", metavar="ADDRESS")
    add_shortcut(p, "--port", "serve.port", metavar="N")
    add_config_arguments(p, ["serve"], kinds={"serve": ServeConfig})
    p.set_defaults(func=run)


def serve_config(args: argparse.Namespace, directory=None):
    """The ``ServeConfig`` of the options given, typed and checked as every config section is (the key also
    from TXL_SERVE_API_KEY). With the model's ``directory``, the reading context not given is `txl score`'s
    (``run_defaults``): one default context for the two commands."""
    import os

    from txl.cli.options import section_config
    from txl.serve.config import ServeConfig

    key = os.environ.get("TXL_SERVE_API_KEY")
    defaults = {"api_key": key} if key else {}
    if directory is not None:
        defaults.update(run_defaults(directory))
    return section_config(args, "serve", ServeConfig, defaults)


def run_defaults(directory) -> dict:
    """The reading context of a training run's ``[eval]`` section (what `txl score`, `txl eval` and the
    in-process lm-eval model read with) as ``serve`` fields: tgt_len as segment_len, mem_len, same_length,
    clamp_len, each only where the run sets it ({} for a model directory without a run)."""
    from txl.cli.generate import run_section

    e = run_section(directory, "eval")
    names = {"tgt_len": "segment_len", "mem_len": "mem_len", "same_length": "same_length", "clamp_len": "clamp_len"}
    return {field: e[name] for name, field in names.items() if e.get(name) is not None}


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading
    from pathlib import Path

    from txl.signals import Interrupted, StopRequest

    try:
        import uvicorn

        from txl.serve import create_app
    except ImportError as err:
        raise ValueError(f"txl serve needs the serve extra ({err.name} is missing): pip install 'txl[serve]'") from None
    from txl.cli.generate import load_model_and_tokenizer
    from txl.pretrained import resolve_model_dir

    config = serve_config(args)  # a bad option is refused before anything is loaded
    # A missing model: one line now, not a server that 503s. A run's [eval] context is the default, as txl score's.
    config = serve_config(args, resolve_model_dir(args.model, revision=args.revision))
    args.checkpoint = args.model
    failed: list[Exception] = []
    loaded = threading.Event()
    stopped_at_start: list[int] = []
    """A signal that came before the model was loaded: start-up is interrupted (one line, 128 + N), not drained."""

    def load():
        model, tokenizer, directory = load_model_and_tokenizer(args)
        loaded.set()
        # The name clients see: a Hub id as given, a directory by its last part (never a server path).
        return model, tokenizer, Path(args.model).name if Path(args.model).exists() else str(args.model)

    def load_error(err: Exception) -> None:  # the server stops and the command says why
        failed.append(err)
        server.should_exit = True

    app = create_app(config, load, load_error)
    logging.getLogger("txl.serve.access").setLevel(logging.INFO)

    class Server(uvicorn.Server):
        async def _serve(self, sockets=None) -> None:
            if early.requested:  # a signal came before uvicorn took over SIGINT and SIGTERM: never start
                stopped_at_start.append(int(early.signal))
                return
            await super()._serve(sockets)

        def handle_exit(self, sig, frame) -> None:
            # Once the model is loaded, SIGTERM and SIGINT drain and exit 0 (uvicorn would raise the signal again
            # once stopped); before, they interrupt the start-up.
            if not loaded.is_set():
                stopped_at_start.append(sig)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    sock = listen(config.host, config.port)
    host, port = sock.getsockname()[:2]
    logging.getLogger("txl.serve").info("txl serve: listening on http://%s:%d", host if ":" not in host else
                                        f"[{host}]", port)
    server = Server(uvicorn.Config(app, access_log=False, log_level="info", log_config=None,
                                   timeout_graceful_shutdown=config.drain_seconds))
    try:
        # Until uvicorn installs its own handlers (in its event loop), a signal is recorded rather than raised
        # inside asyncio's set-up, where it would leave uvicorn's coroutine never awaited.
        with StopRequest() as early:
            server.run(sockets=[sock])
    finally:
        sock.close()
    if stopped_at_start:
        raise Interrupted(signal.Signals(stopped_at_start[0]))
    if failed:
        raise ValueError(f"the model could not be loaded: {failed[0]}")
    return 0


def listen(host: str, port: int):
    """A listening socket on (host, port), with TCP_NODELAY: uvicorn writes a response's head and body
    separately, and without it each small response waits ~40 ms for the client's delayed ACK."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by the accepted connections
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({err.strerror}); choose another --port") from None
    sock.listen(2048)
    return sock
