"""The step budget: how far one outer step may move a fragment, in absolute terms, whoever sent it
(docs/algorithm.md#bounds-on-one-contribution).

The rules of core/guard.py bound an island against its peers; without an honest majority the peers
may be hostile, so the step itself is also bounded by a rate the run established. The
synchronizer's rounds (synchronizer/rounds.py) ask it for each close's factor and record what moved.
"""

from __future__ import annotations

import math

STEP_RATIO = 2.0  # x the mean outer step so far: a linear ramp of honest steps (the learning rate's warm-up) fits under it
STEP_WARMUP = 4  # outer steps of a fragment before the step budget applies: its mean is its first steps' own
STEP_WINDOW = 4  # steps a falling mean follows: it comes down with honest training within a few rounds
MINORITY_SHARE = 0.5  # a round merging at most this share of the islands taking part has no majority of the run
STEP_MEASURES = "movement"  # what StepBudget's mean is of, in its checkpoint: the fragment's movement per outer step


class StepBudget:
    """How far one outer step may move a fragment, in absolute terms: ``ratio`` x the budget's
    ``mean`` (the fragment's recent movement per outer step, its outer momentum's part included),
    once ``warmup`` steps have set it; a round that merged ``share`` <= ``MINORITY_SHARE`` of the
    islands taking part moves it at most ``share`` x the mean (its share of a typical step). A
    longer step is scaled down to the bound, its direction kept.

    The movement, not the merged outer gradient: with outer momentum a round whose own entries the
    other rules had cut to nothing still moved the fragment by the momentum.

    The invariant it keeps (docs/algorithm.md#bounds-on-one-contribution): islands without a
    majority of the run move the fragment no farther, over the run, than honest training does, and
    honest training converges (its steps shrink).
    - A round of a minority (two colluding islands of four open rounds of their own ahead of the
      clock) has its share of a typical step, and neither raises nor lowers the mean after the
      warm-up: counted, one island's tiny or huge steps in rounds of its own would set the budget
      of the whole run.
    - The mean rises no faster than the run's mean (by at most mean x (ratio - 1) / n at the n-th
      step, linearly in n; a learning rate's warm-up ramp x_n = a n, mean a (n + 1) / 2, fits)
      and falls as fast as the last ``window`` steps: it follows honest training down.
    - A step it held counts at the mean x the factor it was held by, so pushing past the budget
      lowers it, the harder the more. Counted as the mean (the rule before), two colluding
      flippers of four held it where the honest islands' early steps set it and drifted the model
      linearly at that rate (2.2 a version; 80x-272x the honest-only distance in 30 s).
    - It never falls below ``peak`` x ``warmup`` / steps (``peak``: the highest mean since the
      warm-up): at nothing it would freeze the fragment for good once an attack stopped; shrinking
      as 1/n it bounds a pushing loop's drift by the logarithm of the steps.
    A step the opposition shortened counts at the length its entries stated, within the budget,
    in a round of any size: a tug-of-war's length is the opposition's, not the run's speed.
    Counted short, its steps lowered the budget until it held the winning side's steps: one
    flipper of two, grace window, 4.1x -> 3.6x the one-honest distance at worst; two flippers of
    four, with the influence budget charging what moved each side's way (core/guard.py
    along_the_step, before its majority gate), 2.4x-6.4x the honest-only distance in 30 s against
    2.0x-3.1x counted as stated. (Until the influence budget charged that, rounds of three or more counted as moved: a
    tie leaned to the flippers' identical directions, and counted as stated it kept the budget up
    while they drifted the model.) In the warm-up, with no budget to bound what they stated, such
    a step is not counted: counted as moved, the first rounds' ties set a low mean that then held
    the winning side's steps (two flippers of four: 1.8x-6.2x against 2.0x-3.1x).
    """

    def __init__(self, ratio: float = STEP_RATIO, warmup: int = STEP_WARMUP, window: int = STEP_WINDOW) -> None:
        self.ratio, self.warmup, self.window = ratio, warmup, window
        self.steps = 0
        self.mean = 0.0
        self.peak = 0.0

    def cap(self, share: float = 1.0) -> float | None:
        """The longest step allowed now for a round that merged ``share`` of the islands taking
        part (None: still in warm-up)."""
        if self.steps < self.warmup:
            return None
        return share * self.mean if share <= MINORITY_SHARE else self.ratio * self.mean

    def scale(self, norm: float, share: float = 1.0) -> float:
        """The factor that brings a step of length ``norm`` within the budget (1.0: it fits)."""
        cap = self.cap(share)
        return 1.0 if cap is None or norm <= cap else cap / norm

    def record(self, norm: float, *, scale: float = 1.0, opposed: float = 1.0, share: float = 1.0) -> None:
        """A step taken, of length ``norm`` (after :meth:`scale`); ``scale``: the factor the budget
        held it by (1.0: it fitted); ``opposed``: the factor its entries' opposition shortened it
        by (:func:`opposition_scale`); ``share``: the part of the islands taking part it merged.
        In the warm-up (no budget yet) every step its entries' opposition did not shorten counts
        at ``norm``, and the others not at all."""
        if not math.isfinite(norm):
            return
        cap = self.cap()
        if (cap is not None and share <= MINORITY_SHARE) or (cap is None and opposed < 1.0):
            return
        if scale < 1.0:
            norm = self.mean * scale
        elif cap is not None and 0.0 < opposed < 1.0:
            norm = min(norm / opposed, cap)
        self.steps += 1
        rate = 1.0 / (min(self.steps, self.window) if norm < self.mean else self.steps)
        self.mean += (norm - self.mean) * rate
        if self.steps >= self.warmup:  # (the warm-up's means are of a step or two)
            self.peak = max(self.peak, self.mean)
            self.mean = max(self.mean, self.peak * self.warmup / self.steps)

    def state_dict(self) -> dict[str, float | str]:
        return {"steps": self.steps, "mean": self.mean, "peak": self.peak, "measures": STEP_MEASURES}

    def load_state_dict(self, state: dict) -> None:
        if state.get("measures") != STEP_MEASURES:
            # a checkpoint of the merged outer gradient's lengths (before 2026-11-28's second part):
            # with outer momentum a movement is several of them, and held steps no longer raise the
            # mean, so that mean would have held every honest step from then on. It warms up again
            self.steps, self.mean, self.peak = 0, 0.0, 0.0
            return
        self.steps, self.mean = int(state.get("steps", 0)), float(state.get("mean", 0.0))
        self.peak = float(state.get("peak", self.mean))  # (none before the falling budget: its mean)
        if self.steps < 0 or not all(math.isfinite(v) and v >= 0.0 for v in (self.mean, self.peak)):
            raise ValueError(f"step budget state {state!r} must have steps >= 0 and a finite mean and peak >= 0")
