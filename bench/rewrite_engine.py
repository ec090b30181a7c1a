"""Speed of the rewrite engine: dispatch, rewriting, and building UOps; side by side with tinygrad where importable.

  python bench/rewrite_engine.py            # full run (about a minute with tinygrad)
  python bench/rewrite_engine.py --quick    # smoke run of a few seconds, smaller sizes
  python bench/rewrite_engine.py --rows build   # some rows only (dispatch, rewrite, build)

Rows:
  (a) dispatch: a 100,000-node integer graph and a matcher of 50 rules of which a handful can match; the matcher
      is called on every node (raw), then the whole graph goes through graph_rewrite.
  (b) rewrite: constant folding and algebraic simplification of 10,000 random integer expressions of depth 8,
      one graph_rewrite per expression, with the small rule set defined below.
  (c) build: 1,000,000 new UOps (half constants, half additions of two of them), and dropping them: each engine
      pays for taking its dead nodes out of its table.
  Floors (Graft's nodes and Python's machinery, no engine): the least any engine of this design can cost on rows
  (a) and (c), measured in the same run, so that a target above a floor's ratio is known to be out of reach of
  Python code (docs/design.md, "The rewrite engine"):
  (a) floor: per node, its op, one table lookup and one call of a function that only reads its sources' ops
      (the least a matcher of this design, a table of per-op functions, does);
  (c) floor: a weakly hash-consed node at its cheapest: the key tuple, one lookup, a slotted object, its weak
      reference and one insert; no __del__ (the table is cleared in one go after each build).

Both engines get the same graphs (each built with that engine's own UOp from one seeded description) and the same
rules (written once below against a small adapter that names each engine's UOp, UPat and ops). Every figure is
the median of several repeats of CPU time of this process (another process's load on a shared machine does not
count), the engines taking turns; the ratio is Graft's rate over tinygrad's. Graft's graph_rewrite pauses Python's
cyclic garbage collector while it runs (see rewrite/graph_rewrite.py); tinygrad's does not.
"""
from __future__ import annotations
import argparse, gc, os, platform, random, statistics, sys, time, weakref
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ops the bench uses, by Graft's name; tinygrad names C-style division and remainder CDIV and CMOD
OP_NAMES = ("CONST", "SINK", "ADD", "MUL", "MAX", "IDIV", "MOD", "CMPLT", "CMPNE", "WHERE", "NEG", "AND", "OR", "XOR",
            "SHL", "SHR", "CAST")
TINYGRAD_NAMES = {"IDIV": "CDIV", "MOD": "CMOD"}


def graft_engine() -> SimpleNamespace:
  from rewrite import UOp, UPat, PatternMatcher, graph_rewrite, Ops, dtypes
  return SimpleNamespace(name="graft", UOp=UOp, UPat=UPat, PatternMatcher=PatternMatcher, int=dtypes.int32, void=dtypes.void,
                         ops=SimpleNamespace(**{n: Ops[n] for n in OP_NAMES}, VAR=Ops.DEFINE_VAR),
                         graph_rewrite=lambda root, pm: graph_rewrite(root, pm))


def tinygrad_engine() -> SimpleNamespace | None:
  try:
    import tinygrad
    from tinygrad.uop.ops import UOp, UPat, PatternMatcher, graph_rewrite, Ops
    from tinygrad.dtype import dtypes
  except ImportError: return None
  var = Ops.DEFINE_VAR if "DEFINE_VAR" in Ops.__members__ else Ops.PARAM  # 0.14 has no DEFINE_VAR; PARAM is a leaf too
  # tinygrad's default graph_rewrite rewrites sources before their users, as Graft's default does
  try:
    from importlib.metadata import version
    name = f"tinygrad {version('tinygrad')}"
  except Exception: name = "tinygrad"
  return SimpleNamespace(name=name, UOp=UOp, UPat=UPat,
                         PatternMatcher=PatternMatcher, int=dtypes.int32, void=dtypes.void,
                         ops=SimpleNamespace(**{n: Ops[TINYGRAD_NAMES.get(n, n)] for n in OP_NAMES}, VAR=var),
                         graph_rewrite=lambda root, pm: graph_rewrite(root, pm))


# ---- rules, written once for either engine ----

def _cdiv(a: int, b: int) -> int: return -(-a // b) if (a < 0) != (b < 0) and a % b else a // b  # C truncation
def _cmod(a: int, b: int) -> int: return a - b * _cdiv(a, b)


def simplify_rules(E) -> list:
  """Constant folding and algebraic identities over integers: the rule set of row (b); it terminates.

  tinygrad rebuilds each rule function from its code and globals, so the functions close over nothing: new
  constants come from `.replace` of a captured one, and an engine's op travels as a default argument.
  """
  P, O = E.UPat, E.ops
  def cst(name): return P(O.CONST, name=name)
  x = P(name="x")
  folds = [(O.ADD, lambda a, b: a + b), (O.MUL, lambda a, b: a * b), (O.MAX, max),
           (O.IDIV, lambda a, b: _cdiv(a, b) if b else None), (O.MOD, lambda a, b: _cmod(a, b) if b else None)]
  rules = []
  for op, f in folds:
    def fold(r, a, b, f=f):
      v = f(a.arg, b.arg)
      return None if v is None else a.replace(arg=v)
    rules.append((P(op, src=(cst("a"), cst("b")), name="r"), fold))
  rules += [
    (P(O.ADD, src=[x, P(O.CONST, arg=0)]), lambda x: x),
    (P(O.MUL, src=[x, P(O.CONST, arg=1)]), lambda x: x),
    (P(O.MUL, src=[x, P(O.CONST, arg=0, name="z")]), lambda x, z: z),
    (P(O.IDIV, src=(x, P(O.CONST, arg=1))), lambda x: x),
    (P(O.MOD, src=(x, P(O.CONST, arg=1, name="c"))), lambda x, c: c.replace(arg=0)),
    (P(O.MAX, src=(x, x)), lambda x: x),
    (P(O.ADD, src=(x, x), name="r"), lambda r, x, MUL=O.MUL, CONST=O.CONST:
     r.replace(op=MUL, src=(x, r.replace(op=CONST, src=(), arg=2)))),
    # re-associate constants so that they meet and fold
    (P(O.ADD, src=[P(O.ADD, src=[x, cst("c1")]), cst("c2")], name="r"),
     lambda r, x, c1, c2: r.replace(src=(x, c2.replace(arg=c1.arg + c2.arg)))),
    (P(O.MUL, src=[P(O.MUL, src=[x, cst("c1")]), cst("c2")], name="r"),
     lambda r, x, c1, c2: r.replace(src=(x, c2.replace(arg=c1.arg * c2.arg)))),
    (P(O.IDIV, src=(P(O.IDIV, src=(x, cst("c1"))), cst("c2")), name="r"),
     lambda r, x, c1, c2: r.replace(src=(x, c2.replace(arg=c1.arg * c2.arg))) if c1.arg > 0 and c2.arg > 0 else None),
    (P(O.IDIV, src=(P(O.MUL, src=[x, cst("c")]), cst("c2"))),
     lambda x, c, c2: x if c.arg == c2.arg and c.arg > 0 else None),
  ]
  return rules


def dispatch_rules(E) -> list:
  """50 rules over the ops of graph (a); five of them can match, the other 45 fail at various depths."""
  P, O = E.UPat, E.ops
  x, y = P(name="x"), P(name="y")
  # every function takes every name its pattern binds (tinygrad passes them all)
  matching = [
    (P(O.ADD, src=[x, P(O.CONST, arg=0)]), lambda x: x),
    (P(O.MUL, src=[x, P(O.CONST, arg=1)]), lambda x: x),
    (P(O.MUL, src=[x, P(O.CONST, arg=0, name="z")]), lambda x, z: z),
    (P(O.IDIV, src=(x, P(O.CONST, arg=1))), lambda x: x),
    (P(O.MAX, src=(x, x)), lambda x: x),
  ]
  alu = [O.ADD, O.MUL, O.MAX, O.IDIV, O.MOD]
  never = []
  for k in range(45):
    op, inner, c = alu[k % 5], alu[(k // 5) % 5], 1000 + k
    shape = k % 3
    if shape == 0:    # fails on a constant's value
      pat = P(op, src=[x, P(O.CONST, arg=c)])
    elif shape == 1:  # fails one level down, after matching an inner op
      pat = P(op, src=(P(inner, src=(x, P(O.CONST, arg=c))), y))
    else:             # fails on an op the graph never has under this one
      pat = P(op, src=[P(O.WHERE, src=(P(name="g"), x, y)), P(name="z")])
    never.append((pat, lambda **kw: None))
  # the matching rules sit among the others, as real rule sets interleave them
  return never[:20] + matching[:3] + never[20:] + matching[3:]


# ---- graphs, described once (seeded) and built by each engine ----

def dag_description(n_nodes: int, seed: int = 1) -> list[tuple]:
  """A DAG of integer ALU nodes over 8 variables and small constants, as (op, src indices, arg) in build order."""
  rng = random.Random(seed)
  desc: list[tuple] = [("VAR", (), (f"v{i}", -100, 100)) for i in range(8)]
  consts = {}
  for c in range(-2, 8): consts[c] = len(desc); desc.append(("CONST", (), c))
  seen = set()
  ops = ["ADD", "ADD", "MUL", "MUL", "MAX", "IDIV", "MOD"]
  while len(desc) < n_nodes - 1:
    op, n = rng.choice(ops), len(desc)
    a = rng.randrange(max(0, n - 64), n)
    if op in ("IDIV", "MOD"): b = consts[rng.randrange(1, 8)]
    elif rng.random() < 0.3: b = consts[rng.randrange(-2, 8)]
    else: b = rng.randrange(0, n)
    if op == "MAX" and rng.random() < 0.05: b = a
    if (key := (op, a, b)) in seen: continue
    seen.add(key); desc.append((op, (a, b), None))
  used = {s for _, src, _ in desc for s in src}
  desc.append(("SINK", tuple(i for i in range(len(desc)) if i not in used), None))
  return desc


def expr_description(rng: random.Random, depth: int) -> tuple:
  """A random integer expression tree of at most `depth` levels, as nested tuples."""
  if depth == 0 or (depth < 8 and rng.random() < 0.15):
    return ("VAR", (), (rng.choice("abcd"), -50, 50)) if rng.random() < 0.5 else ("CONST", (), rng.randrange(-3, 6))
  op = rng.choice(["ADD", "ADD", "MUL", "MUL", "MAX", "IDIV", "MOD"])
  if op in ("IDIV", "MOD"): return (op, (expr_description(rng, depth - 1), ("CONST", (), rng.randrange(1, 5))), None)
  return (op, (expr_description(rng, depth - 1), expr_description(rng, depth - 1)), None)


def build_dag(E, desc: list[tuple]):
  U, O, dt = E.UOp, E.ops, E.int
  nodes = []
  for op, src, arg in desc: nodes.append(U(getattr(O, op), dt if op != "SINK" else E.void, tuple(nodes[i] for i in src), arg))
  return nodes[-1]


def build_expr(E, d: tuple):
  U, O, dt = E.UOp, E.ops, E.int
  out: dict[int, object] = {}
  stack = [(d, False)]
  while stack:  # iterative, so that the description's depth is no concern
    node, ready = stack.pop()
    if id(node) in out: continue
    if ready or not node[1]:
      out[id(node)] = U(getattr(O, node[0]), dt, tuple(out[id(s)] for s in node[1]), node[2]); continue
    stack.append((node, True))
    stack.extend((s, False) for s in node[1])
  return out[id(d)]


def shape_of(u) -> tuple:
  """An engine-neutral form of a graph (op names mapped back to Graft's), to check both engines agree."""
  back = {v: k for k, v in TINYGRAD_NAMES.items()}
  memo: dict[int, tuple] = {}
  for n in u.toposort() if callable(u.toposort) else u.toposort:
    arg = n.arg if n.op.name not in ("DEFINE_VAR", "PARAM") else n.arg[0]
    memo[id(n)] = (back.get(n.op.name, n.op.name).replace("PARAM", "VAR").replace("DEFINE_VAR", "VAR"), arg,
                   tuple(memo[id(s)] for s in n.src))
  return memo[id(u)]


def topo_list(u) -> list: return list(u.toposort() if callable(u.toposort) else u.toposort)


# ---- measurement ----

_clock = time.process_time  # CPU time of this process: another process's load on a shared machine does not count


def timed_alternately(fns: list, repeats: int) -> list[float]:
  """Median seconds of each function; repeats alternate between them, so that a change in machine load hits all."""
  times: list[list[float]] = [[] for _ in fns]
  for _ in range(repeats):
    for fn, ts in zip(fns, times):
      gc.collect()
      t0 = _clock(); fn(); ts.append(_clock() - t0)
  return [statistics.median(ts) for ts in times]


_COUNTED = [0]
def _counting(fn):
  # no closure (tinygrad refuses them): the wrapped function travels as a default argument
  def counted(__fn=fn, **kw):
    r = __fn(**kw)
    if r is not None: _COUNTED[0] += 1
    return r
  return counted


ROWS = {"dispatch", "rewrite", "build"}


def run(engines: list, sizes: SimpleNamespace, repeats: int, rows: set[str]) -> list[dict]:
  res: list[dict] = [{} for _ in engines]
  if "dispatch" in rows: _dispatch(engines, sizes, repeats, res)
  if "rewrite" in rows: _rewrite(engines, sizes, repeats, res)
  if "build" in rows: _build(engines, sizes, repeats, res)
  return res


def _dispatch(engines: list, sizes: SimpleNamespace, repeats: int, res: list[dict]):
  dag = dag_description(sizes.dag)
  roots = [build_dag(E, dag) for E in engines]
  nodes = [topo_list(r) for r in roots]
  pms = [E.PatternMatcher(dispatch_rules(E)) for E in engines]
  def raw(nodes, rewrite):
    for _ in range(sizes.passes):  # a few passes, so that each timing is long enough to be steady
      for n in nodes: rewrite(n)
  raws = [lambda ns=ns, pm=pm: raw(ns, pm.rewrite) for ns, pm in zip(nodes, pms)]
  grs = [lambda E=E, root=root, pm=pm: E.graph_rewrite(root, pm) for E, root, pm in zip(engines, roots, pms)]
  floor = lambda: dispatch_floor(nodes[0], sizes.passes)
  for f in raws + grs + [floor]: f()  # warm up: compile on first use, caches
  t_raws = timed_alternately(raws + [floor], repeats)
  for r, ns, t_raw, t_gr in zip(res, nodes, t_raws, timed_alternately(grs, repeats)):
    r["raw"], r["gr"], r["dag_nodes"] = sizes.passes * len(ns) / t_raw, len(ns) / t_gr, len(ns)
  res[0]["raw_floor"] = sizes.passes * len(nodes[0]) / t_raws[-1]


def _read_source_ops(u):
  for s in u.src: s.op


def dispatch_floor(nodes: list, passes: int):
  """Row (a)'s floor: what every matcher does at least per node (its op, one lookup, one call, its sources' ops)."""
  get = dict.fromkeys({n.op for n in nodes}, _read_source_ops).get
  for _ in range(passes):
    for n in nodes:
      if (f := get(n.op)) is not None: f(n)


def _rewrite(engines: list, sizes: SimpleNamespace, repeats: int, res: list[dict]):
  rng = random.Random(2)
  descs = [expr_description(rng, 8) for _ in range(sizes.exprs)]
  exprs = [[build_expr(E, d) for d in descs] for E in engines]
  spms = [E.PatternMatcher(simplify_rules(E)) for E in engines]
  for r, E, es in zip(res, engines, exprs):
    _COUNTED[0] = 0
    cpm = E.PatternMatcher([(p, _counting(f)) for p, f in simplify_rules(E)])
    outs = [E.graph_rewrite(e, cpm) for e in es]  # one counting pass (untimed) for the number of rewrites
    r["rewrites"] = _COUNTED[0]
    r["shapes"] = [shape_of(o) for o in outs[:200]]
    r["nodes_in"] = sum(len(topo_list(e)) for e in es)
    r["nodes_out"] = sum(len(topo_list(o)) for o in outs)
  fns = [lambda E=E, es=es, pm=pm: [E.graph_rewrite(e, pm) for e in es] for E, es, pm in zip(engines, exprs, spms)]
  for r, t in zip(res, timed_alternately(fns, repeats)): r["rw/s"], r["expr/s"] = r["rewrites"] / t, sizes.exprs / t


def _build(engines: list, sizes: SimpleNamespace, repeats: int, res: list[dict]):
  half = sizes.build // 2
  def build(E, base=[0]):
    U, O, dt = E.UOp, E.ops, E.int
    base[0] += half  # new constants each time, so that every UOp is new
    keep, prev = [], U(O.CONST, dt, (), -1)
    for i in range(base[0], base[0] + half):
      c = U(O.CONST, dt, (), i)
      keep.append(U(O.ADD, dt, (c, prev)))
      prev = c
    return keep
  floor = SimpleNamespace(UOp=_FloorNode.make, ops=engines[0].ops, int=engines[0].int)
  def build_floor():
    build(floor)            # its nodes die here, as the engines' do when build returns...
    _FloorNode.table.clear()  # ...but their entries (whose keys hold half of them) go at once, in one clear
  times = timed_alternately([lambda E=E: build(E) for E in engines] + [build_floor], repeats)
  for r, t in zip(res, times): r["build"] = 2 * half / t
  res[0]["build_floor"] = 2 * half / times[-1]


class _FloorNode:
  """Row (c)'s floor: a weakly hash-consed node at its cheapest. No node takes itself out of its table when it dies
  (no __del__); the table is cleared at once after each build, which a real engine cannot do (its table outlives
  every build): the floor is below any engine of this design."""
  __slots__ = ("op", "dtype", "src", "arg", "key", "__weakref__")
  table: dict = {}

  @staticmethod
  def make(op, dtype, src=(), arg=None):
    key = (op, dtype, src, arg)
    if (ref := _FloorNode.table.get(key)) is not None and (u := ref()) is not None: return u
    u = _FloorNode()
    u.op, u.dtype, u.src, u.arg, u.key = op, dtype, src, arg, key
    _FloorNode.table[key] = weakref.ref(u)
    return u


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, one repeat")
  ap.add_argument("--repeats", type=int, default=None)
  ap.add_argument("--no-tinygrad", action="store_true", help="measure Graft alone")
  ap.add_argument("--rows", default="dispatch,rewrite,build", help="which rows to run (comma-separated; default all)")
  args = ap.parse_args(argv)
  rows_wanted = set(args.rows.split(","))
  if rows_wanted - ROWS: ap.error(f"--rows: unknown {sorted(rows_wanted - ROWS)}; rows are {sorted(ROWS)}")
  sizes = SimpleNamespace(dag=5_000, exprs=300, build=50_000, passes=1) if args.quick else \
    SimpleNamespace(dag=100_000, exprs=10_000, build=1_000_000, passes=4)
  repeats = args.repeats or (1 if args.quick else 5)
  engines = [graft_engine()] + ([] if args.no_tinygrad else [e for e in [tinygrad_engine()] if e is not None])
  results = run(engines, sizes, repeats, rows_wanted)

  from tabulate import tabulate
  g = results[0]
  t = results[1] if len(results) > 1 else None
  rows = [
    (f"(a) dispatch, matcher on every node ({g.get('dag_nodes', 0):,} nodes, 50 rules)", "nodes/s", "raw"),
    ("(a) dispatch, graph_rewrite of the whole graph", "nodes/s", "gr"),
    (f"(b) rewrite, {sizes.exprs:,} expressions of depth 8 ({g.get('rewrites', 0):,} rewrites)", "rewrites/s", "rw/s"),
    ("(b) rewrite", "expressions/s", "expr/s"),
    (f"(c) build {sizes.build:,} UOps", "UOps/s", "build"),
    ("(a) floor: op, lookup, call, sources' ops (no engine)", "nodes/s", "raw_floor"),
    ("(c) floor: cheapest weakly hash-consed node (no engine)", "UOps/s", "build_floor"),
  ]
  rows = [r for r in rows if r[2] in g]
  headers = ["measure", "unit", "graft"] + ([engines[1].name, "graft / tinygrad"] if t else [])
  table = []
  for label, unit, key in rows:
    row = [label, unit, f"{g[key]:,.0f}"]
    if t: row += [f"{t[key.removesuffix('_floor')]:,.0f}", f"{g[key] / t[key.removesuffix('_floor')]:.2f}x"]
    table.append(row)
  print(tabulate(table, headers=headers, tablefmt="github"))
  notes = [f"Python {platform.python_version()}, medians of {repeats} repeats"]
  if "nodes_in" in g: notes.append(f"(b) {g['nodes_in']:,} nodes in, {g['nodes_out']:,} out")
  if t and "shapes" in g:
    agree = sum(a == b for a, b in zip(g["shapes"], t["shapes"]))
    notes.append(f"results of (b) identical in both engines for {agree} of {len(g['shapes'])} expressions checked")
    if t["rewrites"] != g["rewrites"]: notes.append(f"tinygrad made {t['rewrites']:,} rewrites")
  print("; ".join(notes))


if __name__ == "__main__":
  main()
