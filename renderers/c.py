"""The C renderer: linear kernels -> C source for gcc, loops run in parallel with OpenMP.

Rules (`c_rules`, before the shared `cstyle_rules`) for what only C says: a loop marked "parallel" by the opt stage
gets `#pragma omp parallel for`, an innermost reduction loop marked "simd" gets `#pragma omp simd reduction(...)` so
that gcc vectorizes it without licence to reorder anything else (no -ffast-math).
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops
from .cstyle import Language, RenderContext, cstyle_rules, render_kernel

C = Language()


def _loop(ctx: RenderContext, r: UOp) -> str:
  head = f"for (int {ctx[r]} = 0; {ctx[r]} < {ctx[r.src[0]]}; {ctx[r]}++) {{"
  mark = r.arg[-1]
  if mark == "parallel": return f"#pragma omp parallel for\n{head}"
  if mark == "simd" and (red := ctx.accumulators.get(r)) is not None:
    return f"#pragma omp simd reduction({'+' if red.arg is Ops.ADD else 'max'}:{ctx.names[red]})\n{head}"
  return head


c_rules = PatternMatcher([
  (UPat(Ops.RANGE, name="r"), _loop),
], name="render.c")


class CRenderer:
  """Renders the kernels of one realize into one C source (one compiler call)."""
  language = C
  device_loops = False  # loops stay loops on the CPU (CUDA maps them onto threads)

  def render(self, name: str, linear: UOp) -> str: return render_kernel(name, linear, c_rules + cstyle_rules, C)

  def source(self, kernels: list[str]) -> str: return "\n".join(C.headers) + "\n\n" + "\n\n".join(kernels) + "\n"


renderer = CRenderer()
