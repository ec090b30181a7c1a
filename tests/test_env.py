"""Numeric settings from environment variables (rewrite/env.py): unset is the default, a bad value an error naming it."""
import pytest
from rewrite.env import env_number


def test_unset_or_blank_is_the_default(monkeypatch):
  monkeypatch.delenv("GRAFT_TEST_SETTING", raising=False)
  assert env_number("GRAFT_TEST_SETTING", 7, "a count") == 7
  monkeypatch.setenv("GRAFT_TEST_SETTING", "  ")
  assert env_number("GRAFT_TEST_SETTING", 7, "a count") == 7
  monkeypatch.setenv("GRAFT_TEST_SETTING", " 12 ")
  assert env_number("GRAFT_TEST_SETTING", 7, "a count") == 12


@pytest.mark.parametrize("value", ["many", "1.5", "-1"])
def test_an_integer_setting_refuses_what_is_not_one(monkeypatch, value):
  monkeypatch.setenv("GRAFT_TEST_SETTING", value)
  with pytest.raises(ValueError, match=rf"GRAFT_TEST_SETTING='{value}': set it to a count, an integer >= 0 \(default 7\)"):
    env_number("GRAFT_TEST_SETTING", 7, "a count")


@pytest.mark.parametrize("value", ["nan", "-0.5", "soon"])
def test_a_float_setting_refuses_nan_and_negatives(monkeypatch, value):
  monkeypatch.setenv("GRAFT_TEST_SETTING", value)
  with pytest.raises(ValueError, match="set it to seconds, a number >= 0"):
    env_number("GRAFT_TEST_SETTING", 20.0, "seconds", kind=float)


def test_the_settings_graft_reads_say_what_they_take(monkeypatch):
  from runtime.realize import debug_level
  from runtime.search import search_width
  from runtime.cpu import max_libraries
  monkeypatch.setenv("DEBUG", "verbose")
  with pytest.raises(ValueError, match=r"DEBUG='verbose': set it to a debug level"): debug_level()
  monkeypatch.setenv("DEBUG", "2")
  assert debug_level() == 2
  monkeypatch.setenv("GRAFT_SEARCH", "-1")
  with pytest.raises(ValueError, match=r"GRAFT_SEARCH='-1'.*>= 0"): search_width()
  monkeypatch.setenv("GRAFT_MAX_LIBRARIES", "0")   # a cap of no library would unload every kernel it builds
  with pytest.raises(ValueError, match=r"GRAFT_MAX_LIBRARIES='0'.*>= 1"): max_libraries()


def test_a_bad_debug_level_fails_before_anything_compiles(monkeypatch):
  import numpy as np
  from tensor import Tensor
  import runtime.realize as realize
  monkeypatch.setenv("DEBUG", "x")
  built = []
  monkeypatch.setattr(realize, "build_program", lambda *a, **k: built.append(1))
  with pytest.raises(ValueError, match="DEBUG='x'"): (Tensor(np.ones(4, np.float32)) + 1).numpy()
  assert not built


def test_a_switch_takes_0_or_1(monkeypatch):
  from runtime.cache import cache_dir
  monkeypatch.setenv("GRAFT_CACHE", "0")
  assert cache_dir() is None
  monkeypatch.setenv("GRAFT_CACHE", "false")   # before: anything but "0" left the cache on, silently
  with pytest.raises(ValueError, match=r"GRAFT_CACHE='false': 1 turns the disk cache on, 0 off \(default 1\)"): cache_dir()


def test_raw_texts_follow_every_change_of_the_environment(monkeypatch):
  from rewrite.env import EnvTexts
  texts = EnvTexts("GRAFT_TEST_ONE", "GRAFT_TEST_TWO")
  monkeypatch.delenv("GRAFT_TEST_ONE", raising=False)
  monkeypatch.setenv("GRAFT_TEST_TWO", "x")
  before = texts()
  assert before[0] is None and before[1] is not None
  monkeypatch.setenv("GRAFT_TEST_ONE", "1")
  monkeypatch.setenv("GRAFT_TEST_TWO", "y")
  after = texts()
  assert after[0] is not None and after[1] != before[1] and texts() == after
