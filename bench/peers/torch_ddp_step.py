"""PyTorch's own data parallelism on gpt-small-cpu: the peer of
bench_ddp_step and bench_zero_step.

Same model (shape, parameter names, initialisation), batch, optimizer and
thread settings as bench/ddp_step.cpp (attention through
F.scaled_dot_product_attention where torch has it, as ours does on 2.x). The
setups share the processes and their timed blocks alternate within every
round, so their ratios compare like with like on a noisy machine:

  ddp       DistributedDataParallel (bucket_cap_mb 25), AdamW
  zero      DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)
  fsdp2     fully_shard (FSDP2) on every block and the root, AdamW on the
            sharded parameters (torch 2.6 and later; skipped before)
  no_sync   the ddp model under no_sync(): no communication at all, the floor
            for N processes sharing this machine
  lockstep  no_sync steps that end in a barrier: the floor plus the wait for
            the slowest rank that any synchronous step pays
  single    rank 0 alone trains a plain model while the other ranks wait:
            the single-process floor

Run with the Python whose torch matches the LibTorch of the C++ side
(Debian's python3-torch, or the venv of `setup.sh --torch pip`):
  python bench/peers/torch_ddp_step.py [--nproc 2] [--rounds 5] [--steps 6]
      [--setups ddp,zero,fsdp2,no_sync,lockstep,single] [--out FILE.json]
"""
import argparse
import json
import math
import os
import resource
import socket
import statistics
import sys
import time


def _pin_library_threads():
    """torch.set_num_threads does not bound the BLAS library's own thread pool
    in Debian's build (OpenBLAS, pthreads): a "1-thread" rank would still run
    its GEMMs on every core. The pools size themselves from the environment
    when the library loads, so set it before importing torch; spawned ranks
    inherit it."""
    threads = "1"
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            threads = sys.argv[i + 1]
        elif a.startswith("--threads="):
            threads = a.split("=", 1)[1]
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = threads


if __name__ == "__main__":
    _pin_library_threads()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB, CTX, WIDTH, HEADS, LAYERS = 4096, 128, 256, 4, 4
MICRO_BATCH = 8


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d, eps=1e-5)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=1e-5)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def attn(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2)
                   for z in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.h))
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(future, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """zoo/gpt.cpp's GPT: same modules, names and GPT-2 initialisation."""

    def __init__(self, vocab=VOCAB, ctx=CTX, d=WIDTH, h=HEADS, n=LAYERS):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.lnf = nn.LayerNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, 0.02)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
                elif isinstance(m, nn.LayerNorm):
                    m.weight.fill_(1.0)
                    m.bias.zero_()

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))


def adamw_kwargs():
    return dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def machine():
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "torch": torch.__version__,
            "python": sys.version.split()[0]}


def stats(v):
    v = sorted(v)
    if not v:
        return None
    pick = lambda p: v[int(p * (len(v) - 1) + 0.5)]
    return {"median": statistics.median(v), "p10": pick(0.1),
            "p90": pick(0.9), "n": len(v)}


def worker(rank, world, port, args, queue):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    setups = args.setups.split(",")
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, CTX + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_of(model):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))

    models, opts = {}, {}
    if "ddp" in setups or "no_sync" in setups or "lockstep" in setups:
        torch.manual_seed(0)
        models["ddp"] = nn.parallel.DistributedDataParallel(GPT(), bucket_cap_mb=25)
        opts["ddp"] = torch.optim.AdamW(models["ddp"].parameters(), **adamw_kwargs())
    if "zero" in setups:
        torch.manual_seed(0)
        models["zero"] = nn.parallel.DistributedDataParallel(GPT(), bucket_cap_mb=25)
        opts["zero"] = ZeroRedundancyOptimizer(
            models["zero"].parameters(), optimizer_class=torch.optim.AdamW,
            **adamw_kwargs())
    if "fsdp2" in setups:
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0)
        m = GPT()
        for blk in m.blocks:
            fully_shard(blk)
        models["fsdp2"] = fully_shard(m)
        opts["fsdp2"] = torch.optim.AdamW(m.parameters(), **adamw_kwargs())
    if "single" in setups and rank == 0:
        torch.manual_seed(0)
        models["single"] = GPT()
        opts["single"] = torch.optim.AdamW(models["single"].parameters(), **adamw_kwargs())

    # Phases of the single-process step, as bench_ddp_step times them.
    phases = {"forward": [], "backward": [], "optimizer": []}

    def step(name, timed=True):
        key = "ddp" if name in ("no_sync", "lockstep") else name
        model, opt = models[key], opts[key]
        t0 = time.perf_counter()
        opt.zero_grad()
        if name in ("no_sync", "lockstep"):
            with model.no_sync():
                loss_of(model).backward()
        elif name == "single":
            loss = loss_of(model)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if timed:
                phases["forward"].append((t1 - t0) * 1e3)
                phases["backward"].append((t2 - t1) * 1e3)
                phases["optimizer"].append((t3 - t2) * 1e3)
            return (t3 - t0) * 1e3
        else:
            loss_of(model).backward()
        opt.step()
        if name == "lockstep":
            dist.barrier()
        return (time.perf_counter() - t0) * 1e3

    def runs_here(name):
        return name != "single" or rank == 0

    times = {s: [] for s in setups}
    for _ in range(args.warmup):
        for s in setups:
            dist.barrier()
            if runs_here(s):
                step(s, timed=False)
    for r in range(args.rounds):
        for s in setups:
            dist.barrier()
            if runs_here(s):
                for _ in range(args.steps):
                    times[s].append(step(s))
        if rank == 0:
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    dist.barrier()
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
                       dtype=torch.float64)
    all_rss = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(all_rss, rss)
    if rank == 0:
        queue.put({"times": times, "phases": phases,
                   "rss": [int(t.item()) for t in all_rss]})
    dist.barrier()
    dist.destroy_process_group()


def has_fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        return True
    except Exception:  # absent, or (Debian's 1.13 on 3.11) fails to import
        return False


def default_setups():
    return ("ddp,zero," + ("fsdp2," if has_fsdp2() else "") +
            "no_sync,lockstep,single")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--setups", default=default_setups())
    p.add_argument("--out", default="")
    args = p.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.nproc, port, args, queue))
             for r in range(args.nproc)]
    for pr in procs:
        pr.start()
    res = queue.get()
    for pr in procs:
        pr.join()
        if pr.exitcode != 0:
            sys.exit(f"rank failed with exit code {pr.exitcode}")
    times = res["times"]
    params = sum(p.numel() for p in GPT().parameters())
    steps = {k: stats(v) for k, v in times.items()}
    med = {k: v["median"] for k, v in steps.items() if v}
    ratios = {}
    if "no_sync" in med:
        ratios = {f"{k}_over_no_sync": med[k] / med["no_sync"]
                  for k in med if k != "no_sync"}
    result = {
        "benchmark": "torch_ddp_step",
        "implementation": "PyTorch (Python) " + torch.__version__,
        "model": "gpt-small-cpu",
        "parameters": params,
        "config": {"world_size": args.nproc, "micro_batch": MICRO_BATCH,
                   "seq_len": CTX, "threads_per_rank": args.threads,
                   "library_threads_env": os.environ.get("OPENBLAS_NUM_THREADS"),
                   "bucket_cap_mb": 25, "steps_per_round": args.steps,
                   "rounds": args.rounds,
                   "optimizer": "AdamW(3e-4, wd 0.01)", "dtype": "fp32"},
        "machine": machine(),
        "step_ms": steps,
        "single_phases_ms": {k: stats(v) for k, v in res["phases"].items() if v},
        "ratios": ratios,
        "peak_rss_bytes_per_rank": res["rss"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
