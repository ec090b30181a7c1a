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
