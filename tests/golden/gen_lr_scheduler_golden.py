#!/usr/bin/python3
"""Writes lr_scheduler_golden.h: the learning rates (and momentum for
OneCycleLR) that colossalai.nn.lr_scheduler produces, step by step, for the
cases test_lr_scheduler.cpp replays in C++.

Schedulers that ColossalAI takes from torch.optim.lr_scheduler are run as
torch's own classes, built the way ColossalAI builds them. The ones ColossalAI
defines itself are restated below on top of torch's scheduler base class, so
the script only needs torch (Debian's python3-torch):

    /usr/bin/python3 tests/golden/gen_lr_scheduler_golden.py
"""

import math
import os
import sys
import warnings

import torch
from torch.optim import lr_scheduler as tls

# torch 2.x renamed the base class; 1.13 only has the underscored name.
Base = getattr(tls, "LRScheduler", None) or tls._LRScheduler

LRS = (0.1, 0.03)  # the two parameter groups' initial learning rates


# --- ColossalAI's own schedulers, restated -----------------------------------


class LinearWarmupLR(Base):
    """Rises over warmup_steps as (e + 1) / (warmup_steps + 1) * base, then
    falls linearly, reaching 0 at total_steps."""

    def __init__(self, optimizer, total_steps, warmup_steps=0):
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        super().__init__(optimizer)

    def get_lr(self):
        e = self.last_epoch
        if e < self.warmup_steps:
            return [(e + 1) / (self.warmup_steps + 1) * b for b in self.base_lrs]
        return [(self.total_steps - e) / (self.total_steps - self.warmup_steps) * b for b in self.base_lrs]


class PolynomialLR(Base):
    """(base - end_lr) * (1 - min(e, total) / total) ** power + end_lr."""

    def __init__(self, optimizer, total_steps, end_lr=0.0001, power=1.0):
        self.total_steps = total_steps
        self.end_lr = end_lr
        self.power = power
        super().__init__(optimizer)

    def get_lr(self):
        frac = min(self.last_epoch, self.total_steps) / self.total_steps
        return [(b - self.end_lr) * ((1 - frac) ** self.power) + self.end_lr for b in self.base_lrs]


class TwoStage(Base):
    """Runs a first stage itself, then hands every step to `after`, which
    takes over this scheduler's base learning rates when it starts."""

    def __init__(self, optimizer, after):
        self.after = after
        self.finished = False
        super().__init__(optimizer)

    def hand_over(self):
        if not self.finished:
            self.after.base_lrs = self.base_lrs
            self.finished = True

    def step(self):
        if not self.finished:
            return super().step()
        self.after.step()
        self._last_lr = self.after.get_last_lr()


class WarmupScheduler(TwoStage):
    """Linear warmup (e + 1) / warmup * base for `warmup` steps, then `after`."""

    def __init__(self, optimizer, warmup, after):
        self.warmup = int(warmup)
        super().__init__(optimizer, after)

    def get_lr(self):
        if self.last_epoch >= self.warmup:
            self.hand_over()
            return self.after.get_lr()
        return [(self.last_epoch + 1) / self.warmup * b for b in self.base_lrs]


class DelayerScheduler(TwoStage):
    """Flat base lr for `delay` steps, then `after`."""

    def __init__(self, optimizer, delay, after):
        self.delay = delay
        super().__init__(optimizer, after)

    def get_lr(self):
        if self.last_epoch >= self.delay:
            self.hand_over()
            return self.after.get_lr()
        return self.base_lrs


class WarmupDelayerScheduler(TwoStage):
    """Linear warmup, then flat, then `after` (groups reset to base lr first)."""

    def __init__(self, optimizer, warmup, delay, after):
        self.warmup = warmup
        self.delay = delay
        super().__init__(optimizer, after)

    def get_lr(self):
        e = self.last_epoch
        if e >= self.warmup + self.delay:
            if not self.finished:
                for group, b in zip(self.optimizer.param_groups, self.base_lrs):
                    group["lr"] = b
            self.hand_over()
            return self.after.get_lr()
        if e >= self.warmup:
            return self.base_lrs
        return [(e + 1) / self.warmup * b for b in self.base_lrs]


# --- ColossalAI's constructors (total_steps first) ---------------------------


def cosine_annealing(opt, total_steps, eta_min=0):
    return tls.CosineAnnealingLR(opt, total_steps, eta_min=eta_min)


def cosine_annealing_warmup(opt, total_steps, warmup_steps=0, eta_min=0.0):
    after = tls.CosineAnnealingLR(opt, total_steps - warmup_steps, eta_min=eta_min)
    return WarmupScheduler(opt, warmup_steps, after)


def flat_annealing(opt, total_steps, pct_start=0.72):
    flat = int(total_steps * pct_start)
    after = tls.CosineAnnealingLR(opt, total_steps - flat)
    return DelayerScheduler(opt, flat, after)


def flat_annealing_warmup(opt, total_steps, warmup_steps=0, pct_start=0.72, eta_min=0):
    flat = int((total_steps - warmup_steps) * pct_start)
    after = tls.CosineAnnealingLR(opt, total_steps - warmup_steps - flat, eta_min=eta_min)
    return WarmupDelayerScheduler(opt, warmup_steps, flat, after)


def multistep(opt, total_steps, milestones=None, gamma=0.1):
    return tls.MultiStepLR(opt, milestones, gamma=gamma)


def multistep_warmup(opt, total_steps, warmup_steps=0, milestones=None, gamma=0.1):
    shifted = [m - warmup_steps for m in milestones if m >= warmup_steps]
    after = tls.MultiStepLR(opt, milestones=shifted, gamma=gamma)
    return WarmupScheduler(opt, warmup_steps, after)


def one_cycle(opt, total_steps, **kw):
    max_lrs = [g["lr"] for g in opt.param_groups]
    return tls.OneCycleLR(opt, max_lrs, total_steps=total_steps, **kw)


def polynomial_warmup(opt, total_steps, warmup_steps=0, end_lr=0.0001, power=1.0):
    after = PolynomialLR(opt, total_steps - warmup_steps, end_lr=end_lr, power=power)
    return WarmupScheduler(opt, warmup_steps, after)


def exponential(opt, total_steps, gamma=1.0):
    return tls.ExponentialLR(opt, gamma)


def step_lr(opt, total_steps, step_size=1, gamma=0.1):
    return tls.StepLR(opt, step_size, gamma=gamma)


def lambda_lr(opt, total_steps, lr_lambda):
    return tls.LambdaLR(opt, lr_lambda)


def multiplicative(opt, total_steps, lr_lambda):
    return tls.MultiplicativeLR(opt, lr_lambda)


# --- Cases --------------------------------------------------------------------
# (name, optimizer kind, scheduler factory, steps, {step: lr factor applied to
# every group just before that step, to check the recursive forms}).
# Keep in sync with test_lr_scheduler.cpp.

CASES = [
    ("LinearWarmupLR", "sgd", lambda o: LinearWarmupLR(o, 40, warmup_steps=8), 40, {}),
    ("CosineAnnealingLR", "sgd", lambda o: cosine_annealing(o, 25, eta_min=0.001), 60, {}),
    ("CosineAnnealingLRChained", "sgd", lambda o: cosine_annealing(o, 30), 45, {12: 0.5}),
    ("CosineAnnealingWarmupLR", "sgd", lambda o: cosine_annealing_warmup(o, 50, warmup_steps=10, eta_min=1e-4), 50, {}),
    ("CosineAnnealingWarmupLRNoWarmup", "sgd", lambda o: cosine_annealing_warmup(o, 30), 30, {}),
    ("FlatAnnealingLR", "sgd", lambda o: flat_annealing(o, 40, pct_start=0.5), 40, {}),
    (
        "FlatAnnealingWarmupLR",
        "sgd",
        lambda o: flat_annealing_warmup(o, 50, warmup_steps=6, pct_start=0.3, eta_min=1e-3),
        50,
        {},
    ),
    ("MultiStepLR", "sgd", lambda o: multistep(o, 50, milestones=[25, 10, 25, 40], gamma=0.5), 50, {}),
    (
        "MultiStepWarmupLR",
        "sgd",
        lambda o: multistep_warmup(o, 50, warmup_steps=10, milestones=[5, 10, 20, 35], gamma=0.3),
        50,
        {},
    ),
    ("OneCycleLRSgd", "sgd", lambda o: one_cycle(o, 40), 40, {}),
    (
        "OneCycleLRAdamThreePhase",
        "adam",
        lambda o: one_cycle(
            o,
            45,
            pct_start=0.25,
            anneal_strategy="linear",
            base_momentum=0.8,
            max_momentum=0.9,
            div_factor=10.0,
            final_div_factor=100.0,
            three_phase=True,
        ),
        45,
        {},
    ),
    ("PolynomialLR", "sgd", lambda o: PolynomialLR(o, 40, end_lr=1e-4, power=2.0), 45, {}),
    ("PolynomialWarmupLR", "sgd", lambda o: polynomial_warmup(o, 50, warmup_steps=5, end_lr=1e-3, power=0.5), 50, {}),
    ("ExponentialLR", "sgd", lambda o: exponential(o, 60, gamma=0.9), 60, {}),
    ("ExponentialLRChained", "sgd", lambda o: exponential(o, 40, gamma=0.95), 40, {7: 3.0}),
    ("StepLR", "sgd", lambda o: step_lr(o, 50, step_size=7, gamma=0.5), 50, {}),
    ("LambdaLR", "sgd", lambda o: lambda_lr(o, 40, lambda e: 0.97**e), 40, {}),
    (
        "LambdaLRPerGroup",
        "sgd",
        lambda o: lambda_lr(o, 40, [lambda e: 0.97**e, lambda e: 1 / (1 + e // 5)]),
        40,
        {},
    ),
    ("MultiplicativeLR", "sgd", lambda o: multiplicative(o, 40, lambda e: 0.9 + 0.002 * e), 40, {}),
]


def make_optimizer(kind):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in LRS]
    groups = [{"params": [p], "lr": lr} for p, lr in zip(params, LRS)]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=LRS[0], momentum=0.9)
    return torch.optim.Adam(groups, lr=LRS[0], betas=(0.9, 0.999))


def momenta(opt):
    if "betas" in opt.defaults:
        return [g["betas"][0] for g in opt.param_groups]
    return [g["momentum"] for g in opt.param_groups]


def run(kind, factory, steps, tweaks):
    opt = make_optimizer(kind)
    sched = factory(opt)
    lrs = [[g["lr"] for g in opt.param_groups]]
    moms = [momenta(opt)]
    for s in range(1, steps + 1):
        if s in tweaks:
            for g in opt.param_groups:
                g["lr"] *= tweaks[s]
        sched.step()
        current = [g["lr"] for g in opt.param_groups]
        assert current == sched.get_last_lr()
        lrs.append(current)
        moms.append(momenta(opt))
    return lrs, moms


def literal(x):
    x = float(x)
    assert math.isfinite(x)
    return repr(x)  # shortest string that reads back as the same double


def table(name, rows):
    out = [f"inline const std::vector<std::vector<double>> {name} = {{"]
    for row in rows:
        out.append("    {" + ", ".join(literal(v) for v in row) + "},")
    out.append("};")
    return out


def main():
    warnings.simplefilter("ignore")  # torch warns about get_lr() outside step()
    here = os.path.dirname(os.path.abspath(__file__))
    lines = [
        "// Generated by gen_lr_scheduler_golden.py (torch "
        + torch.__version__
        + "); regenerate rather than edit.",
        "// k<Case>Lr[step][group]: learning rates after construction (step 0)",
        "// and after each step(); k<Case>Momentum likewise (OneCycleLR only).",
        "#pragma once",
        "",
        "#include <vector>",
        "",
        "namespace golden {",
        "",
        "inline const std::vector<double> kInitialLrs = {" + ", ".join(literal(v) for v in LRS) + "};",
        "",
    ]
    for name, kind, factory, steps, tweaks in CASES:
        lrs, moms = run(kind, factory, steps, tweaks)
        lines += table(f"k{name}Lr", lrs)
        if name.startswith("OneCycleLR"):
            lines += table(f"k{name}Momentum", moms)
        lines.append("")
    lines.append("} // namespace golden")
    path = os.path.join(here, "lr_scheduler_golden.h")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path} ({len(CASES)} cases)", file=sys.stderr)


if __name__ == "__main__":
    main()
