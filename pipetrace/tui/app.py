"""`pipetrace tui`: the app. It owns the view state and binds it into the widgets.

The run is loaded, analyzed and indexed in a thread worker (`session.open_session`) that
posts typed messages; until then a progress view is shown. Every move on the timeline is a
`Navigator` method (UI-free); the app maps keys and mouse messages to those, then redraws
what changed and shows the notices they return.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.segment import Segment
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.color import Color
from textual.containers import Vertical
from textual.filter import LineFilter
from textual.message import Message
from textual.widgets import ContentSwitcher, Footer, Static

from pipetrace import units
from pipetrace.analyze.source import RunSource
from pipetrace.errors import PipetraceError
from pipetrace.printable import stripped
from pipetrace.tui.commands import PipetraceCommands
from pipetrace.tui.describe import describe
from pipetrace.tui.details import DetailsPanel
from pipetrace.tui.findings import FindingsPanel
from pipetrace.tui.help import HelpScreen
from pipetrace.tui.loading import LoadingView
from pipetrace.tui.navigator import Navigator
from pipetrace.tui.prompt import PromptBar
from pipetrace.tui.ruler import TimeRuler
from pipetrace.tui.session import Session, open_session
from pipetrace.tui.stats import StatsPanel
from pipetrace.tui.stats_data import stats_tables
from pipetrace.tui.timeline import TimelineView
from pipetrace.tui.viewport import ViewState


@dataclass
class Loaded(Message):
    session: Session


@dataclass
class LoadProgress(Message):
    phase: str
    done: int
    total: int


@dataclass
class LoadFailed(Message):
    message: str


class _Printable(LineFilter):
    """Drops what a terminal would act on (an escape sequence in a trace's exception
    message, say) from every line the app draws: docs/security.md."""

    def apply(self, segments: list[Segment], background: Color) -> list[Segment]:
        return [
            segment if segment.control else segment._replace(text=stripped(segment.text))
            for segment in segments
        ]


_PRINTABLE = _Printable()


class PipetraceApp(App[int]):
    TITLE = "pipetrace"
    AUTO_FOCUS = None  # the timeline takes the focus once loaded; nothing before
    COMMANDS = App.COMMANDS | {PipetraceCommands}

    CSS = """
    Screen {
        layout: vertical;
    }
    #title {
        height: 1;
        background: $primary-background;
        padding: 0 1;
    }
    #view {
        height: 1fr;
        display: none;
    }
    #panel-tabs {
        height: 1;
        background: $panel;
        padding: 0 1;
    }
    #panel {
        height: 9;
    }
    """

    BINDINGS = [
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
        Binding("d", "panel('details')", "details", show=False),
        Binding("f", "panel('findings')", "findings"),
        Binding("s", "panel('stats')", "stats"),
        Binding("p", "toggle_plan", "plan"),
        Binding("c", "toggle_comm", "p2p rows", show=False),
        Binding("slash", "prompt('filter')", "filter"),
        Binding("g", "prompt('iteration')", "go to it", show=False),
        Binding("left_square_bracket", "iteration(-1)", "prev it", show=False),
        Binding("right_square_bracket", "iteration(1)", "next it", show=False),
        Binding("n", "finding(1)", "next finding", show=False),
        Binding("N", "finding(-1)", "prev finding", show=False),
        Binding("m", "peer", "peer op"),
        Binding("b,backspace", "back", "back", show=False),
        Binding("z", "fit", "fit", show=False),
        Binding("escape", "clear", "clear", show=False),
    ]

    def get_line_filters(self) -> Sequence[LineFilter]:
        return [*super().get_line_filters(), _PRINTABLE]

    def __init__(
        self,
        path: str | Path | RunSource,
        *,
        session: Session | None = None,
        workers: int | None = None,
        load: dict[str, Any] | None = None,
    ) -> None:
        """``load``: more of `load_run`'s options (``cache``, ``select``)."""
        super().__init__()
        self.source = path  # what is loaded: a directory, or a run gathered from several
        self.path = path.path if isinstance(path, RunSource) else Path(path)
        self.nav: Navigator | None = None  # exists once the run is loaded
        self.panel = "details"
        self.load_error: str | None = None  # why the run could not be loaded (exit code 2)
        self._preloaded = session
        self._parse_workers = workers
        self._load_options = load or {}
        self._last_progress: tuple[str | None, float, float] = (None, -1.0, 0.0)
        self._shown_title: tuple[str, str] | None = None
        self._shown_tabs: tuple[str, str] | None = None

    @property
    def session(self) -> Session | None:
        return self.nav.session if self.nav else None

    @property
    def state(self) -> ViewState | None:
        return self.nav.state if self.nav else None

    # -- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(Text(f"pipetrace · {self.path}", style="bold"), id="title")
        yield LoadingView(str(self.path), id="loading")
        with Vertical(id="view"):
            yield TimeRuler(id="ruler")
            yield TimelineView(id="timeline")
            yield Static("", id="panel-tabs")
            with ContentSwitcher(initial="details", id="panel"):
                yield DetailsPanel(id="details")
                yield FindingsPanel(id="findings")
                yield StatsPanel(id="stats")
        yield PromptBar(id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self._fit_panel()
        if self._preloaded is not None:
            self.post_message(Loaded(self._preloaded))
        else:
            self._load()

    def on_resize(self) -> None:
        self._fit_panel()

    def _fit_panel(self) -> None:
        """Give the timeline the lines its lanes need, the bottom panel the rest (within bounds)."""
        available = self.size.height - 4  # title, ruler, panel tabs, footer
        lanes = len(self.state.lane_ids) if self.state is not None else available // 2
        self.query_one("#panel").styles.height = max(
            7, min(available - lanes, max(7, available // 2))
        )

    # -- loading ---------------------------------------------------------------------------

    @work(thread=True, exclusive=True, exit_on_error=False)
    def _load(self) -> None:
        try:
            with _stderr_with_fileno():
                session = open_session(
                    self.source,
                    progress=self._progress_from_thread,
                    workers=self._parse_workers,
                    **self._load_options,
                )
        except PipetraceError as exc:
            self.post_message(LoadFailed(str(exc)))
        except Exception as exc:
            self.post_message(LoadFailed(f"{type(exc).__name__}: {exc}"))
        else:
            self.post_message(Loaded(session))

    def _progress_from_thread(self, phase: str, done: int, total: int) -> None:
        # coalesce: a message per phase change, else at most one per 50 ms
        last_phase, last_fraction, last_time = self._last_progress
        now = time.monotonic()
        fraction = done / total if total else 0.0
        if phase != last_phase or (fraction > last_fraction and now - last_time > 0.05):
            self._last_progress = (phase, fraction, now)
            self.post_message(LoadProgress(phase, done, total))

    def on_load_progress(self, message: LoadProgress) -> None:
        self.query_one(LoadingView).progress(message.phase, message.done, message.total)

    def on_load_failed(self, message: LoadFailed) -> None:
        self.load_error = message.message
        self.query_one(LoadingView).failed(message.message)
        self.query_one("#title", Static).update(
            Text(f"pipetrace · {self.path} · could not load", style="bold red")
        )

    def on_loaded(self, message: Loaded) -> None:
        session = message.session
        self.nav = Navigator(session)
        self._fit_panel()
        self.query_one(LoadingView).display = False
        self.query_one("#view").display = True
        timeline = self.query_one(TimelineView)
        timeline.bind(session, self.nav.state)
        self.query_one(TimeRuler).bind(self.nav.state, timeline.gutter_width)
        self.query_one(FindingsPanel).show(
            session.findings, [p.message for p in session.run.problems]
        )
        self.query_one(StatsPanel).show(stats_tables(session))
        timeline.focus()
        self.call_after_refresh(self._first_view)

    def _first_view(self) -> None:
        nav = self.nav
        assert nav is not None
        if self._move("open", self.query_one(TimelineView).time_columns):
            self.action_panel("findings")
            self.query_one(TimelineView).focus()

    # -- applying moves --------------------------------------------------------------------

    def _move(self, name: str, *args, severity: str = "warning"):
        """Run a Navigator method, show its notice, and redraw what it changed."""
        nav = self.nav
        if nav is None:
            return None
        state = nav.state
        cursor, lanes, finding = state.cursor, list(state.lane_ids), nav.finding_index
        result = getattr(nav, name)(*args)
        if isinstance(result, str):
            self.notify(result, severity=severity, timeout=6)
        timeline = self.query_one(TimelineView)
        if state.lane_ids != lanes:
            timeline.sync()
            self._fit_panel()
        if state.cursor != cursor or state.lane_ids != lanes:
            if state.cursor is not None and state.cursor[0] in state.lane_ids:
                timeline.scroll_to_lane(state.lane_ids.index(state.cursor[0]))
            self.query_one(DetailsPanel).show(
                describe(nav.session, *state.cursor) if state.cursor else None
            )
        if nav.finding_index != finding and nav.finding_index is not None:
            self.query_one(FindingsPanel).select(nav.finding_index)
        timeline.refresh()
        self.query_one(TimeRuler).refresh()
        self._update_title()
        return result

    def _update_title(self) -> None:
        """The title line and the panel tabs; redrawn only when their text changes (a cursor
        move must not re-render them)."""
        nav = self.nav
        if nav is None:
            return
        session, state, vp = nav.session, nav.state, nav.viewport
        it = session.index.iteration_at(vp.start + vp.span / 2)
        right = [f"it {it}" if it is not None else "", f"{units.duration(vp.span, 2)} shown"]
        if not nav.filter.empty:
            right.append(f"filter {nav.filter.describe()}")
        if state.show_plan:
            right.append("plan shown")
        left = f"pipetrace · {session.title}"
        right_text = " · ".join(r for r in right if r)
        if self._shown_title != (left, right_text):
            self._shown_title = (left, right_text)
            grid = Table.grid(expand=True, padding=(0, 1))
            grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
            grid.add_column(justify="right", no_wrap=True)
            grid.add_row(Text(left, style="bold"), Text(right_text))
            self.query_one("#title", Static).update(grid)
        counts = {
            sev: sum(v.finding.severity == sev for v in session.findings)
            for sev in ("error", "warning", "info")
        }
        found = ", ".join(f"{n} {sev}" for sev, n in counts.items() if n) or "none"
        if self._shown_tabs != (found, self.panel):
            self._shown_tabs = (found, self.panel)
            tabs = Text()
            for name, label in (
                ("details", "d Details"),
                ("findings", f"f Findings ({found})"),
                ("stats", "s Stats"),
            ):
                tabs.append(f" {label} ", style="reverse bold" if name == self.panel else "")
                tabs.append("  ")
            self.query_one("#panel-tabs", Static).update(tabs)

    # -- actions (keys, the palette) -------------------------------------------------------

    def action_step(self, direction: int) -> None:
        self._move("step", direction)

    def action_lane(self, direction: int) -> None:
        self._move("lane", direction)

    def action_pan(self, fraction: float) -> None:
        self._move("pan", fraction)

    def action_zoom(self, factor: float) -> None:
        self._move("zoom", factor)

    def action_zoom_to_cursor(self) -> None:
        self._move("zoom_to_cursor")

    def action_fit(self) -> None:
        self._move("fit")

    def action_edge(self, direction: int) -> None:
        self._move("edge", direction)

    def action_page(self, direction: int) -> None:
        timeline = self.query_one(TimelineView)
        timeline.scroll_relative(
            y=direction * max(timeline.scrollable_content_region.height - 1, 1), animate=False
        )

    def action_iteration(self, direction: int) -> None:
        self._move("iteration", direction)

    def goto_iteration(self, iteration: int) -> None:
        self._move("goto_iteration", iteration)

    def action_peer(self) -> None:
        self._move("peer")

    def action_back(self) -> None:
        self._move("back")

    def action_finding(self, direction: int) -> None:
        self._move("finding", direction)

    def goto_finding(self, k: int) -> None:
        self._move("goto_finding", k)

    def on_findings_panel_picked(self, message: FindingsPanel.Picked) -> None:
        self.goto_finding(message.index)
        if message.final:
            self.query_one(TimelineView).focus()

    def action_panel(self, name: str) -> None:
        self.panel = name
        self.query_one(ContentSwitcher).current = name
        findings = self.session.findings if self.session else []
        if name == "findings" and self.nav is not None and self.nav.finding_index is not None:
            self.query_one(FindingsPanel).select(self.nav.finding_index)
        if name == "findings" and findings:
            self.query_one(FindingsPanel).focus_list()
        elif self.session is not None:
            self.query_one(TimelineView).focus()
        self._update_title()

    def action_toggle_plan(self) -> None:
        self._move("toggle_plan")

    def action_toggle_comm(self) -> None:
        self._move("toggle_comm")

    def action_prompt(self, mode: str) -> None:
        if self.nav is not None:
            self.query_one(PromptBar).open(
                mode, self.nav.filter.describe() if mode == "filter" else ""
            )

    def on_prompt_bar_submitted(self, message: PromptBar.Submitted) -> None:
        if message.mode == "filter":
            self.apply_filter(message.value)
        elif message.value:
            try:
                iteration = int(message.value)
            except ValueError:
                self.notify(f"{message.value!r} is not an iteration number", severity="error")
                return
            self.goto_iteration(iteration)

    def on_prompt_bar_closed(self, message: PromptBar.Closed) -> None:
        self.query_one(TimelineView).focus()

    def apply_filter(self, text: str) -> None:
        self._move("set_filter", text, severity="error")

    def action_clear_filter(self) -> None:
        self.apply_filter("")

    def action_clear(self) -> None:
        """Escape: back to the timeline from a panel, else drop the highlight, else the filter."""
        if self.nav is None:
            return
        timeline = self.query_one(TimelineView)
        if self.focused is not timeline:
            timeline.focus()
        else:
            self._move("clear")

    async def action_quit(self) -> None:
        code = 2 if self.load_error else 0
        self.exit(code, return_code=code)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    # -- mouse messages from the timeline ---------------------------------------------------

    def on_timeline_view_clicked(self, message: TimelineView.Clicked) -> None:
        if message.item is not None and self.nav is not None:
            self._move("select", message.lane_id, message.item)

    def on_timeline_view_zoom(self, message: TimelineView.Zoom) -> None:
        self._move("zoom", message.factor, message.column)

    def on_timeline_view_pan(self, message: TimelineView.Pan) -> None:
        self._move("pan_columns", message.columns)

    def on_timeline_view_resized(self, message: TimelineView.Resized) -> None:
        self._move("resize", message.columns)


@contextlib.contextmanager
def _stderr_with_fileno():
    """Textual replaces sys.stderr with a capture object that has no file descriptor, and
    multiprocessing's spawn (used by load_run for big runs) passes ``sys.stderr.fileno()`` to
    its helper process. Point stderr at /dev/null while loading, so that nothing the parsing
    processes print can scribble over the screen either."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        pass
    else:
        if sys.stderr.fileno() >= 0:
            yield
            return
    saved = sys.stderr
    with open(os.devnull, "w") as devnull:
        sys.stderr = devnull
        try:
            yield
        finally:
            sys.stderr = saved
