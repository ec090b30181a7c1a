"""Rewrite statistics: per stage and per rule, printed at exit by REWRITE_STATS, or collected in Python."""
import json, os, subprocess, sys, textwrap
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, graph_rewrite, stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
i32 = dtypes.int32


def drop_zero(a): return a
def fold_add(a, b): return UOp.const(a.dtype, a.arg + b.arg)


simplify = PatternMatcher([(UPat.var("a") + 0, drop_zero),
                           (UPat(Ops.ADD, src=(UPat.cvar("a"), UPat.cvar("b"))), fold_add)], name="simplify")


def run_some_rewrites():
  x = UOp.variable("x", 0, 10, i32)
  k = lambda v: UOp.const(i32, v)
  graph_rewrite((x + 0) * (k(1) + k(2)), simplify)
  graph_rewrite(x + (k(3) + k(-3)), simplify)
  graph_rewrite(x * 2, simplify, name="other stage")


def test_collect_counts_stages_and_rules():
  with stats.collect() as s: run_some_rewrites()
  st = s.stages["simplify"]
  assert st.calls == 2 and st.rewrites == 4 and st.nodes_in > st.nodes_out and st.time > 0
  assert s.stages["other stage"].rewrites == 0
  rules = {r.name: r for r in s.rules.values() if r.stage == "simplify"}
  assert rules["drop_zero"].matches == 2 and rules["fold_add"].matches == 2
  assert rules["fold_add"].attempts >= rules["fold_add"].matches
  assert rules["drop_zero"].location.endswith(f"test_stats.py:{drop_zero.__code__.co_firstlineno}")


def test_tables_and_plain_data():
  with stats.collect() as s: run_some_rewrites()
  stage_table, rule_table = s.table("stage"), s.table("rule")
  assert "simplify" in stage_table and "other stage" in stage_table and "rewrites" in stage_table
  assert "drop_zero" in rule_table and "fold_add" in rule_table and "share" in rule_table
  assert "test_stats.py:" in rule_table  # each rule's file:line
  data = json.loads(s.to_json())
  assert data == s.as_dict()
  assert {st["name"] for st in data["stages"]} == {"simplify", "other stage"}
  assert {"name", "location", "stage", "matches", "attempts", "match_time", "fn_time"} <= set(data["rules"][0])


def test_level_one_collects_stages_only():
  with stats.collect(level=1) as s: run_some_rewrites()
  assert s.stages["simplify"].rewrites == 4 and not s.rules


def test_results_do_not_depend_on_statistics():
  x = UOp.variable("x", 0, 10, i32)
  e = (x + 0) * (UOp.const(i32, 1) + UOp.const(i32, 2))
  plain = graph_rewrite(e, simplify)
  with stats.collect(): timed = graph_rewrite(e, simplify)
  assert plain is timed is x * 3
  assert not stats.active   # the collection ended with its block


SCRIPT = textwrap.dedent("""
  import sys; sys.path.insert(0, {root!r})
  from tests.test_stats import run_some_rewrites
  run_some_rewrites()
  print("done")
""")


def run_with_env(level: str) -> str:
  env = dict(os.environ, REWRITE_STATS=level)
  out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
  assert out.returncode == 0, out.stderr
  return out.stdout


def test_rewrite_stats_1_prints_a_table_per_stage_at_exit():
  out = run_with_env("1")
  assert out.index("done") < out.index("rewrite statistics per stage")
  assert "simplify" in out and "other stage" in out and "nodes in" in out
  assert "per rule" not in out


def test_rewrite_stats_2_adds_a_row_per_rule():
  out = run_with_env("2")
  assert "rewrite statistics per rule" in out
  rule_lines = [l for l in out.splitlines() if l.startswith("simplify ") and ("drop_zero" in l or "fold_add" in l)]
  assert len(rule_lines) == 2 and all("test_stats.py:" in l and "%" in l for l in rule_lines)


def test_no_statistics_by_default():
  env = {k: v for k, v in os.environ.items() if k != "REWRITE_STATS"}
  out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
  assert out.stdout.strip() == "done"
