"""The optimizers of a rank that trains on the CPU: torch's AdamW and SGD, without `torch._dynamo`.

torch's optimizers import `torch._dynamo` the first time one is built and again at every step (for
`torch.compile`, which a CPU rank does not use): about 1 CPU-second per process, a fifth of a
local run's start on two cores. These subclasses keep torch's state, state dicts and param groups
(DCP saves and loads them as torch's) and take the step with the same foreach operations, in the
same order, as torch's `foreach` implementation (tests/elastic/train/test_optim.py compares them
bit for bit). A rank on a GPU keeps torch's fused AdamW.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer


def _plain(method):
    """`method` without its `torch._disable_dynamo` wrapper (torch keeps the original as
    `__wrapped__`); `method` itself where there is none."""
    return getattr(method, "__wrapped__", method)


def _loss(closure):
    """What a step's `closure` returns (computed with gradients on), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _WithoutDynamo:
    """Optimizer's methods that torch wraps in `torch._disable_dynamo`, unwrapped: that wrapper
    imports `torch._dynamo` at its first call, and nothing here runs under `torch.compile`."""

    def add_param_group(self, param_group: dict) -> None:
        _plain(Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _plain(Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict:
        return _plain(Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict) -> None:
        _plain(Optimizer.load_state_dict)(self, state_dict)


class AdamW(_WithoutDynamo, torch.optim.AdamW):
    """torch.optim.AdamW (decoupled weight decay; no amsgrad, maximize or capturable), stepped with
    torch's foreach operations."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float = 0.01, eps: float = 1e-8):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _loss(closure)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # torch's scalar dtype for the step: float64 only where that is the default
                    wide = torch.get_default_dtype() == torch.float64
                    state["step"] = torch.tensor(0.0, dtype=torch.float64 if wide else torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
            if weight_decay != 0:
                torch._foreach_mul_(params, 1 - lr * weight_decay)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            bias_correction1 = [1 - beta1 ** s.item() for s in steps]
            bias_correction2 = [1 - beta2 ** s.item() for s in steps]
            step_size = [(lr / bc) * -1 for bc in bias_correction1]
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, [bc ** 0.5 for bc in bias_correction2])
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)
        return loss


class SGD(_WithoutDynamo, torch.optim.SGD):
    """torch.optim.SGD with momentum (optionally Nesterov), no weight decay or dampening: the
    outer optimizer, one flat parameter per fragment."""

    def __init__(self, params, lr: float, momentum: float, nesterov: bool):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _loss(closure)
        for group in self.param_groups:
            momentum, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = torch.clone(d_p).detach()
                    else:
                        buf.mul_(momentum).add_(d_p)
                    d_p = d_p.add(buf, alpha=momentum) if group["nesterov"] else buf
                p.add_(d_p, alpha=-lr)
        return loss
