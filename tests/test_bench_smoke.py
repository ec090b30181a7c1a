"""The engine benchmark runs (smoke run with --quick) and prints its table."""
import os, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rewrite_engine_bench_prints_a_table():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "rewrite_engine.py"), "--quick"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].startswith("| measure") and "graft" in lines[0]
  for row in ("(a) dispatch", "(b) rewrite", "(c) build"): assert any(row in l for l in lines), row
  assert any("UOps/s" in l for l in lines)
