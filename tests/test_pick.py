"""The measured pick (runtime/pick.py): candidates are timed on first use, the fastest is remembered in memory and on
disk, and a later process reuses it."""
import json
import numpy as np
import pytest
from tensor import Tensor
from runtime import pick, extern
from runtime.realize import last_program, _plans as plans


@pytest.fixture
def fresh(cache_env):
  pick.forget()
  yield cache_env
  pick.forget()


def test_the_fastest_candidate_is_chosen_and_written_to_disk(fresh):
  name, why = pick.choose(("k1", "64x64", "CPU"), {"slow": lambda: 0.002, "fast": lambda: 0.001})
  assert name == "fast" and why.startswith("fastest on first use")
  [entry] = (fresh / "pick").glob("*.json")
  saved = json.loads(entry.read_text())
  assert saved["choice"] == "fast" and saved["key"] == ["k1", "64x64", "CPU"]


def test_a_later_process_reuses_the_choice_without_running_anything(fresh):
  pick.choose(("k2",), {"a": lambda: 0.001, "b": lambda: 0.002})
  pick.forget()  # as a new process would start
  def must_not_run() -> float: raise AssertionError("a remembered pick runs no candidate")
  name, why = pick.choose(("k2",), {"a": must_not_run, "b": must_not_run})
  assert name == "a" and "earlier process" in why
  assert pick.choose(("k2",), {"a": must_not_run, "b": must_not_run}) == ("a", "chosen earlier in this process")


def test_other_shapes_are_measured_apart(fresh):
  pick.choose(("k3", "8x8"), {"a": lambda: 0.001, "b": lambda: 0.002})
  assert pick.choose(("k3", "16x16"), {"a": lambda: 0.002, "b": lambda: 0.001})[0] == "b"


def test_a_damaged_entry_is_measured_again(fresh):
  pick.choose(("k4",), {"a": lambda: 0.001, "b": lambda: 0.002})
  pick.forget()
  [entry] = (fresh / "pick").glob("*.json")
  entry.write_text("{not json")
  assert pick.choose(("k4",), {"a": lambda: 0.002, "b": lambda: 0.001})[0] == "b"


@pytest.mark.skipif(extern.routine("CPU", "sgemm") is None, reason="scipy-openblas32 is not installed")
def test_a_matmul_picks_between_sgemm_and_generated_code_and_says_why(fresh, monkeypatch, capsys):
  monkeypatch.delenv("GRAFT_EXTERN", raising=False)
  monkeypatch.setenv("DEBUG", "2")
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((96, 80)).astype(np.float32), rng.standard_normal((80, 72)).astype(np.float32)
  np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), a @ b, rtol=1e-4, atol=1e-4)
  out = capsys.readouterr().out
  assert "or generated" in str(last_program())             # the listing says both are candidates
  assert "sgemm or " in out and "fastest on first use" in out  # DEBUG=2 says which ran and why
  pick.forget(); plans.clear()   # as a new process would start: no choice in memory, no program cached
  np.testing.assert_allclose((Tensor(b.T.copy()) @ Tensor(a.T.copy())).numpy(), b.T @ a.T, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), a @ b, rtol=1e-4, atol=1e-4)
  assert "measured by an earlier process" in capsys.readouterr().out


def test_a_reduction_picks_between_one_kernel_and_its_split_and_a_later_process_reuses_it(fresh, monkeypatch, capsys):
  # the host stage offers the split on a device whose loops are a grid; told the CPU is one (132 SMs), the same PICK
  # step runs here on real kernels: both options timed on first use, the faster remembered on disk
  import runtime.realize as rr
  monkeypatch.setattr(rr, "grid_multiprocessors", lambda device: 132)
  monkeypatch.delenv("GRAFT_SPLIT_REDUCE", raising=False)
  monkeypatch.setenv("DEBUG", "2")
  x = np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)
  np.testing.assert_allclose(Tensor(x).sum().numpy(), x.sum(), rtol=1e-4)
  out = capsys.readouterr().out
  assert "or split_reduce(0, 512): r_512_1_1_" in str(last_program())
  assert "one kernel or split_reduce(0, 512): " in out and "fastest on first use (one kernel " in out
  pick.forget(); rr._plans.clear()   # as a new process would start
  np.testing.assert_allclose(Tensor(x + 1).sum().numpy(), (x + 1).sum(), rtol=1e-4)
  assert "measured by an earlier process" in capsys.readouterr().out


def test_on_a_gpu_a_long_reduction_runs_either_way_and_the_pick_says_which(fresh, monkeypatch, capsys):
  from runtime.device import get_device
  from runtime.cuda import CUDAUnavailable
  try: get_device("CUDA")
  except CUDAUnavailable as e: pytest.skip(f"no usable CUDA GPU here: {str(e).split(' (')[0]}")
  x = np.random.default_rng(2).standard_normal((2048, 2048)).astype(np.float32)
  t = Tensor(x, device="CUDA")
  for mode in ("0", "1"):
    monkeypatch.setenv("GRAFT_SPLIT_REDUCE", mode)
    for reduce, want in ((Tensor.sum, x.sum(dtype=np.float64)), (Tensor.max, x.max())):
      np.testing.assert_allclose(reduce(t).numpy(), want, rtol=1e-4)
      assert str(last_program()).count("call   ") == (2 if mode == "1" else 1)   # partials and their combine, or one
  monkeypatch.delenv("GRAFT_SPLIT_REDUCE")
  monkeypatch.setenv("DEBUG", "2")
  np.testing.assert_allclose(t.sum().numpy(), x.sum(dtype=np.float64), rtol=1e-4)
  out = capsys.readouterr().out
  assert "one kernel or split_reduce(0, " in out and "fastest on first use" in out, out


@pytest.mark.skipif(extern.routine("CPU", "sgemm") is None, reason="scipy-openblas32 is not installed")
def test_a_product_of_few_tiles_picks_among_one_kernel_its_split_and_the_library(fresh, monkeypatch, capsys):
  # attention's p @ v on a GPU: the split over k may beat the library's bare product, so it is a third option of the
  # library's pick; told the CPU is a 132-SM grid, the same PICK runs here on OpenBLAS and real kernels
  import runtime.realize as rr
  monkeypatch.setattr(rr, "grid_multiprocessors", lambda device: 132)
  for var in ("GRAFT_SPLIT_REDUCE", "GRAFT_EXTERN"): monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("DEBUG", "2")
  rng = np.random.default_rng(4)
  p, v = rng.standard_normal((2, 128, 2048)).astype(np.float32), rng.standard_normal((2, 2048, 64)).astype(np.float32)
  np.testing.assert_allclose((Tensor(p, device="CPU") @ Tensor(v, device="CPU")).numpy(), p @ v, rtol=1e-4, atol=1e-3)
  listing, out = str(last_program()), capsys.readouterr().out
  assert "pick   r_2_128_64_" in listing and "or split_reduce(3, " in listing and "or library: sgemm_batched 2x128x64x2048 (A, B)" in listing
  assert "one kernel or split_reduce(3, " in out and " or library: " in out and "fastest on first use" in out
  names = [name for name, _ in next(s for s in last_program().steps if s[0] == "pick")[1]]
  for name in names:   # whichever option the first run picks, each computes the product
    pick.forget(); rr._plans.clear()
    monkeypatch.setattr(pick, "choose", lambda key, candidates, name=name: (name, "chosen by the test"))
    np.testing.assert_allclose((Tensor(p, device="CPU") @ Tensor(v, device="CPU")).numpy(), p @ v, rtol=1e-4, atol=1e-3)
    assert f": {name} (chosen by the test)" in capsys.readouterr().out


def test_a_cpu_pick_is_measured_apart_for_each_thread_count(fresh, monkeypatch):
  from runtime.cpu import CPUDevice
  monkeypatch.delenv("GRAFT_EXTERN", raising=False)
  monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
  monkeypatch.setenv("OMP_NUM_THREADS", "1")
  one = CPUDevice().device_name
  rng = np.random.default_rng(1)
  a, b = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((48, 40)).astype(np.float32)
  np.testing.assert_allclose((Tensor(a, device="CPU") @ Tensor(b, device="CPU")).numpy(), a @ b, rtol=1e-4, atol=1e-4)
  keys = [json.loads(e.read_text())["key"] for e in (fresh / "pick").glob("*.json")]
  assert keys and all(k[-1] == one == "CPU (1 thread)" for k in keys)
  monkeypatch.setenv("OMP_NUM_THREADS", "2,1")
  assert CPUDevice().device_name == "CPU (2 threads)"
  monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
  assert CPUDevice().device_name == "CPU (2 threads, OpenBLAS 1)"
