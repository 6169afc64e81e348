"""The command palette (ctrl+p): every action by name, plus "iteration N", "finding ..." and
"filter ..." typed as text."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from textual.command import DiscoveryHit, Hit, Hits, Provider

if TYPE_CHECKING:
    from pipetrace.tui.app import PipetraceApp

# (name, action, help)
ACTIONS = [
    ("Show details panel", "panel('details')", "details of the selected step"),
    ("Show findings panel", "panel('findings')", "the analyzers' findings"),
    ("Show stats panel", "panel('stats')", "per-rank and per-stage metrics, bubble ratio vs ideal"),
    ("Toggle plan vs actual", "toggle_plan", "the simulated plan under each rank"),
    ("Toggle P2P sub-rows", "toggle_comm", "show or hide the ops in flight"),
    ("Zoom to fit the run", "fit", "show every iteration"),
    ("Zoom to the selected step", "zoom_to_cursor", ""),
    ("Jump to the matching op on the peer", "peer", "for a P2P op or a SEND/RECV step"),
    ("Jump back", "back", "undo the last jump"),
    ("Next finding", "finding(1)", ""),
    ("Previous finding", "finding(-1)", ""),
    ("Next iteration", "iteration(1)", ""),
    ("Previous iteration", "iteration(-1)", ""),
    ("Go to iteration...", "prompt('iteration')", "type a number"),
    ("Filter...", "prompt('filter')", "rank=, stage=, mb=, kind="),
    ("Clear the filter", "clear_filter", ""),
    ("Help: keys", "help", ""),
    ("Quit", "quit", ""),
]


class PipetraceCommands(Provider):
    @property
    def _app(self) -> PipetraceApp:
        return self.app  # type: ignore[return-value]

    async def discover(self) -> Hits:
        for name, action, help_text in ACTIONS:
            yield DiscoveryHit(name, partial(self._run, action), help=help_text or None)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        words = query.strip().split()
        app = self._app
        session = app.session
        if (
            session is not None
            and words
            and words[-1].isdigit()
            and "iteration".startswith(words[0].lower()[:4])
        ):
            it = int(words[-1])
            yield Hit(
                1.0, f"Go to iteration {it}", partial(app.goto_iteration, it), help="show it whole"
            )
        if session is not None and words and words[0].lower() in ("filter", "f") and len(words) > 1:
            text = query.strip().split(None, 1)[1]
            yield Hit(
                1.0, f"Filter: {text}", partial(app.apply_filter, text), help="apply this filter"
            )
        for name, action, help_text in ACTIONS:
            score = matcher.match(name)
            if score > 0:
                yield Hit(
                    score,
                    matcher.highlight(name),
                    partial(self._run, action),
                    help=help_text or None,
                )
        if session is not None:
            for k, view in enumerate(session.findings):
                label = f"Finding: {view.finding.kind}: {view.finding.message}"
                score = matcher.match(label)
                if score > 0:
                    yield Hit(
                        score * 0.9, matcher.highlight(label[:120]), partial(app.goto_finding, k)
                    )

    async def _run(self, action: str) -> None:
        await self._app.run_action(action)
