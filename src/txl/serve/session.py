"""Sessions: a document's reading state, its text carried over between requests, and where it is kept.

Shape legend: L layers, m memory rows (<= mem_len; a compressive model's: mem_len to mem_len + c - 1), C
compressed slots (<= cmem_len), d d_model.

A session's state is what Transformer-XL carries from one segment to the next (Dai et al. 2019,
section 3.2): the memory, (L, m, d), whatever the length of the document, plus the tokens read since
the last segment boundary (at most segment_len + 1; the first is the input that predicts the next); a
compressive model's (Rae et al. 2020, ``txl.model.compressive``) also its compressed memory, (L, C, d). The
scores of those tokens are recomputed from the memory at the boundary when more text comes, so a
document read in any pieces is read in exactly the segments `txl score` reads it in.

Text arrives in arbitrary pieces. What cannot be tokenized yet is carried over: an unfinished UTF-8
character (raw bodies), and for line-level tokenizers (words, BPE) the unfinished line, whose encoding
can still change; character and byte tokenizers commit every complete character at once.

The store keeps ``max_in_memory`` sessions in RAM, least recently used first out: spilled sessions are
written to ``state_dir`` (one safetensors file each, written atomically) and read back on their next request.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from txl.fileio import atomic_write

logger = logging.getLogger(__name__)

ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{32}$")
"""A session id: 24 random bytes from ``secrets``, URL-safe base64 (so never a path)."""


class ClientError(Exception):
    """A request the client must change: HTTP ``status``, the ``field`` at fault (or None) and why."""

    def __init__(self, status: int, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.status, self.field, self.reason = status, field, reason


def new_id() -> str:
    return secrets.token_urlsafe(24)


def owner_of(key: str) -> str:
    """What a session records of the key that created it: a hash, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


NOT_ARCHITECTURE = ("dropout", "dropatt", "mem_len", "ext_len", "clamp_len", "same_length", "same_length_style",
                    "init_std", "proj_init_std")
"""ModelConfig fields a served session does not depend on: training-only
settings and the reading context, which `txl serve` may set otherwise for the same model."""


def model_fingerprint(config, tokenizer) -> dict[str, Any]:
    """What a session records of the model that made it: the sizes its state has (vocabulary, layers, width) and
    hashes of the architecture (the config less ``NOT_ARCHITECTURE``) and of the tokenizer (its spec and symbols),
    so that a state directory's sessions are never read by another model."""
    arch = {k: v for k, v in config.to_dict().items() if k not in NOT_ARCHITECTURE}
    vocab = getattr(tokenizer, "vocab", None)
    tok = {"spec": tokenizer.spec, "symbols": list(vocab.symbols) if vocab is not None else tokenizer.vocab_size}

    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return {"vocab_size": int(config.vocab_size), "n_layer": int(config.n_layer), "d_model": int(config.d_model),
            "architecture": digest(arch), "tokenizer": digest(tok)}


def model_mismatch(meta: dict[str, Any], shapes: dict[str, list[int]], model: dict[str, Any]) -> str | None:
    """Why a session (its file's ``meta`` and tensor ``shapes``) belongs to another model than ``model`` (a
    ``model_fingerprint``), or None. A session written before fingerprints were recorded is judged by what it
    holds: its memory's layers and width, its token ids."""
    recorded = meta.get("model")
    if recorded is not None:
        differ = [k for k in model if recorded.get(k) != model[k]]
        return ", ".join(f"{k} {recorded.get(k)} there, {model[k]} here" for k in differ) or None
    for name in ("memory", "compressed"):
        if name in shapes and (shapes[name][0], shapes[name][-1]) != (model["n_layer"], model["d_model"]):
            L, *_, d = shapes[name]
            return f"its {name} has {L} layers of width {d}, this model {model['n_layer']} of {model['d_model']}"
    bad = next((t for t in meta.get("tokens", []) if not 0 <= int(t) < model["vocab_size"]), None)
    if bad is not None:
        return f"it holds token id {bad}, out of range for this model's vocab_size {model['vocab_size']}"
    return None


@dataclass
class SessionState:
    id: str
    owner: str = ""
    with_memory: bool = True
    """False: each segment is read alone (the page's 'without memory' view)."""
    memory: torch.Tensor | None = None
    """(L, m, d) float: every layer's input for the last m positions before ``tokens``; None when empty."""
    compressed: torch.Tensor | None = None
    """(L, C, d): a compressive model's compressed memory (the states that left ``memory``, c to a slot); None
    when empty (and always for a model without one)."""
    tokens: list[int] = field(default_factory=list)
    """Tokens since the last segment boundary; tokens[0] is the input that predicts tokens[1]."""
    tail: str = ""
    """Text received but not yet tokenized (an unfinished line for line-level tokenizers)."""
    raw: bytes = b""
    """An unfinished UTF-8 character at the end of a raw body."""
    n_tokens: int = 0
    """Tokens read, text and generated (the context token, if any, not counted)."""
    n_scored: int = 0
    nll: float = 0.0
    """Summed negative log-likelihood (nats) of the scored tokens."""
    chars: int = 0
    """Characters tokenized (read and generated)."""
    generated: int = 0
    requests: int = 0
    """Requests that changed the session."""
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    model: dict[str, Any] | None = None
    """The fingerprint of the model that made the session (``model_fingerprint``); None: not recorded."""
    generation: Any = None
    """RAM only, never written: the rows of the session's last generation (``engine.Kept``), so that a generation
    that follows it directly steps on from them instead of reading its tokens again; None otherwise."""

    def info(self, *, n_layer: int, mem_len: int, d_model: int, cmem_len: int = 0, cmem_rate: int = 1) -> dict:
        """What GET /v1/sessions/{id} reports; ``cmem_len`` > 0: a compressive model's, whose memory keeps up to
        mem_len + cmem_rate - 1 rows (rows leave in whole groups of c) and whose compressed memory is reported too."""
        m = 0 if self.memory is None else int(self.memory.size(1))
        bits = self.nll / 0.6931471805599453
        rows = mem_len + cmem_rate - 1 if cmem_len else mem_len
        info = {
            "id": self.id, "object": "session", "with_memory": self.with_memory,
            "tokens_read": self.n_tokens, "tokens_generated": self.generated, "tokens_scored": self.n_scored,
            "nll": self.nll, "bits_per_token": bits / self.n_scored if self.n_scored else None,
            "chars": self.chars, "bits_per_char": bits / self.chars if self.chars and self.n_scored else None,
            "pending_chars": len(self.tail), "pending_bytes": len(self.raw), "requests": self.requests,
            "memory": {"shape": [n_layer, m, d_model], "max_shape": [n_layer, rows, d_model],
                       "bytes": _bytes(self.memory)},
            "created": self.created, "last_used": self.last_used,
        }
        if cmem_len:
            C = 0 if self.compressed is None else int(self.compressed.size(1))
            info["compressed_memory"] = {"shape": [n_layer, C, d_model], "max_shape": [n_layer, cmem_len, d_model],
                                         "rate": cmem_rate, "bytes": _bytes(self.compressed)}
        return info

    # -- saving ------------------------------------------------------------------------------------
    def to_file(self, path: Path) -> None:
        from safetensors.torch import save

        meta = {k: getattr(self, k) for k in ("id", "owner", "with_memory", "tokens", "tail", "n_tokens", "n_scored",
                                             "nll", "chars", "generated", "requests", "created", "last_used", "model")}
        meta["raw"] = self.raw.hex()
        tensors = {"memory": self.memory.contiguous()} if self.memory is not None else {}
        if self.compressed is not None:
            tensors["compressed"] = self.compressed.contiguous()
        # Serialized in memory and written by Python's own file I/O, so that a full disk is the OSError it is
        # (safetensors' save_file reports it as SafetensorError, which no caller would read as a disk error).
        data = save(tensors, metadata={"txl_session": json.dumps(meta)})
        with open(path, "wb") as f:
            f.write(data)

    @classmethod
    def from_file(cls, path: Path) -> SessionState:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["txl_session"])
            memory = f.get_tensor("memory") if "memory" in f.keys() else None
            # A file written before compressed memories were served has none: the session reads on from an empty one.
            compressed = f.get_tensor("compressed") if "compressed" in f.keys() else None
        meta["raw"] = bytes.fromhex(meta["raw"])
        return cls(memory=memory, compressed=compressed, **meta)


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _lines(text: str) -> list[str]:
    """``text`` cut after each '\\n' (each line keeps it; no empty line after a final one), as a file reads."""
    pieces = text.split("\n")
    return [p + "\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])


def take_text(state: SessionState, data: str | bytes, tokenizer, *, final: bool) -> tuple[list[int], str, str, bytes]:
    """The token ids that ``data`` completes, the text they cover, and the new (tail, raw) to carry.

    Nothing in ``state`` is changed (the caller commits once the model has read the ids). Newlines are
    read as a text file is (universal newlines: '\\r\\n' and '\\r' are '\\n'), so a session equals
    `txl score` on the same bytes. ``final``: the document ends here (its last line is read as it stands: at word
level without an ``<eos>`` unless the text ends with a line break, as `txl score` reads a file).
    """
    raw = state.raw
    if isinstance(data, bytes):
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            text = decoder.decode(raw + data, final=final)
        except UnicodeDecodeError as err:
            raise ClientError(400, "text", f"not UTF-8 text (byte {err.start - len(raw)}: {err.reason})") from None
        raw = decoder.getstate()[0]
    else:
        if raw:
            raise ClientError(400, "text", "the session holds an unfinished UTF-8 character from a raw body; "
                              "send its remaining bytes as a raw body first")
        text = data
    text = state.tail + text
    hold = ""
    if text.endswith("\r") and not final:  # perhaps the first half of '\r\n'
        text, hold = text[:-1], "\r"
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if tokenizer.boundary == "line" and not final:
        cut = text.rfind("\n") + 1
        text, tail = text[:cut], text[cut:] + hold
    else:
        tail = hold
    try:
        ids = [int(i) for i in tokenizer.encode_lines(_lines(text))] if text else []
    except ValueError as err:  # a character or word the vocabulary cannot encode
        raise ClientError(400, "text", str(err)) from None
    return ids, text, tail, raw


TEMPORARY = re.compile(r"^\.tmp-[A-Za-z0-9_-]{32}\.safetensors-(?P<pid>\d+)-[0-9a-f]+$")
"""A session file being written by ``atomic_write`` in process ``pid``."""


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending anything)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


class SessionStore:
    """Sessions by id: the most recently used ``max_in_memory`` in RAM, the others in ``state_dir``.

    Used from one thread (the engine's worker); ``pinned`` sessions (with work in progress) are never evicted.
    """

    SUFFIX = ".safetensors"
    RETRY_SECONDS = 2.0
    """How often eviction tries again while session files cannot be written."""

    def __init__(self, state_dir: str | os.PathLike, *, max_in_memory: int, ttl: float,
                 model: dict[str, Any] | None = None) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_in_memory, self.ttl, self.model = max_in_memory, ttl, model
        self.ram: OrderedDict[str, SessionState] = OrderedDict()
        self.dirty: set[str] = set()
        self.last_used: dict[str, float] = {}
        """Every known session, in RAM or on disk -> last use (for the TTL); on disk at start: the file's mtime."""
        self.foreign: dict[str, str] = {}
        """Sessions on disk that another model made (``model``: this one's fingerprint) -> why: never read, never
        expired or deleted here; a request for one is a 409."""
        for p in self.dir.glob("*" + self.SUFFIX):
            if ID_PATTERN.match(p.stem):
                why = self._mismatch(p)
                if why is None:
                    self.last_used[p.stem] = p.stat().st_mtime
                else:
                    self.foreign[p.stem] = why
        if self.foreign:
            logger.warning("%d sessions in %s belong to another model (%s); they are left as they are, and a request "
                           "for one is refused (409)", len(self.foreign), self.dir, next(iter(self.foreign.values())))
        self.evictions = 0
        self.retry_at = 0.0
        """While writes fail (a full disk): when eviction next tries (monotonic); 0 while they succeed."""
        n = self.remove_stale_temporaries()
        if n:
            logger.info("removed %d temporary session files left in %s by a server that was killed", n, self.dir)

    def _mismatch(self, path: Path) -> str | None:
        """Why the session file at ``path`` belongs to another model (its header only is read), or None (also for
        an unreadable file: ``get`` reports it)."""
        if self.model is None:
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads(f.metadata()["txl_session"])
                shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception:  # noqa: BLE001 - a damaged file is get's to report, once
            return None
        return model_mismatch(meta, shapes, self.model)

    def remove_stale_temporaries(self) -> int:
        """Remove what a writer killed mid-write left (``atomic_write``'s ``.tmp-ID.safetensors-PID-HEX``): those of
        a process that no longer runs. A live process's temporary (another server on the same directory, mid-write)
        is left to it."""
        n = 0
        for p in self.dir.glob(".tmp-*" + self.SUFFIX + "-*"):
            found = TEMPORARY.match(p.name)
            if found and not _running(int(found.group("pid"))):
                p.unlink(missing_ok=True)
                n += 1
        return n

    def path(self, sid: str) -> Path:
        return self.dir / (sid + self.SUFFIX)

    @property
    def on_disk(self) -> int:
        return sum(1 for sid in self.last_used if sid not in self.ram or sid not in self.dirty)

    def create(self, owner: str, *, with_memory: bool = True, context: list[int] | None = None) -> SessionState:
        state = SessionState(id=new_id(), owner=owner, with_memory=with_memory, tokens=list(context or []),
                             model=self.model)
        self.ram[state.id] = state
        self.last_used[state.id] = state.last_used
        self.dirty.add(state.id)
        return state

    def get(self, sid: str, owner: str) -> SessionState:
        """The session, read back from disk if it was spilled; 404 when unknown or another key's, 409 when another
        model made it."""
        if sid in self.foreign:
            raise ClientError(409, "session", f"the session was made by another model than the one served here "
                              f"({self.foreign[sid]}): serve that model on {self.dir} to use it, or start this one "
                              "with another serve.state_dir")
        state = self.ram.get(sid) if ID_PATTERN.match(sid) else None
        if state is None and ID_PATTERN.match(sid) and sid in self.last_used:
            try:
                state = SessionState.from_file(self.path(sid))
            except FileNotFoundError:
                state = None
            except Exception as err:  # a damaged file: the session is lost, say so once, server intact
                logger.error("session file %s is unreadable (%s); the session is dropped", self.path(sid), err)
                self.last_used.pop(sid, None)
                state = None
            if state is not None and self.model is not None and state.model not in (None, self.model):
                # Written after start-up by a server of another model on the same directory: left as it is.
                self.foreign[sid] = model_mismatch({"model": state.model}, {}, self.model) or "another model"
                self.last_used.pop(sid, None)
                return self.get(sid, owner)
            if state is not None:
                if state.model is None:  # written before fingerprints: it passed model_mismatch at start-up
                    state.model = self.model
                self.ram[sid] = state
        if state is None or state.owner != owner:  # another key's session does not exist for this key
            raise ClientError(404, "session", "no such session (it was deleted, expired, or belongs to another key)")
        self.ram.move_to_end(sid)
        state.last_used = self.last_used[sid] = time.time()
        return state

    def save(self, state: SessionState) -> None:
        self.write(state)
        self.dirty.discard(state.id)

    def write(self, state: SessionState) -> None:
        """Write the session's file (atomic, fsynced) and touch nothing else: another thread may call it while
        the session is in no other use (the engine keeps it active until then)."""
        atomic_write(self.path(state.id), state.to_file)

    def changed(self, state: SessionState, *, durable: bool) -> None:
        self.dirty.add(state.id)
        if durable:
            self.save(state)

    def delete(self, sid: str) -> None:
        self.ram.pop(sid, None)
        self.dirty.discard(sid)
        self.last_used.pop(sid, None)
        self.path(sid).unlink(missing_ok=True)

    def evict(self, pinned: set[str]) -> int:
        """Write the least recently used sessions beyond the budget to disk and drop them from RAM.

        A session that cannot be written (a full disk) stays in RAM, changed, beyond the budget: the error is
        logged once, eviction tries again every ``RETRY_SECONDS`` and says when writes work again. Nothing is
        lost and the worker goes on serving."""
        if len(self.ram) <= self.max_in_memory or time.monotonic() < self.retry_at:
            return 0
        n = 0
        for sid in list(self.ram):
            if len(self.ram) <= self.max_in_memory:
                break
            if sid in pinned:
                continue
            if sid in self.dirty:
                try:
                    self.save(self.ram[sid])
                except OSError as err:
                    if not self.retry_at:
                        logger.error("could not write session %s to %s (%s): sessions stay in memory beyond "
                                     "serve.max_sessions_in_memory=%d until they can be written (retried every %g s)",
                                     sid, self.dir, _reason(err), self.max_in_memory, self.RETRY_SECONDS)
                    self.retry_at = time.monotonic() + self.RETRY_SECONDS
                    break
                if self.retry_at:
                    logger.info("sessions can be written to %s again", self.dir)
                    self.retry_at = 0.0
            del self.ram[sid]
            n += 1
        self.evictions += n
        return n

    def expire(self, now: float, busy: set[str]) -> int:
        old = [sid for sid, t in self.last_used.items() if now - t > self.ttl and sid not in busy]
        for sid in old:
            self.delete(sid)
        return len(old)

    def flush(self, exclude: set[str] = frozenset()) -> int:
        """Write every session changed since it was last written (at shutdown), but ``exclude``; a session that
        cannot be written is logged (by id) and the others are still written. Returns how many were written."""
        dirty = [self.ram[sid] for sid in self.dirty if sid in self.ram and sid not in exclude]
        n = 0
        for state in dirty:
            try:
                self.save(state)
                n += 1
            except OSError as err:
                logger.error("could not write session %s to %s (%s): its changes since it was last written are lost",
                             state.id, self.dir, _reason(err))
        return n
