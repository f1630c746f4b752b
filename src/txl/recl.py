r"""Relative Effective Context Length (RECL), Dai et al. 2019, Section 4.3 and Appendix C.

Definition (Appendix C), for a *model group* :math:`M = \{m_1, \dots, m_N\}`:

* :math:`l_i(c, t) = -\log P_{m_i}(x_t \mid x_{t-1}, \dots, x_{t-c})` is the loss of model
  :math:`m_i` on token :math:`t` when it sees a context of :math:`c` tokens.
* Baseline, per position, the best loss *in the group* at the short context :math:`c`:
  :math:`b(c, t) = \min_i l_i(c, t)`.
* Positions: :math:`\mathcal{T}` = the top-:math:`r` fraction of positions with the largest
  :math:`b(c, t)`, i.e. the positions where even the best short-context model is worst
  (:math:`r = 1` keeps every position).
* Relative loss of :math:`m_i` going from :math:`c` to :math:`c' \ge c`:
  :math:`f_i(c, c') = \frac{1}{|\mathcal{T}|} \sum_{t \in \mathcal{T}} \min\big(b(c, t), l_i(c', t)\big)`.
  Only improvements below the group baseline count, so every model has to beat the same baseline.
* Relative gain (relative perplexity reduction):
  :math:`g_i(c, c') = \big(\exp f_i(c, c) - \exp f_i(c, c')\big) / \exp f_i(c, c)`.
  Note :math:`f_i(c, c) = \operatorname{mean}_{\mathcal{T}} b(c, t)` is the same for every model.
* Search, with step :math:`\Delta`: start at an initial :math:`c`, set :math:`c' = c + \Delta`;
  if :math:`g_i(c, c') < 0.01` return RECL :math:`= c`, otherwise set :math:`c = c'` and repeat.

The paper reports RECL for r = 0.1, 0.5 and 1.0 (Table 8).

Interpretations we had to make (the paper does not pin these down):

1. :math:`\mathcal{T}` is re-selected at every short context :math:`c` (it is defined through
   :math:`b(c, t)`), and from the whole group's losses, so it is the same set for every model.
2. :math:`|\mathcal{T}| = \lceil r P \rceil` for :math:`P` positions (at least one position). Ties in
   :math:`b(c, t)` are broken by position order (earlier positions first), deterministically.
3. The context lengths actually evaluated form a grid; :math:`\Delta` is implied by it: from
   :math:`c` the search moves to the next grid length (for a uniform grid this is exactly
   :math:`c + \Delta`). If ``step`` is given, the grid must contain every :math:`c + \Delta` the
   search needs.
4. If the gain is still above the threshold at the largest evaluated length, the search cannot go
   further and RECL is that largest length: a lower bound, reported by :func:`recl_details` as
   ``saturated=True``.
5. The stopping test is strict as in the paper: a gain of exactly ``threshold`` continues.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["RECLResult", "group_baseline", "hard_positions", "relative_gain", "recl", "recl_details"]

Losses = Mapping[str, Mapping[int, np.ndarray]]


@dataclass(frozen=True)
class RECLResult:
    """RECL of one model and the search path that produced it."""

    recl: int
    """The relative effective context length."""
    gains: tuple[tuple[int, int, float], ...]
    """Each step of the search as ``(c, c_long, g_i(c, c_long))``."""
    saturated: bool
    """True when the gain never fell below the threshold before the largest evaluated context,
    so ``recl`` is only a lower bound."""


def _as_loss_table(losses: Losses, contexts: Sequence[int]) -> dict[str, dict[int, np.ndarray]]:
    if not isinstance(losses, Mapping) or not losses:
        raise ValueError("losses must be a non-empty mapping {model: {context_length: per-position losses}}")
    table: dict[str, dict[int, np.ndarray]] = {}
    n_positions = None
    for model, per_context in losses.items():
        if not isinstance(per_context, Mapping):
            raise ValueError(f"losses[{model!r}] must map context length -> per-position loss array")
        missing = [c for c in contexts if c not in per_context]
        if missing:
            raise ValueError(
                f"losses[{model!r}] has no losses for context lengths {missing}; "
                "every model needs every context length of the grid"
            )
        table[model] = {}
        for c in contexts:
            arr = np.asarray(per_context[c], dtype=np.float64)
            if arr.ndim != 1 or arr.size == 0:
                raise ValueError(
                    f"losses[{model!r}][{c}] must be a non-empty 1-D array, got shape {arr.shape}"
                )
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"losses[{model!r}][{c}] contains NaN or infinite values")
            if n_positions is None:
                n_positions = arr.size
            elif arr.size != n_positions:
                raise ValueError(
                    f"losses[{model!r}][{c}] has {arr.size} positions but others have {n_positions}; "
                    "all models and contexts must be scored on the same positions"
                )
            table[model][c] = arr
    return table


def _check_grid(contexts: Sequence[int]) -> list[int]:
    grid = [int(c) for c in contexts]
    if len(grid) < 2:
        raise ValueError(f"contexts={list(contexts)} needs at least two context lengths")
    if any(c <= 0 for c in grid) or any(b <= a for a, b in zip(grid, grid[1:], strict=False)):
        raise ValueError(f"contexts={grid} must be strictly increasing positive integers")
    return grid


def _check_r(r: float) -> None:
    if not (0.0 < r <= 1.0):
        raise ValueError(f"r={r} must be in (0, 1] (the paper uses 0.1, 0.5 and 1.0)")


def group_baseline(losses: Losses, c: int) -> np.ndarray:
    """:math:`b(c, t) = \\min_i l_i(c, t)`: per position, the best loss in the group at context ``c``."""
    return np.min(
        np.stack([np.asarray(per_context[c], dtype=np.float64) for per_context in losses.values()]), axis=0
    )


def hard_positions(baseline: np.ndarray, r: float) -> np.ndarray:
    """Sorted indices of the ``ceil(r * P)`` (at least 1) positions with the largest ``baseline``."""
    _check_r(r)
    n = baseline.shape[0]
    k = max(1, math.ceil(r * n - 1e-9))  # tolerance: r * n like 0.1 * 30 must not round up to 4
    order = np.argsort(-baseline, kind="stable")  # largest first, ties by position
    return np.sort(order[:k])


def relative_gain(losses: Losses, model: str, c: int, c_long: int, *, r: float = 1.0) -> float:
    """:math:`g_i(c, c')` of ``model`` within the group ``losses`` (Appendix C)."""
    if c_long < c:
        raise ValueError(f"c_long={c_long} must be >= c={c}")
    if model not in losses:
        raise ValueError(f"model={model!r} is not in the group {list(losses)}")
    _check_r(r)
    table = _as_loss_table(losses, [c, c_long] if c_long != c else [c])
    return _gain(table, model, c, c_long, r)


def _gain(table: dict[str, dict[int, np.ndarray]], model: str, c: int, c_long: int, r: float) -> float:
    b = group_baseline(table, c)  # (P,)
    t = hard_positions(b, r)  # indices of the set T
    f_short = float(np.mean(b[t]))  # f_i(c, c) = mean of min(b, l_i(c)) = mean of b
    f_long = float(np.mean(np.minimum(b[t], table[model][c_long][t])))
    return (math.exp(f_short) - math.exp(f_long)) / math.exp(f_short)


def recl_details(
    losses: Losses,
    contexts: Sequence[int],
    *,
    r: float = 1.0,
    threshold: float = 0.01,
    step: int | None = None,
    start: int | None = None,
) -> dict[str, RECLResult]:
    """RECL of every model of the group, with the gains along each model's search path.

    Args:
        losses: ``losses[model][c]`` is the 1-D array of per-position losses (nats) of ``model``
            at context length ``c``; the same positions for every model and context. All models
            in the mapping form the group.
        contexts: the evaluated context lengths, strictly increasing.
        r: fraction of hardest positions (by the group baseline) the gain is measured on.
        threshold: the search stops at the first relative gain below this (paper: 0.01).
        step: the step :math:`\\Delta`; default: move to the next grid length.
        start: the initial short context; default: ``contexts[0]``.
    """
    grid = _check_grid(contexts)
    _check_r(r)
    if not threshold > 0:
        raise ValueError(f"threshold={threshold} must be > 0 (the paper uses 0.01)")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step <= 0):
        raise ValueError(f"step={step!r} must be a positive int, or None to follow the contexts grid")
    c0 = grid[0] if start is None else int(start)
    if c0 not in grid:
        raise ValueError(f"start={start} must be one of the contexts {grid}")
    table = _as_loss_table(losses, grid)

    def next_context(c: int) -> int | None:
        if step is None:
            i = grid.index(c)
            return grid[i + 1] if i + 1 < len(grid) else None
        if c + step > grid[-1]:
            return None
        if c + step not in grid:
            raise ValueError(f"contexts={grid} lacks {c + step} = {c} + step; evaluate it or change step")
        return c + step

    results = {}
    for model in table:
        c, path = c0, []
        while (c_long := next_context(c)) is not None:
            g = _gain(table, model, c, c_long, r)
            path.append((c, c_long, g))
            if g < threshold:
                break
            c = c_long
        saturated = not path or path[-1][2] >= threshold
        results[model] = RECLResult(recl=c, gains=tuple(path), saturated=saturated)
    return results


def recl(
    losses: Losses,
    contexts: Sequence[int],
    *,
    r: float = 1.0,
    threshold: float = 0.01,
    step: int | None = None,
    start: int | None = None,
) -> dict[str, int]:
    """RECL of every model of the group ``losses``; see :func:`recl_details` for the arguments."""
    details = recl_details(losses, contexts, r=r, threshold=threshold, step=step, start=start)
    return {model: d.recl for model, d in details.items()}
