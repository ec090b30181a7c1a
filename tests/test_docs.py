"""The code blocks of docs/rules.md run, in order, in one namespace: the tutorial cannot rot."""
import pathlib, re

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "rules.md"


def test_every_code_block_of_the_rules_tutorial_runs():
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
  assert len(blocks) >= 5
  namespace: dict = {}
  for i, block in enumerate(blocks):
    exec(compile(block, f"{DOC}:block{i + 1}", "exec"), namespace)
  from rules.pipeline import pipeline
  assert "fma" not in pipeline.names()  # the tutorial cleans up after itself


def test_the_readmes_training_loop_runs_and_learns(capsys):
  readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
  (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "loss.backward()" in b]
  namespace: dict = {}
  exec(compile(block, "README.md:training", "exec"), namespace)
  first = float((namespace["y"].numpy() ** 2).mean())   # the loss of a model that answers 0
  assert namespace["loss"].item() < first / 10 and "loss after 100 steps" in capsys.readouterr().out
