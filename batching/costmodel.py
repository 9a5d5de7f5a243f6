"""Online fit of a batch's run time: ``seconds ≈ a + b·rows + c·padded_tokens``.

The worker reports each batch's measured time (:meth:`CostModel.observe`); the engine
asks for predictions (:meth:`CostModel.estimate`) to decide waits, deadlines and
expirations. The fit is exponentially weighted least squares (recent batches count
more, so a warming GPU or a new model version is followed) with a small ridge toward
a prior, so it is defined from the first call and stays well posed when every batch
has the same shape (then ``rows`` and ``padded_tokens`` are collinear).
"""

from __future__ import annotations

from collections.abc import Sequence

ROW_SCALE = 32.0
"""Features are scaled to similar magnitudes so one ridge weight suits all three."""
TOKEN_SCALE = 1024.0

Coefficients = tuple[float, float, float]
"""``(a, b, c)``: seconds per batch, per row, per padded token."""

PRIOR: Coefficients = (0.005, 0.0005, 0.0)
"""A modest GPU-ish guess, used until measurements arrive (and as the ridge anchor)."""


class CostModel:
    """Exponentially weighted, non-negative, ridge-regularised linear fit of batch time."""

    def __init__(
        self, prior: Coefficients = PRIOR, *, decay: float = 0.995, ridge: float = 0.01
    ) -> None:
        self._prior = (prior[0], prior[1] * ROW_SCALE, prior[2] * TOKEN_SCALE)
        self._decay = decay
        self._ridge = ridge
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._coef: Coefficients = prior
        self._dirty = False
        self.observations = 0

    @property
    def coefficients(self) -> Coefficients:
        """The current fit ``(a, b, c)`` in seconds, seconds/row, seconds/padded token."""
        if self._dirty:
            self._refit()
        return self._coef

    @property
    def overhead(self) -> float:
        """Fixed cost of running any batch (the ``a`` that batching amortises)."""
        return self.coefficients[0]

    def estimate(self, rows: int, padded_tokens: int) -> float:
        """Predicted seconds for a batch of ``rows`` rows and ``padded_tokens`` tokens."""
        a, b, c = self.coefficients
        return max(a + b * rows + c * padded_tokens, 1e-6)

    def observe(self, rows: int, padded_tokens: int, seconds: float) -> None:
        """Fold one measured batch into the fit (older measurements fade by ``decay``)."""
        if seconds < 0 or rows <= 0:
            return
        x = (1.0, rows / ROW_SCALE, padded_tokens / TOKEN_SCALE)
        d = self._decay
        for i in range(3):
            row = self._xx[i]
            for j in range(3):
                row[j] = d * row[j] + x[i] * x[j]
            self._xy[i] = d * self._xy[i] + x[i] * seconds
        self.observations += 1
        self._dirty = True

    def _refit(self) -> None:
        # Solve (XᵀX + λI) β = Xᵀy + λ β_prior; drop any coefficient that comes out
        # negative (a negative per-row cost would make bigger batches look free).
        active = [0, 1, 2]
        beta = [0.0, 0.0, 0.0]
        while active:
            m = [
                [self._xx[i][j] + (self._ridge if i == j else 0.0) for j in active] for i in active
            ]
            v = [self._xy[i] + self._ridge * self._prior[i] for i in active]
            sol = _solve(m, v)
            negative = [active[k] for k, s in enumerate(sol) if s < 0]
            if not negative:
                beta = [0.0, 0.0, 0.0]
                for k, i in enumerate(active):
                    beta[i] = sol[k]
                break
            active.remove(negative[0])
        self._coef = (beta[0], beta[1] / ROW_SCALE, beta[2] / TOKEN_SCALE)
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
