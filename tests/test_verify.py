"""rewrite.verify: rules over integer and boolean arithmetic are checked for keeping meaning, by random evaluation."""
import pytest
from rewrite import UPat, PatternMatcher, Ops, verify, VerifyError
from rules.symbolic import symbolic_rules

x, c = UPat.var("x"), UPat.cvar("c")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_projects_symbolic_rules_keep_meaning(seed):
  assert verify(symbolic_rules, instances=120, seed=seed) == []


def test_a_wrong_rule_is_caught_with_its_location():
  # (x // c) * c == x only when c divides x: false for x = 7, c = 2
  wrong = PatternMatcher([((x // c) * c, lambda x, c: x)])
  with pytest.raises(VerifyError) as e:
    verify(wrong)
  (cx,) = e.value.counterexamples
  assert cx.location.endswith(f"test_verify.py:{wrong.rules[0].location.rsplit(':', 1)[1]}")
  assert "changes the value" in str(e.value) and cx.expected != cx.got


def test_a_right_rule_with_a_bound_condition_passes():
  # x % c == x when 0 <= x < c: the rule checks the bounds, so it is right
  bounded = PatternMatcher([(x % c, lambda x, c: x if 0 <= x.vmin and x.vmax < c.arg else None)])
  assert verify(bounded) == []


def test_a_rule_that_crashes_is_reported():
  crashing = PatternMatcher([(x + 0, lambda x: x.arg[5])])
  found = verify(crashing, raise_on_failure=False)
  assert found and "Error" in str(found[0].got)


def test_rules_over_other_ops_are_skipped():
  floats = PatternMatcher([(UPat(Ops.EXP2, name="e"), lambda e: e)])
  assert verify(floats) == []
