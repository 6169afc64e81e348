"""Train your own model with pipetrace's pipeline runtime under torchrun.

    torchrun --nproc-per-node 2 examples/train_torchrun.py --schedule zbv --microbatches 4
    torchrun --nnodes 2 --node-rank N --master-addr HOST --nproc-per-node 8 \\
        examples/train_torchrun.py --schedule interleaved-1f1b --microbatches 16

Every rank builds the same model (same seed), and `PipelineRunner` keeps the stages the
schedule places on it. The process group is made from torchrun's environment: gloo on CPU,
NCCL when the model is on a GPU. ``--check`` compares the first step's gradients with a
single-process run of the whole model on every rank.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist

from pipetrace.runtime import parity
from pipetrace.runtime.api import PipelineRunner

FEATURES, HIDDEN, CLASSES = 32, 64, 10


def build_model(num_blocks: int, seed: int) -> torch.nn.Sequential:
    """A classifier: an input layer, residual-free blocks with LayerNorm, and a head."""
    torch.manual_seed(seed)
    blocks = [torch.nn.Linear(FEATURES, HIDDEN)]
    for _ in range(num_blocks):
        blocks.append(
            torch.nn.Sequential(
                torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(), torch.nn.LayerNorm(HIDDEN)
            )
        )
    blocks.append(torch.nn.Linear(HIDDEN, CLASSES))
    return torch.nn.Sequential(*blocks)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(size, FEATURES, generator=generator)
    return inputs, (inputs[:, :CLASSES].argmax(dim=1) + step) % CLASSES


def say(line: str) -> None:
    """One write per line, so that lines from ranks sharing a terminal do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--overlap-p2p", action="store_true")
    parser.add_argument(
        "--check", action="store_true", help="compare step 1 with a single-process run"
    )
    args = parser.parse_args()

    model = build_model(num_blocks=8, seed=0)
    reference = copy.deepcopy(model) if args.check else None
    loss_fn = torch.nn.functional.cross_entropy
    runner = PipelineRunner(
        model,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        loss_fn=loss_fn,
        overlap_p2p=args.overlap_p2p,
    )
    rank = dist.get_rank()
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.1)
    status = 0
    with runner:
        for step in range(args.steps):
            inputs, targets = batch(step, args.microbatches * args.microbatch_size)
            loss = runner.step(inputs, targets)
            if reference is not None:
                report = parity.check(
                    runner,
                    reference,
                    inputs,
                    targets,
                    loss=loss,
                    loss_fn=loss_fn,
                    rank=rank,
                    tolerance=1e-4,  # float32
                )
                verdict = "match" if report.ok else f"DIFFER: {report.mismatches}"
                say(
                    f"rank {rank}: stages {sorted(runner.stages)}: "
                    f"{report.compared} checked, {verdict}"
                )
                status |= not report.ok
                reference = None
            optimizer.step()
            optimizer.zero_grad()
            if loss is not None:
                say(f"rank {rank}: step {step + 1} loss {loss:.4f}")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
