"""A txl model for lm-evaluation-harness (``pip install 'txl[lmeval]'``): ``txl-lm-eval --model txl``.

Importing this module registers the model under the name ``txl`` (lm-eval's ``register_model``, the way its
documentation adds a model from outside its package). lm-eval 0.4 finds a model by name only in its own table
and among the classes registered in the running process: it reads no entry points, so its own ``lm_eval``
command cannot know ``txl``. ``txl-lm-eval ARGS`` (the console script this package installs) and
``python -m txl.lmeval ARGS`` are lm-eval's own command line with the model registered::

    txl-lm-eval --model txl --model_args pretrained=runs/wt103 --tasks wikitext

or in Python: ``lm_eval.simple_evaluate(model=TxlLM(pretrained="runs/wt103"), tasks=[...])``.

``loglikelihood_rolling`` reads each document as ``txl score`` reads a file: from its start to its end, one
segment at a time, the memory carrying the context across segments (Dai et al. 2019, section 3.2), never
restarting a window, with the token lm-eval calls the prefix (``Tokenizer.prefix_id``: ``<eos>`` at word
level, the line break at char or byte level) read first so that the first token is scored too. The prefix is
``txl score``'s own context token and a document's tokens are its text's (no ``<eos>`` after a last line
without a line break, at word level as in ``txl score``: ``Tokenizer.context_id`` states the one rule), so a
document's log-likelihood is exactly the negative of ``txl score``'s total NLL on the same text. The reading
context (segment length, mem_len, same_length, clamp_len) is
``txl score``'s: a run's ``[eval]`` section, else the model's, each field overridable in ``--model_args``.

``loglikelihood`` reads the context and the continuation the same way (the prefix before an empty context,
a context's own first token otherwise, as lm-eval's HTTP models send it): the continuation's log-prob, and
``is_greedy``, whether each of its tokens is the most likely one where it is read (what `txl serve`'s
``top_logprobs`` give lm-eval over HTTP). ``generate_until`` is ``txl.generate``: greedy unless the task asks for
a temperature, cut at the first stop text. Text is tokenised as a prompt (``Tokenizer.encode_prompt``), as
``txl serve``'s ``/tokenize`` does: a word-level text ending without a line break gets no final ``<eos>``.
"""

from __future__ import annotations

from typing import Any

try:
    # lm-eval fills its model registry with its own models only when the registry is empty: import them first,
    # or registering ``txl`` would hide 'local-completions' and the rest from get_model.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as err:  # one line, with the fix
    raise ImportError("txl's lm-evaluation-harness model needs lm-eval: pip install 'txl[lmeval]'") from err

import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["TxlLM", "main"]


def _flag(value: Any) -> bool | None:
    """A --model_args value (lm-eval passes strings through its own parsing: 'True', 'false', ...)."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise ValueError(f"same_length={value!r} must be true or false")


@register_model("txl")
class TxlLM(TemplateLM):
    """A txl model (run directory, model directory or Hub id) as an lm-evaluation-harness language model."""

    def __init__(self, pretrained: str, *, revision: str | None = None, device: str = "auto",
                 batch_size: int | str = 8, segment_len: int | None = None, mem_len: int | None = None,
                 same_length: bool | str | None = None, clamp_len: int | None = None, max_gen_toks: int = 256,
                 **kwargs: Any) -> None:
        super().__init__()
        unknown = sorted(k for k in kwargs if k not in ("dtype", "trust_remote_code", "max_length", "max_batch_size"))
        if unknown:
            raise ValueError(f"unknown model_args for the txl model: {', '.join(unknown)}; it takes pretrained, "
                             "revision, device, batch_size, segment_len, mem_len, same_length, clamp_len, max_gen_toks")
        import txl
        from txl.data.tokenizer import load_model_tokenizer
        from txl.distributed import resolve_device
        from txl.pretrained import resolve_model_dir

        if str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line passes device=cuda:0 unless told otherwise; its own models fall back too.
            logger.warning("device %s: CUDA is not available on this machine; the model runs on the CPU", device)
            device = "cpu"
        directory = resolve_model_dir(pretrained, revision=revision)
        self.model = txl.from_pretrained(directory, device=resolve_device(device)).eval()
        self.tokenizer = load_model_tokenizer(directory, vocab_size=self.model.config.vocab_size)
        self.segment_len, self.context = reading_context(
            directory, self.model, segment_len=segment_len, mem_len=mem_len,
            same_length=_flag(same_length), clamp_len=clamp_len)
        self._batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self._device = next(self.model.parameters()).device

    # -- tokens ------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        prefix = self.tokenizer.prefix_id
        if prefix is None:
            raise ValueError("the tokenizer has no token to read before a document (no <eos>, no line break in its "
                             "vocabulary), which lm-eval needs; score documents with txl score")
        return prefix

    @property
    def prefix_token_id(self) -> int:
        return self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return [int(i) for i in self.tokenizer.encode_prompt(string)]

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def tokenizer_name(self) -> str:
        return f"txl-{self.tokenizer.level}-{self.tokenizer.vocab_size}"

    # -- scoring -----------------------------------------------------------------------------------------
    def _score(self, docs: list[list[int]], context_id: int | None) -> list[Any]:
        """txl score's reading of each document: its DocumentScore (per-token log-probs kept)."""
        from txl.score import score_documents

        return score_documents(self.model, docs, segment_len=self.segment_len, batch_size=self._batch_size,
                               mem_len=self.context.mem_len, same_length=self.context.same_length,
                               clamp_len=self.context.clamp_len, context_id=context_id, keep_logprobs=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        docs = [self.tok_encode(req.args[0]) for req in requests]
        scores = self._score(docs, self.prefix_token_id)
        out = []
        for req, doc in zip(requests, scores):
            out.append(-doc.nll)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, -doc.nll)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        # Each request: ((context, continuation), context ids, continuation ids); the context's first token
        # is read as the context of the rest (it is the prefix when the context text was empty).
        out = []
        for key, ctx, cont in requests:
            answer = self._read(list(ctx) + list(cont), len(cont))
            out.append(answer)
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    @torch.no_grad()
    def _read(self, ids: list[int], n: int) -> tuple[float, bool]:
        """Read ``ids`` as txl score does (segments, memory carried: txl.decoding.read); the summed log-prob of
        the last ``n`` and whether each of them is the most likely token where it stands."""
        from txl.decoding import read

        c = self.context
        context = self.model.config.context(mem_len=c.mem_len, same_length=c.same_length, clamp_len=c.clamp_len,
                                            ext_len=0)
        x = torch.tensor([ids[:-1]], dtype=torch.long, device=self._device)  # (1, N - 1): inputs
        y = torch.tensor([ids[1:]], dtype=torch.long, device=self._device)  # (1, N - 1): labels
        first = x.size(1) - n  # the continuation's labels start here
        memory, logprob, greedy = None, 0.0, True
        for start in range(0, x.size(1), self.segment_len):
            xs, ys = x[:, start:start + self.segment_len], y[:, start:start + self.segment_len]  # (1, S) each
            lp, out = read(self.model, xs, ys, memory, context=context)
            memory = out.memory
            skip = max(first - start, 0)  # positions of this segment before the continuation
            if skip >= xs.size(1):
                continue
            logprob += float(lp[0, skip:].sum())
            best = self.model.softmax.log_prob(out.hidden[0, skip:]).argmax(-1)  # (S - skip,)
            greedy = greedy and bool((best == ys[0, skip:]).all())
        return logprob, greedy

    # -- generation --------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from txl.generation import generate

        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", True) else 0.0
            ids = self.tok_encode(context) or [self.prefix_token_id]
            made = generate(self.model, ids, max_new_tokens=max_new, temperature=temperature,
                            segment_len=self.segment_len, stop_strings=until, decode=self.tokenizer.decode,
                            top_k=int(kwargs.pop("top_k", 0)), top_p=float(kwargs.pop("top_p", 1.0)))
            text = self.tokenizer.decode([t for t in made[0].tolist() if t >= 0])
            cut = min((text.find(s) for s in until if s in text), default=-1)
            text = text[:cut] if cut >= 0 else text
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out


def reading_context(directory, model, *, segment_len: int | None = None, **changes: Any):
    """The segment length and attention context ``txl score`` reads with: the run's ``[eval]`` section (when
    ``directory`` belongs to a run), then the model's config, each field overridden by a value given."""
    from txl.checkpoint import RUN_FILE, read_run
    from txl.config import SCORE_SEGMENT_LEN, EvalConfig

    base = read_run(directory).to_dict()["eval"] if (directory / RUN_FILE).is_file() else {}
    given = {k: v for k, v in changes.items() if v is not None}
    if segment_len is not None:
        given["tgt_len"] = int(segment_len)
    e = EvalConfig(**{**base, **given, "ext_len": None})
    return e.segment_len(SCORE_SEGMENT_LEN), e.context(model.config)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line, with the ``txl`` model registered (the ``txl-lm-eval`` command runs it)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    with torch.no_grad():  # scoped: a caller in the same process (a test, a notebook) gets its grad mode back
        cli_evaluate()


if __name__ == "__main__":
    main()
