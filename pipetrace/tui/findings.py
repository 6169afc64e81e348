"""The findings panel: the analyzers' findings, most severe first; picking one shows it."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from pipetrace.tui.session import FindingView

SEVERITY_STYLE = {"error": "bold #ff5f5f", "warning": "bold #ffaf00", "info": "#5fafff"}


class FindingsPanel(Vertical):
    DEFAULT_CSS = """
    FindingsPanel {
        height: 1fr;
    }
    FindingsPanel > OptionList {
        height: 1fr;
        border: none;
        padding: 0;
        scrollbar-size-vertical: 1;
    }
    FindingsPanel > #finding-cause {
        height: auto;
        max-height: 3;
        padding: 0 1;
        color: $text-muted;
    }
    """

    class Picked(Message):
        """A finding was highlighted (``final``: chosen with Enter or a click)."""

        def __init__(self, index: int, final: bool) -> None:
            super().__init__()
            self.index, self.final = index, final

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.views: list[FindingView] = []
        self._quiet = False

    def compose(self):
        yield OptionList(id="finding-list")
        yield Static("", id="finding-cause")

    def show(self, views: list[FindingView], problems: list[str]) -> None:
        self.views = views
        options = self.query_one(OptionList)
        options.clear_options()
        for k, view in enumerate(views):
            f = view.finding
            text = Text.assemble(
                (f"{f.severity.upper():7} ", SEVERITY_STYLE.get(f.severity, "")),
                (f"{f.kind} ", "bold"),
                f.message,
            )
            options.add_option(Option(text, id=f"finding-{k}"))
        for problem in problems:
            options.add_option(Option(Text(f"input   {problem}", style="dim"), disabled=True))
        if not views and not problems:
            options.add_option(
                Option(
                    Text("No findings: nothing hung, failed or mismatched.", style="green"),
                    disabled=True,
                )
            )
        self._cause(None)

    def focus_list(self) -> None:
        self.query_one(OptionList).focus()

    def select(self, index: int) -> None:
        """Highlight a finding without reporting it back (the app already jumped)."""
        options = self.query_one(OptionList)
        if 0 <= index < len(self.views):
            self._quiet = True
            options.highlighted = index
            self._quiet = False
            self._cause(index)

    def _cause(self, index: int | None) -> None:
        cause = self.query_one("#finding-cause", Static)
        if index is None or not 0 <= index < len(self.views):
            cause.update("")
            return
        cause.update(Text.assemble(("cause: ", "bold"), self.views[index].finding.cause))

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        event.stop()
        if event.option_index < len(self.views):
            self._cause(event.option_index)
            if not self._quiet:
                self.post_message(self.Picked(event.option_index, final=False))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option_index < len(self.views):
            self.post_message(self.Picked(event.option_index, final=True))
