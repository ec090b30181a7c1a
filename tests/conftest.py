"""Fixtures more than one test module needs."""
import pytest
from runtime import cache


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
  """A private, empty compile cache for one test (on disk and in memory); its directory is the value."""
  monkeypatch.setenv("GRAFT_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("GRAFT_CACHE", raising=False)
  cache.clear_memory()
  yield tmp_path / "cache"
  cache.clear_memory()


@pytest.fixture
def on_cpu(monkeypatch):
  """Run the test on the CPU whatever DEVICE says: for tests of the CPU's own code paths (its optimization
  vocabulary, its C, its BLAS), which a `DEVICE=CUDA` run of the suite must still check as CPU tests."""
  monkeypatch.setenv("DEVICE", "CPU")
