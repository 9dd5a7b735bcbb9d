"""Progress for long command-line work (kernel builds, benchmark runs): tqdm's bar where tqdm is installed (the
``progress`` extra) and stderr is a terminal, else plain lines with a count."""

from __future__ import annotations

import sys


class Progress:
    """``total`` steps of ``unit``. ``write(line)`` prints a finished step's line and advances by one; ``note(line)``
    prints a line without advancing. With tqdm the lines go above the bar; without it (or off a terminal, where a
    redrawn bar would only clutter a log) each advancing line carries ``[done/total]``."""

    def __init__(self, total: int, unit: str = "kernel"):
        self.total, self.done = total, 0
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit=unit, file=sys.stderr)

    def write(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(line)
            self.bar.update(1)
        else:
            print(f"[{self.done:>{len(str(self.total))}}/{self.total}] {line}", flush=True)

    def note(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
