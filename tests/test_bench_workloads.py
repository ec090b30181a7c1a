"""Smoke test of bench/workloads.py: a --quick run of two workloads prints the table, with Graft's results correct."""
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "workloads.py"


def test_quick_table_prints():
  env = {k: v for k, v in os.environ.items() if k != "DEBUG"}
  r = subprocess.run([sys.executable, str(BENCH), "--quick", "--only", "ew,sum"], env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, f"bench/workloads.py failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
  lines = r.stdout.splitlines()
  header = next(l for l in lines if l.startswith("| id"))
  for column in ("ok", "graft cold ms", "graft warm ms", "graft rate", "numpy warm ms", "graft/numpy"):
    assert column in header, f"no column {column!r} in {header}"
  rows = {l.split("|")[1].strip(): [c.strip() for c in l.split("|")[1:-1]] for l in lines if l.startswith("| ") and l != header}
  assert set(rows) == {"ew", "sum"}, r.stdout
  for wid, cells in rows.items():
    assert cells[2] == "yes", f"{wid}: Graft's result is not correct:\n{r.stdout}"
    assert "GB/s" in cells[5], f"{wid}: no rate in {cells}"
