"""UPat: what a pattern matches. Each test builds a one-rule matcher and asks it which nodes match."""
import pytest
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes

i32, f32 = dtypes.int32, dtypes.float32
x, y = UOp.variable("x", 0, 10, i32), UOp.variable("y", 0, 10, i32)


def captures(pat: UPat, u: UOp):
  """What `pat` binds on `u` (a dict of name -> node), or None when it does not match."""
  got = []
  names = sorted(pat.names())
  def record(**kw):
    got.append(kw)
    return u  # any non-None result stops the matcher
  rule = eval(f"lambda {', '.join(names)}{', ' if names else ''}**kw: record(**{{n: v for n, v in locals().items() if n not in ('kw', 'record')}})",
              {"record": record})
  PatternMatcher([(pat, rule)]).rewrite(u)
  return got[0] if got else None


def matches(pat: UPat, u: UOp) -> bool: return captures(pat, u) is not None


def test_match_by_op_and_by_set_of_ops():
  assert matches(UPat(Ops.ADD), x + y)
  assert not matches(UPat(Ops.MUL), x + y)
  assert matches(UPat({Ops.ADD, Ops.MUL}), x * y)
  assert matches(UPat((Ops.ADD, Ops.MUL)), x + y)
  assert not matches(UPat({Ops.ADD, Ops.MUL}), x.maximum(y))
  assert matches(UPat(), x.maximum(y))  # no op: anything


def test_match_by_dtype_and_by_set_of_dtypes():
  assert matches(UPat(Ops.CONST, i32), UOp.const(i32, 1))
  assert not matches(UPat(Ops.CONST, f32), UOp.const(i32, 1))
  assert matches(UPat(Ops.CONST, {f32, i32}), UOp.const(f32, 1))
  assert matches(UPat.var("p", dtypes.int32.ptr()), UOp(Ops.DEFINE_GLOBAL, dtypes.int32.ptr(), (), 0))


def test_match_by_arg():
  assert matches(UPat(Ops.CONST, arg=3), UOp.const(i32, 3))
  assert not matches(UPat(Ops.CONST, arg=4), UOp.const(i32, 3))
  assert matches(UPat(Ops.SINK, arg=None), UOp(Ops.SINK))          # None is a real arg value...
  assert not matches(UPat(Ops.SINK, arg=None), UOp(Ops.SINK, arg=1))
  assert matches(UPat(Ops.SINK), UOp(Ops.SINK, arg=1))             # ...while no arg given matches any


def test_short_forms_take_the_long_forms_arguments():
  # a rule for one constant: cvar pins the value and still binds the node
  assert captures(UPat.cvar("c", arg=1000), UOp.const(i32, 1000)) == {"c": UOp.const(i32, 1000)}
  assert not matches(UPat.cvar("c", arg=1000), UOp.const(i32, 999))
  assert not matches(UPat.cvar("c", f32, arg=1000), UOp.const(i32, 1000))
  assert captures(UPat.const(i32, 2, name="two"), UOp.const(i32, 2)) == {"two": UOp.const(i32, 2)}
  # var with sources, an arg and allow_any_len, as UPat(None, ...) would have it
  sink = UOp(Ops.SINK, src=(x, y), arg=7)
  assert captures(UPat.var("s", src=(UPat.var("a"),), allow_any_len=True, arg=7), sink) == {"s": sink, "a": x}
  assert not matches(UPat.var("s", src=(UPat.var("a"),), arg=7), sink)  # exactly one source asked
  assert not matches(UPat.var("s", arg=8), sink)


def test_names_capture_nodes():
  e = x * 3
  got = captures(UPat(Ops.MUL, src=(UPat.var("a"), UPat.cvar("c")), name="m"), e)
  assert got == {"a": x, "c": UOp.const(i32, 3), "m": e}


def test_tuple_sources_match_in_order_and_by_count():
  pat = UPat(Ops.ADD, src=(UPat.var("a"), UPat.cvar("c")))
  assert captures(pat, x + 1) == {"a": x, "c": UOp.const(i32, 1)}
  assert not matches(pat, 1 + x)                                   # order matters
  assert not matches(UPat(Ops.WHERE, src=(UPat(), UPat())), (x < y).where(x, y))  # three sources, not two


def test_list_sources_match_any_permutation():
  pat = UPat(Ops.ADD, src=[UPat.var("a"), UPat.cvar("c")])
  assert captures(pat, x + 1)["a"] is x
  assert captures(pat, 1 + x)["a"] is x
  three = UPat(Ops.WHERE, src=[UPat(Ops.CMPLT, name="c"), UPat.cvar("k"), UPat.var("v")])
  k = UOp.const(i32, 7)
  assert captures(three, UOp(Ops.WHERE, i32, (k, x, x < y))) == {"c": x < y, "k": k, "v": x}


def test_a_single_upat_must_match_every_source():
  pat = UPat(Ops.SINK, src=UPat(Ops.CONST))
  k1, k2 = UOp.const(i32, 1), UOp.const(i32, 2)
  assert matches(pat, UOp(Ops.SINK, src=(k1, k2, k1)))
  assert not matches(pat, UOp(Ops.SINK, src=(k1, x)))
  assert matches(pat, UOp(Ops.SINK, src=()))                       # vacuously
  # a name inside binds one node: every source must be that node
  same = UPat(Ops.SINK, src=UPat.var("s"))
  assert captures(same, UOp(Ops.SINK, src=(k1, k1))) == {"s": k1}
  assert not matches(same, UOp(Ops.SINK, src=(k1, k2)))


def test_allow_any_len_matches_a_prefix():
  pat = UPat(Ops.SINK, src=(UPat.cvar("first"),), allow_any_len=True)
  k1 = UOp.const(i32, 1)
  assert captures(pat, UOp(Ops.SINK, src=(k1, x, y))) == {"first": k1}
  assert matches(pat, UOp(Ops.SINK, src=(k1,)))
  assert not matches(pat, UOp(Ops.SINK, src=()))
  assert not matches(UPat(Ops.SINK, src=(UPat.cvar("first"),)), UOp(Ops.SINK, src=(k1, x)))


def test_a_repeated_name_binds_one_node():
  pat = UPat(Ops.ADD, src=(UPat.var("a"), UPat.var("a")))
  assert captures(pat, x + x) == {"a": x}
  assert not matches(pat, x + y)
  deep = UPat(Ops.MUL, src=[UPat(Ops.ADD, src=[UPat.var("a"), UPat.cvar("c")]), UPat.var("a")])
  assert matches(deep, (1 + x) * x) and matches(deep, x * (x + 1))
  assert not matches(deep, (x + 1) * y)


def test_upat_any_tries_alternatives_in_order():
  pat = UPat.any(UPat(Ops.ADD, src=(UPat.var("a"), UPat.cvar("c"))), UPat(Ops.MUL, src=(UPat.var("a"), UPat.cvar("c"))))
  assert captures(pat, x * 2) == {"a": x, "c": UOp.const(i32, 2)}
  assert captures(pat, x + 2)["c"].arg == 2
  assert not matches(pat, x.maximum(y))
  named = UPat.any(UPat(Ops.ADD), UPat(Ops.MUL)).named("n")
  assert captures(UPat.any(UPat(Ops.ADD), UPat(Ops.MUL), ).named("n"), x * y) == {"n": x * y}
  assert named.names() == {"n"}


def test_upat_sugar_builds_commutative_patterns():
  p = UPat.var("x") + 0
  assert p.op == {Ops.ADD} and p.src_kind == "any_order"
  assert matches(p, x + 0) and matches(p, 0 + x) and not matches(p, x + 1)
  q = UPat.var("x") * UPat.cvar("c")
  assert matches(q, 3 * x) and matches(q, x * 3)
  d = UPat.var("x") // UPat.cvar("c")                              # not commutative: in order
  assert d.src_kind == "in_order" and matches(d, x // 2) and not matches(d, UOp.const(i32, 2) // x)
  assert (UPat.var("x") < 3).op == {Ops.CMPLT} and UPat.var("x").ne(1).src_kind == "any_order"
  assert matches(UPat.var("c").where(UPat.var("a"), 0), (x < y).where(x, 0))


def test_repr_reads_like_the_pattern():
  assert repr(UPat.var("x") + 0) == "ADD[x, 0]"
  assert repr(UPat(Ops.MUL, src=(UPat.var("a"), UPat.cvar("c")), name="m")) == "MUL(a, CONST:c):m"


def test_bad_patterns_are_refused_where_written():
  with pytest.raises(ValueError, match=r"test_upat.py:\d+: UPat has unknown op 'ADD'"): UPat("ADD")
  with pytest.raises(ValueError, match=r"test_upat.py:\d+: UPat has unknown dtype"): UPat(Ops.ADD, dtype="int32")
  with pytest.raises(ValueError, match=r"test_upat.py:\d+: UPat src must be"): UPat(Ops.ADD, src=UOp.const(i32, 1))
