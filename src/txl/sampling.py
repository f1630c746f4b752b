"""Next-token samplers as pure functions of the logits.

Every function here takes logits (or log-probabilities: the filters and the softmax are invariant to
a per-row additive constant, so either works) whose last dimension is the vocabulary ``V``, and
returns new tensors; nothing is modified in place and no global random state is used. Randomness
comes only from an optional ``torch.Generator`` passed to :func:`sample_next`.

Order of operations in :func:`sample_next` (the usual one, e.g. Hugging Face ``generate``):
temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020), then one categorical draw.
Filtered-out tokens get logit ``-inf`` and therefore probability exactly zero.
"""

from __future__ import annotations

import torch

from txl.config import check_sampling

__all__ = [
    "apply_repetition_penalty", "apply_temperature", "check_sampling", "top_k_filter", "top_p_filter", "sample_next",
]


def _check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"{name} must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {logits.dtype}")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Return ``logits / temperature``.

    ``temperature`` must be > 0: values below 1 sharpen the distribution, above 1 flatten it.
    Greedy decoding (temperature 0) is not a rescaling; ask :func:`sample_next` for it.
    """
    _check_logits(logits)
    if not temperature > 0:  # also rejects NaN
        raise ValueError(
            f"temperature={temperature} must be > 0 here; for greedy decoding call "
            "sample_next(..., temperature=0)"
        )
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row and set the others to ``-inf``.

    ``k == 0`` disables the filter, as does ``k >= V``. Logits tied with the k-th largest value are
    all kept (the result never depends on the order of tied tokens), so a row may keep more than
    ``k`` tokens when there are ties at the boundary.
    """
    _check_logits(logits)
    check_sampling(top_k=k)
    return _top_k(logits, k)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0 or k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1): the k-th largest value per row
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose mass reaches ``p``.

    A token is kept when the probability mass of the tokens strictly more probable than it (in
    sorted order) is below ``p``; so the token that crosses ``p`` is kept, and the most probable
    token is always kept. ``p == 1`` disables the filter. ``p`` must lie in (0, 1].
    """
    _check_logits(logits)
    check_sampling(top_p=p)
    return _top_p(logits, p)


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p == 1.0:
        return logits.clone()
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V) each
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    remove_sorted = mass_before >= p
    remove_sorted[..., 0] = False  # the top token survives even with rounding error
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)  # back to vocab order
    return logits.masked_fill(remove, float("-inf"))


def apply_repetition_penalty(log_probs: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalise tokens already in the context (Keskar et al. 2019, CTRL, section 4.1): a new (B, V) tensor.

    ``seen``: (B, V) bool, True for the tokens each row has read or produced. CTRL divides a seen token's
    logit by ``penalty``; as in Hugging Face's ``RepetitionPenaltyLogitsProcessor`` a negative score is
    multiplied instead, so the penalty always lowers it. Our scores are log-probabilities (<= 0), so a seen
    token's is multiplied by ``penalty``: its probability becomes p ** penalty before renormalising.
    ``penalty`` 1 changes nothing; below 1 favours repetition.
    """
    check_sampling(repetition_penalty=penalty)
    if seen.shape != log_probs.shape or seen.dtype != torch.bool:
        raise ValueError(f"seen must be a {tuple(log_probs.shape)} bool tensor, got {seen.dtype} {tuple(seen.shape)}")
    scaled = torch.where(log_probs < 0, log_probs * penalty, log_probs / penalty)
    return torch.where(seen, scaled, log_probs)


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one next token per row from ``logits`` of shape ``(B, V)``; returns ``(B,)`` int64.

    ``temperature == 0`` means greedy decoding: the argmax of each row (``top_k``/``top_p`` cannot
    change the argmax, so they are only validated). Otherwise the logits are divided by
    ``temperature``, filtered by :func:`top_k_filter` and :func:`top_p_filter`, and one token is
    drawn from the softmax with ``torch.multinomial`` using ``generator`` (which must live on the
    same device as ``logits``). The same generator state gives the same tokens.
    """
    _check_logits(logits)
    if logits.dim() != 2:
        raise ValueError(
            f"logits must have shape (B, V), got shape {tuple(logits.shape)}; "
            "take the last position first, e.g. logits[:, -1, :]"
        )
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)

    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    filtered = _top_p(_top_k(logits / temperature, top_k), top_p)  # arguments checked above
    probs = torch.softmax(filtered.float(), dim=-1)  # (B, V); float32 even for half-precision logits
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)
