"""Users' rule sets: placed in the pipeline, loaded from GRAFT_RULES, listed by `python -m rules`, errors named."""
import os, subprocess, sys, textwrap
import numpy as np
import pytest
from rewrite import UPat, PatternMatcher, Ops, RuleError
from rules.pipeline import pipeline
from tensor import Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def restore_pipeline():
  saved = list(pipeline.stages)
  yield
  pipeline.stages[:] = saved
  pipeline.version += 1  # kernels compiled by the modified pipeline are not reused


def test_insert_before_and_after_a_stage(restore_pipeline):
  early, late = PatternMatcher([], name="early"), PatternMatcher([], name="late")
  pipeline.insert("lower", early, where="before")
  pipeline.insert("lower", late, where="after")
  names = pipeline.names()
  assert names.index("early") + 1 == names.index("lower") == names.index("late") - 1
  assert pipeline.stages[names.index("late")].origin.startswith(__file__)
  pipeline.insert("lower", late)  # the same rule set again: nothing changes
  assert pipeline.names() == names


def test_unknown_stage_and_bad_where_are_refused(restore_pipeline):
  with pytest.raises(ValueError, match="no stage named 'lowering'.*lower"):
    pipeline.insert("lowering", PatternMatcher([]))
  with pytest.raises(ValueError, match="before"):
    pipeline.insert("lower", PatternMatcher([]), where="inside")


def test_replacing_a_stage_changes_what_it_does(restore_pipeline):
  # a symbolic stage that folds nothing still computes the right thing: the C compiler folds for us
  pipeline.replace("symbolic", PatternMatcher([], name="no_symbolic"))
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  np.testing.assert_allclose(Tensor(x).T.sum(axis=0).numpy(), x.sum(axis=1))


def test_a_rule_that_raises_names_itself_the_stage_and_the_node(restore_pipeline):
  def broken(x): raise KeyError("oops")
  pipeline.insert("symbolic", PatternMatcher([(UPat(Ops.STORE, name="x"), broken)], name="broken_rules"))
  with pytest.raises(RuleError) as e:
    (Tensor(np.ones(5, np.float32)) * 3).numpy()
  msg = str(e.value)
  assert "rule broken at" in msg and "test_user_rules.py" in msg and "'broken_rules'" in msg and "Ops.STORE" in msg
  assert isinstance(e.value.__cause__, KeyError)


RULE_MODULE = textwrap.dedent("""
  from rewrite import PatternMatcher
  from rules.pipeline import pipeline
  pipeline.insert("linearize", PatternMatcher([], name="from_{tag}"), where="before")
""")


def run(code: str, **env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env={**os.environ, **env}, cwd=env.pop("cwd", None))


def test_graft_rules_loads_files_and_modules(tmp_path):
  (tmp_path / "file_rules.py").write_text(RULE_MODULE.format(tag="file"))
  (tmp_path / "mod_rules.py").write_text(RULE_MODULE.format(tag="module"))
  r = run("from rules.pipeline import pipeline; print(pipeline.names())",
          GRAFT_RULES=f"{tmp_path / 'file_rules.py'}, mod_rules", PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
  assert r.returncode == 0, r.stderr
  assert "'from_file'" in r.stdout and "'from_module'" in r.stdout


def test_graft_rules_that_cannot_load_say_so():
  r = run("import rules.pipeline", GRAFT_RULES="no_such_rules_module")
  assert r.returncode != 0 and "GRAFT_RULES" in r.stderr and "no_such_rules_module" in r.stderr


def test_python_m_rules_lists_the_pipeline_with_users_stages(tmp_path):
  (tmp_path / "mine.py").write_text(RULE_MODULE.format(tag="me"))
  r = subprocess.run([sys.executable, "-m", "rules"], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "GRAFT_RULES": str(tmp_path / "mine.py")})
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  order = [next(i for i, l in enumerate(lines) if f" {name} " in l) for name in ("realize", "lower", "symbolic", "from_me", "linearize")]
  assert order == sorted(order)
  assert "mine.py" in next(l for l in lines if " from_me " in l)


def test_the_fma_example_fires_and_stays_right():
  r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "custom_rule.py"), "--small"], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert "fused_multiply_add fired" in r.stdout and "ok" in r.stdout
