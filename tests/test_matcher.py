"""PatternMatcher: ordered rules, compiled per root op; how rules are called, named, composed and refused."""
import os
import pytest
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes

i32 = dtypes.int32
x, y = UOp.variable("x", 0, 10), UOp.variable("y", 0, 10)
HERE = os.path.abspath(__file__)


def test_a_rule_returns_a_new_node_or_none():
  pm = PatternMatcher([(UPat.var("a") + 0, lambda a: a)])
  assert pm.rewrite(x + 0) is x
  assert pm.rewrite(x + 1) is None
  assert pm.rewrite(x * 0) is None          # no rule for MUL at all


def test_first_match_wins_in_rule_order():
  pm = PatternMatcher([
    (UPat(Ops.ADD, src=(UPat.var("a"), UPat.cvar("c"))), lambda a, c: UOp.const(i32, 1)),
    (UPat(Ops.ADD, name="e"), lambda e: UOp.const(i32, 2)),
  ])
  assert pm.rewrite(x + 5).arg == 1
  assert pm.rewrite(x + y).arg == 2
  flipped = PatternMatcher(list(reversed([(p.pattern, p.fn) for p in pm.rules])))
  assert flipped.rewrite(x + 5).arg == 2


def test_a_rule_returning_none_lets_the_next_rule_try():
  pm = PatternMatcher([
    (UPat(Ops.ADD, src=[UPat.var("a"), UPat.cvar("c")]), lambda a, c: None if c.arg < 100 else a),
    (UPat(Ops.ADD, src=[UPat.var("a"), UPat.cvar("c")]), lambda a, c: c),
  ])
  assert pm.rewrite(x + 3).arg == 3
  assert pm.rewrite(x + 300) is x


def test_every_permutation_is_tried_before_giving_up():
  # the first ordering binds (a=x, c=y); the rule refuses; the second ordering binds (a=y, c=x) and is accepted
  pm = PatternMatcher([(UPat(Ops.ADD, src=[UPat.var("a"), UPat(Ops.DEFINE_VAR, name="c")]),
                        lambda a, c: c if c.arg[0] == "x" else None)])
  assert pm.rewrite(x + y) is x and pm.rewrite(y + x) is x


def test_ctx_is_passed_to_rules_that_ask_for_it():
  seen = []
  pm = PatternMatcher([
    (UPat(Ops.DEFINE_VAR, name="v"), lambda ctx, v: ctx.setdefault(v.arg[0], UOp.const(i32, len(ctx)))),
    (UPat(Ops.CONST, name="c"), lambda c: seen.append(c)),           # no ctx parameter: none passed
  ])
  names: dict = {}
  assert pm.rewrite(x, names).arg == 0 and pm.rewrite(y, names).arg == 1 and pm.rewrite(x, names).arg == 0
  assert set(names) == {"x", "y"}
  assert pm.rewrite(UOp.const(i32, 5), names) is None and len(seen) == 1


def test_rule_parameters_of_every_kind():
  c = UOp.const(i32, 4)
  def kw_only(a, *, c): return a * c
  def var_kw(**caught): return caught["a"] * caught["c"]
  def defaulted(a, unused=None, c=None): return a * c
  pat = UPat(Ops.ADD, src=(UPat.var("a"), UPat.cvar("c")))
  assert PatternMatcher([(pat, kw_only)]).rewrite(x + c) is x * c
  assert PatternMatcher([(pat, var_kw)]).rewrite(x + c) is x * c
  assert PatternMatcher([(pat, defaulted)]).rewrite(x + c) is x * c
  assert PatternMatcher([(pat, lambda ctx, a, c: ctx)]).rewrite(x + c, y) is y


def test_matchers_compose_with_plus_keeping_order():
  zero = PatternMatcher([(UPat.var("a") * 0, lambda a: UOp.const(a.dtype, 0))])
  one = PatternMatcher([(UPat.var("a") * 1, lambda a: a), (UPat(Ops.MUL, name="m"), lambda m: UOp.const(i32, -1))])
  both = zero + one
  assert len(both) == 3
  assert both.rewrite(x * 0).arg == 0 and both.rewrite(x * 1) is x and both.rewrite(x * y).arg == -1
  assert (one + zero).rewrite(x * 0).arg == -1   # one's catch-all comes first now
  assert len(zero) == 1 and zero.rewrite(x * 1) is None   # the parts are unchanged


def named_rule(a): return a


def test_every_rule_knows_its_name_and_location():
  pm = PatternMatcher([(UPat.var("a") + 0, named_rule), (UPat.var("a") * 1, lambda a: a)])
  r0, r1 = pm.rules
  assert r0.name == "named_rule" and r0.location == f"{HERE}:{named_rule.__code__.co_firstlineno}"
  assert r1.name == "MUL[a, 1]"                   # a lambda is named by its pattern
  assert r1.location.startswith(HERE + ":")
  assert "named_rule" in repr(r0)


def test_the_generated_matcher_is_readable_python():
  pm = PatternMatcher([(UPat.var("a") + 0, named_rule)])
  src = pm.source(Ops.ADD)
  assert src.startswith("def match(u, ctx):") and "named_rule" in src and HERE in src
  compile(src, "<test>", "exec")
  assert pm.source(Ops.MUL) == ""


def test_rules_without_a_root_op_apply_to_every_op():
  pm = PatternMatcher([(UPat(name="n", dtype=dtypes.bool), lambda n: UOp.const(dtypes.bool, True))])
  assert pm.rewrite(x < y).arg is True and pm.rewrite(x.ne(y)).arg is True and pm.rewrite(x + y) is None


# ---- rules refused at construction, naming the rule's file:line ----

def test_unknown_op_is_refused():
  with pytest.raises(ValueError, match=rf"{HERE}:\d+: UPat has unknown op"): PatternMatcher([(UPat("NOT_AN_OP"), lambda: None)])


def test_parameter_not_bound_by_the_pattern_is_refused():
  def needs_c(a, c): return a
  line = needs_c.__code__.co_firstlineno
  with pytest.raises(ValueError, match=rf"{HERE}:{line}: rule needs_c takes parameter 'c', which its pattern .* does not bind"):
    PatternMatcher([(UPat.var("a") + 1, needs_c)])
  with pytest.raises(ValueError, match="does not bind"):  # every alternative must bind it
    PatternMatcher([(UPat.any(UPat.var("a") + 1, UPat(Ops.MUL)), lambda a: a)])


@pytest.mark.parametrize("pat, why", [
  (UPat(Ops.ADD, src=(UPat(Ops.CONST, name="a"), UPat(Ops.DEFINE_VAR, name="a"))), "never agree"),
  (UPat(Ops.ADD, src=(UPat(Ops.CONST, arg=1, name="a"), UPat(Ops.CONST, arg=2, name="a"))), r"args \d and \d differ"),
  (UPat(Ops.ADD, src=(UPat.var("a", dtypes.int32), UPat.var("a", dtypes.float32))), "dtypes never agree"),
  (UPat(Ops.ADD, src=(UPat.var("a"), UPat.var("b")), name="a"), "its own source"),
])
def test_impossible_repeated_name_is_refused(pat, why):
  def rule(a): return a
  with pytest.raises(ValueError, match=rf"{HERE}:{rule.__code__.co_firstlineno}: name 'a' is used twice .*{why}"):
    PatternMatcher([(pat, rule)])


def test_malformed_rules_are_refused_where_the_list_is_written():
  with pytest.raises(ValueError, match=rf"{HERE}:\d+: rule #0 must be a \(UPat, function\) pair"): PatternMatcher([UPat()])
  with pytest.raises(ValueError, match=rf"{HERE}:\d+: a rule is \(UPat, function\)"): PatternMatcher([(UPat(), 3)])


def test_a_rule_may_carry_its_name_for_the_statistics():
  from rewrite import stats, graph_rewrite
  x = UOp(Ops.DEFINE_VAR, dtypes.int32, (), ("x", 0, 9))
  rules = PatternMatcher([(UPat.var("x") * 1, lambda x: x, "mul-one"), (UPat.var("x") + 0, lambda x: x)], name="named")
  assert [r.name for r in rules.rules][0] == "mul-one" and "lambda" not in rules.rules[1].name
  with stats.collect() as s: assert graph_rewrite(x * 1, rules, name="named") is x
  assert {r.name for r in s.rules.values() if r.matches} == {"mul-one"}
  with pytest.raises(ValueError, match="name"): PatternMatcher([(UPat.var("x") * 1, lambda x: x, "")])
