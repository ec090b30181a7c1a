"""graph_rewrite: a matcher applied everywhere to a fixed point, in a chosen order, once per node, never forever."""
import functools
import pytest
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, graph_rewrite, RewriteLoopError, RuleError

i32 = dtypes.int32
x, y = UOp.variable("x", 0, 10, i32), UOp.variable("y", 0, 10, i32)

identities = PatternMatcher([
  (UPat.var("a") + 0, lambda a: a),
  (UPat.var("a") * 1, lambda a: a),
  (UPat.var("a") * 0, lambda a: UOp.const(a.dtype, 0)),
])
folding = PatternMatcher([
  (UPat(Ops.ADD, src=(UPat.cvar("a"), UPat.cvar("b"))), lambda a, b: UOp.const(a.dtype, a.arg + b.arg)),
  (UPat(Ops.MUL, src=(UPat.cvar("a"), UPat.cvar("b"))), lambda a, b: UOp.const(a.dtype, a.arg * b.arg)),
], name="folding")


def test_rewrites_everywhere_to_a_fixed_point():
  e = (x * 1 + 0) * (y + (x * 0))
  assert graph_rewrite(e, identities) is x * y
  # a rewrite can enable another one above it: the result is rewritten again
  k = lambda v: UOp.const(i32, v)
  assert graph_rewrite((k(2) + k(3)) * (k(1) + k(1)), folding) is k(10)
  assert graph_rewrite(x + (k(2) * k(0)), identities + folding) is x


def test_a_graph_nothing_matches_comes_back_unchanged():
  e = (x + y) * y
  assert graph_rewrite(e, identities) is e


# Two rules whose outcome depends on the order: `wrap` sees NEG(EXP2(v)) only if `inner` has not yet turned the
# EXP2 into a SQRT. (The ops are placeholders; what matters is which rule sees the node first.)
order_rules = PatternMatcher([
  (UPat(Ops.NEG, src=(UPat(Ops.EXP2, src=(UPat.var("v"),)),)), lambda v: UOp(Ops.LOG2, v.dtype, (v,))),
  (UPat(Ops.EXP2, src=(UPat.var("v"),)), lambda v: UOp(Ops.SQRT, v.dtype, (v,))),
])


def test_bottom_up_rewrites_sources_before_their_users():
  f = UOp.variable("f", 0, 1, dtypes.float32)
  e = UOp(Ops.NEG, dtypes.float32, (UOp(Ops.EXP2, dtypes.float32, (f,)),))
  assert graph_rewrite(e, order_rules) is UOp(Ops.NEG, dtypes.float32, (UOp(Ops.SQRT, dtypes.float32, (f,)),))


def test_top_down_tries_a_node_before_its_sources():
  f = UOp.variable("f", 0, 1, dtypes.float32)
  e = UOp(Ops.NEG, dtypes.float32, (UOp(Ops.EXP2, dtypes.float32, (f,)),))
  assert graph_rewrite(e, order_rules, top_down=True) is UOp(Ops.LOG2, dtypes.float32, (f,))


def test_top_down_descends_into_what_a_node_became():
  expand = PatternMatcher([(UPat(Ops.MUL, src=(UPat.var("a"), UPat.cvar("c", i32))),
                            lambda a, c: (a * (c.arg - 1)) + a if c.arg > 1 else None)]) + identities
  assert graph_rewrite(x * 3, expand, top_down=True) is (x + x) + x
  assert graph_rewrite((x * 3) + 0, expand, top_down=True) is (x + x) + x


def test_each_distinct_node_is_matched_once():
  calls: dict = {}
  def count(m):
    calls[m] = calls.get(m, 0) + 1
  counting = PatternMatcher([(UPat(Ops.MUL, name="m"), count)])
  e = x + 1
  for _ in range(60): e = e * e       # 2**60 paths, 61 distinct nodes
  graph_rewrite(e, counting)
  assert len(calls) == 60 and set(calls.values()) == {1}


def test_a_rebuilt_node_already_seen_is_not_matched_again():
  calls = []
  pm = PatternMatcher([(UPat(Ops.MAX, name="m"), lambda m: calls.append(m))]) + identities
  both = UOp(Ops.SINK, src=(x.maximum(y), (x + 0).maximum(y)))  # the second becomes the first once x+0 is x
  assert graph_rewrite(both, pm) is UOp(Ops.SINK, src=(x.maximum(y), x.maximum(y)))
  assert calls == [x.maximum(y)]


def test_deep_chains_rewrite_without_recursion():
  e = x
  for _ in range(200_000): e = e + 0
  assert graph_rewrite(e, identities) is x
  assert graph_rewrite(e, identities, top_down=True) is x
  f = x
  for i in range(200_000): f = f + (i % 3)  # only the +0 links go
  out = graph_rewrite(f, identities)
  assert len(out.toposort) < len(f.toposort) and out.vmax == f.vmax


def test_ctx_reaches_the_rules():
  rename = PatternMatcher([(UPat(Ops.DEFINE_VAR, name="v"), lambda ctx, v: ctx.get(v))])
  assert graph_rewrite(x * y + x, rename, ctx={x: y}) is y * y + y


# ---- rule sets that never finish, and rules that fail ----

def swap(a, b): return b + a
def grow(a, c): return a + (c.arg + 1)


def test_a_two_cycle_raises_naming_the_rule_and_the_node():
  pm = PatternMatcher([(UPat(Ops.ADD, src=(UPat.var("a"), UPat.var("b"))), swap)])
  with pytest.raises(RewriteLoopError, match=r"does not terminate") as err:
    graph_rewrite(x + y, pm, name="swapping")
  msg = str(err.value)
  assert "swap" in msg and f"test_graph_rewrite.py:{swap.__code__.co_firstlineno}" in msg
  assert "'swapping'" in msg and "Ops.ADD" in msg


def test_an_ever_growing_rewrite_raises_naming_the_rule():
  pm = PatternMatcher([(UPat(Ops.ADD, src=(UPat.var("a"), UPat.cvar("c"))), grow)])
  with pytest.raises(RewriteLoopError) as err: graph_rewrite(x + 1, pm)
  assert f"grow ({__file__}:{grow.__code__.co_firstlineno})" in str(err.value) and "DEFINE_VAR" in str(err.value)


def test_a_loop_through_two_rules_names_both():
  def to_mul(a): return a * 2
  def to_add(a): return a + a
  pm = PatternMatcher([(UPat(Ops.ADD, src=(UPat.var("a"), UPat.var("a"))), to_mul),
                       (UPat(Ops.MUL, src=(UPat.var("a"), UPat.const(i32, 2))), to_add)])
  with pytest.raises(RewriteLoopError) as err: graph_rewrite(x + x, pm)
  assert "to_mul" in str(err.value) and "to_add" in str(err.value)


def grow_around(a): return (a + 0) + 0  # the node it fired on is inside what it returns, ever deeper


@pytest.mark.parametrize("top_down", [False, True])
@pytest.mark.parametrize("graph", [x + 0, (x + 0) * 3], ids=["root", "inner"])
def test_a_rule_that_grows_around_its_node_raises_a_loop_naming_it(graph, top_down):
  pm = PatternMatcher([(UPat.var("a") + 0, grow_around)])
  with pytest.raises(RewriteLoopError) as err: graph_rewrite(graph, pm, name="growing", top_down=top_down)
  msg = str(err.value)
  assert f"grow_around ({__file__}:{grow_around.__code__.co_firstlineno})" in msg and "'growing'" in msg
  assert "returned" in msg and "Ops.ADD" in msg


def return_a_str(a): return "a + 0"
def return_a_list(a): return [a]


@pytest.mark.parametrize("top_down", [False, True])
@pytest.mark.parametrize("rule", [return_a_str, return_a_list])
@pytest.mark.parametrize("pattern, graph", [(UPat.var("a") + 0, x + 0), (UPat.var("a") + 0, (x + 0) * 3),
                                            (UPat(Ops.DEFINE_VAR, name="a"), x * 3)], ids=["root", "inner", "leaf"])
def test_a_rule_returning_something_not_a_uop_is_named(pattern, graph, rule, top_down):
  pm = PatternMatcher([(pattern, rule)])
  with pytest.raises(RuleError) as err: graph_rewrite(graph, pm, name="returning", top_down=top_down)
  msg = str(err.value)
  assert f"rule {rule.__name__} at {__file__}:{rule.__code__.co_firstlineno} returned {rule(x)!r}" in msg
  assert "'returning'" in msg and "while matching UOp(" in msg

def divide(a, c): return UOp.const(a.dtype, a.arg // c.arg)


def test_a_raising_rule_is_reported_with_rule_stage_and_node():
  pm = PatternMatcher([(UPat(Ops.IDIV, src=(UPat.cvar("a"), UPat.cvar("c"))), divide)], name="fold division")
  bad = UOp.const(i32, 7) // 0
  with pytest.raises(RuleError) as err: graph_rewrite(x + bad, pm)
  msg = str(err.value)
  assert f"rule divide at {__file__}:{divide.__code__.co_firstlineno} raised ZeroDivisionError" in msg
  assert "'fold division'" in msg and "Ops.IDIV" in msg
  assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_results_of_rewrites_are_rewritten_in_turn():
  # x*4 -> (x*2)*2: the result holds a new node that is rewritten first, then the result itself
  pm = PatternMatcher([
    (UPat(Ops.MUL, src=(UPat.var("a"), UPat.const(i32, 4))), lambda a: (a * 2) * 2),
    (UPat(Ops.MUL, src=(UPat.var("a"), UPat.const(i32, 2))), lambda a: a + a),
  ])
  assert graph_rewrite(x * 4, pm) is (x + x) + (x + x)
  assert graph_rewrite(x * 4, pm, top_down=True) is (x + x) + (x + x)
  # a chain of rewrites on one node: y*1 -> y+0 -> y
  chain = PatternMatcher([(UPat.var("a") * 1, lambda a: a + 0), (UPat.var("a") + 0, lambda a: a)])
  e = UOp(Ops.SINK, src=((y * 1) * 1, y * 1 + x, (y * 1) * 1))
  assert graph_rewrite(e, chain) is UOp(Ops.SINK, src=(y, y + x, y))
  assert graph_rewrite(e, chain, top_down=True) is UOp(Ops.SINK, src=(y, y + x, y))


def test_a_rewritten_leaf_is_finished_once():
  calls = []
  def rename(v):
    calls.append(v)
    return UOp.variable("z", 0, 10, i32) if v.arg[0] == "x" else None
  pm = PatternMatcher([(UPat(Ops.DEFINE_VAR, name="v"), rename)])
  z = UOp.variable("z", 0, 10, i32)
  assert graph_rewrite((x + y) * x, pm) is (z + y) * z
  assert sorted(v.arg[0] for v in calls) == ["x", "y", "z"]


def test_the_garbage_collector_is_as_it_was_after_a_rewrite():
  import gc
  assert gc.isenabled()
  graph_rewrite(x + 0, identities)
  assert gc.isenabled()
  pm = PatternMatcher([(UPat(Ops.IDIV, src=(UPat.cvar("a"), UPat.cvar("c"))), divide)])
  with pytest.raises(RuleError): graph_rewrite(UOp.const(i32, 1) // 0, pm)
  assert gc.isenabled()
  gc.disable()
  try:
    graph_rewrite(x + 0, identities)
    assert not gc.isenabled()
  finally: gc.enable()


def test_a_rule_may_run_a_graph_rewrite_of_its_own():
  def simplify_inside(s): return UOp(Ops.NOOP, s.dtype, (graph_rewrite(s.src[0], identities),))
  pm = PatternMatcher([(UPat(Ops.SINK, src=(UPat(Ops.ADD),), name="s"), simplify_inside)])
  deep = x
  for _ in range(3000): deep = deep + 0
  assert graph_rewrite(UOp(Ops.SINK, src=(deep,)), pm) is UOp(Ops.NOOP, src=(x,))


def test_a_caller_deep_in_the_stack_still_gets_its_rewrite():
  import inspect, sys
  e = x
  for _ in range(500): e = e + 0
  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(len(inspect.stack(0)) + 60)  # less headroom than the rewrite would like to recurse into
  try: out = graph_rewrite(e, identities)
  finally: sys.setrecursionlimit(limit)
  assert out is x


def test_substitute_replaces_nodes_and_rebuilds_their_users():
  from rewrite import substitute, stats
  a, b = UOp.variable("a", 0, 9), UOp.variable("b", 0, 9)
  e = (a + 1) * (a + 2)
  assert substitute(e, {a: b}) is (b + 1) * (b + 2)
  # a replacement may hold the node it replaces
  assert substitute(e, {a + 1: (a + 1) * 3}) is ((a + 1) * 3) * (a + 2)
  # one shared rule set serves every call, its rule named for what it does, in the statistics like any stage
  with stats.collect() as s:
    substitute(e, {a: b}, name="swap_a_for_b")
    substitute(e, {b: a}, name="swap_a_for_b")
  assert {(r.stage, r.name) for r in s.rules.values()} == {("swap_a_for_b", "rebuild_users_of_replaced_nodes")}
  assert s.stages["swap_a_for_b"].calls == 2


def test_substitute_does_not_enter_what_the_caller_calls_opaque():
  from rewrite import substitute, stats
  a, b, c = UOp.variable("a", 0, 9), UOp.variable("b", 0, 9), UOp.variable("c", 0, 9)
  big = functools.reduce(lambda x, k: x * 3 + k, range(50), b)  # holds no `a`: the caller knows it
  e = (a + 1) * big
  with stats.collect() as s:
    whole = substitute(e, {a: c}, name="whole")
    pruned = substitute(e, {a: c}, name="pruned", opaque=lambda n: n is big)
  assert pruned is whole is (c + 1) * big
  assert s.stages["pruned"].nodes_in == 3 and s.stages["whole"].nodes_in > 100   # 1, a + 1 and the product


def test_in_order_makes_each_decision_once_in_list_order_whatever_order_rules_ask():
  from rewrite import InOrder
  made = []
  decisions = InOrder()
  for place in (2, 0, 4, 3): decisions.up_to(place, made.append)
  assert made == [0, 1, 2, 3, 4]
