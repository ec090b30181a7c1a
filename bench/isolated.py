"""Each measurement of the benchmarks runs in a fresh process: cold means cold, and two frameworks' thread pools never
share the cores. The worker prints one tagged line, RESULT (JSON) or ERROR (one line); the parent reads it back."""
from __future__ import annotations
import json, subprocess, sys, traceback
from typing import Any, Callable


def report(measure: Callable[[], Any]) -> None:
  """In the worker: run the measurement and print its tagged result line (exit 1 on error)."""
  try: res = measure()
  except Exception as e:
    traceback.print_exc()
    # the exception's first line names the failure; a compiler error's later lines are its output
    print("ERROR " + json.dumps(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:400]}"))
    sys.exit(1)
  print("RESULT " + json.dumps(res))


def run_isolated(cmd: list[str], env: dict, timeout: float) -> tuple[Any | None, str | None]:
  """In the parent: (result, None) or (None, why it failed)."""
  try: r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired: return None, f"timed out after {timeout:.0f} s"
  tagged = {l.split(" ", 1)[0]: l.split(" ", 1)[1] for l in r.stdout.splitlines() if l.startswith(("RESULT ", "ERROR "))}
  if r.returncode == 0 and "RESULT" in tagged: return json.loads(tagged["RESULT"]), None
  if "ERROR" in tagged: return None, json.loads(tagged["ERROR"])
  tail = " | ".join(r.stderr.strip().splitlines()[-3:])  # a crash with no Python exception (a signal, say)
  return None, f"exit {r.returncode}: {tail[-400:]}"
