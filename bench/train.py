"""One training step of a GPT-2-style language model (../shared/WORKLOADS.md `gpt_train`), Graft against torch eager.

A step: token embedding (vocabulary 8192), the gpt stack (pre-layernorm, causal attention, GELU MLP 4x, residuals),
the output projection tied to the embedding, cross-entropy against integer targets, backward, AdamW. Each framework
runs in its own process (bench/isolated.py) on new random token ids every step; the model is the same (GPT-2's
initialization, seed 0; attention written out as products and a softmax in both, as examples/train_gpt.py does).

  python3 bench/train.py                         # CPU size: 4 layers, 64 tokens, width 256, batch 4, 4 heads
  python3 bench/train.py --device CUDA --layers 12 --tokens 1024 --width 768 --heads 12
  python3 bench/train.py --quick                 # tiny, for the smoke test
  python3 bench/train.py --only graft-jit,torch  # some of the rows

Rows: `graft` (the step as a user writes it: the graph built and its program found on every step), `graft-jit` (the
same step under `tensor.jit`: from the third step on, the recorded programs replay on the new token ids, writing the
parameters and AdamW's state in place; no graph is built), `torch` (eager).

Reported per framework: the first step (cold: compiles for Graft), the median of the warm steps, and memory: the
process's peak resident memory above what it held after importing the framework (the model, its gradients, the
optimizer's state and the step's temporaries), with the peak resident total beside it.
"""
from __future__ import annotations
import argparse, json, math, os, resource, statistics, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]
from isolated import report, run_isolated  # noqa: E402


def rss_mb() -> float:
  with open("/proc/self/statm") as f: return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float: return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def token_batches(cfg: dict):
  import numpy as np
  rng = np.random.default_rng(1)
  while True:
    ids = rng.integers(0, cfg["vocab"], (cfg["batch"], cfg["tokens"] + 1)).astype(np.int32)
    yield ids[:, :-1], ids[:, 1:]


def graft_worker(cfg: dict, use_jit: bool = False) -> dict:
  from tensor import Tensor, jit
  from tensor.optim import AdamW
  from train_gpt import GPTLM
  base = rss_mb()
  model = GPTLM(cfg["vocab"], cfg["tokens"], cfg["layers"], cfg["width"], cfg["heads"])
  opt = AdamW(model.parameters(), lr=1e-4)
  feed = token_batches(cfg)
  def train_step(ids: Tensor, targets: Tensor) -> Tensor:
    loss = model.loss(ids, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
  run = jit(train_step) if use_jit else train_step   # jit: from the third step on, the recorded programs replay
  def step() -> float:
    ids, targets = next(feed)
    return run(Tensor(ids), Tensor(targets)).item()
  return measure(step, cfg, base)


def torch_worker(cfg: dict) -> dict:
  import numpy as np
  import torch
  import torch.nn.functional as F
  device = "cuda" if cfg["device"] == "CUDA" else "cpu"
  base = rss_mb()
  rng = np.random.default_rng(0)
  def param(*shape, value=None):
    data = np.full(shape, value, np.float32) if value is not None else rng.standard_normal(shape, np.float32) * 0.02
    return torch.tensor(data, device=device, requires_grad=True)
  V, T, L, D, H = cfg["vocab"], cfg["tokens"], cfg["layers"], cfg["width"], cfg["heads"]
  wte, wpe = param(V, D), param(T, D)
  blocks = [dict(ln1_g=param(D, value=1.0), ln1_b=param(D, value=0.0), qkv_w=param(D, 3 * D), qkv_b=param(3 * D, value=0.0),
                 proj_w=param(D, D), proj_b=param(D, value=0.0), ln2_g=param(D, value=1.0), ln2_b=param(D, value=0.0),
                 fc_w=param(D, 4 * D), fc_b=param(4 * D, value=0.0), out_w=param(4 * D, D), out_b=param(D, value=0.0))
            for _ in range(L)]
  lnf_g, lnf_b = param(D, value=1.0), param(D, value=0.0)
  params = [wte, wpe, *(t for b in blocks for t in b.values()), lnf_g, lnf_b]
  opt = torch.optim.AdamW(params, lr=1e-4)
  causal = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)

  def forward(ids):
    B = ids.shape[0]
    x = wte[ids] + wpe[:T]
    for b in blocks:
      h = F.layer_norm(x, (D,), b["ln1_g"], b["ln1_b"])
      q, k, v = (h @ b["qkv_w"] + b["qkv_b"]).reshape(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
      s = (q @ k.transpose(-1, -2) * (1 / math.sqrt(D // H))).masked_fill(causal, -math.inf)
      a = (s.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, T, D)
      x = x + a @ b["proj_w"] + b["proj_b"]
      h = F.layer_norm(x, (D,), b["ln2_g"], b["ln2_b"])
      x = x + F.gelu(h @ b["fc_w"] + b["fc_b"], approximate="tanh") @ b["out_w"] + b["out_b"]
    return F.layer_norm(x, (D,), lnf_g, lnf_b) @ wte.T

  feed = token_batches(cfg)
  def step() -> float:
    ids, targets = next(feed)
    ids, targets = torch.from_numpy(ids).long().to(device), torch.from_numpy(targets).long().to(device)
    loss = F.cross_entropy(forward(ids).reshape(-1, V), targets.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    out = loss.item()   # waits for the device
    return out
  return measure(step, cfg, base)


def measure(step, cfg: dict, base: float) -> dict:
  t0 = time.perf_counter()
  first_loss = step()
  cold = time.perf_counter() - t0
  for _ in range(cfg["warmup"]): step()
  times, losses = [], []
  for _ in range(cfg["steps"]):
    t0 = time.perf_counter()
    losses.append(step())
    times.append(time.perf_counter() - t0)
  return {"cold_ms": cold * 1e3, "warm_ms": statistics.median(times) * 1e3, "first_loss": first_loss,
          "last_loss": losses[-1], "mem_mb": peak_mb() - base, "peak_rss_mb": peak_mb()}


WORKERS = {"graft": graft_worker, "graft-jit": lambda cfg: graft_worker(cfg, use_jit=True), "torch": torch_worker}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--device", default=os.environ.get("DEVICE", "CPU"))
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--width", type=int, default=256)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--steps", type=int, default=10, help="warm steps timed (median reported)")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--quick", action="store_true", help="1 layer, 16 tokens, width 32, vocabulary 64, 3 steps")
  ap.add_argument("--only", default=None, help="comma-separated frameworks of graft, graft-jit, torch")
  ap.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
  ap.add_argument("--config", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    cfg = json.loads(args.config)
    os.environ["DEVICE"] = cfg["device"]
    report(lambda: WORKERS[args.worker](cfg))
    return
  cfg = dict(device=args.device, layers=args.layers, tokens=args.tokens, width=args.width, heads=args.heads,
             batch=args.batch, vocab=args.vocab, steps=args.steps, warmup=args.warmup)
  if args.quick: cfg.update(layers=1, tokens=16, width=32, heads=2, batch=2, vocab=64, steps=3, warmup=1)
  # the root ahead of what this process was given: a child finds what the parent found (cffi carried on a GPU host)
  env = {**os.environ, "DEVICE": cfg["device"], "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
  results = {}
  for fw in (args.only.split(",") if args.only else list(WORKERS)):
    if fw not in WORKERS: ap.error(f"--only: unknown framework {fw!r} (of {', '.join(WORKERS)})")
    res, err = run_isolated([sys.executable, __file__, "--worker", fw, "--config", json.dumps(cfg)], env, timeout=3600)
    results[fw] = res
    if err: print(f"  ! {fw}: {err}")
  print(f"gpt_train: {cfg['layers']} layers, {cfg['tokens']} tokens, width {cfg['width']}, {cfg['heads']} heads, "
        f"batch {cfg['batch']}, vocabulary {cfg['vocab']}, AdamW; {cfg['device']}; warm = median of {cfg['steps']} steps")
  print("| framework | cold ms | warm ms | loss first -> last | memory MB (peak above imports) | peak RSS MB |")
  print("|---|---|---|---|---|---|")
  for fw, r in results.items():
    if r is None: print(f"| {fw} | - | - | - | - | - |"); continue
    print(f"| {fw} | {r['cold_ms']:.0f} | {r['warm_ms']:.1f} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | "
          f"{r['mem_mb']:.0f} | {r['peak_rss_mb']:.0f} |")
  t = results.get("torch")
  for fw in ("graft", "graft-jit"):
    if (g := results.get(fw)) and t:
      print(f"{fw} speed / torch eager: {t['warm_ms'] / g['warm_ms']:.2f}x (above 1: Graft faster); "
            f"memory {fw} / torch: {g['mem_mb'] / t['mem_mb']:.2f}x")


if __name__ == "__main__":
  main()
