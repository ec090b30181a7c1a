"""A user's rule: fuse `a * b + c` on floats into one multiply-add (C `fmaf`, CUDA `fmaf`).

Importing this module puts the rule set into the pipeline after the `symbolic` stage; so does running any script
with `GRAFT_RULES=examples/custom_rule.py`. Run it directly to see the rule fire in the statistics table and the
result stay right:

    DEVICE=CPU python examples/custom_rule.py
"""
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes
from rules.pipeline import pipeline

floats = (dtypes.float16, dtypes.float32, dtypes.float64)


def fused_multiply_add(m: UOp, c: UOp) -> UOp:
  """a*b + c with one rounding instead of two: faster, and never less accurate."""
  return UOp(Ops.MULACC, m.dtype, (*m.src, c))


fma_rules = PatternMatcher([
  (UPat(Ops.ADD, dtype=floats, src=[UPat(Ops.MUL, name="m"), UPat.var("c")]), fused_multiply_add),
], name="fma")

pipeline.insert("symbolic", fma_rules, where="after")


if __name__ == "__main__":
  import os, sys, time
  import numpy as np
  import rewrite
  from tensor import Tensor

  n = 64 if "--small" in sys.argv else 2048
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(3))
  with rewrite.stats.collect() as s:
    t0 = time.perf_counter()
    out = (Tensor(a) * Tensor(b) + Tensor(c)).numpy()
    elapsed = time.perf_counter() - t0
  np.testing.assert_allclose(out, a * b + c, rtol=1e-5, atol=1e-5)
  print(s.table("rule").split("\n", 2)[0])
  print("\n".join(line for line in s.table("rule").splitlines() if line.startswith("fma ") or "fused_multiply_add" in line))
  fired = sum(r.matches for r in s.rules.values() if r.name == "fused_multiply_add")
  assert fired > 0, "the fma rule did not fire"
  print(f"fused_multiply_add fired {fired} time(s); result matches numpy; {elapsed * 1e3:.1f} ms on {os.environ.get('DEVICE', 'CPU')}")
  print("ok")
