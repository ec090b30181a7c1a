"""Realize from several threads at once (docs/design.md, "Threads"): many threads building different kernels into a
fresh cache, each checked against numpy; the collector's pause is balanced afterwards."""
import gc, threading
import numpy as np
from tensor import Tensor
from runtime.realize import last_program

THREADS = 12


def work(i: int, errors: list) -> None:
  try:
    rng = np.random.default_rng(i)
    a = rng.standard_normal((8 + i, 16)).astype(np.float32)
    w = rng.standard_normal((16, 4 + i)).astype(np.float32)
    x, wt = Tensor(a), Tensor(w)
    for step in range(3):   # a distinct kernel per thread (shapes and the constant differ), then warm calls
      out = ((x * (i + 1) + step).relu() @ wt).sum(axis=1)
      np.testing.assert_allclose(out.numpy(), (np.maximum(a * (i + 1) + step, 0) @ w).sum(1), rtol=1e-4, atol=1e-3)
      assert last_program() is not None and last_program().outputs  # this thread's own program
    t = Tensor(a.copy())
    t[::2] = float(i)
    t.assign(t * 2)
    expect = a.copy(); expect[::2] = i
    np.testing.assert_allclose(t.numpy(), expect * 2)
  except BaseException as e:  # noqa: BLE001 -- reported by the main thread
    errors.append((i, e))


def test_many_threads_compile_and_run_different_kernels_at_once(cache_env):
  errors: list = []
  threads = [threading.Thread(target=work, args=(i, errors)) for i in range(THREADS)]
  for t in threads: t.start()
  for t in threads: t.join()
  assert not errors, errors[0]
  assert gc.isenabled()   # every rewrite's pause of the collector was undone


def test_last_program_is_per_thread():
  seen = {}
  all_realized = threading.Barrier(4)   # every thread has realized before any reads: a global would be the last one's
  def run(i):
    (Tensor(np.ones((3, i + 2), np.float32)) * 2).realize()
    all_realized.wait()
    seen[i] = last_program()
  threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
  for t in threads: t.start()
  for t in threads: t.join()
  assert len({id(p) for p in seen.values()}) == 4
  assert all(f"float32[{3 * (i + 2)}]" in str(p) for i, p in seen.items())   # each thread's own program
