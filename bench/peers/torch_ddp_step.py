"""PyTorch's own DDP on gpt-small-cpu: the peer for bench_ddp_step.

Same model, batch, optimizer and thread settings as bench/ddp_step.cpp, with
rounds alternating between synchronized steps and steps under no_sync.
Run with Debian's python3-torch: /usr/bin/python3 bench/peers/torch_ddp_step.py
"""
import argparse
import json
import math
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def attn(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.h)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=4096, ctx=128, d=256, h=4, n=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.lnf(x))


def worker(rank, world, port, args, queue):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(GPT(), bucket_cap_mb=25)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999),
                            eps=1e-8, weight_decay=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 4096, (8, 129), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step(sync):
        t0 = time.perf_counter()
        opt.zero_grad()
        if sync:
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        else:
            with model.no_sync():
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        return (time.perf_counter() - t0) * 1e3

    times = {"ddp": [], "no_sync": []}
    for _ in range(args.warmup):
        step(True)
        step(False)
    for _ in range(args.rounds):
        for sync in (True, False):
            dist.barrier()
            for _ in range(args.steps):
                times["ddp" if sync else "no_sync"].append(step(sync))
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in times.items()})
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(args.nproc, port, args, queue), nprocs=args.nproc)
    med = queue.get()
    result = {"benchmark": "torch_ddp_step", "torch": torch.__version__,
              "world_size": args.nproc, "ddp_step_ms": med["ddp"],
              "no_sync_step_ms": med["no_sync"],
              "ratio_ddp_over_floor": med["ddp"] / med["no_sync"]}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
