"""Compiler speed, WORKLOADS.md's sched_mlp, sched_tfm and sym: Graft beside tinygrad where it is importable.

  python bench/compiler_speed.py                 # all three (several minutes: tinygrad's sym is slow)
  python bench/compiler_speed.py --only sym
  python bench/compiler_speed.py --quick         # smoke run: 1 repeat, 300 expressions
  python bench/compiler_speed.py --no-tinygrad

Rows:
  sched_mlp  schedule + codegen of an 8-layer MLP forward, x (256, 1024) -> 8x relu(x @ W + b), W (1024, 1024).
  sched_mlp64  the same MLP with 64 layers: scheduling and codegen must scale linearly (the note under the table
             gives its time over sched_mlp's; Graft's aim is at most 8.5).
  sched_1000 schedule + codegen of a chain of 1,000 kernels ((x * 2 + 1).contiguous(), 16x16): one kernel, rendered
             once, so this is the scheduler's cost per kernel (Graft's aim: under 2 s).
  sched_tfm  schedule + codegen of one transformer block forward: x (128, 512), 8 heads of 64, pre-layernorm (with
             gain and bias), attention with q/k/v/out projections, GELU MLP 512 -> 2048 -> 512, two residuals.
  sym        symbolic simplification of 10,000 distinct index expressions, each the (index, validity) pair of a
             6-D view chain: a random permute and pad of a random shape, read through a reshape that merges two
             neighbouring dims and splits one (stacked as two views, so the index needs // and %).

What is timed. codegen = the kernel source text, without the C compile. Graft: `rules.pipeline.schedule`, then per
distinct kernel `normalize` + `lower_kernel` + the CPU renderer's `render` (what runtime/realize.py does before it
calls gcc). tinygrad 0.14 (DEV=NULL, nothing runs): `Tensor.schedule_linear()`, then per distinct kernel AST
`full_rewrite_to_sink` + linearize + the Clang renderer (its `to_program` without the compile step), with its
schedule cache off (SCACHE=0). Both compilers render a kernel that occurs several times once, as each does in a real
run. A third column runs tinygrad with NOOPT=1 (no upcasts or unrolls: nearer to what Graft's opt stage does
today, and its sources are as short). The model is written once below and built with each framework's own Tensor;
parameters are created outside the timing. Each (row, compiler) pair runs in a fresh process: `first` is its first schedule + codegen (the rule
sets' lazy setup included), `median` the median of the repeats that follow, each on a freshly built graph.

sym: both compilers simplify the same expressions (built with Graft's View.to_index_chain, translated op by op for
tinygrad; // and % there become FLOORDIV and FLOORMOD, equal to C's on these non-negative indices), one
graph_rewrite per expression, with Graft's `symbolic_rules` and tinygrad's `sym` (its codegen's index simplifier).
Every set of 10,000 is new (a re-run over the same expressions finds cached bounds and runs about twice as fast);
the rate is over the first pass. "nodes" is the mean size of a simplified expression (smaller is simpler).
"""
from __future__ import annotations
import argparse, gc, math, os, random, statistics, sys, time
from types import SimpleNamespace
from isolated import report, run_isolated  # bench/isolated.py, beside this script

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- the models, written once against either Tensor API ----

def mlp(layers: int):
  def model(param):
    x = param((256, 1024))
    for _ in range(layers): x = (x @ param((1024, 1024)) + param((1024,))).relu()
    return x
  return model


def chain_of_kernels(param, n=1000):
  """n kernels in a row, each reading the one before: the scheduler's cost per kernel, free of codegen (all n are one
  kernel over other buffers, rendered once)."""
  x = param((16, 16))
  for _ in range(n): x = (x * 2 + 1).contiguous()
  return x


def transformer_block(param, seq=128, d=512, heads=8):
  x, dh = param((seq, d)), d // heads
  def norm(h): return h.layernorm(-1) * param((d,)) + param((d,))
  def dense(h, n_in, n_out): return h @ param((n_in, n_out)) + param((n_out,))
  def split_heads(h): return h.reshape(seq, heads, dh).permute(1, 0, 2)   # (heads, seq, dh)
  h = norm(x)
  q, k, v = (split_heads(dense(h, d, d)) for _ in range(3))
  att = (q @ k.transpose(-1, -2) / math.sqrt(dh)).softmax(-1) @ v
  x = x + dense(att.permute(1, 0, 2).reshape(seq, d), d, d)
  return x + dense(dense(norm(x), d, 4 * d).gelu(), 4 * d, d)


MODELS = {"sched_mlp": mlp(8), "sched_tfm": transformer_block, "sched_mlp64": mlp(64), "sched_1000": chain_of_kernels}
SLOW_ROWS = {"sched_mlp64": 3, "sched_1000": 3}  # at most this many repeats: one schedule takes seconds in a peer


# ---- each compiler's front end: parameters, and schedule + codegen without compiling ----

def graft_compiler() -> SimpleNamespace:
  import numpy as np
  from tensor import Tensor
  from rewrite import Ops
  from rules.pipeline import schedule, lower_kernel, Run
  from rules.realize import normalize
  from runtime.device import get_device

  def codegen(out) -> dict:
    kernels, _ = schedule([out.uop], [out.device], Run(out.device))
    sources: dict = {}
    for k in kernels:
      if k.op is Ops.COPY: continue
      norm, _ = normalize(k)
      if (norm, k.arg) in sources: continue  # the same kernel over other buffers: realize compiles it once
      renderer = get_device(k.arg).renderer
      device_loops = getattr(renderer, "device_loops", False)
      linear = lower_kernel(norm, Run(k.arg, parallel=not device_loops, device_loops=device_loops))
      sources[(norm, k.arg)] = renderer.render(f"kernel{len(sources)}", linear)
    return {"kernels": len(kernels), "rendered": len(sources), "chars": sum(map(len, sources.values()))}

  return SimpleNamespace(name="graft", param=lambda shape: Tensor(np.zeros(shape, np.float32), device="CPU"),
                         codegen=codegen)


def tinygrad_compiler() -> SimpleNamespace | None:
  try:
    import tinygrad
    from tinygrad import Tensor
    from tinygrad.codegen import full_rewrite_to_sink, pm_to_program, do_compile
    from tinygrad.renderer.cstyle import ClangRenderer
    from tinygrad.helpers import Target
    from tinygrad.uop.ops import Ops, UOp, PatternMatcher, ProgramInfo, graph_rewrite
  except ImportError: return None
  renderer = ClangRenderer(Target("CPU", "CLANG", "x86_64,native"))
  # tinygrad's own to_program, up to the source text: every step of its pm_to_program but the compile
  render_only = PatternMatcher([p for p in pm_to_program.patterns if p[1] is not do_compile])

  def render(ast) -> str:
    sink = full_rewrite_to_sink(ast, renderer, optimize=ast.tag is None)
    prg = UOp(Ops.PROGRAM, src=(sink,), arg=ProgramInfo.from_sink(sink, renderer.target))
    prg = graph_rewrite(prg, render_only, ctx=renderer, name="render")
    return next(s.arg for s in prg.src if s.op is Ops.SOURCE)

  def codegen(out) -> dict:
    calls = out.schedule_linear().src
    asts = dict.fromkeys(c.src[0] for c in calls if c.src[0].op is Ops.SINK)  # hash-consed: equal kernels are one
    sources = [render(a) for a in asts]
    return {"kernels": len(calls), "rendered": len(sources), "chars": sum(map(len, sources))}

  return SimpleNamespace(name=f"tinygrad {tinygrad.__version__}" if hasattr(tinygrad, "__version__") else "tinygrad",
                         param=lambda shape: Tensor.empty(*shape), codegen=codegen)


COMPILERS = {"graft": graft_compiler, "tinygrad": tinygrad_compiler}


# ---- sym: index expressions of view chains ----

def view_chain_expression(rng: random.Random):
  """SINK(index, validity) of one random permute + pad + reshape chain of a 6-D shape, over loop indices."""
  from rewrite import UOp, Ops, dtypes
  from rules.strided_view import View, to_index_chain
  shape = tuple(rng.randint(2, 5) for _ in range(6))
  order = list(range(6))
  rng.shuffle(order)
  inner = View.contiguous(shape).permute(tuple(order)).pad(tuple((rng.randint(0, 2), rng.randint(0, 2)) for _ in range(6)))
  dims = list(inner.shape)
  j = rng.randrange(5)
  dims[j:j + 2] = [dims[j] * dims[j + 1]]
  k = rng.randrange(len(dims))
  if (f := next((f for f in (2, 3, 5, 7) if dims[k] % f == 0 and dims[k] > f), None)): dims[k:k + 1] = [f, dims[k] // f]
  outer = View.contiguous(inner.shape).reshape(tuple(dims))
  idxs = [UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, s),), ("sym", d)) if s > 1 else UOp.const(dtypes.index, 0)
          for d, s in enumerate(dims)]
  flat, valid = to_index_chain([inner, outer], idxs)
  return UOp(Ops.SINK, dtypes.void, (flat,) if valid is None else (flat, valid))


def expression_set(seed: int, count: int) -> list:
  rng, out = random.Random(seed), {}
  while len(out) < count: out[view_chain_expression(rng)] = None  # hash-consed: equal expressions are one UOp
  return list(out)


def to_tinygrad(root):
  """The same expression as tinygrad UOps (index ints are its weakint; loops are its ranges)."""
  from rewrite import Ops, dtypes
  from tinygrad.uop.ops import UOp as TU, Ops as TO
  from tinygrad.dtype import dtypes as tdt
  names = {Ops.IDIV: TO.FLOORDIV, Ops.MOD: TO.FLOORMOD}
  def dt(u): return tdt.void if u.op is Ops.SINK else tdt.bool if u.dtype is dtypes.bool else tdt.weakint
  memo = {}
  for u in root.toposort:
    if u.op is Ops.CONST: memo[u] = TU.const(u.arg, dt(u))
    elif u.op is Ops.RANGE: memo[u] = TU.range(u.src[0].arg, u.arg[1])
    else: memo[u] = TU(names[u.op] if u.op in names else TO[u.op.name], dt(u), tuple(memo[s] for s in u.src))
  return memo[root]


def simplifier(name: str):
  """(prepare an expression, simplify it, count its nodes) for one compiler."""
  if name == "graft":
    from rewrite import graph_rewrite
    from rules.symbolic import symbolic_rules
    return (lambda e: e), (lambda e: graph_rewrite(e, symbolic_rules)), (lambda e: len(e.toposort))
  from tinygrad.uop.ops import graph_rewrite
  from tinygrad.uop.symbolic import sym
  return to_tinygrad, (lambda e: graph_rewrite(e, sym)), (lambda e: len(e.toposort()))


# ---- one (row, compiler) pair, in a fresh process ----

def worker(row: str, name: str, repeats: int, count: int) -> dict:
  if row in MODELS:
    c = COMPILERS[name]()
    times, info = [], {}
    for _ in range(repeats + 1):
      out = MODELS[row](c.param)  # parameters and graph built outside the timing, fresh every repeat
      gc.collect()
      t0 = time.perf_counter()
      info = c.codegen(out)
      times.append(time.perf_counter() - t0)
      del out
    return {"first": times[0] * 1e3, "median": statistics.median(times[1:]) * 1e3 if repeats else None, **info}
  prepare, simplify, nodes = simplifier(name)
  rates, sizes = [], []
  for s in range(repeats):
    exprs = [prepare(e) for e in expression_set(s, count)]
    gc.collect()
    t0 = time.perf_counter()
    outs = [simplify(e) for e in exprs]
    rates.append(len(exprs) / (time.perf_counter() - t0))
    sizes.append(statistics.mean(nodes(o) for o in outs))
    sizes_in = statistics.mean(nodes(e) for e in exprs)
    del exprs, outs
  return {"first": rates[0], "median": statistics.median(rates), "sets": repeats, "nodes": statistics.mean(sizes),
          "nodes_in": sizes_in}


# the columns: a compiler, and the environment of its worker process
VARIANTS = {
  "graft": ("graft", {}),
  "tinygrad": ("tinygrad", {}),
  # tinygrad without its kernel optimizations (upcasts, unrolls, which also make its sources larger): closer to
  # what Graft's opt stage does today; it changes nothing in sym
  "tinygrad NOOPT": ("tinygrad", {"NOOPT": "1"}),
}


def measure(row: str, variant: str, repeats: int, count: int, timeout: float) -> tuple[dict | None, str | None]:
  name, extra = VARIANTS[variant]
  env = {**os.environ, "DEV": "NULL", "SCACHE": "0", "DEBUG": "0", **extra}
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", row, name, "--repeats", str(repeats), "--count", str(count)]
  return run_isolated(cmd, env, timeout)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default="", help="comma-separated rows: sched_mlp, sched_tfm, sched_mlp64, sched_1000, sym")
  ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 300 expressions")
  ap.add_argument("--repeats", type=int, default=None, help="repeats after the first (sched rows; default 10)")
  ap.add_argument("--sets", type=int, default=None, help="expression sets for sym (default 3; tinygrad 1)")
  ap.add_argument("--count", type=int, default=None, help="expressions per sym set (default 10,000)")
  ap.add_argument("--no-tinygrad", action="store_true")
  ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed to one (row, compiler) process")
  ap.add_argument("--worker", nargs=2, metavar=("ROW", "COMPILER"), help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  count = args.count or (300 if args.quick else 10_000)
  if args.worker:
    row, name = args.worker
    return report(lambda: worker(row, name, args.repeats, count))

  rows = [s.strip() for s in args.only.split(",") if s.strip()] or ["sched_mlp", "sched_tfm", "sched_mlp64", "sched_1000", "sym"]
  if (bad := [r for r in rows if r not in (*MODELS, "sym")]): ap.error(f"--only: no row {', '.join(bad)}")
  variants = ["graft"]
  if not args.no_tinygrad:
    try:
      import tinygrad  # noqa: F401  (only asking whether it is there; the workers import it)
      variants += ["tinygrad", "tinygrad NOOPT"]
    except ImportError: print("tinygrad is not importable: Graft alone", file=sys.stderr)
  peers = variants[1:]
  repeats = args.repeats if args.repeats is not None else 1 if args.quick else 10
  # tinygrad simplifies some 30 expressions/s here: one set of 10,000 takes minutes already
  sets = args.sets or (1 if args.quick else 3)

  from tabulate import tabulate
  table, notes, results = [], [], {}
  for row in rows:
    res: dict[str, dict | None] = {}
    for v in variants:
      if row == "sym" and v == "tinygrad NOOPT": res[v] = None; continue
      t0 = time.perf_counter()
      n = min(repeats, SLOW_ROWS.get(row, repeats)) if row in MODELS else sets if v == "graft" else min(sets, 1)
      res[v], err = measure(row, v, n, count, args.timeout)
      print(f"  {row:<10s} {v:<15s} {time.perf_counter() - t0:7.1f} s{'  ' + err if err else ''}", file=sys.stderr)
      if err: notes.append(f"{row}, {v}: {err}")
    g = res["graft"]
    if row in MODELS:
      unit = "ms"
      def cells(r): return ["-", "-"] if r is None else [f"{r['first']:.1f}", f"{r['median']:.1f}" if r["median"] else "-"]
      # speed ratio: the peer's time over Graft's
      ratios = [f"{res[p]['median'] / g['median']:.3g}x" if g and res[p] and g["median"] and res[p]["median"] else "-"
                for p in peers]
      detail = "; ".join(f"{v}: {r['kernels']} kernels, {r['rendered']} rendered, {r['chars']:,} chars"
                         for v, r in res.items() if r)
    else:
      unit = "expressions/s"
      def cells(r): return ["-", "-"] if r is None else [f"{r['first']:,.0f}", f"{r['median']:,.0f}"]
      ratios = [f"{g['median'] / res[p]['median']:.3g}x" if g and res[p] else "-" for p in peers]
      done = {v: r for v, r in res.items() if r}
      detail = f"{count:,} per set; mean nodes {next(iter(done.values()))['nodes_in']:.1f} in -> " + \
        ", ".join(f"{v} {r['nodes']:.1f} ({r['sets']} set{'s' if r['sets'] > 1 else ''})" for v, r in done.items()) \
        if done else ""
    table.append([row, unit] + [c for v in variants for c in cells(res[v])] + ratios + [detail])
    results[row] = res
  headers = ["id", "unit"] + [f"{v} {w}" for v in variants for w in ("first", "median")] + [f"graft/{p}" for p in peers]
  print(tabulate(table, headers=headers + ["detail"], tablefmt="github", disable_numparse=True))
  print(f"sched rows: the first schedule + codegen in a fresh process, then the median of {repeats} more; sym: the rate "
        f"of the first set and the median over sets; graft/x: the speed ratio (above 1: Graft faster)")
  if "sched_mlp" in results and "sched_mlp64" in results:  # linear scaling: 8x the layers should cost about 8x
    scale = [f"{v} {r64['median'] / r8['median']:.2f}x" for v in variants
             if (r8 := results["sched_mlp"][v]) and (r64 := results["sched_mlp64"][v]) and r8["median"] and r64["median"]]
    print(f"sched_mlp64 / sched_mlp (median over median): {', '.join(scale)}")
  for n in notes: print(f"  ! {n}")
  sys.stdout.flush()


if __name__ == "__main__":
  main()
