"""Properties of the engine over random graphs (hypothesis): hash-consing is structural equality, and graph_rewrite
reaches a fixed point that keeps the value of the expression."""
from hypothesis import given, settings, strategies as st
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, graph_rewrite

i32 = dtypes.int32
VARS = {"a": (-4, 4), "b": (0, 7), "c": (-9, 2)}
BINARY = [Ops.ADD, Ops.MUL, Ops.MAX, Ops.IDIV, Ops.MOD]

# A tree description: ("const", v) | ("var", name) | (op, left, right); IDIV/MOD divide by a positive constant.
leaves = st.one_of(st.tuples(st.just("const"), st.integers(-3, 5)), st.tuples(st.just("var"), st.sampled_from(sorted(VARS))))
trees = st.recursive(leaves, lambda kids: st.one_of(
  st.tuples(st.sampled_from([Ops.ADD, Ops.MUL, Ops.MAX]), kids, kids),
  st.tuples(st.sampled_from([Ops.IDIV, Ops.MOD]), kids, st.tuples(st.just("const"), st.integers(1, 4)))), max_leaves=24)


def build(t) -> UOp:
  if t[0] == "const": return UOp.const(i32, t[1])
  if t[0] == "var": return UOp.variable(t[1], *VARS[t[1]], dtype=i32)
  return UOp(t[0], i32, (build(t[1]), build(t[2])))


def tweak(t):
  """The same tree with its first leaf changed: looks alike, is not equal."""
  if t[0] == "const": return ("const", t[1] + 1)
  if t[0] == "var": return ("var", "a" if t[1] != "a" else "b")
  return (t[0], tweak(t[1]), t[2])


def cdiv(a: int, b: int) -> int: return abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)  # C truncation
def cmod(a: int, b: int) -> int: return a - b * cdiv(a, b)


def evaluate(u: UOp, env: dict) -> int:
  """The value of an integer expression, with C division; iterative, like the engine."""
  val: dict = {}
  for n in u.toposort:
    if n.op is Ops.CONST: val[n] = n.arg
    elif n.op is Ops.DEFINE_VAR: val[n] = env[n.arg[0]]
    else:
      a, b = (val[s] for s in n.src)
      val[n] = {Ops.ADD: lambda: a + b, Ops.MUL: lambda: a * b, Ops.MAX: lambda: max(a, b),
                Ops.IDIV: lambda: cdiv(a, b), Ops.MOD: lambda: cmod(a, b)}[n.op]()
  return val[u]


def fold(e, a, b):
  if e.op in (Ops.IDIV, Ops.MOD) and b.arg == 0: return None
  return UOp.const(e.dtype, evaluate(e, {}))


simplify = PatternMatcher([
  (UPat(BINARY, src=(UPat.cvar("a"), UPat.cvar("b")), name="e"), fold),
  (UPat.var("x") + 0, lambda x: x),
  (UPat.var("x") * 1, lambda x: x),
  (UPat.var("x") * 0, lambda x: UOp.const(x.dtype, 0)),
  (UPat.var("x") // 1, lambda x: x),
  (UPat.var("x") % 1, lambda x: UOp.const(x.dtype, 0)),
  (UPat.var("x").maximum(UPat.var("x")), lambda x: x),
  ((UPat.var("x") + UPat.cvar("c1")) + UPat.cvar("c2"), lambda x, c1, c2: x + (c1.arg + c2.arg)),
])


@given(trees)
def test_building_a_tree_twice_gives_the_same_object(t):
  assert build(t) is build(t)


@given(trees)
def test_a_tree_with_one_leaf_changed_is_a_different_object(t):
  u, v = build(t), build(tweak(t))
  assert u is not v
  assert u.toposort.keys() != v.toposort.keys()


@settings(max_examples=200, deadline=None)
@given(trees, st.fixed_dictionaries({k: st.integers(lo, hi) for k, (lo, hi) in VARS.items()}))
def test_graph_rewrite_reaches_a_fixed_point_that_keeps_the_value(t, env):
  u = build(t)
  out = graph_rewrite(u, simplify)
  for n in out.toposort: assert simplify.rewrite(n) is None, f"a rule still matches {n}"
  assert evaluate(out, env) == evaluate(u, env)
  assert out.vmin <= evaluate(out, env) <= out.vmax
  assert graph_rewrite(out, simplify) is out  # rewriting a fixed point changes nothing


@settings(max_examples=100, deadline=None)
@given(trees)
def test_top_down_reaches_a_fixed_point_too(t):
  out = graph_rewrite(build(t), simplify, top_down=True)
  for n in out.toposort: assert simplify.rewrite(n) is None
