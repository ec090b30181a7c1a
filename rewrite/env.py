"""Settings read from environment variables, all one way: unset or empty is the default, and a value that is not what
the variable takes is a ValueError naming the variable, the value and what it takes (never a silent default)."""
from __future__ import annotations
import os
from typing import Any


def env_flag(name: str, default: bool, meaning: str) -> bool:
  """$name as a switch: 1 on, 0 off; `meaning` says what it switches, for the error."""
  value = os.environ.get(name, "").strip()
  if not value: return default
  if value not in ("0", "1"): raise ValueError(f"{name}={value!r}: 1 turns {meaning} on, 0 off (default {int(default)})")
  return value == "1"


def env_number(name: str, default: float, meaning: str, minimum: float = 0, kind: type = int) -> Any:
  """$name as an int (or `kind=float`) of at least `minimum`; `meaning` says what it is, for the error. Read when asked,
  not cached: a test or a program may change it between calls (REWRITE_STATS alone is read once, at import)."""
  value = os.environ.get(name, "").strip()
  if not value: return default
  try: number = kind(value)
  except ValueError: number = None
  if number is None or number != number or number < minimum:   # number != number: a float NaN
    raise ValueError(f"{name}={value!r}: set it to {meaning}, a{'n integer' if kind is int else ' number'} >= {minimum} "
                     f"(default {default}), or unset it")
  return number


class EnvTexts:
  """The raw text of a few variables, read on every call of a hot path (a warm realize keys its program by its
  switches): `EnvTexts("A", "B")()` is a tuple of each one's value, None where unset, as os.environ holds it (bytes on
  POSIX: for comparing, not for parsing). os.environ.get costs a raised and caught KeyError for each unset name;
  the table behind os.environ (CPython's `_data`, which every change through os.environ updates) answers a plain
  lookup."""
  __slots__ = ("names", "keys")

  def __init__(self, *names: str):
    self.names = names
    encode = getattr(os.environ, "encodekey", None)
    self.keys = tuple(map(encode, names)) if encode is not None else None

  def __call__(self) -> tuple:
    try: get = os.environ._data.get   # type: ignore[attr-defined]
    except AttributeError: get = None  # os.environ replaced by a plain mapping
    if get is None or self.keys is None: return tuple(map(os.environ.get, self.names))
    return tuple(map(get, self.keys))
