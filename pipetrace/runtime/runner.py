"""The one pipeline runner, written against the backend seam (`pipetrace.runtime.backend`):
no torch, no MindSpore here.

A runner builds this rank's stages, its P2P and its executor through its `Backend`, runs
iterations through the executor, reports a failure to the recorder exactly once, and ends
the recording cleanly only when nothing failed. The public classes
`pipetrace.runtime.api.PipelineRunner` (torch) and
`pipetrace.runtime.mindspore.api.PipelineRunner` only pick their backend and add what is
their framework's own (torch's device and process group; MindSpore's gradient lists).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pipetrace.recorder.hooks import RecorderHooks
from pipetrace.recorder.setup import RecordSettings
from pipetrace.runtime.backend import Backend, LossFn, Stage
from pipetrace.runtime.config import P2P_TIMEOUT
from pipetrace.runtime.executor import CustomFunction, Executor
from pipetrace.runtime.p2p_common import StreamMeta
from pipetrace.runtime.split import stage_modules
from pipetrace.schedule.builders import build_plan, resolve_schedule_name
from pipetrace.schedule.ir import Plan, StepKind
from pipetrace.schedule.lowering import lower

Batch = Any  # one tensor to split along dim 0, a sequence of M tensors, or None


class PipelineRunner:
    """This rank's part of a pipeline: its stages, its plan, its messages, on ``backend``.

    ``model`` is the whole model as the backend's sequential model (split into the plan's
    stages), a sequence with one module per stage, or a mapping ``{stage: module}`` of only
    the stages this rank holds (so that big models need not be built whole on every rank).
    ``schedule`` is a built-in name (with ``num_microbatches``) or a `Plan`; a plan without
    messages is lowered here. Ranks in the plan are ranks in the backend's group.
    ``tensor_meta`` gives message shapes up front (see `pipetrace.runtime.p2p_common`); it
    must be the same on every rank. ``recorder`` defaults to the one PIPETRACE_DIR and the
    other PIPETRACE_* variables ask for (none without them). ``timeout`` bounds a wait on a
    peer when the runner joins the group itself. ``tied`` names one parameter shared by the
    first and the last stage (its name there, e.g. ``("0.0.weight", "7.0.weight")``): a
    built-in schedule then gets TIED_REDUCE steps, which sum its two gradients.

    The last stage backpropagates ``loss_fn(output, target) / M`` for each micro-batch, so
    after `step` the gradients are those of the mean loss over the whole batch.
    """

    def __init__(
        self,
        backend: Backend,
        model: Any,
        *,
        schedule: str | Plan,
        loss_fn: LossFn,
        num_microbatches: int | None = None,
        stages_per_rank: int | None = None,
        overlap_p2p: bool = False,
        recorder: RecorderHooks | None = None,
        tensor_meta: Mapping[tuple[str, int], StreamMeta] | None = None,
        timeout: float = P2P_TIMEOUT.default,
        run_config: dict[str, Any] | None = None,
        tied: tuple[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.rank, world_size = backend.join(timeout)
        place = backend.pipeline_place()
        self.plan = resolve_plan(
            schedule, world_size, num_microbatches, stages_per_rank, tied is not None
        )
        self.stages: dict[int, Stage] = self._make_stages(model, loss_fn)
        if recorder is None:  # PIPETRACE_DIR=run/ turns recording on in a user's script
            recorder = backend.make_recorder(RecordSettings.from_env())
        self.recorder: RecorderHooks = recorder
        p2p = None
        if any(step.is_comm for step in self.plan.steps(self.rank)):
            p2p = backend.make_p2p(
                num_stages=self.plan.num_stages,
                recorder=recorder,
                overlap=overlap_p2p,
                known=tensor_meta,
            )
        self.executor = Executor(
            plan=self.plan,
            rank=self.rank,
            stages=self.stages,
            p2p=p2p,
            recorder=recorder,
            ops=backend,
            tied=self._tied_parameters(tied),
        )
        self._failure: BaseException | None = None
        self._closed = False
        config = {
            "overlap_p2p": overlap_p2p,
            "device": backend.device_name(),
            **(run_config or {}),
        }
        # Pipeline ranks (in the backend's group): the plan and P2P peers speak of those;
        # ``place`` gives the recorder the global ranks the trace speaks of.
        recorder.begin_run(
            rank=self.rank, world_size=world_size, plan=self.plan, config=config, place=place
        )

    def _make_stages(self, model: Any, loss_fn: LossFn) -> dict[int, Stage]:
        last = self.plan.num_stages - 1
        return {
            index: self.backend.make_stage(
                module,
                stage_index=index,
                num_stages=self.plan.num_stages,
                loss_fn=loss_fn if index == last else None,
            )
            for index, module in stage_modules(self.backend, model, self.plan, self.rank).items()
        }

    def _tied_parameters(self, tied: tuple[str, str] | None) -> dict[int, Any]:
        """The tied parameter of each of the first and last stage this rank holds."""
        if tied is None:
            return {}
        found = {}
        for stage, name in zip((0, self.plan.num_stages - 1), tied):
            if stage in self.stages:
                # a one-stage model holds both names of one parameter: keep both
                module = self.stages[stage].module
                params = dict(module.named_parameters(remove_duplicate=False))
                if name not in params:
                    raise ValueError(f"stage {stage} has no parameter {name!r} to tie")
                found[stage] = params[name]
        return found

    @property
    def stage_modules(self) -> dict[int, Any]:
        """The modules of the stages this rank holds, by stage index."""
        return {index: stage.module for index, stage in self.stages.items()}

    def parameters(self) -> Iterator[Any]:
        """This rank's trainable parameters (give them to the optimizer), each once: stages
        on one rank may share a tied parameter."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for param in stage.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def register_custom_function(self, kind: StepKind | str, fn: CustomFunction) -> None:
        """Replace the handler of a step kind with ``fn(step, context)`` (see `StepContext`)."""
        self.executor.register_custom_function(kind, fn)

    def step(self, inputs: Batch = None, targets: Batch = None) -> float | None:
        """Forward and backward of one batch, split into the plan's micro-batches along
        dim 0 (or given already split, as a sequence of M tensors). Only the rank holding
        stage 0 needs ``inputs`` and only the one holding the last stage needs ``targets``.
        Returns the mean micro-batch loss on the last stage's rank, None on the others.
        Gradients accumulate: zero them between steps."""
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: the runner is closed: build a new one")
        why = self.backend.cannot_train()  # a misuse, not a failed step: nothing recorded
        if why:
            raise RuntimeError(f"rank {self.rank}: step() trains, and {why}")
        try:
            num = self.plan.num_microbatches
            if inputs is None and 0 in self.stages:
                raise ValueError(f"rank {self.rank} holds stage 0: step() needs the inputs")
            return self.executor.run_iteration(
                self._split(inputs, num, "inputs") or (), self._split(targets, num, "targets")
            )
        except BaseException as exc:
            self._failure = exc
            self.recorder.exception(exc)
            raise

    def close(self) -> None:
        """Stop the overlap thread and close the recording (cleanly, if nothing failed)."""
        if self._closed:
            return
        self._closed = True
        self.executor.close()
        if self._failure is None:
            self.recorder.end_run()

    def __enter__(self) -> PipelineRunner:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and self._failure is None:
            self._failure = exc
            self.recorder.exception(exc)
        self.close()

    def _split(self, batch: Batch, num: int, what: str) -> Sequence[Any] | None:
        """``num`` equal micro-batches of ``batch`` (a tensor), or ``batch`` itself when it is
        None or already a sequence of ``num`` micro-batches."""
        if batch is None or not isinstance(batch, self.backend.tensor_type):
            if batch is not None and len(batch) != num:
                raise ValueError(f"{what}: expected {num} micro-batches, got {len(batch)}")
            return batch
        size, rest = divmod(batch.shape[0], num)
        if rest or not size:
            raise ValueError(
                f"{what}: a batch of {batch.shape[0]} samples does not split into {num} equal "
                "micro-batches; make the batch size a multiple of the micro-batch count"
            )
        return self.backend.split_tensor(batch, size)


def resolve_plan(
    schedule: str | Plan,
    num_ranks: int,
    num_microbatches: int | None,
    stages_per_rank: int | None,
    tie_weights: bool = False,
) -> Plan:
    """A plan with its messages: a given plan (lowered if it has none) or a built-in one
    (with TIED_REDUCE steps when ``tie_weights``)."""
    if isinstance(schedule, Plan):
        if schedule.num_ranks != num_ranks:
            raise ValueError(
                f"the plan is for {schedule.num_ranks} ranks but the group has {num_ranks}"
            )
        if tie_weights and not _ties_itself(schedule):
            raise ValueError(
                "tied weights need TIED_REDUCE steps in the given plan, which has none: "
                "build it with tie_weights=True (its first and last stage are on two ranks, "
                "whose gradients would otherwise never be summed)"
            )
        return schedule if schedule.has_comms() or num_ranks == 1 else lower(schedule)
    if num_microbatches is None:
        raise ValueError("give num_microbatches with a schedule name")
    return build_plan(
        resolve_schedule_name(schedule),
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        stages_per_rank=stages_per_rank,
        comms=True,
        tie_weights=tie_weights,
    )


def _ties_itself(plan: Plan) -> bool:
    """Whether a plan sums a tied weight's two gradients: with TIED_REDUCE steps, or with its
    first and last stage on one rank (autograd sums them there)."""
    if plan.placement[0] == plan.placement[-1]:
        return True
    return any(
        step.kind is StepKind.TIED_REDUCE
        for rank in range(plan.num_ranks)
        for step in plan.steps(rank)
    )
