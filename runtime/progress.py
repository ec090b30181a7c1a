"""Progress of long work (compiling a realize's kernels, a plan search) on stderr, where a person waits.

When stderr is a terminal: one live line, redrawn at most ten times a second, shown only once the work has taken
half a second (a quick compile prints nothing) and erased when the work is done. Under DEBUG=1 or more: plain lines
(one per `line()`; what `show()` says goes to the live line only). Otherwise: nothing. A dependency (tqdm) would
give a bar, which work of unknown length (a search ends when a round finds nothing better) has no use for.
"""
from __future__ import annotations
import shutil, sys, time
from rewrite.env import env_number, EnvTexts

DELAY, EVERY = 0.5, 0.1   # seconds before the live line appears, and between redraws


_DEBUG = EnvTexts("DEBUG")


def debug_level() -> int:
  """DEBUG: 1 prints a line per realize, 2 the host program and a line per step, 3 the kernels' source too."""
  if not _DEBUG()[0]: return 0   # unset or empty: the common case, read on every realize
  return env_number("DEBUG", 0, "a debug level (1: realizes, 2: and the host program, 3: and the kernels' source)")


class Progress:
  def __init__(self, what: str, since: float | None = None, stream=None):
    """`since`: when the work began (time.perf_counter()), if before now (a second part of the same work); `stream`:
    where to write (stderr)."""
    self.what, self.start, self.drawn, self.last = what, time.perf_counter() if since is None else since, False, 0.0
    self.out = stream or sys.stderr
    self.plain = debug_level() >= 1
    self.live = not self.plain and self.out.isatty()

  def show(self, text: str) -> None:
    """The live line's news (on a terminal); nothing in plain mode."""
    if not self.live: return
    now = time.perf_counter()
    if now - self.start < DELAY or now - self.last < EVERY: return
    self.last, self.drawn = now, True
    self.out.write(f"\r\x1b[K{self.what}: {text}"[:_width()])
    self.out.flush()

  def line(self, text: str) -> None:
    """News worth a line of its own under DEBUG; on a terminal, the live line's."""
    if self.plain: print(f"{self.what}: {text}", file=self.out, flush=True)
    else: self.show(text)

  def done(self) -> None:
    if self.drawn: self.out.write("\r\x1b[K"); self.out.flush()
    self.drawn = False

  def __enter__(self): return self
  def __exit__(self, *exc): self.done()


def _width() -> int:
  """The live line's length in characters, its control characters included (it must not wrap to a second line)."""
  return max(20, shutil.get_terminal_size().columns - 1) + len("\r\x1b[K")
