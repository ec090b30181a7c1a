"""Progress on stderr (runtime/progress.py): a live line on a terminal, plain lines at DEBUG=1, silent otherwise; and
the plan search and the compile of a realize's kernels using it."""
import io, re
import numpy as np
import pytest
from runtime import progress
from runtime.progress import Progress


class Terminal(io.StringIO):
  def isatty(self): return True


@pytest.fixture
def no_delay(monkeypatch):
  """The live line from the start, redrawn at every news; DEBUG unset."""
  monkeypatch.delenv("DEBUG", raising=False)
  monkeypatch.setattr(progress, "DELAY", 0.0)
  monkeypatch.setattr(progress, "EVERY", 0.0)


def test_live_line_on_a_terminal_is_redrawn_and_erased(no_delay):
  out = Terminal()
  with Progress("compiling", stream=out) as p:
    p.show("kernel 1 of 2")
    p.line("kernel 2 of 2")
  assert out.getvalue() == "\r\x1b[Kcompiling: kernel 1 of 2\r\x1b[Kcompiling: kernel 2 of 2\r\x1b[K"


def test_plain_lines_at_debug_1_and_silence_elsewhere(no_delay, monkeypatch):
  monkeypatch.setenv("DEBUG", "1")
  out = Terminal()
  with Progress("search", stream=out) as p:
    p.show("live news only")
    p.line("round 1")
  assert out.getvalue() == "search: round 1\n"
  monkeypatch.delenv("DEBUG")
  quiet = io.StringIO()   # not a terminal
  with Progress("search", stream=quiet) as p: p.show("x"); p.line("y")
  assert quiet.getvalue() == ""


def test_a_quick_job_draws_nothing(no_delay, monkeypatch):
  monkeypatch.setattr(progress, "DELAY", 60.0)
  out = Terminal()
  with Progress("compiling", stream=out) as p: p.show("kernel 1 of 1")
  assert out.getvalue() == ""


def test_search_and_compile_report_at_debug_1(capsys, monkeypatch, cache_env, on_cpu):
  from tensor import Tensor
  monkeypatch.setenv("DEBUG", "1")
  monkeypatch.setenv("GRAFT_SEARCH", "1")
  monkeypatch.setenv("GRAFT_SEARCH_SECONDS", "5")   # a round begins once the heuristic's plan is timed: on a loaded machine, seconds
  monkeypatch.setenv("GRAFT_EXTERN", "0")
  a = np.random.default_rng(1).standard_normal((24, 24)).astype(np.float32)
  np.testing.assert_allclose((Tensor(a) @ Tensor(a) + 1).numpy(), a @ a + 1, rtol=1e-4, atol=1e-4)
  lines = capsys.readouterr().err.splitlines()
  assert any(re.fullmatch(r"plan search 24x24x24: round 1, best \d+\.\d{3} ms \(heuristic \d+\.\d{3} ms\), \d+ plans timed, "
                          r"\d+\.\d of 5 s.*", l) for l in lines), lines
  assert any(re.fullmatch(r"compiling: kernel 1 of 1: r_24_24_[0-9a-f]{8}, plan .*\[search\]", l) for l in lines), lines
  assert "compiling: building 1 kernels for CPU in one compiler call" in lines


def test_a_search_out_of_time_before_its_first_round_says_so(capsys, monkeypatch, cache_env, on_cpu):
  from tensor import Tensor
  monkeypatch.setenv("DEBUG", "1")
  monkeypatch.setenv("GRAFT_SEARCH", "1")
  monkeypatch.setenv("GRAFT_SEARCH_SECONDS", "0")
  monkeypatch.setenv("GRAFT_EXTERN", "0")
  a = np.ones((8, 8), np.float32)
  np.testing.assert_allclose((Tensor(a) @ Tensor(a)).numpy(), a @ a)
  assert any(re.fullmatch(r"plan search 8x8x8: the budget \(0 s\) went on timing the heuristic's plan: \d+\.\d{3} ms", l)
             for l in capsys.readouterr().err.splitlines())
