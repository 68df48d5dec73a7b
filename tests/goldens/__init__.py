"""Numeric goldens: small JSON trajectories that pin what the merge, the outer step and a short
strategy run compute, so a refactor that changes a number fails even where every property test
still holds.

``check_golden(name, values)`` compares against ``tests/goldens/<name>.json``. To accept new
numbers on purpose (a deliberate change of the algorithm, or of torch's kernels), run the tests
with ``DILOCO_REGENERATE_GOLDENS=1`` and commit the JSON diff with the reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

HERE = Path(__file__).parent
REGENERATE = "DILOCO_REGENERATE_GOLDENS"


def check_golden(name: str, values: dict[str, torch.Tensor | list[float] | float], *, rtol: float = 1e-5,
                 atol: float = 1e-6) -> None:
    got = {k: torch.as_tensor(v, dtype=torch.float64).flatten().tolist() for k, v in values.items()}
    path = HERE / f"{name}.json"
    if os.environ.get(REGENERATE) == "1":
        path.write_text(json.dumps({k: [float(f"{x:.9g}") for x in v] for k, v in got.items()}, indent=1) + "\n")
    assert path.exists(), f"no golden {path.name}; create it with {REGENERATE}=1"
    expected = json.loads(path.read_text())
    assert sorted(got) == sorted(expected), f"golden {path.name} holds {sorted(expected)}, the test computed {sorted(got)}"
    for key in expected:
        a, b = torch.tensor(got[key], dtype=torch.float64), torch.tensor(expected[key], dtype=torch.float64)
        assert a.shape == b.shape, f"{path.name}[{key}]: {a.numel()} values, golden has {b.numel()}"
        worst = float((a - b).abs().max()) if a.numel() else 0.0
        assert torch.allclose(a, b, rtol=rtol, atol=atol), (
            f"{path.name}[{key}] moved from the golden by up to {worst:.3g}; if that is intended, "
            f"rerun with {REGENERATE}=1 and commit the new JSON with the reason"
        )
