"""bench/rule_reach.py: the compiler's work is done by rules on the nodes it concerns, not by rules handed the whole
graph (a design property of rules/, measured statically; nothing is timed)."""
import importlib.util, os, subprocess, sys
from tests.helpers import python_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("rule_reach", os.path.join(ROOT, "bench", "rule_reach.py"))
rule_reach = sys.modules["rule_reach"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rule_reach)


def test_under_a_fifth_of_the_rules_code_is_reached_only_from_whole_graph_rules():
  r = rule_reach.measure()
  assert r.total > 500, "the measure found too little of rules/: is every rule set of the pipeline read?"
  assert r.share < 0.20, f"{r.share:.0%} of rules/ behind rules on a SINK; the largest: {r.only[:8]}"


def test_grouping_fusion_and_memory_planning_are_rules_on_kernels_and_steps():
  rules = {(stage, name): whole for stage, name, _, whole, _ in rule_reach.measure().rules}
  for stage, name in (("group", "merge_kernels_of_one_depth"), ("gpu_fuse", "inline_broadcast_reductions"),
                      ("memory", "plan_memory_of_step")):
    assert rules[(stage, name)] is False, f"{stage}: {name} is a rule on a SINK"


def test_a_rule_on_a_sink_counts_as_whole_graph_whatever_its_arg_or_sources():
  classes = {(stage, name): whole for stage, name, _, whole, _ in rule_reach.measure().rules}
  assert classes[("memory", "place_allocs_and_frees")]   # pattern SINK(arg="steps")
  assert classes[("linearize", "start_kernel_block")]    # pattern SINK(src=STORE...)
  assert not classes[("lower", "lower_store")]


def test_the_script_prints_the_share_and_the_functions_behind_it():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "rule_reach.py"), "--top", "3"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": python_path(ROOT)})
  assert out.returncode == 0, out.stderr
  assert "reached only from whole-graph rules" in out.stdout and "Stage.prepare" in out.stdout
