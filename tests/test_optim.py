"""Optimizers (tensor/optim.py) follow torch's: a 30-step MLP run, step by step, and each optimizer's options."""
import gc, weakref
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rewrite import Ops
from tensor import Tensor
from tensor.optim import SGD, Adam, AdamW
from runtime.realize import last_program


def _data():
  rng = np.random.default_rng(0)
  x, y = rng.standard_normal((32, 8)).astype(np.float32), rng.standard_normal((32, 3)).astype(np.float32)
  ws = [(rng.standard_normal((16, 8)) * 0.4).astype(np.float32), np.zeros(16, np.float32),
        (rng.standard_normal((3, 16)) * 0.4).astype(np.float32), np.full(3, 0.1, np.float32)]
  return x, y, ws


def _losses_graft(opt_cls, steps, **kw):
  x, y, ws = _data()
  ps = [Tensor(w, requires_grad=True) for w in ws]
  opt, X, Y, out = opt_cls(ps, **kw), Tensor(x), Tensor(y), []
  for _ in range(steps):
    loss = ((X.linear(ps[0], ps[1]).relu().linear(ps[2], ps[3]) - Y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    out.append(loss.item())
  return out, [p.numpy() for p in ps]


def _losses_torch(opt_cls, steps, **kw):
  x, y, ws = _data()
  ps = [torch.tensor(w, requires_grad=True) for w in ws]
  opt, X, Y, out = opt_cls(ps, **kw), torch.tensor(x), torch.tensor(y), []
  for _ in range(steps):
    loss = ((F.linear(F.linear(X, ps[0], ps[1]).relu(), ps[2], ps[3]) - Y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    out.append(loss.item())
  return out, [p.detach().numpy() for p in ps]


@pytest.mark.parametrize("name, kw", [
  ("SGD", dict(lr=0.05)),
  ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
  ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1)),
  ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
  ("Adam", dict(lr=1e-2)),
  ("Adam", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2)),
  ("AdamW", dict(lr=1e-2)),
  ("AdamW", dict(lr=1e-2, weight_decay=0.1, eps=1e-6)),
])
def test_a_30_step_mlp_run_follows_torch_step_by_step(name, kw):
  ours, our_params = _losses_graft({"SGD": SGD, "Adam": Adam, "AdamW": AdamW}[name], 30, **kw)
  theirs, their_params = _losses_torch(getattr(torch.optim, name), 30, **kw)
  np.testing.assert_allclose(ours, theirs, rtol=1e-3)
  assert ours[-1] < ours[0] * 0.7, "the loss should fall"
  for a, b in zip(our_params, their_params): np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_defaults_are_torchs():
  p = [Tensor(np.ones(2, np.float32), requires_grad=True)]
  for ours, theirs in ((Adam(p), torch.optim.Adam([torch.ones(2, requires_grad=True)])),
                       (AdamW(p), torch.optim.AdamW([torch.ones(2, requires_grad=True)]))):
    d = theirs.defaults
    assert (ours.lr, (ours.b1, ours.b2), ours.eps, ours.weight_decay) == (d["lr"], d["betas"], d["eps"], d["weight_decay"])
  assert SGD(p).lr == torch.optim.SGD([torch.ones(2, requires_grad=True)]).defaults["lr"]


def test_step_is_one_realize_writing_every_parameter_and_state_in_place():
  x, y, ws = _data()
  ps = [Tensor(w, requires_grad=True) for w in ws]
  opt = AdamW(ps, lr=1e-2)
  loss = ((Tensor(x).linear(ps[0], ps[1]).relu().linear(ps[2], ps[3]) - Tensor(y)) ** 2).mean()
  loss.backward()
  memory = [p.uop.src[0].arg.handle for p in ps + opt.m + opt.v]
  opt.step()
  program = last_program()
  # the forward, the backward and the update in that one program: the loss and the gradients are realized by it
  assert loss.is_realized and all(p.grad.is_realized for p in ps)
  assert program is not None and len(program.outputs) >= 3 * len(ps) + len(ps) + 1
  assert [p.uop.src[0].arg.handle for p in ps + opt.m + opt.v] == memory, "updates go into the tensors' own memory"


def test_a_step_keeps_no_copy_of_the_old_parameters_unless_a_lazy_tensor_reads_them(monkeypatch):
  from runtime.buffer import Buffer
  copies = []
  real = Buffer.split_version
  monkeypatch.setattr(Buffer, "split_version", lambda self: copies.append(self) or real(self))
  x, y, ws = _data()
  ps = [Tensor(w, requires_grad=True) for w in ws]
  opt = AdamW(ps, lr=1e-2)
  def loss(): return ((Tensor(x).linear(ps[0], ps[1]).relu().linear(ps[2], ps[3]) - Tensor(y)) ** 2).mean()
  for _ in range(2):
    opt.zero_grad(); loss().backward(); opt.step()
  assert copies == []    # the updates read every parameter and state in place: nothing else reads the old values
  before = ps[0].numpy()
  kept = ps[0] * 1       # a lazy tensor of the old weight, kept across the step
  opt.zero_grad(); loss().backward(); opt.step()
  assert [b.size for b in copies] == [ps[0].numel()]
  np.testing.assert_array_equal(kept.numpy(), before)


def test_a_training_loop_gives_old_buffers_back_without_the_cyclic_collector():
  # a step's dead graph goes by reference counting, and the memory it names with it: the old versions of the
  # parameters that the forward pass read, the gradients of the step before
  x, y, ws = _data()
  ps = [Tensor(w, requires_grad=True) for w in ws]
  opt, X, Y = AdamW(ps, lr=1e-2), Tensor(x), Tensor(y)
  gc.disable()
  try:
    for _ in range(3):
      loss = ((X.linear(ps[0], ps[1]).relu().linear(ps[2], ps[3]) - Y) ** 2).mean()
      opt.zero_grad()
      loss.backward()
      named = [weakref.ref(n.arg) for g in [loss] + [p.grad for p in ps] for n in g.uop.toposort if n.op is Ops.BUFFER]
      opt.step()
      loss.item()
      del loss
      live = {id(t.uop.src[0].arg) for t in ps + opt.m + opt.v + [p.grad for p in ps] + [X, Y, opt._lr, opt.b1_t, opt.b2_t]}
      assert all(r() is None or id(r()) in live for r in named)
  finally: gc.enable()


def test_changing_the_learning_rate_takes_effect():
  p = Tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
  opt = SGD([p], lr=0.1)
  (p * p).sum().backward()
  opt.step()
  np.testing.assert_allclose(p.numpy(), [0.8, 1.6], rtol=1e-6)   # x - 0.1 * 2x
  opt.lr = 0.5
  opt.zero_grad()
  (p * p).sum().backward()
  opt.step()
  np.testing.assert_allclose(p.numpy(), np.zeros(2), atol=1e-7)   # x - 0.5 * 2x = 0: the new rate took effect


def test_clear_errors():
  p = Tensor(np.ones(2, np.float32), requires_grad=True)
  with pytest.raises(RuntimeError, match="no parameter has a gradient"): SGD([p], lr=0.1).step()
  with pytest.raises(ValueError, match="empty"): Adam([])
  with pytest.raises(ValueError, match="Nesterov"): SGD([p], lr=0.1, nesterov=True)
  with pytest.raises(ValueError, match="learning rate"): SGD([p], lr=-1.0)


def test_a_step_that_fails_midway_leaves_clear_tensors_and_the_next_step_runs(monkeypatch):
  # the step's realize also computes the gradients and the loss, whose graphs it lets go once its program is found:
  # when the run fails, each of them says so when used (not an AttributeError from inside), the parameters the run
  # had not written yet hold their values, and a new backward() and step() train on
  from runtime.program import Program
  rng = np.random.default_rng(0)
  w = Tensor(rng.standard_normal((8, 4)).astype(np.float32), requires_grad=True)
  opt, x = SGD([w], lr=0.1), Tensor(rng.standard_normal((16, 8)).astype(np.float32))
  loss = ((x @ w) ** 2).mean()
  loss.backward()
  before, plain = w.numpy(), Program._step
  def fails_at_the_first_kernel(self, step, *args):
    if step[0] in ("call", "extern", "pick"): raise MemoryError("no memory left (simulated)")
    return plain(self, step, *args)
  monkeypatch.setattr(Program, "_step", fails_at_the_first_kernel)
  with pytest.raises(MemoryError, match="simulated") as failure: opt.step()
  monkeypatch.setattr(Program, "_step", plain)
  assert "0 of the 1 tensors it writes hold their new values, the others their old ones" in str(failure.value.__notes__)
  np.testing.assert_array_equal(w.numpy(), before)
  for lost in (w.grad, loss):
    with pytest.raises(RuntimeError, match=r"has no value: the realize computing it failed \(MemoryError: no memory left"):
      lost.numpy()
  with pytest.raises(RuntimeError, match="has no value"): (w.grad * 2).numpy()   # a graph reading it says so too
  opt.zero_grad()
  loss = ((x @ w) ** 2).mean()
  loss.backward()
  opt.step()
  tw = torch.tensor(before, requires_grad=True)
  ((torch.tensor(x.numpy()) @ tw) ** 2).mean().backward()
  np.testing.assert_allclose(w.numpy(), before - 0.1 * tw.grad.numpy(), rtol=1e-5, atol=1e-6)
