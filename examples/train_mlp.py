"""Training a small MLP on synthetic data with backward() and an optimizer: the loss of every step, with a progress bar.

  DEVICE=CPU python examples/train_mlp.py                  # 200 steps, AdamW
  DEVICE=CPU python examples/train_mlp.py --optimizer sgd  # SGD with momentum
  DEVICE=CPU python examples/train_mlp.py --small          # 30 quick steps (what the tests run)

The data: points x in [-2, 2]^2 and a target y = sin(2 x0) * cos(x1) + 0.5 x0 x1 the network learns to fit.
"""
import argparse, sys, time
import numpy as np
from tensor import Tensor
from tensor.optim import AdamW, SGD


def progress(step: int, total: int, loss: float, width: int = 30) -> str:
  done = width * step // total
  return f"[{'#' * done}{'.' * (width - done)}] step {step:4d}/{total}  loss {loss:.5f}"


class MLP:
  def __init__(self, sizes: list[int], rng: np.random.Generator):
    # torch.nn.Linear's initialization: uniform in +-1/sqrt(fan_in)
    self.layers = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
      bound = 1 / np.sqrt(fan_in)
      w = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
      b = rng.uniform(-bound, bound, fan_out).astype(np.float32)
      self.layers.append((Tensor(w, requires_grad=True), Tensor(b, requires_grad=True)))

  def __call__(self, x: Tensor) -> Tensor:
    for i, (w, b) in enumerate(self.layers):
      x = x.linear(w, b)
      if i < len(self.layers) - 1: x = x.gelu()
    return x

  def parameters(self) -> list[Tensor]: return [t for layer in self.layers for t in layer]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="30 steps of a narrow network (what the tests run)")
  ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
  ap.add_argument("--steps", type=int, default=None)
  args = ap.parse_args()
  steps = args.steps or (30 if args.small else 200)
  width, batch = (32, 64) if args.small else (128, 256)

  rng = np.random.default_rng(0)
  x = rng.uniform(-2, 2, (batch, 2)).astype(np.float32)
  y = (np.sin(2 * x[:, :1]) * np.cos(x[:, 1:]) + 0.5 * x[:, :1] * x[:, 1:]).astype(np.float32)
  model = MLP([2, width, width, 1], rng)
  opt = AdamW(model.parameters(), lr=1e-2) if args.optimizer == "adamw" else SGD(model.parameters(), lr=0.05, momentum=0.9)
  X, Y = Tensor(x), Tensor(y)

  tty, losses, t0 = sys.stdout.isatty(), [], time.perf_counter()
  for step in range(1, steps + 1):
    loss = ((model(X) - Y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()                      # one realize: forward, backward and the update
    losses.append(loss.item())      # realized by the step already
    print(("\r" if tty else "") + progress(step, steps, losses[-1]), end="" if tty else "\n", flush=True)
  if tty: print()
  secs = time.perf_counter() - t0
  print(f"{steps} steps in {secs:.2f} s ({secs / steps * 1e3:.1f} ms a step, the first ones compile); "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
  if losses[-1] < 0.5 * losses[0]: print("ok")


if __name__ == "__main__":
  main()
