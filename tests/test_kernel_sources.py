"""Tensor.kernel_sources(device=None): the sources a realize would compile, with nothing compiled or run."""
import re
import numpy as np
from tensor import Tensor
from runtime import cache
from runtime.realize import last_program

x = Tensor(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 100)


def test_the_sources_are_those_a_realize_then_compiles(cache_env):
  y = (x * 2).softmax(-1)
  builds = cache.stats["build"]
  sources = y.kernel_sources()
  assert cache.stats["build"] == builds and not y.is_realized   # nothing compiled, nothing run
  assert sources and all(re.search(r"\bvoid \w+\(", s) for s in sources)
  y.realize()
  assert sources == [ck.source for ck in last_program().kernels_called()]


def test_sources_for_another_device_render_without_that_device(cache_env):
  sources = ((x + 1).sum(axis=1)).kernel_sources(device="cuda")
  assert len(sources) == 1 and "__global__" in sources[0]


def test_a_realized_tensor_has_nothing_left_to_compile():
  assert (x + 1).realize().kernel_sources() == []
