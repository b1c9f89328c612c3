"""Whether LibTorch's AdamW step (the op sequence of torch::optim::AdamW)
gives bit-identical float32 results on the host and on the GPU, op by op and
by tensor length (the host kernels' vectorized body vs their scalar tail).
Gemini keeps an offloaded chunk's AdamW on the host; the rest of its family
steps on the device."""
import math
import sys

import torch


def adamw_ops(p, g, m, v, step, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=1e-2):
    out = {}
    p.mul_(1 - lr * wd)
    out["mul_"] = p.clone()
    m.mul_(b1).add_(g, alpha=1 - b1)
    out["exp_avg"] = m.clone()
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    out["exp_avg_sq"] = v.clone()
    bc1 = 1 - b1**step
    bc2 = 1 - b2**step
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    out["denom"] = denom.clone()
    p.addcdiv_(m, denom, value=-lr / bc1)
    out["param"] = p.clone()
    return out


def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 100, 1000, 4095, 4096, 65536 + 3]
    worst = {}
    for n in lengths:
        p = torch.randn(n, generator=gen) * 0.02
        m = torch.zeros(n)
        v = torch.zeros(n)
        pd, md, vd = (t.to(dev, copy=True) for t in (p, m, v))
        for step in (1, 2, 3):
            g = torch.randn(n, generator=gen) * 1e-2
            a = adamw_ops(p, g, m, v, step)
            b = adamw_ops(pd, g.to(dev), md, vd, step)
            for k in a:
                d = (a[k] != b[k].cpu()).sum().item()
                if d:
                    worst.setdefault(k, []).append((n, step, d))
    if not worst:
        print(f"AdamW host vs {dev}: bit-identical for every op and length")
    for k, rows in worst.items():
        print(f"{k}: differs (length, step, elements): {rows[:12]}")
    # Each op alone, on lengths with and without a tail.
    for n in (64, 67):
        x = torch.rand(n, generator=gen) + 0.5
        y = torch.rand(n, generator=gen) + 0.5
        z = torch.rand(n, generator=gen) + 0.5
        ops = {
            "add_(alpha)": lambda a, b, c: a.clone().add_(b, alpha=0.1),
            "addcmul_": lambda a, b, c: a.clone().addcmul_(b, c, value=0.001),
            "addcdiv_": lambda a, b, c: a.clone().addcdiv_(b, c, value=-1e-3),
            "sqrt/div": lambda a, b, c: a.sqrt() / math.sqrt(0.3),
            "mul_": lambda a, b, c: a.clone().mul_(0.99999),
        }
        for name, f in ops.items():
            h = f(x, y, z)
            d = f(x.to(dev), y.to(dev), z.to(dev)).cpu()
            print(f"  length {n} {name}: {(h != d).sum().item()} of {n} differ")


if __name__ == "__main__":
    main()
