"""Rewrite statistics as a user meets them: per kernel, and written to JSON or CSV for scripts."""
import csv, json, os, subprocess, sys
import numpy as np
import rewrite
from tensor import Tensor

PROGRAM = "from tensor import Tensor; import numpy as np; Tensor(np.ones((16, 16), np.float32)).softmax().numpy()"


def test_each_kernel_shows_time_and_rewrites_per_stage():
  with rewrite.stats.collect() as s:
    (Tensor(np.arange(30, dtype=np.float32).reshape(5, 6)) * 3).sum(axis=1).numpy()
  assert s.kernels, "no kernel was recorded"
  (name, stages), = [(k, v) for k, v in s.kernels.items() if k.startswith("r_5")]
  assert {"views", "lower", "symbolic", "linearize", "render"} <= set(stages)
  assert stages["render"].rewrites > 0  # the renderer's rules: one text per instruction
  assert stages["lower"].rewrites > 0 and stages["lower"].time > 0
  table = s.table("kernel")
  assert name in table and "lower ms/rw" in table


def run(**env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


def test_rewrite_stats_file_json(tmp_path):
  path = tmp_path / "stats.json"
  r = run(REWRITE_STATS_FILE=str(path))
  assert r.returncode == 0, r.stderr
  assert r.stdout == ""  # writing the file prints nothing unless REWRITE_STATS asks for tables too
  data = json.loads(path.read_text())
  assert {"stages", "rules", "kernels"} <= set(data)
  assert any(s["name"] == "lower" and s["rewrites"] > 0 for s in data["stages"])
  assert any(r["matches"] > 0 for r in data["rules"])


def test_rewrite_stats_file_csv_and_tables_at_exit(tmp_path):
  path = tmp_path / "stats.csv"
  r = run(REWRITE_STATS_FILE=str(path), REWRITE_STATS="2")
  assert r.returncode == 0, r.stderr
  assert "per stage" in r.stdout and "per rule" in r.stdout and "per kernel" in r.stdout
  rows = list(csv.DictReader(path.open()))
  assert {row["kind"] for row in rows} == {"stage", "rule", "kernel"}


def test_the_renderers_rules_are_counted_per_rule():
  with rewrite.stats.collect() as s:
    (Tensor(np.arange(21, dtype=np.float32).reshape(7, 3)) * 1.25 + 1).exp().numpy()  # a kernel no other test compiles
  render = [r for r in s.rules.values() if r.stage == "render"]
  assert render and sum(r.matches for r in render) > 0
  assert any(r.name == "render_load" for r in render)  # the C-style renderers' load rule, by its given name
