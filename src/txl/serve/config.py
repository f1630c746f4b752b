"""`txl serve`'s settings: the ``[serve]`` config section (``--serve.FIELD VALUE`` on the command line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from txl.config import Context, ModelConfig


def _check(name: str, ok: bool, need: str, value: object) -> None:
    if not ok:
        raise ValueError(f"serve.{name}={value!r} {need}")


@dataclass(kw_only=True)
class ServeConfig:
    """The server: address, reading context, sessions, limits and security."""

    host: str = "127.0.0.1"
    """Address to listen on; the default accepts local connections only (0.0.0.0: every interface)."""
    port: int = 8000
    """TCP port to listen on (0: any free port, printed at start)."""
    segment_len: int = 128
    """Tokens read per forward pass: with mem_len, the context of every token, exactly as txl score reads."""
    mem_len: int | None = None
    """Memory of a session in positions (none: the model's); a session's state is n_layer x mem_len x d_model."""
    same_length: bool | None = None
    """Every query attends to the same number of keys while reading text (none: the model's)."""
    clamp_len: int | None = None
    """Relative distances beyond this share one encoding (none: the model's; <= 0: no clamping)."""
    state_dir: str = "txl-sessions"
    """Directory of the sessions' saved state (one safetensors file each), read again after a restart."""
    max_sessions_in_memory: int = 64
    """Sessions kept in RAM; the least recently used beyond this are written to state_dir and dropped."""
    session_ttl: float = 86400.0
    """Seconds an idle session lives; then it is deleted, from RAM and disk."""
    durability: Literal["request", "shutdown"] = "request"
    """'request': a request that changed a session returns after its state is on disk (fsynced), so it
    survives kill -9; 'shutdown': written on eviction and at shutdown only (faster, lost on kill -9)."""
    api_key: str = ""
    """Bearer keys, comma-separated (or the TXL_SERVE_API_KEY environment variable); empty: no key needed.
    A session belongs to the key that created it."""
    max_body_bytes: int = 1_048_576
    """Largest request body accepted (413 above)."""
    max_text_chars: int = 262_144
    """Longest text (or prompt) in one request, in characters (413 above)."""
    max_tokens: int = 1024
    """Most tokens one generate or completion request may ask for."""
    max_queue: int = 64
    """Requests waiting for the model beyond this get 429 (backpressure)."""
    max_batch: int = 16
    """Most sessions read in one batched forward pass."""
    drain_seconds: float = 10.0
    """On SIGTERM/SIGINT: seconds the requests in flight get to finish before the sessions are written."""
    compile: bool = False
    """Run each generation step as one torch.compile graph (``txl.compiled_step``; relative attention without a
    compressed memory, any other model is refused at start): the same tokens, less per-step cost (1.6x eager's
    tokens/s at one session, 1.25x at 8 on a CPU), for a compilation of tens of seconds that the first generation
    of one session, and the first of several, wait for."""
    graphs: Literal["auto", "on", "off"] = "auto"
    """Generation steps in preallocated buffers, each batch size's step captured once as a CUDA graph and replayed
    (``txl.captured_step``): 'auto' on CUDA for relative attention without a compressed memory, 'on' wherever the
    model allows it (a CPU runs the same step uncaptured; another model is refused at start), 'off' never (the
    eager or compiled step). With ``compile`` the captured step is compiled by inductor first (a compilation per
    batch bucket, which the first generation at that batch size waits for). The server says which at start-up."""
    threads: int = 0
    """Torch threads for the forward passes (0: the command's, --threads: OMP_NUM_THREADS, else 1)."""
    model_name: str = ""
    """The model's name for clients: GET /v1/models/NAME, and a completion's model must be it (or absent);
    empty: the model directory's name, or the Hub id as given."""
    cors_origins: str = ""
    """Web origins whose pages may call the API (CORS), comma-separated, or '*' for any; empty: none (no CORS
    headers; a browser allows only the server's own page)."""

    def __post_init__(self) -> None:
        _check("port", 0 <= self.port <= 65535, "must be in 0..65535", self.port)
        for name in ("segment_len", "max_sessions_in_memory", "max_body_bytes", "max_text_chars", "max_tokens",
                     "max_queue", "max_batch"):
            _check(name, getattr(self, name) >= 1, "must be a positive integer", getattr(self, name))
        if self.mem_len is not None:
            _check("mem_len", self.mem_len >= 0, "must be >= 0", self.mem_len)
        _check("session_ttl", self.session_ttl > 0, "must be > 0 seconds", self.session_ttl)
        _check("drain_seconds", self.drain_seconds >= 0, "must be >= 0 seconds", self.drain_seconds)
        _check("threads", self.threads >= 0, "must be >= 0", self.threads)
        _check("graphs", self.graphs in ("auto", "on", "off"), "must be 'auto', 'on' or 'off'", self.graphs)
        _check("durability", self.durability in ("request", "shutdown"), "must be 'request' or 'shutdown'",
               self.durability)

    def context(self, model: ModelConfig) -> Context:
        """The reading context, by the rule of every command (``EvalConfig.context``): a field left unset (None)
        is the model's. ``ext_len`` is 0: a session reads each token once."""
        return model.context(mem_len=self.mem_len, same_length=self.same_length, clamp_len=self.clamp_len,
                             ext_len=0)

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    @property
    def keys(self) -> list[str]:
        return [k.strip() for k in self.api_key.split(",") if k.strip()]
