"""Under torchrun (2 ranks): weights tied across the first and last stage, gradients
accumulated over two steps with no zeroing between them, against one process. Prints one
line per tied copy: "match" or "DIFFER <relative error>"."""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

from pipetrace.runtime.api import PipelineRunner

WIDTH = 8


def main(schedule: str) -> None:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]
    model = nn.Sequential(*blocks).double()
    model[3][0].weight = model[0][0].weight
    reference = copy.deepcopy(model)
    loss_fn = nn.functional.mse_loss
    runner = PipelineRunner(
        model,
        schedule=schedule,
        num_microbatches=4,
        loss_fn=loss_fn,
        tied=("0.0.weight", "3.0.weight"),
    )
    generator = torch.Generator().manual_seed(1)
    batches = [
        tuple(torch.randn(8, WIDTH, generator=generator, dtype=torch.float64) for _ in "xy")
        for _ in range(2)
    ]
    with runner:
        for inputs, targets in batches:
            runner.step(inputs, targets)
    for inputs, targets in batches:
        loss_fn(reference(inputs), targets).backward()
    expected = reference[0][0].weight.grad
    for stage, module in runner.stage_modules.items():
        for name, param in module.named_parameters():
            if name in ("0.0.weight", "3.0.weight"):
                error = float((param.grad - expected).abs().max() / expected.abs().max())
                verdict = "match" if error < 1e-12 else f"DIFFER {error:.3g}"
                # one write per line: the ranks share the launcher's stdout
                sys.stdout.write(f"rank {dist.get_rank()} stage {stage} {name}: {verdict}\n")
                sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
