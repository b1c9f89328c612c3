"""The gpt2-medium-gpu training step in plain PyTorch eager (Python): the peer
of bench_gpu_gpt_step. Same model (bench/peers/torch_ddp_step.py's GPT, which
mirrors zoo/gpt.cpp, attention through F.scaled_dot_product_attention;
transformers' GPT2LMHeadModel for gpt2-medium-hf, LlamaForCausalLM for the
Llama shapes), batch, bf16 autocast, fp32 cross-entropy and AdamW settings.

  python3 bench/gpu/torch_gpt_step.py [--device cuda] [--model gpt2-medium]
      [--batch 8] [--steps 20] [--warmup 3] [--foreach auto|on|off]
      [--out FILE.json]
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from torch_ddp_step import GPT, machine, stats  # noqa: E402

MODELS = {"gpt2-medium": dict(vocab=50304, ctx=1024, d=1024, h=16, n=24),
          "gpt-small-cpu": dict(vocab=4096, ctx=128, d=256, h=4, n=4),
          # transformers' GPT2LMHeadModel (SDPA attention, tied head), as
          # colossalai::models::GPT2LMHeadModel; dropout off.
          "gpt2-medium-hf": dict(vocab=50257, ctx=1024, d=1024, h=16, n=24, hf=True),
          "gpt2-small-cpu-hf": dict(vocab=4096, ctx=128, d=256, h=4, n=4, hf=True),
          # transformers' LlamaForCausalLM (SDPA attention), as
          # colossalai::models::LlamaForCausalLM on the C++ side.
          "llama3.2-1b": dict(vocab=128256, ctx=2048, d=2048, h=32, kv=8, n=16,
                              ffn=8192, eps=1e-5, theta=500000.0, tied=True),
          "llama-small-cpu": dict(vocab=4096, ctx=128, d=256, h=4, kv=2, n=4,
                                  ffn=688, eps=1e-6, theta=10000.0, tied=False)}


def build(name, cfg, dev):
    """The model and a function from ids to logits."""
    if cfg.get("hf"):
        from transformers import GPT2Config, GPT2LMHeadModel
        c = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["ctx"], n_embd=cfg["d"],
                       n_layer=cfg["n"], n_head=cfg["h"], resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0)
        c._attn_implementation = "sdpa"
        with torch.device(dev):
            model = GPT2LMHeadModel(c)
        return model, lambda x: model(input_ids=x, use_cache=False).logits
    if "ffn" not in cfg:
        model = GPT(**cfg).to(dev)
        return model, model
    from transformers import LlamaConfig, LlamaForCausalLM
    rope = {"rope_type": "default", "rope_theta": cfg["theta"]}
    # rope_theta for transformers 4, rope_parameters for 5.
    c = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["d"],
                    intermediate_size=cfg["ffn"], num_hidden_layers=cfg["n"],
                    num_attention_heads=cfg["h"], num_key_value_heads=cfg["kv"],
                    max_position_embeddings=cfg["ctx"], rms_norm_eps=cfg["eps"],
                    rope_theta=cfg["theta"], rope_parameters=rope,
                    tie_word_embeddings=cfg["tied"])
    c._attn_implementation = "sdpa"
    with torch.device(dev):
        model = LlamaForCausalLM(c)
    return model, lambda x: model(input_ids=x, use_cache=False).logits


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def matmul_rates(dev, n):
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    iters = 20 if dev.type == "cuda" else 2
    for _ in range(3):
        torch.matmul(a, b, out=c)
    sync(dev)
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=c)
        sync(dev)
        rates.append(2.0 * n ** 3 * iters / (time.perf_counter() - t0))
    return rates


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="gpt2-medium", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--foreach", default="auto", choices=["auto", "on", "off"],
                   help="AdamW's multi-tensor path (auto: PyTorch's default)")
    p.add_argument("--fused", action="store_true",
                   help="AdamW(fused=True): one fused kernel per step")
    p.add_argument("--fp16", action="store_true",
                   help="fp16 autocast with torch.amp.GradScaler instead of bf16")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (compiled in the warm-up steps)")
    p.add_argument("--seq", type=int, default=0,
                   help="sequence length of the Llama models (0: their own)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev = torch.device(a.device)
    cfg = dict(MODELS[a.model])
    if a.seq and "ffn" in cfg:
        cfg["ctx"] = a.seq
    n = a.matmul_n if dev.type == "cuda" else min(a.matmul_n, 1024)
    rates = matmul_rates(dev, n)
    peak = statistics.median(rates)

    torch.manual_seed(0)
    model, forward = build(a.model, cfg, dev)
    foreach = None if a.foreach == "auto" else a.foreach == "on"
    kind = "fused" if a.fused else f"foreach {a.foreach}"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999),
                            eps=1e-8, weight_decay=0.01,
                            **({"fused": True} if a.fused else {"foreach": foreach}))
    fwd = torch.compile(forward) if a.compile else forward
    g = torch.Generator().manual_seed(100)
    tokens = torch.randint(0, cfg["vocab"], (a.batch, cfg["ctx"] + 1), generator=g)
    x, y = tokens[:, :-1].contiguous().to(dev), tokens[:, 1:].contiguous().to(dev)
    last = [0.0]
    scaler = torch.amp.GradScaler(dev.type) if a.fp16 else None

    def step():
        sync(dev)
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=torch.float16 if a.fp16 else torch.bfloat16):
            logits = fwd(x)
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]).float(), y.reshape(-1))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sync(dev)
        last[0] = loss.item()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(a.warmup):
        step()
    times = [step() for _ in range(a.steps)]
    params = sum(p.numel() for p in model.parameters())
    if "ffn" in cfg:  # every parameter a matmul's (the tied head's product)
        flops_per_token = 6.0 * params + 12.0 * cfg["n"] * cfg["d"] * cfg["ctx"]
    elif cfg.get("hf"):  # the tied head's product; positions are a lookup
        flops_per_token = (6.0 * (params - cfg["ctx"] * cfg["d"]) +
                           12.0 * cfg["n"] * cfg["d"] * cfg["ctx"])
    else:
        embed = (cfg["vocab"] + cfg["ctx"]) * cfg["d"]
        flops_per_token = 6.0 * (params - embed) + 12.0 * cfg["n"] * cfg["d"] * cfg["ctx"]
    step_ms = statistics.median(times)
    tokens_per_s = a.batch * cfg["ctx"] / (step_ms * 1e-3)
    result = {
        "benchmark": "gpu_gpt_step",
        "implementation": f"PyTorch {torch.__version__} "
                          f"{'torch.compile' if a.compile else 'eager'} (Python), AdamW {kind}",
        "model": a.model, "parameters": params,
        "config": {"device": a.device, "batch": a.batch, "seq_len": cfg["ctx"],
                   "precision": ("fp16 autocast, fp32 parameters, GradScaler" if a.fp16
                                 else "bf16 autocast, fp32 parameters"),
                   "optimizer": f"AdamW(3e-4, wd 0.01, {kind})",
                   "steps": a.steps, "warmup": a.warmup},
        "machine": machine(),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "matmul": {"n": n, "bf16_flops_median": peak, "bf16_flops_max": max(rates)},
        "flops_per_token": flops_per_token,
        "step_ms": stats(times),
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / peak,
        "final_loss": last[0],
        "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else -1,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
