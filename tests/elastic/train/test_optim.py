"""A CPU rank's optimizers (`elastic.train.optim`) against torch's: the same parameters, state and
state dicts, bit for bit, and no `torch._dynamo` in a rank's process from its start to its first
outer step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic.train.optim import SGD, AdamW

REPO = Path(__file__).resolve().parents[3]


def _params(seed: int) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(33, 17)), nn.Parameter(torch.randn(17)), nn.Parameter(torch.randn(5, 4, 3))]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * (step + 1)


def test_adamw_steps_and_saves_as_torchs_foreach_adamw_does():
    ours, theirs = _params(0), _params(0)

    def groups(ps):
        return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]

    a = AdamW(groups(ours), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    b = torch.optim.AdamW(groups(theirs), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    for step in range(7):
        for opt, ps in ((a, ours), (b, theirs)):
            _grads(ps, step)
            if step == 3:
                for group in opt.param_groups:   # a schedule changes the learning rate
                    group["lr"] = 1e-3
            opt.step()
            opt.zero_grad(set_to_none=True)
        for x, y in zip(ours, theirs):
            assert torch.equal(x, y), step
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sb["state"]:
        for name, v in sb["state"][k].items():
            assert torch.equal(sa["state"][k][name], v) and sa["state"][k][name].dtype == v.dtype, name
    # torch's AdamW loads ours and steps on from it as from its own.
    c_params = [nn.Parameter(p.detach().clone()) for p in theirs]
    c = torch.optim.AdamW(groups(c_params), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    c.load_state_dict(sa)
    for opt, ps in ((c, c_params), (b, theirs)):
        _grads(ps, 9)
        opt.step()
    for x, y in zip(c_params, theirs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("nesterov", [True, False])
def test_sgd_steps_as_torchs_sgd_and_leaves_the_gradient_alone(nesterov):
    ours, theirs = _params(1)[:1], _params(1)[:1]
    a = SGD(ours, lr=0.7, momentum=0.9, nesterov=nesterov)
    b = torch.optim.SGD(theirs, lr=0.7, momentum=0.9, nesterov=nesterov, foreach=False)
    for step in range(5):
        for opt, ps in ((a, ours), (b, theirs)):
            _grads(ps, step)
            opt.step()
        kept = torch.randn(ours[0].shape, generator=torch.Generator().manual_seed(1000 + step)) * (step + 1)
        assert torch.equal(ours[0].grad, kept)   # the averaged Δ a joiner replays is read after the step
        assert torch.equal(ours[0], theirs[0]), step
    assert torch.equal(a.state[ours[0]]["momentum_buffer"], b.state[theirs[0]]["momentum_buffer"])


def test_a_cpu_rank_starts_and_steps_without_importing_torch_dynamo():
    """torch's optimizers import torch._dynamo (about a CPU-second) when built and at each step; a
    CPU rank's setup, inner phase and outer step import none of it."""
    probe = '''
import datetime, sys
import torch.distributed as dist
from tests.conftest import tiny_recipe
from elastic.train.replica import RankSpec, RankWorker, Schedule
recipe = tiny_recipe()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
w = RankWorker(RankSpec(recipe=recipe.model_dump(mode="json"), replica_id=0, rank=0, ranks=1, store_host="127.0.0.1",
                        store_port=store.port, schedule=Schedule.for_recipe(recipe)))
w.setup()
t = recipe.train
w.inner_phase(0, 0, 0, t.batch_size * t.seq_len)
assert w.outer_sync(0, 0, 1)["ok"]
w.outer_apply()
print("torch._dynamo imported:", "torch._dynamo" in sys.modules)
'''
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch._dynamo imported: False" in out.stdout, out.stdout
