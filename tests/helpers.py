"""What the Tensor tests share: realize many tensors at once, then compare each with numpy."""
import contextlib
import numpy as np
from numpy.testing import assert_allclose
from tensor import Tensor


def realize_and_check(pairs, rtol=1e-5, atol=1e-6):
  """Realize every tensor of `pairs` in one go (one compile for all their kernels), then compare each with numpy."""
  Tensor.realize_all(*(t for t, _ in pairs))
  for i, (t, want) in enumerate(pairs):
    want = np.asarray(want)
    got = t.numpy()
    assert got.shape == want.shape, f"pair {i}: shape {got.shape} != {want.shape}"
    assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"pair {i}")


@contextlib.contextmanager
def unfused_attention():
  """The pipeline without its attention stage (rules/attention.py): softmax(s) @ v runs as the kernels of its graph
  (the scores, the probabilities, the product), for tests of that form."""
  from rules.pipeline import pipeline
  at = pipeline.index("attention")
  stage = pipeline.remove("attention")
  try: yield
  finally:
    pipeline.stages.insert(at, stage)
    pipeline.version += 1


def python_path(*first: str) -> str:
  """PYTHONPATH for a child process: `first` (the repository root, say) ahead of what this process was given, so a
  child finds the packages that the parent found through PYTHONPATH too (cffi carried beside the tree on a GPU host)."""
  import os
  return os.pathsep.join([*map(str, first), *filter(None, [os.environ.get("PYTHONPATH", "")])])
