"""Progress of the long-running commands: the bar of ``leyline replay`` and ``leyline eval``,
and the status line while an embedded server starts (``start_server``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.status import Status

    from leyline_agent.backends.sglang.launch import EmbeddedServer


def progress_bar(console: Console) -> Progress:
    """A transient bar on ``console``: description, bar, done/total, elapsed time."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


class _LogFollower:
    """New lines of a growing log file, read on each call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def __call__(self) -> str:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return ""
        cut = data.rfind(b"\n") + 1  # whole lines only
        self.offset += cut
        return data[:cut].decode(errors="replace").rstrip("\n")


def start_server(
    server: EmbeddedServer, console: Console, *, verbose: bool = False, every_s: float = 15.0
) -> None:
    """Start ``server`` showing progress on ``console``: where its log goes, then a status line
    with the seconds waited and the phase read from the log (a plain line every ``every_s``
    seconds when ``console`` is not a terminal). ``verbose``: the log itself, as it grows,
    instead of the phase.

    Raises:
        ServerError: as ``EmbeddedServer.start`` (the process exited or never answered).
    """
    from rich.text import Text

    console.print(f"starting the embedded leyline serve (log: {server.log_path})", highlight=False)
    follow = _LogFollower(server.log_path) if verbose else None
    last = [0.0]

    def show(status: Status | None, elapsed: float) -> None:
        if follow is not None:
            text = follow()
            if text:
                console.print(text, markup=False, highlight=False)
        line = f"starting leyline serve: {elapsed:.0f} s"
        phase = server.phase()[:70] if follow is None else ""
        line += f" ({phase})" if phase else ""
        if status is not None:  # one line, cut to the terminal's width
            status.update(Text(line, no_wrap=True, overflow="ellipsis"))
        elif follow is None and elapsed - last[0] >= every_s:
            last[0] = elapsed
            console.print(line, markup=False, highlight=False)

    if console.is_terminal:
        with console.status("starting leyline serve") as status:
            server.start(on_poll=lambda s: show(status, s))
    else:
        server.start(on_poll=lambda s: show(None, s))
    console.print(f"leyline serve ready at {server.url}")
