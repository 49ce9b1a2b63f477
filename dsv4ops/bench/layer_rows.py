"""`bench --only layer`'s rows: V4-Flash and V4-Pro per layer kind (bench/layer_step.py), V4.1-Flash
per layer role (bench/layer_step_v41.py), each model's whole-stack rows after its own."""

from __future__ import annotations

import torch

from dsv4ops.bench import layer_step, layer_step_v41
from dsv4ops.config import CSA, HCA, SLIDING


@torch.no_grad()
def run(quick: bool = False, progress=print, device="cuda", timer=None, models=("flash", "pro", "v41"),
        kinds=(SLIDING, CSA, HCA), points=None) -> list[dict]:
    """The rows of `models` at `points` (default layer_step.POINTS, QUICK_POINTS with `quick`), timed by
    `timer` (default: one CUDA-graph replay, bench/timing.py) against the rates it measures first."""
    from dsv4ops.bench.timing import graph_time_us

    timer = timer or graph_time_us
    rates = layer_step.measured_rates(timer)
    points = points or (layer_step.QUICK_POINTS if quick else layer_step.POINTS)
    rows = []
    for model in models:
        if model == "v41":
            rows += layer_step_v41.run(progress, device, timer, rates, points)
        else:
            rows += layer_step.run(progress, device, timer, rates, points, (model,), kinds)
    return rows
