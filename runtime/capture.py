"""Recording what a thread runs, for `jit` (tensor/jit.py) to replay it: the realizes and the versions split.

A call of a function of tensors runs as a sequence of events, and nothing else touches memory:
  - ("realize", program, input Buffers, result Buffers): runtime/realize.py `realize` ran a host program;
  - ("split", old Buffer, new Buffer): an in-place update kept the old contents for lazy readers
    (runtime/buffer.py `Buffer.split_version`: `old` now holds a copy, `new` the original memory, which is written).
  - ("guard", flag Buffer, subject Buffer, error): a check on values (an index in range) that raised nothing: a replay
    checks it again on its own buffers (`guard`).
`recording()` collects them for the calls made inside it; a replay runs the same programs on the same kinds of
buffers, in order. A function that reads a tensor's values into Python (`.numpy()`, `.item()`) cannot be replayed by
running programs: `check_read` calls the recording's `on_read`, which refuses it.
"""
from __future__ import annotations
import contextlib, threading
from dataclasses import dataclass, field
from typing import Any, Callable

_local = threading.local()


@dataclass
class Recording:
  events: list[tuple] = field(default_factory=list)
  on_read: Callable[[str], Any] | None = None     # called with what read values into Python (may raise)


def active() -> Recording | None:
  """This thread's recording, or None (the common case: one attribute read)."""
  return getattr(_local, "recording", None)


@contextlib.contextmanager
def recording(on_read: Callable[[str], Any] | None = None):
  """Record the realizes and splits of this thread inside the `with` (recordings do not nest: a jit function called
  inside another's recorded call is recorded as the work it runs)."""
  outer = active()
  rec = _local.recording = Recording(on_read=on_read) if outer is None else outer
  try: yield rec
  finally: _local.recording = outer


def note_realize(program, inputs: list, results: list) -> None:
  if (rec := active()) is not None: rec.events.append(("realize", program, list(inputs), [u.src[0].arg for u in results]))


def note_split(old, new) -> None:
  if (rec := active()) is not None: rec.events.append(("split", old, new))


def guard(flag, subject, error: Callable) -> None:
  """Raise error(the values of Buffer `subject`) when the one-element Buffer `flag` holds a nonzero value (a check of
  data: an index out of range). Inside a recording it is also an event, which every replay checks again."""
  if (rec := active()) is not None: rec.events.append(("guard", flag, subject, error))
  if flag.numpy()[0]: raise error(subject.numpy())


def check_read(what: str) -> None:
  if (rec := active()) is not None and rec.on_read is not None: rec.on_read(what)
