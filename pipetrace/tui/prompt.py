"""A one-line prompt under the timeline: the filter (``/``) and go to iteration (``g``)."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input

PROMPTS = {
    "filter": (
        "filter: ",
        "rank=0,2 stage=1 mb=0-3 kind=F,B,send   (Enter applies, empty clears, Esc cancels)",
    ),
    "iteration": ("iteration: ", "an iteration number   (Enter jumps, Esc cancels)"),
}


class PromptBar(Input):
    DEFAULT_CSS = """
    PromptBar {
        dock: bottom;
        height: 1;
        border: none;
        padding: 0 1;
        display: none;
        background: $boost;
    }
    PromptBar.-shown {
        display: block;
    }
    """

    BINDINGS = [Binding("escape", "cancel", "cancel", show=False)]

    class Submitted(Message):
        def __init__(self, mode: str, value: str) -> None:
            super().__init__()
            self.mode, self.value = mode, value

    class Closed(Message):
        pass

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mode = "filter"

    def open(self, mode: str, value: str = "") -> None:
        self.mode = mode
        self.placeholder = PROMPTS[mode][0] + PROMPTS[mode][1]
        self.value = value
        self.add_class("-shown")
        self.focus()

    def close(self) -> None:
        self.remove_class("-shown")
        self.post_message(self.Closed())

    def action_cancel(self) -> None:
        self.close()

    async def action_submit(self) -> None:
        self.post_message(self.Submitted(self.mode, self.value.strip()))
        self.close()
