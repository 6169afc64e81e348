"""The built-in demo on MindSpore: the same model and data recipe as the torch demo
(`pipetrace.runtime.demo`), drawn from numpy generators instead of torch's.

``num_stages * blocks_per_stage`` blocks of Dense(width, width) + Tanh in float64, named
``0.0.weight``, ``0.0.bias``, ... as in torch; inputs and targets of step k come from a
generator seeded with (seed, k), targets from a fixed random "teacher"; mean squared error.
The numbers differ from the torch demo's (other generators), so parity is checked against a
single-process MindSpore run, never against torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipetrace.runtime.config import DemoConfig

if TYPE_CHECKING:
    from mindspore import Tensor, nn


def build_demo_model(num_stages: int, demo: DemoConfig, *, seed: int) -> nn.SequentialCell:
    """The same model (same initial weights) on every rank and in the reference run."""
    import mindspore as ms
    from mindspore import nn

    generator = np.random.default_rng(seed)
    bound = (3.0 / demo.width) ** 0.5  # unit-variance weights keep tanh activations alive
    blocks = []
    for _ in range(num_stages * demo.blocks_per_stage):
        dense = nn.Dense(demo.width, demo.width, dtype=ms.float64)
        dense.weight.set_data(ms.Tensor(generator.uniform(-bound, bound, (demo.width, demo.width))))
        dense.bias.set_data(ms.Tensor(generator.uniform(-bound, bound, (demo.width,))))
        blocks.append(nn.SequentialCell([dense, nn.Tanh()]))
    return nn.SequentialCell(blocks)


def demo_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error: a mean, so micro-batch losses average to the batch loss."""
    from mindspore import ops

    return ops.mean(ops.square(output - target))


def demo_batch(step: int, batch_size: int, demo: DemoConfig, *, seed: int) -> tuple[Tensor, Tensor]:
    """Inputs and targets of iteration ``step``: the same on every rank and in every run
    with the same seed."""
    import mindspore as ms

    teacher = np.random.default_rng(seed + 1_000_003)
    projection = teacher.standard_normal((demo.width, demo.width)) * demo.width**-0.5
    inputs = np.random.default_rng([seed, step]).standard_normal((batch_size, demo.width))
    return ms.Tensor(inputs), ms.Tensor(np.tanh(inputs @ projection))
