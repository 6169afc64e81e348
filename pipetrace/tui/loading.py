"""Shown while the run loads in the background: what is being done, and how far."""

from __future__ import annotations

from textual.containers import Center, Middle
from textual.widgets import Label, ProgressBar

PHASES = {
    "reading": "Reading rank logs",
    "analyzing": "Running the analyzers",
    "indexing": "Building the timeline",
}


class LoadingView(Middle):
    DEFAULT_CSS = """
    LoadingView {
        height: 1fr;
    }
    LoadingView Label {
        width: auto;
        margin-bottom: 1;
    }
    LoadingView .error {
        color: $error;
        text-style: bold;
    }
    """

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.path = path

    def compose(self):
        with Center():
            yield Label(f"Loading {self.path}", id="loading-title")
        with Center():
            yield Label("Reading rank logs", id="loading-phase")
        with Center():
            yield ProgressBar(total=None, show_eta=False, id="loading-bar")

    def progress(self, phase: str, done: int, total: int) -> None:
        label = PHASES.get(phase, phase)
        if phase == "reading" and total:
            label += f" ({done}/{total})"
        self.query_one("#loading-phase", Label).update(label)
        bar = self.query_one(ProgressBar)
        # reading logs is most of the work: 0-80 %, then analysis and indexing
        share = {"reading": (0, 80), "analyzing": (80, 92), "indexing": (92, 100)}.get(
            phase, (0, 100)
        )
        fraction = done / total if total else 0.0
        bar.update(total=100, progress=share[0] + (share[1] - share[0]) * fraction)

    def failed(self, message: str) -> None:
        phase = self.query_one("#loading-phase", Label)
        phase.update(f"{message}\n\nPress q to quit.")
        phase.add_class("error")
        self.query_one(ProgressBar).display = False
