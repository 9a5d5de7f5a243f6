"""Online fit of a batch's run time: ``seconds ≈ a + b·rows + c·padded + d·rows·padded``.

The worker reports each batch's measured time (:meth:`CostModel.observe`); the engine
asks for predictions (:meth:`CostModel.estimate`) to decide waits, deadlines and
expirations, and which batch size gives the most rows per second
(:meth:`CostModel.row_cost`). The fit is exponentially weighted least squares (recent
batches count more, so a warming GPU or a new model version is followed) with a small
ridge toward a prior, so it is defined from the first call and stays well posed when
every batch has the same shape (then ``rows`` and ``padded_tokens`` are collinear).

The ``d·rows·padded`` term (per row: ``d·rows·width``) is what makes a bigger batch
slower *per row* on a CPU: measured on all-MiniLM-L6-v2, one thread, a row of 64
tokens costs 15.8 ms in a batch of 8 and 17.0 ms in a batch of 32 (the activations
outgrow the caches). A linear fit cannot see that and always fills to the cap; with
it, the best batch size for rows of ``w`` tokens is ``sqrt(a / (d·w))``. On a GPU
(or any cost without that term) ``d`` fits to about 0 and nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

ROW_SCALE = 32.0
"""Features are scaled to similar magnitudes so one ridge weight suits all four."""
TOKEN_SCALE = 1024.0
CROSS_SCALE = ROW_SCALE * TOKEN_SCALE

Coefficients = tuple[float, float, float, float]
"""``(a, b, c, d)``: seconds per batch, per row, per padded token, per row x padded token."""

PRIOR: Coefficients = (0.005, 0.0005, 0.0, 0.0)
"""A modest GPU-ish guess, used until measurements arrive (and as the ridge anchor)."""
_SCALES = (1.0, ROW_SCALE, TOKEN_SCALE, CROSS_SCALE)
_N = len(_SCALES)


class CostModel:
    """Exponentially weighted, non-negative, ridge-regularised fit of batch time."""

    def __init__(
        self, prior: Coefficients = PRIOR, *, decay: float = 0.995, ridge: float = 0.01
    ) -> None:
        self._prior = tuple(p * s for p, s in zip(prior, _SCALES, strict=True))
        self._decay = decay
        self._ridge = ridge
        self._xx = [[0.0] * _N for _ in range(_N)]
        self._xy = [0.0] * _N
        self._coef: Coefficients = prior
        self._dirty = False
        self.observations = 0

    @property
    def coefficients(self) -> Coefficients:
        """The current fit ``(a, b, c, d)`` (seconds; per row, per padded token, per both)."""
        if self._dirty:
            self._refit()
        return self._coef

    @property
    def overhead(self) -> float:
        """Fixed cost of running any batch (the ``a`` that batching amortises)."""
        return self.coefficients[0]

    @property
    def padding_costs(self) -> bool:
        """Whether padded tokens cost anything (else length grouping buys nothing)."""
        _, _, c, d = self.coefficients
        return c > 0.0 or d > 0.0

    def estimate(self, rows: int, padded_tokens: int) -> float:
        """Predicted seconds for a batch of ``rows`` rows and ``padded_tokens`` tokens."""
        a, b, c, d = self.coefficients
        return max(a + b * rows + c * padded_tokens + d * rows * padded_tokens, 1e-6)

    def estimator(self) -> Callable[[int, int], float]:
        """:meth:`estimate` with the current fit bound in: cheaper in a search loop."""
        a, b, c, d = self.coefficients

        def estimate(rows: int, padded_tokens: int) -> float:
            return max(a + b * rows + c * padded_tokens + d * rows * padded_tokens, 1e-6)

        return estimate

    def best_rows(self, tokens: int, row_cap: int, token_cap: int | None = None) -> int:
        """The batch size (rows of ``tokens`` tokens each) with the least time per row."""
        a, _, _, d = self.coefficients
        cap = max(1, row_cap)
        if token_cap is not None and tokens > 0:
            cap = max(1, min(cap, token_cap // tokens))
        if d <= 0.0 or tokens <= 0:
            return cap
        best = math.sqrt(a / (d * tokens))  # minimises a/R + d·R·w
        lo = max(1, min(cap, math.floor(best)))
        hi = max(1, min(cap, lo + 1))
        return lo if self._per_row(lo, tokens) <= self._per_row(hi, tokens) else hi

    def row_cost(self, tokens: int, row_cap: int, token_cap: int | None = None) -> float:
        """Seconds per row for rows of ``tokens`` tokens in a batch of the best size for them.

        This is a row's cost with no padding and the overhead shared as well as it can
        be: what a batch is measured against when it is composed for throughput.
        """
        return self._per_row(self.best_rows(tokens, row_cap, token_cap), tokens)

    def _per_row(self, rows: int, tokens: int) -> float:
        return self.estimate(rows, rows * tokens) / rows

    def observe(self, rows: int, padded_tokens: int, seconds: float) -> None:
        """Fold one measured batch into the fit (older measurements fade by ``decay``)."""
        if seconds < 0 or rows <= 0:
            return
        x = (1.0, rows / ROW_SCALE, padded_tokens / TOKEN_SCALE, rows * padded_tokens / CROSS_SCALE)
        d = self._decay
        for i in range(_N):
            row = self._xx[i]
            for j in range(_N):
                row[j] = d * row[j] + x[i] * x[j]
            self._xy[i] = d * self._xy[i] + x[i] * seconds
        self.observations += 1
        self._dirty = True

    def _refit(self) -> None:
        # Solve (XᵀX + λI) β = Xᵀy + λ β_prior; drop any coefficient that comes out
        # negative (a negative per-row cost would make bigger batches look free).
        active = list(range(_N))
        beta = [0.0] * _N
        while active:
            m = [
                [self._xx[i][j] + (self._ridge if i == j else 0.0) for j in active] for i in active
            ]
            v = [self._xy[i] + self._ridge * self._prior[i] for i in active]
            sol = _solve(m, v)
            negative = [active[k] for k, s in enumerate(sol) if s < 0]
            if not negative:
                beta = [0.0] * _N
                for k, i in enumerate(active):
                    beta[i] = sol[k]
                break
            active.remove(negative[0])
        a, b, c, d = (beta[i] / _SCALES[i] for i in range(_N))
        self._coef = (a, b, c, d)
        self._dirty = False


def _solve(m: list[list[float]], v: Sequence[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small, positive definite system."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        p = a[col][col]
        if abs(p) < 1e-15:
            continue
        for r in range(col + 1, n):
            f = a[r][col] / p
            if f:
                for k in range(col, n + 1):
                    a[r][k] -= f * a[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        p = a[r][r]
        s = a[r][n] - sum(a[r][k] * out[k] for k in range(r + 1, n))
        out[r] = s / p if abs(p) >= 1e-15 else 0.0
    return out
