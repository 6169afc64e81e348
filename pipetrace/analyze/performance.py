"""Performance findings from the metrics: straggler and exposed_comm.

- straggler: a stage whose compute steps of some kind are slower than its peers' (the median
  over the other stages of their median costs) by `STRAGGLER_FACTOR`, even in their lower
  quartile (so that a few preempted steps are not enough). Its effect is measured, not
  guessed: the simulator is run again with that stage at the median cost; the difference in
  makespan is what the straggler costs per iteration. Warning when that is at least
  `STRAGGLER_MIN_EFFECT` of the iteration, info otherwise.
- exposed_comm: in overlap mode (recvs posted early, sends drained at iteration end), the
  time a rank still waited after its peer had posted the other side, i.e. transfer time the
  schedule meant to hide. Warning at `EXPOSED_MIN_FRACTION` of the iteration time, info
  otherwise. In plain mode the same time is reported as info (the schedule does not try to
  overlap it).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from pipetrace.analyze import findings as fk
from pipetrace.analyze.findings import Finding
from pipetrace.analyze.ideal import IdealTimeline, ideal_timeline
from pipetrace.analyze.metrics import OVERLAPPED, Metrics, reduce_groups
from pipetrace.analyze.model import Run
from pipetrace.analyze.selection import short_rank_list

STRAGGLER_FACTOR = 2.0
STRAGGLER_MIN_EFFECT = 0.10
EXPOSED_MIN_FRACTION = 0.75
MAX_SIMULATED = 8


Slow = dict[str, tuple[float, float]]
"""A slow stage's kinds: kind -> (its median cost, its peers' median cost), ns."""


def find_stragglers(run: Run, metrics: Metrics, ideal: IdealTimeline) -> list[Finding]:
    """Stages slower than their peers; ``ideal`` is the run's simulated plan, the baseline
    their effect is measured against."""
    slow = _slow_stages(metrics)
    if not slow:
        return []
    steady = metrics.steady()
    iteration = float(np.mean(metrics.iteration_time[steady])) if len(steady) else 0.0
    costs = metrics.mean_costs()
    # The effect is simulated for the slowest stages only: each simulation costs a run of the
    # whole plan, and beyond a handful the list is the story, not each stage's share.
    simulated = set(
        sorted(slow, key=lambda st: -max(c / m for c, m in slow[st].values()))[:MAX_SIMULATED]
    )
    out = []
    for stage, kinds in sorted(slow.items()):
        effect = None
        if stage in simulated and ideal.makespan_ns is not None:
            override = {(stage, k): med for k, (_, med) in kinds.items()}
            fixed = ideal_timeline(run.plan, costs, override=override).makespan_ns
            effect = ideal.makespan_ns - fixed if fixed is not None else None
        out.append(_straggler(run, stage, kinds, effect, ideal.makespan_ns, iteration))
    return out


def _slow_stages(metrics: Metrics) -> dict[int, Slow]:
    """Per stage, the kinds whose steps are `STRAGGLER_FACTOR` slower than the median of
    the other stages' median costs (stages with at least 4 standalone steps of the kind)."""
    by_kind: dict[str, dict[int, tuple[float, float]]] = defaultdict(dict)
    keys = [
        key
        for key, values in metrics.stage_costs.items()
        if len(values) >= 4 and not key[1].endswith(OVERLAPPED)
    ]
    quartiles = reduce_groups(
        [metrics.stage_costs[key] for key in keys],
        lambda rows: np.column_stack((np.median(rows, axis=1), np.percentile(rows, 25, axis=1))),
    )
    for (stage, kind), (median, low) in zip(keys, quartiles.tolist()):
        by_kind[kind][stage] = (median, low)
    slow: dict[int, Slow] = defaultdict(dict)
    for kind, per_stage in by_kind.items():
        if kind == "I":  # stage 0 has no input gradient: its dx steps are empty by design
            per_stage.pop(0, None)
        if len(per_stage) < 2:
            continue
        peers_median = _leave_one_out_medians({st: m for st, (m, _) in per_stage.items()})
        for stage, (c, low) in per_stage.items():
            median = peers_median[stage]
            # Even the stage's faster steps (lower quartile) must be slow: a few preempted
            # steps on a busy host are noise, not a straggler.
            if median > 0 and low >= STRAGGLER_FACTOR * median and c - median > 50_000:
                slow[stage][kind] = (c, median)
    return slow


def _straggler(
    run: Run,
    stage: int,
    kinds: Slow,
    effect: float | None,
    base: float | None,
    iteration: float,
) -> Finding:
    """The finding for one slow stage; ``effect``: how much shorter the ideal iteration
    (``base``) would be at its peers' speed (None: not simulated)."""
    placement = run.plan.placement if run.plan is not None else ()
    rank = placement[stage] if stage < len(placement) else None
    # its costs are pooled over every replica loaded: each one's rank holding the stage
    loaded = {r.rank for r in run.present_ranks}
    pipelines = run.pipelines
    ranks = (
        [g for g in (pipelines.global_rank(r, rank) for r in range(pipelines.count)) if g in loaded]
        if rank is not None
        else []
    )
    named = f" (rank {ranks[0]})" if len(ranks) == 1 else f" (ranks {short_rank_list(ranks)})"
    worst_kind, _ = max(kinds.items(), key=lambda kv: kv[1][0] / kv[1][1])
    share = effect / base if effect is not None and base else None
    severity = fk.WARNING if share is not None and share >= STRAGGLER_MIN_EFFECT else fk.INFO
    what = ", ".join(
        f"{k} {c / 1e6:.3g} ms vs {m / 1e6:.3g} ms median ({c / m:.1f}x)"
        for k, (c, m) in sorted(kinds.items())
    )
    effect_text = (
        f"; at its peers' speed the ideal iteration would be {effect / 1e6:.3g} ms "
        f"({share:.0%}) shorter"
        if effect is not None and share is not None
        else ""
    )
    return Finding(
        fk.STRAGGLER,
        severity,
        f"stage {stage}" + (named if ranks else "") + f" is slow: {what}{effect_text}",
        (
            f"rank {ranks[0]} computes stage {stage}"
            if len(ranks) == 1
            else f"the {len(ranks)} ranks holding stage {stage} compute it"
        )
        + " slower than its peers (a heavier layer split, a slower or busier host, CPU "
        "contention)"
        if ranks
        else "one stage is slower than its peers",
        ranks=ranks,
        details={
            "stage": stage,
            "rank": ranks[0] if ranks else None,
            "kinds": {
                k: {"mean_ns": c, "median_ns": m, "factor": c / m} for k, (c, m) in kinds.items()
            },
            "worst_kind": worst_kind,
            "effect_ns": effect,
            "effect_fraction": share,
            "iteration_ns": iteration,
        },
    )


def _leave_one_out_medians(values: dict[int, float]) -> dict[int, float]:
    """For each key, the median of the other values (O(n log n))."""
    keys = sorted(values, key=values.__getitem__)
    ordered = [values[k] for k in keys]
    n = len(ordered)
    out = {}
    for i, k in enumerate(keys):
        rest = ordered[:i] + ordered[i + 1 :] if n <= 64 else None
        if rest is not None:
            out[k] = float(np.median(rest))
            continue
        # without element i, position j of the rest is ordered[j] (j < i) or ordered[j + 1]
        m = n - 1

        def at(j: int, i: int = i) -> float:
            return ordered[j] if j < i else ordered[j + 1]

        out[k] = at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2
    return out


def find_exposed_comm(run: Run, metrics: Metrics) -> list[Finding]:
    """One finding for the run, naming the ranks by exposed time, worst first."""
    steady = metrics.steady()
    if not len(steady):
        return []
    iteration = float(np.mean(metrics.iteration_time[steady]))
    if iteration <= 0:
        return []
    per_rank = []
    for rank, m in sorted(metrics.per_rank.items()):
        values = m.exposed if metrics.overlap_mode else m.blocking_transfer
        exposed = float(np.nanmean(values[steady])) if np.isfinite(values[steady]).any() else 0.0
        if exposed > 0 and exposed / iteration >= 0.05:
            per_rank.append((exposed, rank))
    if not per_rank:
        return []
    per_rank.sort(reverse=True)
    worst = per_rank[0][0]
    fraction = worst / iteration
    label = "overlapped" if metrics.overlap_mode else "blocking"
    severity = fk.WARNING if metrics.overlap_mode and fraction >= EXPOSED_MIN_FRACTION else fk.INFO
    listed = ", ".join(f"rank {r} {e / 1e6:.3g} ms ({e / iteration:.0%})" for e, r in per_rank[:6])
    more = f" and {len(per_rank) - 6} more ranks" if len(per_rank) > 6 else ""
    return [
        Finding(
            fk.EXPOSED_COMM,
            severity,
            "P2P transfers still running after the peer had posted its side "
            f"({label} mode), per iteration: {listed}{more}",
            (
                "the transfers take longer than the compute meant to hide them (large "
                "activations, slow link, or CPU contention on the transport)"
            )
            if metrics.overlap_mode
            else "plain P2P mode waits for every transfer in its own step; overlapped P2P "
            "(pipetrace run --overlap-p2p, PipelineRunner(overlap_p2p=True)) waits for a recv "
            "only where its data is used, behind the compute",
            ranks=[r for _, r in per_rank],
            details={
                "overlap_mode": metrics.overlap_mode,
                "iteration_ns": iteration,
                "ranks": [
                    {"rank": r, "exposed_ns_per_iteration": e, "fraction": e / iteration}
                    for e, r in per_rank
                ],
            },
        )
    ]
