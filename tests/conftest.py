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
