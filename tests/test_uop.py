"""UOp: the immutable, hash-consed graph node, its sugar, bounds, walks and printing."""
import copy, gc, pickle, sys, weakref
import pytest
from rewrite import UOp, Ops, dtypes, pretty
from rewrite import uop as uop_module

DEEP = 200_000  # deeper than any recursion limit: every walk of the engine must be iterative


def deep_chain(n: int = DEEP) -> UOp:
  x = UOp.variable("x", 0, 10)
  for i in range(n): x = UOp(Ops.ADD, dtypes.int32, (x, UOp.const(dtypes.int32, 1)))
  return x


# ---- immutability ----

def test_fields_cannot_be_assigned_or_deleted():
  u = UOp.const(dtypes.int32, 3)
  with pytest.raises(AttributeError, match="immutable"): u.arg = 4
  with pytest.raises(AttributeError, match="immutable"): u.op = Ops.ADD
  with pytest.raises(AttributeError, match="immutable"): del u.src
  assert u.arg == 3


def test_a_uop_has_no_truth_value():
  with pytest.raises(TypeError, match="truth value"): bool(UOp.const(dtypes.int32, 1))


# ---- hash-consing ----

def test_equal_nodes_are_the_same_object():
  x = UOp.variable("x", 0, 7, dtypes.int32)
  assert UOp(Ops.ADD, dtypes.int32, (x, UOp.const(dtypes.int32, 1))) is (x + 1)
  assert UOp.const(dtypes.float32, 2.0) is UOp.const(dtypes.float32, 2.0)
  assert (x * 2 + 1) is (x * 2 + 1)


def test_different_nodes_are_different_objects():
  x, y = UOp.variable("x", 0, 7), UOp.variable("y", 0, 7)
  assert (x + y) is not (y + x)       # source order is structure
  assert (x + 1) is not (x + 2)        # so is arg
  assert UOp.const(dtypes.int32, 1) is not UOp.const(dtypes.int64, 1)  # and dtype
  assert UOp(Ops.ADD, dtypes.int32, (x, x)) is not UOp(Ops.MUL, dtypes.int32, (x, x))  # and op


def test_args_python_considers_equal_are_distinct_nodes():
  # 0.0 == -0.0 and 1 == 1.0 == True in Python, but they are different constants
  f = dtypes.float32
  assert UOp(Ops.CONST, f, (), 0.0) is not UOp(Ops.CONST, f, (), -0.0)
  assert UOp(Ops.CONST, f, (), -0.0).arg.hex() == (-0.0).hex()
  assert UOp(Ops.CONST, dtypes.int32, (), 1) is not UOp(Ops.CONST, dtypes.int32, (), 1.0)
  assert UOp(Ops.CONST, dtypes.int32, (), 1) is not UOp(Ops.CONST, dtypes.int32, (), True)
  nan = float("nan")
  assert UOp(Ops.CONST, f, (), nan) is UOp(Ops.CONST, f, (), float("nan"))  # nan != nan, yet one node


def test_dead_nodes_are_freed():
  # the cache holds its nodes weakly: building a node must not keep it alive
  u = UOp(Ops.CONST, dtypes.int32, (), 123456789)
  ref = weakref.ref(u)
  size = len(uop_module._cache)
  del u
  gc.collect()
  assert ref() is None
  assert len(uop_module._cache) < size
  assert UOp(Ops.CONST, dtypes.int32, (), 123456789).arg == 123456789  # and building it again is fine


def test_a_whole_dead_graph_is_freed_at_once():
  # every node here is unique to this test, so nothing else keeps one alive; its toposort was asked (cached on it)
  # and the cache's keys name its nodes: neither keeps the graph alive, so it goes by reference counting, without
  # waiting for the cyclic collector
  refs = [weakref.ref(n) for n in (UOp.variable("dead", 0, 3) * 55555 + 77777).toposort]
  assert all(r() is None for r in refs)
  gc.disable()
  try:
    x = UOp.variable("deeper", 0, 3)
    for i in range(50): x = (x + 9898) * (i + 1)
    x.toposort, x.src[0].toposort   # cached on two nodes of the chain
    refs = [weakref.ref(n) for n in x.toposort]
    del x
    assert all(r() is None for r in refs)
  finally: gc.enable()


def test_an_equal_node_built_after_its_twin_died_is_interned_again():
  x = UOp.variable("twin", 0, 3)
  size = len(uop_module._cache)
  ref = weakref.ref(x * 31337)
  assert ref() is None and len(uop_module._cache) == size   # its entry went with it
  assert x * 31337 is x * 31337


def test_pickling_reinterns():
  x = UOp.variable("x", 0, 10)
  e = (x * 3 + 1).maximum(x)
  back = pickle.loads(pickle.dumps(e))
  assert back is e                      # unpickling returns the live node
  assert pickle.loads(pickle.dumps(UOp.const(dtypes.float32, -0.0))).arg.hex() == (-0.0).hex()
  assert copy.copy(e) is e and copy.deepcopy(e) is e


def test_pickled_graph_unpickles_to_an_equal_graph_after_the_original_died():
  data = pickle.dumps(UOp.variable("gone", 0, 9) + 424242)
  gc.collect()
  u = pickle.loads(data)
  assert u.op is Ops.ADD and u.src[1].arg == 424242 and u.src[0].arg == ("gone", 0, 9)
  assert u is UOp.variable("gone", 0, 9) + 424242


def test_replace():
  x, y = UOp.variable("x", 0, 10, dtypes.int32), UOp.variable("y", 0, 10, dtypes.int32)
  e = x + y
  assert e.replace(op=Ops.MUL) is x * y
  assert e.replace(src=[y, x]) is y + x      # any sequence of sources becomes a tuple
  assert UOp(Ops.ADD, dtypes.int32, [x, y]) is e
  assert e.replace() is e
  assert UOp.const(dtypes.int32, 1).replace(arg=2) is UOp.const(dtypes.int32, 2)
  with pytest.raises(TypeError, match="unknown fields"): e.replace(name="z")


# ---- walks on deep graphs ----

def test_toposort_orders_sources_first_and_is_the_callers_own():
  x = UOp.variable("x", 0, 10)
  e = (x + 1) * (x + 1)
  order = list(e.toposort)
  assert order[-1] is e and order.index(x) < order.index(x + 1) < order.index(e)
  assert len(order) == 4                  # x, 1, x+1, e: the shared x+1 once
  mine = e.toposort
  mine.clear()                            # a dict of the caller's: the cached walk is untouched
  assert list(e.toposort) == order and list((e + 1).toposort) == order + [e + 1]   # (the 1 is x + 1's)


def test_loops_are_the_range_nodes_below_in_toposort_order():
  idx = dtypes.index
  r = [UOp(Ops.RANGE, idx, (UOp.const(idx, n),), ("out", i)) for i, n in enumerate((4, 8, 16))]
  e = (r[2] * 3 + r[0]) * (r[1] + r[0]) + r[2]
  assert e.loops == tuple(n for n in e.toposort if n.op is Ops.RANGE) == (r[2], r[0], r[1])
  assert (r[1] + 1).loops == (r[1],) and UOp.const(idx, 3).loops == ()
  copy_ = e.replace(src=(e.src[0], r[1]))   # a new node over known ones: its loops from its sources'
  assert copy_.loops == (r[2], r[0], r[1]) and (copy_.src[0].loops is e.src[0].loops)


def test_deep_chain_walks_bounds_and_printing_do_not_recurse():
  e = deep_chain()
  assert len(e.toposort) == DEEP + 2
  assert (e.vmin, e.vmax) == (DEEP, DEEP + 10)
  text = e.pretty()
  assert text.count("\n") > DEEP
  assert "nodes" in repr(e)               # large graphs print a one-line summary
  assert pickle.loads(pickle.dumps(e)) is e


def test_pretty_prints_shared_nodes_once():
  x = UOp.variable("x", 0, 10)
  shared = x * 7
  text = pretty(shared + shared)
  assert text.count("Ops.MUL") == 1 and text.count("%0") == 2
  assert text.splitlines()[0].startswith("UOp(Ops.ADD")
  assert repr(shared + shared) == text


# ---- sugar and helpers ----

def test_operator_sugar_builds_alu_nodes():
  x, y = UOp.variable("x", 0, 10, dtypes.int32), UOp.variable("y", 0, 10, dtypes.int32)
  i = dtypes.int32
  one = UOp.const(i, 1)
  assert (x + y).op is Ops.ADD and (x + y).src == (x, y)
  assert (x * 2).src[1] is UOp.const(i, 2)
  assert (2 * x).src == (UOp.const(i, 2), x)
  assert (1 + x).src == (one, x)
  assert (x - y) is x + y * -1                  # integer negation is a multiplication
  assert (-x) is x * -1
  f = UOp.const(dtypes.float32, 1.5)
  assert (-f).op is Ops.NEG
  assert (x // 3).op is Ops.IDIV and (x % 4).op is Ops.MOD
  assert (x < y).op is Ops.CMPLT and (x < y).dtype is dtypes.bool
  assert (x > 3) is (UOp.const(i, 3) < x)
  assert x.ne(y).op is Ops.CMPNE and x.ne(y).dtype is dtypes.bool
  w = (x < y).where(x, 0)
  assert w.op is Ops.WHERE and w.dtype is i and w.src[2] is UOp.const(i, 0)
  assert x.maximum(y).op is Ops.MAX
  assert x.minimum(y) is -((-x).maximum(-y))
  assert (x & y).op is Ops.AND and (x | y).op is Ops.OR and (x ^ y).op is Ops.XOR
  assert x.cast(dtypes.int64).op is Ops.CAST and x.cast(i) is x


def test_python_numbers_become_constants_of_the_other_operands_dtype():
  h = UOp.variable("h", 0, 10, dtypes.int64)
  assert (h + 1).src[1].dtype is dtypes.int64
  g = UOp.const(dtypes.float16, 1.0)
  assert (g * 2).src[1] is UOp.const(dtypes.float16, 2.0) and isinstance((g * 2).src[1].arg, float)


def test_const_and_variable():
  assert UOp.const(dtypes.int32, 3.0).arg.__class__ is int
  assert UOp.const(dtypes.bool, 1).arg is True
  assert UOp.const(dtypes.float32, 1).arg.__class__ is float
  with pytest.raises(TypeError): UOp.const(dtypes.int32, 1.5)
  v = UOp.variable("n", 1, 16)
  assert v.op is Ops.DEFINE_VAR and v.arg == ("n", 1, 16) and v.dtype is dtypes.index
  with pytest.raises(ValueError, match="min 5 > max 1"): UOp.variable("bad", 5, 1)


# ---- value bounds ----

@pytest.mark.parametrize("expr, lo, hi", [
  (lambda x, y: x + y, -3, 15),
  (lambda x, y: x * y, -15, 50),
  (lambda x, y: x * -2, -20, 6),
  (lambda x, y: x.maximum(y), 0, 10),
  (lambda x, y: x // 2, -1, 5),
  (lambda x, y: y % 4, 0, 3),
  (lambda x, y: (x < 20).where(y, x), 0, 5),
])
def test_bounds_of_integer_expressions(expr, lo, hi):
  x, y = UOp.variable("x", -3, 10), UOp.variable("y", 0, 5)
  e = expr(x, y)
  assert (e.vmin, e.vmax) == (lo, hi)


def test_bounds_of_boolean_expressions():
  x, y = UOp.variable("x", 0, 4), UOp.variable("y", 10, 20)
  assert ((x < y).vmin, (x < y).vmax) == (True, True)      # always true: a rule may fold it
  assert ((y < x).vmin, (y < x).vmax) == (False, False)
  assert ((x < 2).vmin, (x < 2).vmax) == (False, True)
  assert (x.ne(y).vmin, x.ne(y).vmax) == (True, True)
  t = UOp.const(dtypes.bool, True)
  assert ((t & (x < 2)).vmin, (t & (x < 2)).vmax) == (False, True)


def test_bounds_are_cached():
  e = UOp.variable("x", 0, 3) * 5
  assert e.vmax == 15 and e._bounds == (0, 15)
