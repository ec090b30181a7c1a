"""Model workloads of WORKLOADS.md (`gpt`): Graft side by side with torch eager (and torch.compile on a GPU).

  python bench/models.py                          # CPU: 12 layers, 128 tokens, width 768, float32
  python bench/models.py --device CUDA            # GPU: 12 layers, 1024 tokens, width 768, float32 and float16
  python bench/models.py --layers 2 --tokens 16 --width 64 --heads 4   # a quick run

The model is examples/gpt.py (pre-layernorm, causal attention, GELU(tanh) MLP 4x, residuals; weights normal * 0.02,
seed 0); torch runs the same forward on the same weights. Each row runs in a fresh process of its own, Graft with an
empty GRAFT_CACHE_DIR, torch.compile with an empty TORCHINDUCTOR_CACHE_DIR. A new input tensor every call (the
inputs sit on the device before the clock starts); every call ends with the device synchronized.
  - cold: the process's first call (graph build, scheduling, codegen, compile, run);
  - warm: median of 20 calls after 3 warm-ups, a new input each call;
  - same: (Graft) the same, every call on one input tensor: the cached program is found either way, so new/same is
    what new data costs;
  - kernel: (Graft) the device's share of a run of the program (each kernel timed alone by the device's events, other
    steps by the clock; median of 5 runs);
    host = warm - kernel;
  - peak: resident memory of the process (CPU), or device memory held (GPU: Graft's allocator incl. its pool, torch's
    max_memory_reserved);
  - graft jit: `jit(model.forward)`: call 1 as usual, call 2 captures, then the same warm median (on a GPU the replay
    runs as CUDA graphs; `jit-launches` is the same with GRAFT_CUDA_GRAPH=0, kernel by kernel);
  - graft 1 layer cold: the first call of a 1-layer model in its own process (first-call scaling: 12 layers / 1);
  - err: largest absolute difference from numpy float64 on the same weights, over the largest absolute reference.
"""
from __future__ import annotations
import argparse, json, math, os, resource, shutil, statistics, sys, tempfile, time
import numpy as np
from isolated import report, run_isolated  # bench/isolated.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "examples"))
WARMUPS, REPEATS = 3, 20


def inputs(tokens: int, width: int, n: int, dtype) -> list[np.ndarray]:
  rng = np.random.default_rng(1)
  return [rng.standard_normal((tokens, width), np.float32).astype(dtype) for _ in range(n)]


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
  return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


def reference(a) -> np.ndarray:
  """numpy float64 on the float32 weights (float16 models are compared with it too)."""
  from gpt import numpy_weights, forward_numpy_weights
  return forward_numpy_weights(numpy_weights(a.layers, a.width), a.heads, inputs(a.tokens, a.width, 1, np.float32)[0])


def median_ms(call, make_input, n: int = REPEATS) -> float:
  ts = []
  for i in range(n):
    x = make_input(i)
    t0 = time.perf_counter(); call(x); ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def peak_rss_mib() -> float: return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- workers: one framework, one process ----
def graft_worker(a) -> dict:
  from tensor import Tensor, dtypes, jit
  from runtime.device import get_device
  from runtime.realize import find_program
  from gpt import GPT
  dev = get_device(a.device)
  held = {"now": 0, "peak": 0}
  if a.device == "CUDA":   # device memory held, the allocator's pool included
    alloc, free = dev.allocator._alloc, dev.allocator._free
    def tracked_alloc(n):
      h = alloc(n); held["now"] += n; held["peak"] = max(held["peak"], held["now"]); return h
    def tracked_free(h, n): free(h, n); held["now"] -= n
    dev.allocator._alloc, dev.allocator._free = tracked_alloc, tracked_free
  dtype = dtypes.float16 if a.dtype == "f16" else dtypes.float32
  model = GPT(a.layers, a.width, a.heads, dtype)
  xs = [Tensor(x, device=a.device) for x in inputs(a.tokens, a.width, WARMUPS + REPEATS + 1, dtype.np)]
  for x in xs: x.realize()
  dev.synchronize()
  forward = jit(model.forward) if a.mode == "jit" else model.forward
  def call(x):
    out = forward(x).realize()
    dev.synchronize()
    return out
  t0 = time.perf_counter(); out = call(xs[0]); cold = (time.perf_counter() - t0) * 1e3
  res = {"cold_ms": cold}
  if a.mode == "cold": return res
  got = out.cast(dtypes.float32).numpy()
  if a.mode == "jit": call(xs[1])   # the capture
  for i in range(WARMUPS): call(xs[1 + i])
  res["warm_ms"] = median_ms(call, lambda i: xs[1 + WARMUPS + i])
  if a.mode == "plain":   # new against same input, in alternating rounds (a shared machine's load falls on both)
    new, same = [], []
    for r in range(3):
      same.append(median_ms(call, lambda i: xs[0], 5)); new.append(median_ms(call, lambda i: xs[1 + (i + r) % REPEATS], 5))
    res["new_ms"], res["same_ms"] = statistics.median(new), statistics.median(same)
  out = model.forward(xs[2])
  program, params = find_program([(out.uop, out.device)])
  runs = []
  for _ in range(5):
    seconds: list[float] = []
    program.run(params, step_seconds=seconds)
    runs.append(sum(seconds) * 1e3)
  res["kernel_ms"] = statistics.median(runs)
  res["peak_mib"] = held["peak"] / 2**20 if a.device == "CUDA" else peak_rss_mib()
  res["err"] = rel_err(got, reference(a)) if a.check else None
  return res


def torch_worker(a) -> dict:
  import torch
  from gpt import numpy_weights
  device = "cuda" if a.device == "CUDA" else "cpu"
  dtype = torch.float16 if a.dtype == "f16" else torch.float32
  blocks, final = numpy_weights(a.layers, a.width)
  W = [{k: torch.from_numpy(v).to(device, dtype) for k, v in b.items()} for b in blocks]
  F = {k: torch.from_numpy(v).to(device, dtype) for k, v in final.items()}
  H, D = a.heads, a.width
  def forward(x):
    T = x.shape[0]
    mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    for b in W:
      h = torch.nn.functional.layer_norm(x, (D,), b["ln1_g"], b["ln1_b"])
      q, k, v = (h @ b["qkv_w"] + b["qkv_b"]).view(T, 3, H, D // H).permute(1, 2, 0, 3)
      s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(D // H))
      p = s.masked_fill(mask, float("-inf")).softmax(-1)
      x = x + (p @ v).permute(1, 0, 2).reshape(T, D) @ b["proj_w"] + b["proj_b"]
      h = torch.nn.functional.layer_norm(x, (D,), b["ln2_g"], b["ln2_b"])
      x = x + torch.nn.functional.gelu(h @ b["fc_w"] + b["fc_b"], approximate="tanh") @ b["out_w"] + b["out_b"]
    return torch.nn.functional.layer_norm(x, (D,), F["lnf_g"], F["lnf_b"])
  fn = torch.compile(forward) if a.mode == "compile" else forward
  xs = [torch.from_numpy(x).to(device, dtype) for x in inputs(a.tokens, a.width, WARMUPS + REPEATS + 1, np.float32)]
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  def call(x):
    with torch.no_grad(): out = fn(x)
    sync()
    return out
  t0 = time.perf_counter(); out = call(xs[0]); cold = (time.perf_counter() - t0) * 1e3
  for i in range(WARMUPS): call(xs[1 + i])
  warm = median_ms(call, lambda i: xs[1 + WARMUPS + i])
  peak = torch.cuda.max_memory_reserved() / 2**20 if device == "cuda" else peak_rss_mib()
  err = rel_err(out.float().cpu().numpy(), reference(a)) if a.check else None
  return {"cold_ms": cold, "warm_ms": warm, "peak_mib": peak, "err": err}


# ---- the parent: one process per row, one table ----
ROWS = [("graft", "plain"), ("graft", "jit"), ("graft", "jit-launches"), ("graft", "cold1"), ("torch", "eager"),
        ("torch", "compile")]
GPU_ONLY = ("compile", "jit-launches")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--device", default="CPU", choices=["CPU", "CUDA"])
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--tokens", type=int)
  ap.add_argument("--width", type=int, default=768)
  ap.add_argument("--heads", type=int, default=12)
  ap.add_argument("--dtypes", default=None, help="f32,f16 (default: f32 on the CPU, both on a GPU)")
  ap.add_argument("--only", default=None, help="rows to run: " + ",".join(f"{f}-{m}" for f, m in ROWS))
  ap.add_argument("--no-check", dest="check", action="store_false", help="skip the numpy float64 reference")
  ap.add_argument("--check", dest="check", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--timeout", type=float, default=900)
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
  ap.add_argument("--dtype", default="f32", help=argparse.SUPPRESS)
  a = ap.parse_args()
  a.tokens = a.tokens or (1024 if a.device == "CUDA" else 128)
  if a.worker == "graft": return report(lambda: graft_worker(a))
  if a.worker == "torch": return report(lambda: torch_worker(a))
  rows = [(f, m) for f, m in ROWS if a.device == "CUDA" or m not in GPU_ONLY]
  if a.only: rows = [r for r in rows if f"{r[0]}-{r[1]}" in a.only.split(",")]
  print(f"gpt: {a.layers} layers, {a.tokens} tokens, width {a.width}, {a.heads} heads on {a.device}")
  for dt in (a.dtypes or ("f32,f16" if a.device == "CUDA" else "f32")).split(","):
    print(f"\n{dt}: {'row':<18s} {'cold ms':>9s} {'warm ms':>9s} {'peak MiB':>9s} {'err':>8s}  notes")
    found = {}
    for f, m in rows:
      cache = tempfile.mkdtemp(prefix="graft-models-")
      env = {**os.environ, "DEBUG": "0", "DEVICE": a.device, "GRAFT_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": cache,
             "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
      mode, layers = ("cold", 1) if m == "cold1" else ("jit", a.layers) if m == "jit-launches" else (m, a.layers)
      if m == "jit-launches": env["GRAFT_CUDA_GRAPH"] = "0"   # the jit's replay launch by launch, not as CUDA graphs
      cmd = [sys.executable, os.path.abspath(__file__), "--worker", f, "--mode", mode, "--dtype", dt, "--device", a.device,
             "--layers", str(layers), "--tokens", str(a.tokens), "--width", str(a.width), "--heads", str(a.heads)]
      if a.check and m not in ("cold1",): cmd.append("--check")
      res, why = run_isolated(cmd, env, a.timeout)
      shutil.rmtree(cache, ignore_errors=True)
      name = f"{f} {'1 layer cold' if m == 'cold1' else m}"
      if res is None: print(f"    {name:<18s} failed: {why}"); continue
      found[(f, m)] = res
      notes = []
      if "new_ms" in res: notes.append(f"new/same input {res['new_ms']:.2f}/{res['same_ms']:.2f} ms = {res['new_ms'] / res['same_ms']:.3f}x")
      if "kernel_ms" in res:
        host = res["warm_ms"] - res["kernel_ms"]
        notes.append(f"kernels {res['kernel_ms']:.2f} ms, host {host:.2f} ms = {100 * host / res['warm_ms']:.1f}% of the call")
      fmt = lambda k, spec: format(res[k], spec) if res.get(k) is not None else "-"
      print(f"    {name:<18s} {fmt('cold_ms', '9.1f')} {fmt('warm_ms', '9.2f')} {fmt('peak_mib', '9.0f')} {fmt('err', '8.1e')}  {'; '.join(notes)}",
            flush=True)
    if ("graft", "plain") in found and ("graft", "cold1") in found:
      r = found[("graft", "plain")]["cold_ms"] / found[("graft", "cold1")]["cold_ms"]
      print(f"    first call, {a.layers} layers / 1 layer: {r:.2f}x")
    for peer in ("eager", "compile"):
      if ("graft", "jit") in found and ("torch", peer) in found:
        print(f"    warm, torch {peer} / graft jit: {found[('torch', peer)]['warm_ms'] / found[('graft', 'jit')]['warm_ms']:.3f}x")


if __name__ == "__main__":
  main()
