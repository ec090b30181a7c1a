"""Memory planning: peak bytes of intermediate buffers under the host program's plan (rules/host.py, stage memory:
lifetimes, storage shared best fit) against every intermediate in a buffer of its own, for WORKLOADS.md's sched_mlp
and sched_tfm graphs (the models of bench/compiler_speed.py).

  python bench/memory_plan.py

Nothing is compiled or run: `runtime.realize.plan` lowers the graph to its planned host program. The figures are
exact byte counts (they do not depend on the machine). Library calls are off (GRAFT_EXTERN=0) so that the program is
the same on every machine.
"""
from __future__ import annotations
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["GRAFT_EXTERN"] = "0"
from compiler_speed import MODELS  # noqa: E402


def main() -> None:
  import numpy as np
  from tensor import Tensor
  from runtime.realize import plan
  print(f"{'workload':<10s} {'kernels':>7s} {'intermediates':>13s} {'unplanned MiB':>13s} {'peak MiB':>8s} {'ratio':>6s}")
  for name, model in MODELS.items():
    out = model(lambda shape: Tensor(np.zeros(shape, np.float32), device="CPU"))
    p = plan([(out.uop, out.device)])
    temps = sum(s[0] == "alloc" for s in p.steps)
    print(f"{name:<10s} {len(p.kernels_called()):7d} {temps:13d} {p.unplanned_bytes / 2**20:13.2f} "
          f"{p.peak_bytes / 2**20:8.2f} {p.unplanned_bytes / max(p.peak_bytes, 1):5.1f}x")


if __name__ == "__main__":
  main()
