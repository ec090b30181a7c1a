"""`python -m rules`: the pipeline, stage by stage: scope, rule count, and where each rule set comes from."""
from __future__ import annotations
from tabulate import tabulate
from rewrite.stats import short_path
from .pipeline import pipeline


def describe() -> str:
  rows = []
  for i, stage in enumerate(pipeline):
    origins = sorted({short_path(r.location).rsplit(":", 1)[0] for r in stage.rules.rules})
    rows.append((i + 1, stage.name, stage.scope, len(stage.rules.rules), stage.origin, ", ".join(origins)))
  return tabulate(rows, headers=["#", "stage", "scope", "rules", "from", "files"], tablefmt="simple")


if __name__ == "__main__":
  print(describe())
