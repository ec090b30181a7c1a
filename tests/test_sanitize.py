"""GRAFT_SANITIZE=1: kernels built with -fsanitize=address,undefined (runtime/cpu.py), over random programs.

Each check runs in a process of its own: the AddressSanitizer runtime must be the first library of the process
(LD_PRELOAD), and a report ends the process."""
import os
import subprocess
import sys
import pytest
from runtime.device import CompileError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from fuzz import sanitized_env  # noqa: E402  (bench/fuzz.py)
from tests.helpers import python_path

ENV = {**sanitized_env(), "DEVICE": "CPU"}
pytestmark = [pytest.mark.skipif(not os.path.isabs(ENV["LD_PRELOAD"]), reason="the C compiler has no libasan.so"),
              pytest.mark.usefixtures("on_cpu")]  # the sanitizers are the CPU C compiler's, whatever DEVICE says


def run_sanitized(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], env={**ENV, "PYTHONPATH": python_path(ROOT)}, cwd=ROOT, capture_output=True,
                        text=True, timeout=600)


def test_random_programs_run_clean_under_the_sanitizers():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fuzz.py"), "--count", "60", "--seed", "7000",
                        "--batch", "10", "--sanitize"], env={**os.environ, "DEVICE": "CPU", "PYTHONPATH": python_path(ROOT)}, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "60 ok, 0 mismatch, 0 error" in out.stdout and "with sanitizers" in out.stdout


def test_an_out_of_bounds_write_in_a_kernel_is_reported_where_it_happens():
  # a kernel that writes one element past its buffer: silent at -O3, a report and a failed process when sanitized
  out = run_sanitized(
    "from runtime.cpu import CPUDevice\n"
    "dev = CPUDevice()\n"
    "k = dev.build('void past_the_end(int* restrict out) { for (int i = 0; i <= 4; i++) out[i] = i; }', ['past_the_end'])\n"
    "buf = dev.allocator.alloc(16)\n"
    "k['past_the_end'](buf)\n")
  assert out.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in out.stderr, out.stderr[-2000:]
  assert "past_the_end" in out.stderr


def test_a_signed_overflow_in_a_kernel_is_reported():
  out = run_sanitized(
    "from runtime.cpu import CPUDevice\n"
    "dev = CPUDevice()\n"
    "k = dev.build('void overflow(int* restrict out) { out[0] = out[0] + 2147483647; }', ['overflow'])\n"
    "buf = dev.allocator.alloc(4)\n"
    "import cffi; f = cffi.FFI(); f.cast('int*', buf)[0] = 5\n"
    "k['overflow'](buf)\n")
  assert out.returncode != 0 and "signed integer overflow" in out.stderr, out.stderr[-2000:]


def test_sanitizing_without_the_runtime_loaded_first_says_how(monkeypatch):
  from tensor import Tensor
  import numpy as np
  monkeypatch.setenv("GRAFT_SANITIZE", "1")
  with pytest.raises(CompileError, match="LD_PRELOAD"):
    (Tensor(np.arange(3, dtype=np.float32)) * 7.25).numpy()
