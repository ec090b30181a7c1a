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
