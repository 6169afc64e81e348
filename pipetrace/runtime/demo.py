"""The built-in demo: a small MLP and deterministic synthetic regression data.

The model is ``num_stages * blocks_per_stage`` blocks of Linear(width, width) + Tanh, so it
splits evenly into the stages of every schedule and placement, whatever P and V are. It runs
in float64 so that the parity check can demand 1e-5 relative agreement with a wide margin
(pipeline and single-process runs sum the same numbers in a different order; in float64 the
difference is ~1e-15). Targets come from a fixed random "teacher" network, so the loss goes
down as the demo trains. The default size makes one 4-rank step take tens of milliseconds on
a 2-core CPU.
"""

from __future__ import annotations

import torch

from pipetrace.runtime.config import DemoConfig

DTYPE = torch.float64


def build_demo_model(
    num_stages: int, demo: DemoConfig, *, seed: int, tie_weights: bool = False
) -> torch.nn.Sequential:
    """The same model (same initial weights) on every rank and in the reference run. With
    ``tie_weights`` the last block's Linear uses the first block's weight (one Parameter in
    this process, as an input embedding tied to the output projection; see
    `DemoConfig.tied_names`)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(num_stages * demo.blocks_per_stage):
        linear = torch.nn.Linear(demo.width, demo.width, dtype=DTYPE)
        bound = (3.0 / demo.width) ** 0.5  # unit-variance weights keep tanh activations alive
        with torch.no_grad():
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)
        blocks.append(torch.nn.Sequential(linear, torch.nn.Tanh()))
    if tie_weights:
        blocks[-1][0].weight = blocks[0][0].weight
    return torch.nn.Sequential(*blocks)


def demo_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error: a mean, so micro-batch losses average to the batch loss."""
    return torch.nn.functional.mse_loss(output, target)


def demo_batch(
    step: int, batch_size: int, demo: DemoConfig, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of iteration ``step``: the same on every rank and in every run
    with the same seed."""
    teacher = torch.Generator().manual_seed(seed + 1_000_003)
    projection = (
        torch.randn(demo.width, demo.width, generator=teacher, dtype=DTYPE) * demo.width**-0.5
    )
    data = torch.Generator().manual_seed(seed * 1_000_033 + step)
    inputs = torch.randn(batch_size, demo.width, generator=data, dtype=DTYPE)
    return inputs, torch.tanh(inputs @ projection)
