"""`idlegrad top`: the terminal UI (textual). It reads a `StatusSource`, never a socket.

The source's blocking calls (fetch, control) run in threads (`asyncio.to_thread`) so the UI never
waits on the network; what is shown is computed by the pure view model (`monitor/view.py`).
Everything shown is `rich.text.Text` or a widget with markup off: a snapshot's strings, and the
operator's own filter, are text, never markup.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Button, DataTable, Footer, Input, Label, Static

from . import view
from .source import StatusSource


class Confirm(ModalScreen[bool]):
    """Yes or no, before a command is sent."""

    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]
    DEFAULT_CSS = """
    Confirm { align: center middle; }
    Confirm > Vertical { width: 64; max-width: 100%; height: auto; border: thick $warning;
                         background: $surface; padding: 1 2; }
    Confirm #question { width: 100%; }
    Confirm Horizontal { height: auto; margin-top: 1; }
    Confirm Button { margin-right: 2; }
    """

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="question", markup=False)
            with Horizontal():
                yield Button("Yes (y)", variant="warning", id="yes")
                yield Button("No (n)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class Chart(Widget):
    """Loss and the target metric over time, in braille, sized to the widget."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.snapshot: Optional[dict] = None

    def show(self, snap: Optional[dict]) -> None:
        self.snapshot = snap
        self.refresh()

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        if width <= 0 or height <= 0:
            return Text("")
        lines = view.chart_lines(self.snapshot, width, height)
        text = Text()
        for i, line in enumerate(lines):
            style = "bold" if i == 0 else None
            text.append(line + ("\n" if i < len(lines) - 1 else ""), style=style)
        return text


class MonitorApp(App):
    """The fleet at a glance. `source` gives snapshots and takes commands."""

    TITLE = "idlegrad top"
    CSS = """
    #header { height: 2; padding: 0 1; background: $boost; }
    #connection { height: 1; padding: 0 1; }
    #middle { height: 11; }
    #middle.with-data { height: 16; }
    #chart { width: 1fr; height: 100%; padding: 0 1; border-right: solid $primary-darken-2; }
    #rounds { width: 44; height: 100%; padding: 0 1; }
    #leaderboard { width: 40; height: 100%; padding: 0 1; border-left: solid $primary-darken-2; }
    #workers { height: 1fr; }
    #filter { dock: bottom; display: none; }
    #filter.shown { display: block; }
    #events { height: 7; padding: 0 1; border-top: solid $primary-darken-2; color: $text-muted; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("s", "sort", "sort"),
        Binding("slash", "filter", "filter", key_display="/"),
        Binding("p", "pause", "pause/resume"),
        Binding("d", "drain", "drain worker"),
        Binding("escape", "clear_filter", "clear filter", show=False),
    ]

    def __init__(self, source: StatusSource, interval: float = 1.0, timeout: float = 1.0,
                 watch: Optional[Callable[[], Optional[str]]] = None):
        super().__init__()
        self.source = source
        self.interval = interval
        self.timeout = timeout
        self.watch = watch  # called each poll: a string ends the app with that message
        self.snapshot: Optional[dict] = None
        self.sort = "id"
        self.filter_text = ""
        self.events = view.EventLog()
        self.connection = Text(f"connecting to {view.shown(source.address)}...")
        self.connected = False
        self.lost_at: Optional[float] = None
        self.polls = 0
        self.end_message: Optional[str] = None
        self._polling = False

    # layout -----------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(view.header(None, self.connection), id="header", markup=False)
        yield Static("", id="connection", markup=False)
        with Horizontal(id="middle"):
            yield Chart(id="chart")
            yield Static("", id="rounds", markup=False)
            yield Static("", id="leaderboard", markup=False)
        table = DataTable(id="workers", cursor_type="row", zebra_stripes=True)
        yield table
        yield Input(placeholder="filter workers (id, host, device, state); enter to keep, "
                                "escape to clear", id="filter")
        yield Static("", id="events", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#workers", DataTable)
        for key, title in view.COLUMNS:
            table.add_column(title, key=key)
        table.focus()
        self.poll()
        self.set_interval(self.interval, self.poll)

    # polling ----------------------------------------------------------------------------------

    def poll(self) -> None:
        if self.watch is not None:
            message = self.watch()
            if message is not None:
                self.end_message = message
                self.exit(message)
                return
        if not self._polling:
            self._polling = True
            self.run_worker(self._fetch(), group="fetch")

    async def _fetch(self) -> None:
        try:
            snap = await asyncio.to_thread(self.source.fetch, self.timeout)
            self.polls += 1
            self.apply(snap, restarted=bool(getattr(self.source, "restarted", False)))
        finally:
            self._polling = False

    def apply(self, snap: Optional[dict], restarted: bool = False) -> None:
        """Show a snapshot (None: the coordinator did not answer)."""
        address = view.shown(self.source.address)
        refused = getattr(self.source, "refused", None)  # a key without the monitor's role
        if snap is None and refused is not None:
            self.connection = Text(f"the coordinator at {address} refused: "
                                   f"{view.shown(refused)}", style="red")
        elif snap is None:
            if self.connected:
                self.connected = False
                self.lost_at = time.monotonic()
            if self.lost_at is not None:
                self.connection = Text(f"lost the coordinator at {address} "
                                       f"{view.duration(time.monotonic() - self.lost_at)} ago; "
                                       f"reconnecting...", style="red")
            else:
                self.connection = Text(f"connecting to {address}...", style="yellow")
        else:
            if restarted or (self.snapshot is not None
                             and snap.get("instance") != self.snapshot.get("instance")):
                self.connection = Text(f"reconnected: the coordinator at {address} restarted",
                                       style="yellow")
            elif self.lost_at is not None:
                self.connection = Text(f"reconnected to {address}", style="green")
            elif not self.connected:
                self.connection = Text(f"connected to {address}")
            self.connected = True
            self.lost_at = None
            self.snapshot = snap
            self.events.update(snap)
        self.refresh_view()

    def refresh_view(self) -> None:
        snap = self.snapshot
        try:
            header = self.query_one("#header", Static)
        except NoMatches:  # a fetch that ends while the app closes finds its widgets gone
            return
        header.update(view.header(snap, lost=self.lost_at is not None))
        sort_note = f"sort: {self.sort}" + (
            f"  filter: {view.shown(repr(self.filter_text))}" if self.filter_text else "")
        self.query_one("#connection", Static).update(
            Text.assemble(self.connection, "   ", (sort_note, "dim")))
        self.query_one("#chart", Chart).show(snap)
        lines = view.rounds_lines(snap)
        data = snap.get("data") if snap else None
        if isinstance(data, dict):  # the data plane, as `idlegrad status` shows it
            lines = [*lines, *view.data_panel_lines(data)]
        # the panel grows to hold the data plane's lines (the workers table gives way)
        self.query_one("#middle").set_class(isinstance(data, dict), "with-data")
        self.query_one("#rounds", Static).update(Text.assemble(
            ("rounds and redundancy", "bold"), *(f"\n{line}" for line in lines)))
        self.query_one("#leaderboard", Static).update(Text.assemble(
            ("credits: samples, verified", "bold"),
            *(f"\n{line}" for line in view.leaderboard_lines(snap))))
        self.query_one("#events", Static).update(
            Text("\n".join(self.events.tail(6)), no_wrap=True, overflow="ellipsis"))
        self._fill_table()

    def _fill_table(self) -> None:
        table = self.query_one("#workers", DataTable)
        selected = self.selected_worker()
        rows = view.worker_rows(self.snapshot, self.sort, self.filter_text)
        table.clear()
        state_col = [k for k, _ in view.COLUMNS].index("state")
        for row in rows:
            # a str cell would be parsed as markup by the DataTable
            cells = [Text(cell, no_wrap=True, overflow="ellipsis") for cell in row.cells]
            cells[state_col].stylize(view.STATE_STYLES.get(row.state, ""))
            table.add_row(*cells, key=row.id)
        ids = [r.id for r in rows]
        if selected in ids:
            table.move_cursor(row=ids.index(selected), animate=False)

    def worker_ids(self) -> list[str]:
        """The workers in table order (what the operator sees)."""
        table = self.query_one("#workers", DataTable)
        return [str(table.coordinate_to_cell_key((i, 0)).row_key.value)
                for i in range(table.row_count)]

    def selected_worker(self) -> Optional[str]:
        table = self.query_one("#workers", DataTable)
        if table.row_count == 0:
            return None
        row = min(max(table.cursor_row, 0), table.row_count - 1)
        return str(table.coordinate_to_cell_key((row, 0)).row_key.value)

    # keys -------------------------------------------------------------------------------------

    def action_sort(self) -> None:
        self.sort = view.next_sort(self.sort)
        self.notify(f"sorted by {self.sort}", timeout=1.5, markup=False)
        self.refresh_view()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.value = self.filter_text
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self.filter_text = event.value
            self.refresh_view()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            event.input.remove_class("shown")
            self.query_one("#workers", DataTable).focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.remove_class("shown")
        self.filter_text = ""
        self.query_one("#workers", DataTable).focus()
        self.refresh_view()

    def action_pause(self) -> None:
        paused = bool(self.snapshot and (self.snapshot.get("paused")
                                         or self.snapshot.get("state") == "paused"))
        action = "resume" if paused else "pause"
        question = ("Resume training? Workers get slots again." if paused else
                    "Pause training? No new slots are handed out; workers finish what they hold "
                    "and idle.")
        self.push_screen(Confirm(question), lambda yes: self._confirmed(yes, action, None))

    def action_drain(self) -> None:
        worker = self.selected_worker()
        if worker is None:
            self.notify("no worker selected", severity="warning", markup=False)
            return
        self.push_screen(Confirm(f"Drain worker {view.shown(worker)}? It finishes its current "
                                 f"slots, gets no more, and leaves."),
                         lambda yes: self._confirmed(yes, "drain", worker))

    def _confirmed(self, yes: Optional[bool], action: str, worker: Optional[str]) -> None:
        if yes:
            self.run_worker(self._control(action, worker), group="control")

    async def _control(self, action: str, worker: Optional[str]) -> None:
        ok, detail = await asyncio.to_thread(self.source.control, action, worker)
        self.notify(view.shown(detail or action), severity="information" if ok else "error",
                    timeout=4 if ok else 8, markup=False)
        self.poll()


def run(address: str, interval: float = 1.0, timeout: float = 1.0, keys=None) -> int:
    """`idlegrad top`."""
    from .source import ZmqStatusSource

    with ZmqStatusSource(address, keys=keys) as source:
        MonitorApp(source, interval=interval, timeout=timeout).run()
    return 0
