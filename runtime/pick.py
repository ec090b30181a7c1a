"""The measured pick: where a step has several implementations (a generated kernel and a library call, say), the
first call times each on the real buffers and the fastest is remembered, in memory and on disk, by (what the step
computes, its shapes, the device, the machine). Later calls and later processes reuse the choice.

`choose(key, candidates) -> (name, why)`: `key` is a tuple of strings naming the work (kernel, shapes, device);
`candidates` maps a name to a callable that runs that implementation once and returns its time in seconds (having
waited for the device). Each candidate runs once to warm up (a first call may load a library or fault pages in), then
`RUNS` rounds run each candidate once, in turn; the smallest minimum wins. Load from other processes only adds time,
and comes in bursts that rounds in turn share out: on a shared 2-core machine a median of three runs taken one
candidate after the other chose OpenBLAS for attention's products in some processes, where the generated kernels beat
it there (one thread, `bench/cpu_steps.py`: q @ k.T 2.5 against 3.4 ms, p @ v 2.8 against 3.4 ms).

On disk: `<cache dir>/pick/<sha256 of key and machine>.json` holding {"key": [...], "choice": name, "seconds": {...}},
written atomically by runtime/cache.py's writer (a separate format from the compiled-artifact entries). A file that
cannot be read, or names a choice that is not among the candidates, is measured again and rewritten.
GRAFT_CACHE=0 keeps picks in memory only.

`mode(variable, zero, one)` reads the environment variable that forces a choice (GRAFT_EXTERN for library calls,
GRAFT_SPLIT_REDUCE for split reductions on a GPU): "off" for 0, "on" for 1, "pick" (time both) when unset.
"""
from __future__ import annotations
import hashlib, json, os, threading
from pathlib import Path
from typing import Callable
from runtime import cache

FORMAT = "graft-pick-1"
RUNS = 5
_memory: dict[str, str] = {}
_lock = threading.Lock()


def mode(variable: str, zero: str, one: str) -> str:
  """"off", "on" or "pick" from `variable` (0, 1, unset); anything else is a ValueError naming the choices."""
  v = os.environ.get(variable, "").strip()
  if v not in ("", "0", "1"): raise ValueError(f"{variable}={v!r}: use 0 ({zero}), 1 ({one}) or leave it unset (time both)")
  return {"": "pick", "0": "off", "1": "on"}[v]


def split_mode() -> str: return mode("GRAFT_SPLIT_REDUCE", "one kernel per reduction", "split reductions where offered")


def _digest(key: tuple[str, ...]) -> str:
  from runtime.cpu import machine_identity
  h = hashlib.sha256()
  for part in (FORMAT, *key, machine_identity()):
    b = part.encode()
    h.update(len(b).to_bytes(8, "little") + b)
  return h.hexdigest()


def _path(digest: str) -> Path | None:
  d = cache.cache_dir()
  return None if d is None else d / "pick" / f"{digest}.json"


def choose(key: tuple[str, ...], candidates: dict[str, Callable[[], float]]) -> tuple[str, str]:
  digest = _digest(key)
  with _lock: known = _memory.get(digest)
  if known in candidates: return known, "chosen earlier in this process"
  path = _path(digest)
  if path is not None:
    try:
      known = json.loads(path.read_text())["choice"]
      if known in candidates:
        with _lock: _memory[digest] = known
        return known, f"measured by an earlier process ({path})"
    except (OSError, ValueError, KeyError, TypeError): pass
  for run in candidates.values(): run()
  seconds = {name: float("inf") for name in candidates}
  for _ in range(RUNS):
    for name, run in candidates.items(): seconds[name] = min(seconds[name], run())
  best = min(seconds, key=seconds.get)
  with _lock: _memory[digest] = best
  if path is not None:
    try:
      if cache._dir_problem(path.parent) is None:
        cache._write_atomic(path, json.dumps({"key": list(key), "choice": best, "seconds": seconds}).encode())
    except OSError: pass  # a read-only cache directory: the pick is remembered for this process only
  times = ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in seconds.items())
  return best, f"fastest on first use ({times})"


def forget() -> None:
  """Forget the picks of this process (the disk keeps its own)."""
  with _lock: _memory.clear()
