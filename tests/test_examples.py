"""The examples run: each `examples/<name>.py --small` exits 0 and prints 'ok' (its own check against numpy passed).

Each runs in a fresh interpreter, as a user would start it, with DEVICE taken from the environment (CPU when unset).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["mlp", "softmax", "conv", "attention", "gpt", "train_mlp", "train_gpt"])
def test_example_runs(name, tmp_path):
  env = {**os.environ, "DEVICE": os.environ.get("DEVICE", "CPU"), "GRAFT_CACHE_DIR": str(tmp_path / "cache")}
  env.pop("DEBUG", None)  # debug output would only make the failure message longer
  r = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--small"], env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, f"examples/{name}.py --small failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
  assert "ok" in r.stdout.split(), f"examples/{name}.py --small printed no 'ok':\n{r.stdout}"
