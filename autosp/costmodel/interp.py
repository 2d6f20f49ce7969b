"""Table lookups: monotone log-log interpolation, and an alpha-beta fit for collectives.

Measured tables are noisy: a larger transfer can time faster than a smaller one.
The noise only ever adds time (a descheduled rank, a cold cache), so ``monotone``
takes the lower envelope: each time becomes the least time measured at that size or
any larger one, and a prediction never decreases with size. (The running maximum
would let one slow sample at a small size lift every size above it.)
Between points, time is interpolated
linearly in log(size)-log(time) space. Beyond the last point it extrapolates along
the last segment's chord, time = t_last + (size - x_last) * marginal time per unit, and
never past linear scaling from the last point (the bandwidth- or compute-bound limit).
A fixed cost amortised over a growing size is what makes a table sub-linear; it is
amortised once, so the marginal cost is what the next unit costs. (Extrapolating the
log-log slope instead kept the per-unit time falling: a 2-head and an 8-head attention
table measured 4.1 ns per score at 8192 tokens each extrapolated 26% apart at 16384.)
It says so when it goes further than ``FAR`` times the table's range.
"""

from __future__ import annotations

import bisect
import math
import warnings
from dataclasses import dataclass

FAR = 64.0      # extrapolating past 64x the largest measured size earns a warning


def monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted by size, sizes > 0, times made non-decreasing by the lower envelope from above:
    t(x) = min over measured sizes >= x."""
    pts = sorted((float(x), float(t)) for x, t in points if x > 0 and t > 0)
    out: list[tuple[float, float]] = []
    best = float("inf")
    for x, t in reversed(pts):
        best = min(best, t)
        if out and out[-1][0] == x:
            out[-1] = (x, best)
            continue
        out.append((x, best))
    return out[::-1]


@dataclass
class LogLogTable:
    """Time as a function of size (FLOPs or bytes) from measured points."""

    points: list[tuple[float, float]]
    what: str = "table"

    def __post_init__(self) -> None:
        self.points = monotone(self.points)
        if not self.points:
            raise ValueError(f"{self.what}: no positive (size, time) points")
        self._xs = [math.log(x) for x, _ in self.points]
        self._ys = [math.log(t) for _, t in self.points]

    def __call__(self, size: float) -> float:
        if size <= 0:
            return 0.0
        xs, ys = self._xs, self._ys
        lx = math.log(size)
        if len(xs) == 1:
            return math.exp(ys[0]) * max(1.0, size / self.points[0][0])
        if lx <= xs[0]:
            return math.exp(ys[0])                      # below the table: the smallest time (latency)
        if lx >= xs[-1]:
            (x0, t0), (x1, t1) = self.points[-2:]
            if size > FAR * x1:
                warnings.warn(f"{self.what}: size {size:.3g} is {size / x1:.0f}x beyond the "
                              f"largest measured ({x1:.3g}); extrapolating", stacklevel=3)
            return min(t1 * size / x1, t1 + (size - x1) * (t1 - t0) / (x1 - x0))
        i = bisect.bisect_right(xs, lx) - 1
        f = (lx - xs[i]) / (xs[i + 1] - xs[i])
        return math.exp(ys[i] + f * (ys[i + 1] - ys[i]))


@dataclass
class AlphaBeta:
    """``time = alpha + bytes / bandwidth``, least squares on the measured points."""

    alpha: float
    bandwidth: float

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> "AlphaBeta":
        pts = monotone(points)
        if len(pts) == 1:
            x, t = pts[0]
            return cls(0.0, x / t)
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        mt = sum(t for _, t in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        beta = sum((x - mx) * (t - mt) for x, t in pts) / sxx if sxx else 0.0
        beta = max(beta, 1e-15)
        alpha = max(0.0, mt - beta * mx)
        return cls(alpha, 1.0 / beta)

    def __call__(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.bandwidth if nbytes > 0 else 0.0
