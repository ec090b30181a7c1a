"""The rewrite viewer (rewrite/viz): what it records, its JSON form, and its page in a real browser.

The page test drives Debian's chromium through chromedriver (selenium): it is skipped where they are missing, except
in CI (CI=true), where the README's install command puts them there and a skip would hide a broken page.
"""
import json, os, re, shutil, subprocess, sys, tempfile, time
from pathlib import Path
import pytest
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, graph_rewrite, stats, viz
from rewrite.viz import page, layout
from tests.helpers import python_path

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("GRAFT_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def _run(args: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
  environment = {**os.environ, "DEVICE": "CPU", "GRAFT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": python_path(ROOT), **env}
  for name in ("DEBUG", "GRAFT_VIZ", "REWRITE_STATS", "GRAFT_SEARCH"):
    if name not in env: environment.pop(name, None)
  r = subprocess.run([sys.executable, *args], env=environment, capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert r.returncode == 0, f"{args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
  return r


@pytest.fixture(scope="module")
def mlp_json(tmp_path_factory) -> dict:
  """examples/mlp.py --small recorded through `python -m rewrite.viz -o x.json`."""
  tmp = tmp_path_factory.mktemp("viz_json")
  _run(["-m", "rewrite.viz", "-o", str(tmp / "mlp.json"), "examples/mlp.py", "--small"], tmp)
  return json.loads((tmp / "mlp.json").read_text())


def rewrites_in(scope: dict):
  for item in scope["items"]:
    if "items" in item: yield from rewrites_in(item)
    else: yield item


def in_order(wanted: list[str], stages: list[str]) -> bool:
  """wanted appear in stages in this order (other stages may come between)."""
  rest = iter(stages)
  return all(w in rest for w in wanted)


def scopes_in(scope: dict, kind: str):
  for item in scope["items"]:
    if "items" in item:
      if item["kind"] == kind: yield item
      yield from scopes_in(item, kind)


def test_json_holds_realizes_kernels_and_their_stages(mlp_json):
  d = mlp_json
  assert d["format"] == "graft-viz 1" and "mlp.py --small" in d["command"]
  realizes = list(scopes_in(d["root"], "realize"))
  assert len(realizes) == 1, "the warm calls reuse the first call's program: only the first realize runs the pipeline"
  assert "call   r_8_32_" in realizes[0]["attrs"]["program"]
  stages = [r["stage"] for r in realizes[0]["items"] if "stage" in r]
  assert in_order(["realize", "kernelize", "group", "host", "memory"], stages), stages
  kernels = list(scopes_in(realizes[0], "kernel"))
  assert kernels, "no kernel recorded"
  for k in kernels:
    stages = [r["stage"] for r in k["items"]]
    assert in_order(["views", "lower", "symbolic", "linearize"], stages) and stages[-1] == "linearize", stages
    assert k["name"] in k["attrs"]["source"] and k["attrs"]["plan"]
    assert d["kernel_times"][k["name"]], "the kernel's runs were not timed"
    last = d["nodes"][k["items"][-1]["after"]]
    assert last[0] == "SINK", "a kernel's last stage gives its linear list, a SINK"


def test_json_steps_name_real_rules_and_nodes(mlp_json):
  d = mlp_json
  nodes, rules = d["nodes"], d["rules"]
  for n, (op, dtype, arg, src) in enumerate(nodes):
    assert op in Ops.__members__ and all(s < n for s in src), "a node is numbered after its sources"
  steps = [s for r in rewrites_in(d["root"]) for s in r["steps"]]
  assert len(steps) > 100
  for rule, before, after, new_from, new_to, seconds in steps:
    assert before < len(nodes) and after < len(nodes) and new_from <= new_to <= len(nodes) and 0 <= seconds < 60
    assert before != after
  for r in rules:
    path, line = r["location"].rsplit(":", 1)
    assert (ROOT / path).is_file(), f"{r['location']} is not a file of the checkout"
    text = (ROOT / path).read_text().splitlines()
    assert r["source"] and r["source"].splitlines()[-1].strip() in "\n".join(text), f"{r['name']}'s source is not in {path}"
  fired = {rules[s[0]]["name"] for s in steps}
  assert {"index_view", "call_kernel"} <= fired, fired


def test_recording_changes_nothing_and_counts_what_the_engine_counts():
  x = UOp.variable("x", 0, 10)
  rules = PatternMatcher([(UPat(Ops.ADD, src=(UPat(name="a"), UPat(Ops.CONST, arg=0))), lambda a: a, "add_zero"),
                          (UPat(Ops.MUL, src=(UPat(name="a"), UPat(Ops.CONST, arg=1))), lambda a: a, "mul_one")], name="simplify")
  expr = ((x + 0) * 1 + 0) * 1 * 2
  plain = graph_rewrite(expr, rules)
  with viz.record() as rec, stats.collect() as st:
    recorded = graph_rewrite(expr, rules)
  assert recorded is plain
  (r,) = rec.root.items
  # (x + 0) * 1 becomes x, and so x + 0 and x * 1 again are nodes already done (hash-consing): two rewrites
  assert r.stage == "simplify" and len(r.steps) == st.stages["simplify"].rewrites == 2
  assert [rec.rules[s.rule].name for s in r.steps] == ["add_zero", "mul_one"]
  assert rec.nodes[r.after][0] == "MUL" and rec.rules[0].location.endswith(f"test_viz.py:{rec.rules[0].fn.__code__.co_firstlineno}")
  assert viz.recorder is None, "record() puts back what was recording before"


def test_per_rule_statistics_are_counted_while_recording():
  x = UOp.variable("x", 0, 10)
  rules = PatternMatcher([(UPat(Ops.ADD, src=(UPat(name="a"), UPat(Ops.CONST, arg=0))), lambda a: a, "add_zero")],
                         name="add_zero_only")
  with stats.collect(level=2) as plain: graph_rewrite((x + 0) * 2 + 0, rules)
  with viz.record(), stats.collect(level=2) as recorded: graph_rewrite((x + 0) * 2 + 0, rules)
  counts = lambda st: {(r.name, r.matches, r.attempts) for r in st.rules.values() if r.stage == "add_zero_only"}
  assert counts(recorded) == counts(plain) == {("add_zero", 2, 2)}


def test_a_rule_that_raises_is_recorded_with_its_error():
  def broken(a): raise ZeroDivisionError("no")
  rules = PatternMatcher([(UPat(Ops.NEG, name="a"), broken)], name="broken")
  with viz.record() as rec, pytest.raises(Exception, match="broken"):
    graph_rewrite(-UOp.const(dtypes.float32, 1.0), rules)
  (r,) = rec.root.items
  assert r.after is None and "ZeroDivisionError" in r.error


def test_nothing_is_recorded_while_paused_or_off():
  rules = PatternMatcher([(UPat(Ops.NEG, src=(UPat(Ops.NEG, src=(UPat(name="a"),)),)), lambda a: a)])
  e = -(-UOp.const(dtypes.float32, 2.0))
  with viz.record() as rec:
    with viz.paused(): graph_rewrite(e, rules)
    with viz.scope("kernel", "k") as k:
      graph_rewrite(e, rules, name="inside")
  assert rec.root.items == [k] and [r.stage for r in k.items] == ["inside"]
  assert viz.recorder is None and graph_rewrite(e, rules) is UOp.const(dtypes.float32, 2.0)


def test_kernel_sources_are_recorded_as_a_plan(on_cpu):
  import numpy as np
  from tensor import Tensor
  y = Tensor(np.arange(6, dtype=np.float32)) * 2 + 1
  with viz.record() as rec: y.kernel_sources()
  (plan,) = rec.root.items
  assert plan.kind == "plan" and plan.name == "1 kernels, 1 steps (planned, not run)" and "call" in plan.attrs["program"]
  (kernel,) = [s for s in plan.items if isinstance(s, viz.Scope)]
  assert kernel.kind == "kernel" and kernel.name.startswith("E_6_") and kernel.name in kernel.attrs["source"]


def test_pages_split_big_graphs_and_draw_every_node(tmp_path):
  if not layout.available(): pytest.skip("Graphviz's dot is not installed")
  x = UOp.variable("x", 0, 10)
  e = x
  for i in range(600): e = e * 3 + i   # a chain of 1801 nodes
  rec = viz.Recorder()
  root = rec.node(e)
  ids = layout.under(rec.nodes, root)
  pages = layout.paginate(rec.nodes, ids)
  assert len(pages) > 1 and sorted(sum(pages, [])) == ids and all(len(p) <= layout.PAGE_NODES for p in pages)
  page_of = {n: i for i, p in enumerate(pages) for n in p}
  svgs = layout.render([layout.dot_source(rec.nodes, p, page_of) for p in pages])
  drawn = {int(m) for s in svgs for m in re.findall(r'class="node u(\d+)"', s)}
  assert {n for n in ids if rec.nodes[n][3]} <= drawn, "every node with sources is drawn on its page"


def test_page_without_graphviz_lists_graphs_as_text(tmp_path, monkeypatch):
  monkeypatch.setattr(layout, "available", lambda: False)
  rules = PatternMatcher([(UPat(Ops.NEG, src=(UPat(Ops.NEG, src=(UPat(name="a"),)),)), lambda a: a)])
  with viz.record(str(tmp_path / "p.html")):
    graph_rewrite(-(-UOp.const(dtypes.float32, 2.0)), rules)
  text = (tmp_path / "p.html").read_text()
  assert "dot was not found" in text and "<svg" not in text


def test_bad_graft_viz_is_an_error(tmp_path):
  r = subprocess.run([sys.executable, "-c", "import rewrite"], env={**os.environ, "GRAFT_VIZ": "out.txt", "PYTHONPATH": python_path(ROOT)},
                     capture_output=True, text=True, cwd=tmp_path)
  assert r.returncode != 0 and "ending in .html" in r.stderr


# ---- the page, in a real browser

def _browser():
  try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
  except ImportError: webdriver = None
  chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
  if webdriver is None or not chromium or not driver:
    if os.environ.get("CI"): pytest.fail("CI must test the page in a browser: install chromium, chromium-driver, selenium (README)")
    pytest.skip("chromium, chromedriver or selenium missing")
  options = webdriver.ChromeOptions()
  options.binary_location = chromium
  for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", f"--user-data-dir={tempfile.mkdtemp(prefix='graft-chromium-')}",
            "--window-size=1400,1000"]: options.add_argument(a)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  return webdriver.Chrome(service=Service(driver), options=options)


def test_page_of_mlp_in_a_browser(tmp_path):
  if not layout.available():
    if os.environ.get("CI"): pytest.fail("CI must draw graphs: install graphviz (README)")
    pytest.skip("Graphviz's dot is not installed")
  out = tmp_path / "mlp.html"
  r = _run(["examples/mlp.py", "--small"], tmp_path, GRAFT_VIZ=str(out))
  assert f"GRAFT_VIZ: wrote {out}" in r.stderr
  browser = _browser()
  from selenium.webdriver.common.by import By
  try:
    browser.get(out.as_uri())
    for _ in range(200):
      if browser.execute_script("return document.body.dataset.ready"): break
      time.sleep(0.05)
    assert browser.execute_script("return document.body.dataset.ready") == "1", "the page did not start"
    nav = browser.find_element(By.ID, "nav")
    kernels = nav.find_elements(By.CSS_SELECTOR, "details.nav-kernel > summary")
    assert kernels and all(re.fullmatch(r"kernel r_8_32_[0-9a-f]{8}", k.text) for k in kernels)
    stages = [e.text.split()[0] for e in nav.find_elements(By.CSS_SELECTOR, "details.nav-realize > .nav-stage")]
    assert in_order(["realize", "kernelize", "group", "host", "memory"], stages), stages
    # a kernel's stages, then one stage: its graphs as SVG, then stepping to its first rule application
    kernels[0].click()
    stages = {e.text.split()[0]: e for e in nav.find_elements(By.CSS_SELECTOR, "details.nav-kernel .nav-stage")}
    assert {"views", "lower", "symbolic", "linearize"} <= set(stages)
    assert browser.find_elements(By.CSS_SELECTOR, "pre.source") and "r_8_32_" in browser.find_element(By.CSS_SELECTOR, "pre.source").text
    stages["lower"].click()
    assert browser.find_element(By.ID, "stage-title").text.startswith("stage lower")
    assert len(browser.find_elements(By.CSS_SELECTOR, ".graph svg g.node")) > 10, "no graph drawn as SVG"
    browser.find_element(By.ID, "first").click()
    browser.find_element(By.ID, "next").click()
    assert browser.find_element(By.ID, "step-index").text == "step 1 of " + browser.find_element(By.ID, "step-index").text.split()[-1]
    rule, loc = browser.find_element(By.ID, "step-rule").text, browser.find_element(By.ID, "step-loc").text
    assert re.fullmatch(r"rules/lower\.py:\d+", loc), loc
    path, line = loc.split(":")
    assert rule in "\n".join((ROOT / path).read_text().splitlines()[int(line) - 1:int(line) + 3]), f"{rule} is not at {loc}"
    assert browser.find_elements(By.CSS_SELECTOR, "#step-graph svg g.node"), "the step is not drawn"
    assert browser.find_elements(By.CSS_SELECTOR, ".graph g.hl-result, .graph g.hl-matched"), "no node highlighted"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "viz-mlp.png"))
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not errors, errors
  finally: browser.quit()


def test_ci_runs_the_readmes_two_commands():
  """The README starts with the install command and the test command, and .ci/run runs exactly those."""
  readme = (ROOT / "README.md").read_text()
  install, test = re.search(r"\A# Graft\n\n```\n(.*)\n(.*)\n```\n", readme).groups()
  assert install.startswith("apt-get update && apt-get install -y") and "graphviz chromium chromium-driver" in install
  assert install.endswith("python3 -m pip install -e '.[dev]'") and test == "python3 -m pytest -q"
  packages = re.search(r"apt-get install -y (.*?) &&", install).group(1)
  ci = (ROOT / ".ci" / "run").read_text()
  assert f"apt-get install -y -qq {packages} " in ci, "CI installs other system packages than the README says"
  assert "\npython3 -m pip install -q -e '.[dev]' || exit $?\n" in ci and f"\n{test}\n" in ci
