"""`python -m rules`: the pipeline, stage by stage: scope, rule count, and where each rule set comes from."""
from __future__ import annotations
import os
from tabulate import tabulate
from .pipeline import pipeline


def _where(location: str) -> str:
  path, _, line = location.rpartition(":")
  try: rel = os.path.relpath(path)
  except ValueError: rel = path
  return f"{path if rel.startswith('..') else rel}:{line}"


def describe() -> str:
  rows = []
  for i, stage in enumerate(pipeline):
    origins = sorted({_where(r.location).rsplit(":", 1)[0] for r in stage.rules.rules})
    rows.append((i + 1, stage.name, stage.scope, len(stage.rules.rules), stage.origin, ", ".join(origins)))
  return tabulate(rows, headers=["#", "stage", "scope", "rules", "from", "files"], tablefmt="simple")


if __name__ == "__main__":
  print(describe())
