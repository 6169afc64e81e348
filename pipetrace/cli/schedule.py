"""`pipetrace schedule`: list, show, verify and simulate schedules without running anything."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import click
import orjson

from pipetrace.schedule.ir import Plan, ScheduleError
from pipetrace.schedule.swap import SWAP_EXAMPLES, SwapPolicy, add_swap_steps


def use_color(stream: Any = None) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set."""
    stream = stream or sys.stdout
    return stream.isatty() and not os.environ.get("NO_COLOR")


def json_text(data: Any) -> str:
    """The commands' JSON output: indented, keys that are not strings written as strings."""
    return orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()


def echo_json(data: Any) -> None:
    click.echo(json_text(data))


def plan_source(func: Callable) -> Callable:
    """The options that name a plan: a built-in schedule and its sizes, or a CSV file."""

    @click.argument("name", required=False)
    @click.option("--ranks", "-p", type=click.IntRange(min=1), help="Number of ranks P.")
    @click.option(
        "--microbatches",
        "-m",
        type=click.IntRange(min=1),
        help="Micro-batches M per iteration (with --csv: the M the file must cover; "
        "default: as many as it names).",
    )
    @click.option(
        "--stages-per-rank",
        "-v",
        type=click.IntRange(min=1),
        help="Stages per rank V (interleaved, zero-bubble, V schedules).",
    )
    @click.option(
        "--csv",
        "csv_path",
        type=click.Path(dir_okay=False),
        help="A schedule file in torch.distributed.pipelining's CSV format instead of NAME.",
    )
    @click.option(
        "--overlap-bf",
        is_flag=True,
        help="Pair each steady-state backward with the next forward (OVERLAP_B_F; 1f1b and "
        "interleaved-1f1b).",
    )
    @click.option(
        "--overlap-bf-split",
        is_flag=True,
        help="As --overlap-bf, with each pair's backward split into I then W: "
        "(0I3;0W3;0F7)OVERLAP_B_F.",
    )
    @click.option(
        "--swap",
        metavar="POLICY",
        help=f"Insert activation swap steps for these activations: {SWAP_EXAMPLES}.",
    )
    @functools.wraps(func)
    def wrapper(
        name,
        ranks,
        microbatches,
        stages_per_rank,
        csv_path,
        overlap_bf,
        overlap_bf_split,
        swap,
        **kwargs,
    ):
        pairs = {"overlap_bf": overlap_bf, "overlap_bf_split": overlap_bf_split}
        plan = load_plan(name, ranks, microbatches, stages_per_rank, csv_path, **pairs)
        if swap is not None:
            plan = add_swap_steps(plan, SwapPolicy.parse(swap))
        return func(plan=plan, **kwargs)

    return wrapper


def load_plan(
    name: str | None,
    ranks: int | None,
    microbatches: int | None,
    stages_per_rank: int | None,
    csv_path: str | None,
    overlap_bf: bool = False,
    overlap_bf_split: bool = False,
) -> Plan:
    if csv_path is not None:
        if name is not None:
            raise click.UsageError("give either a schedule NAME or --csv FILE, not both")
        if overlap_bf or overlap_bf_split:
            flag = "--overlap-bf-split" if overlap_bf_split else "--overlap-bf"
            raise click.UsageError(f"{flag} builds a schedule: give a NAME, not --csv")
        from pipetrace.schedule.csvio import load_csv

        plan = load_csv(csv_path, num_microbatches=microbatches)
        if ranks is not None and ranks != plan.num_ranks:
            raise click.UsageError(
                f"--ranks {ranks}, but {csv_path} has {plan.num_ranks} rank(s): the file's "
                "rows are its ranks (leave --ranks out)"
            )
        if stages_per_rank is not None:
            raise click.UsageError(f"-v comes from {csv_path}'s stages: leave it out")
        return plan
    if name is None:
        raise click.UsageError(
            "missing schedule NAME (see `pipetrace schedule list`) or --csv FILE"
        )
    if ranks is None or microbatches is None:
        raise click.UsageError(f"schedule {name!r} needs --ranks and --microbatches")
    from pipetrace.schedule.builders import build_plan

    return build_plan(
        name,  # a torch class name or alias too
        num_ranks=ranks,
        num_microbatches=microbatches,
        stages_per_rank=stages_per_rank,
        overlap_bf=overlap_bf,
        overlap_bf_split=overlap_bf_split,
    )


@click.group()
def schedule() -> None:
    """Show, verify and simulate pipeline schedules. Nothing is executed.

    \b
    Examples:
      pipetrace schedule list
      pipetrace schedule show interleaved-1f1b --ranks 4 --microbatches 8 -v 2
      pipetrace schedule verify zbv -p 4 -m 8 --semantics rendezvous
      pipetrace schedule verify --csv my_schedule.csv --json
      pipetrace schedule simulate 1f1b -p 4 -m 8 --costs F=1,B=2
      pipetrace schedule simulate 1f1b -p 4 -m 8 --swap all --costs swap_bytes=1,swap_bandwidth=2
      pipetrace schedule simulate zbv -p 2 -m 4 --json --timeline
    """


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_schedules(as_json: bool) -> None:
    """List the built-in schedules and the names they answer to.

    \b
    Examples:
      pipetrace schedule list
      pipetrace schedule list --json
    """
    from pipetrace.schedule.builders import describe_schedules

    infos = describe_schedules()
    if as_json:
        echo_json(
            [
                {
                    "name": i.name,
                    "aliases": list(i.aliases),
                    "placement": i.placement.value,
                    "stages_per_rank": i.stages_per_rank,
                    "description": i.description,
                }
                for i in infos
            ]
        )
        return
    width = max(len(i.name) for i in infos)
    for info in infos:
        click.echo(
            f"{info.name:<{width}}  V={info.stages_per_rank:<4} {info.placement.value:<4}  "
            f"{info.description}"
        )
        click.echo(f"{'':<{width}}  aliases: {', '.join(info.aliases)}")


@schedule.command()
@plan_source
@click.option("--comms", is_flag=True, help="Include the SEND/RECV steps the runtime executes.")
@click.option(
    "--fsdp", is_flag=True, help="Include UNSHARD/RESHARD/REDUCE_GRAD steps (implies --comms)."
)
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["text", "csv", "json"]),
    default="text",
    show_default=True,
)
def show(plan: Plan, comms: bool, fsdp: bool, out_format: str) -> None:
    """Print a schedule's step x rank grid.

    \b
    Examples:
      pipetrace schedule show 1f1b --ranks 4 --microbatches 8
      pipetrace schedule show zbv -p 2 -m 4 --comms --format csv > zbv.csv
    """
    if comms or fsdp:
        from pipetrace.schedule.lowering import lower

        plan = lower(plan, fsdp=fsdp) if not plan.has_comms() else plan
    if out_format == "csv":
        from pipetrace.schedule.csvio import plan_to_csv

        click.echo(plan_to_csv(plan), nl=False)
    elif out_format == "json":
        echo_json(plan.to_json())
    else:
        from pipetrace.schedule.grid import render_grid

        click.echo(_title(plan))
        click.echo(render_grid(plan, color=use_color()))


@schedule.command()
@plan_source
@click.option(
    "--semantics",
    type=click.Choice(["eager", "rendezvous", "fifo"]),
    default="rendezvous",
    show_default=True,
    help="P2P semantics for the deadlock check: eager (sends never block), "
    "rendezvous (a send blocks until its recv is posted), "
    "fifo (in-order matching without tags, like NCCL).",
)
@click.option("--json", "as_json", is_flag=True, help="Findings as JSON (see docs/schedules.md).")
def verify(plan: Plan, semantics: str, as_json: bool) -> int:
    """Check a plan: coverage, data dependencies, send/recv pairing and deadlock freedom.

    Reports every problem, not just the first. Exit code 0: valid; 1: problems found;
    2: usage error or unreadable input.

    \b
    Examples:
      pipetrace schedule verify 1f1b -p 4 -m 8
      pipetrace schedule verify --csv plan.csv --semantics fifo --json
    """
    from pipetrace.schedule.verify import verify as verify_plan

    report = verify_plan(plan, semantics=semantics)
    if as_json:
        echo_json(report.to_json())
    else:
        click.echo(_title(plan) + f", {semantics} semantics")
        if report.ok and not report.findings:
            click.echo(click.style("OK", fg="green") if use_color() else "OK")
        for finding in report.findings:
            label = finding.severity.upper()
            if use_color():
                label = click.style(
                    label, fg="red" if finding.severity == "error" else "yellow", bold=True
                )
            click.echo(f"{label} [{finding.kind}] {finding.message}")
        if report.blocked:
            from pipetrace.schedule.grid import render_grid

            click.echo("")
            click.echo(render_grid(report.executed, marks=report.marks(), color=use_color()))
    return 0 if report.ok else 1


@schedule.command()
@plan_source
@click.option(
    "--costs",
    default="",
    metavar="KIND=VALUE,...",
    help="Per-kind costs F, B, I, W, the P2P model comm (latency), bandwidth, message_bytes, "
    "and the activation swap copies swap_bytes, swap_bandwidth. Default F=1,B=2,I=1,W=1,comm=0 "
    "(copies take no time).",
)
@click.option(
    "--semantics",
    type=click.Choice(["eager", "rendezvous", "fifo"]),
    default="eager",
    show_default=True,
)
@click.option(
    "--json", "as_json", is_flag=True, help="Makespan, bubbles and per-rank figures as JSON."
)
@click.option("--timeline", is_flag=True, help="With --json: every step's rank, start and end too.")
def simulate(plan: Plan, costs: str, semantics: str, as_json: bool, timeline: bool) -> int:
    """Predict the timeline, makespan, bubbles and peak activations of a plan.

    \b
    Examples:
      pipetrace schedule simulate 1f1b -p 4 -m 8
      pipetrace schedule simulate zb1p -p 4 -m 8 --costs F=1,I=1,W=1
      pipetrace schedule simulate 1f1b -p 4 -m 8 --swap all --costs swap_bytes=1,swap_bandwidth=2
    """
    from pipetrace.schedule.simulate import Costs
    from pipetrace.schedule.simulate import simulate as run_simulation
    from pipetrace.schedule.verify import verify as verify_plan

    if timeline and not as_json:
        raise click.UsageError("--timeline goes with --json")
    chosen = Costs.parse(costs) if costs else Costs()
    errors = [f for f in verify_plan(plan, semantics=semantics).findings if f.severity == "error"]
    try:
        result = run_simulation(plan, chosen, semantics=semantics)
    except ScheduleError as exc:
        if not errors:
            raise
        click.echo(f"pipetrace schedule simulate: the plan cannot run: {exc}", err=True)
        return 1  # a problem found in a plan that was read: verify's exit code
    if errors:  # the figures below are of the plan as written, which cannot be right
        click.echo(
            f"pipetrace schedule simulate: warning: the plan has {len(errors)} error(s) "
            f"(pipetrace schedule verify says all), first: {errors[0].message}",
            err=True,
        )
    if as_json:
        echo_json(result.to_json(timeline=timeline))
        return 1 if errors else 0
    click.echo(_title(plan))
    click.echo(
        f"makespan {result.makespan:g}   idle fraction {result.idle_fraction:.1%}   "
        f"bubble/ideal {result.bubble_ratio:.3f}"
    )
    click.echo(f"{'rank':>4} {'busy':>9} {'idle':>9} {'idle %':>7} {'bubble':>7} {'peak act':>8}")
    for r in result.per_rank:
        click.echo(
            f"{r.rank:>4} {r.busy:>9g} {r.idle:>9g} {r.idle_fraction:>7.1%} "
            f"{r.bubble_ratio:>7.3f} {r.peak_inflight_activations:>8}"
        )
    waits = [0.0] * len(result.per_rank)
    for sim_step in result.timeline if result.plan.params.get("swap") else ():
        if sim_step.kind in ("OFFLOAD_WAIT", "LOAD_WAIT"):
            waits[sim_step.rank] += sim_step.end - sim_step.start
    if any(waits):
        click.echo(
            "swap copies not hidden by compute (time in OFFLOAD_WAIT / LOAD_WAIT): "
            + ", ".join(f"rank {rank} {wait:g}" for rank, wait in enumerate(waits) if wait)
        )
    return 1 if errors else 0


def _title(plan: Plan) -> str:
    stages_per_rank = plan.num_stages / max(1, plan.num_ranks)
    return (
        f"{plan.name}: {_count(plan.num_ranks, 'rank')}, {_count(plan.num_stages, 'stage')} "
        f"({stages_per_rank:g} per rank), {_count(plan.num_microbatches, 'micro-batch')}"
    )


def _count(n: int, noun: str) -> str:
    plural = noun + ("es" if noun.endswith("ch") else "s")
    return f"{n} {noun if n == 1 else plural}"
