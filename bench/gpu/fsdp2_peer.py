"""Large-model fine-tuning on one GPU in PyTorch: the peer of our Llama-2-7B /
Llama-3-8B single-GPU step. transformers' LlamaForCausalLM (SDPA attention)
trained with AdamW under one of

  fsdp2_offload  fully_shard (FSDP2) at world size 1 on every decoder layer
                 and the root, bf16 compute (MixedPrecisionPolicy), fp32
                 parameters, gradients and AdamW states on the host
                 (CPUOffloadPolicy): AdamW runs on the CPU
  fsdp2          the same without the offload: everything on the device
  plain          no FSDP: fp32 parameters on the device, bf16 autocast, AdamW
                 (fused on CUDA), where it fits

Random token ids, fp32 cross-entropy of the logits, activation checkpointing
of every decoder layer by default. A CUDA out-of-memory error is reported in
the JSON ("error", tokens_per_s null) with exit status 0.

  python3 bench/gpu/fsdp2_peer.py [--model llama2-7b|llama3-8b|llama-small-cpu]
      [--device cuda] [--mode fsdp2_offload|fsdp2|plain] [--seq 4096]
      [--batch 1] [--steps 5] [--warmup 2] [--checkpointing on|off]
      [--layers N] [--matmul-n 8192] [--lr 3e-4] [--out FILE.json]
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

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from torch_ddp_step import machine, stats  # noqa: E402
from torch_gpt_step import matmul_rates, sync  # noqa: E402

# The shapes of the C++ side's workloads (all untied).
MODELS = {"llama2-7b": dict(vocab=32000, d=4096, ffn=11008, n=32, h=32, kv=32,
                            eps=1e-5, theta=10000.0, seq=4096),
          "llama3-8b": dict(vocab=128256, d=4096, ffn=14336, n=32, h=32, kv=8,
                            eps=1e-5, theta=500000.0, seq=4096),
          "llama-small-cpu": dict(vocab=4096, d=256, ffn=688, n=4, h=4, kv=2,
                                  eps=1e-6, theta=10000.0, seq=128)}
SPEC_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16, the usual MFU reference


def config(cfg, seq):
    from transformers import LlamaConfig
    rope = {"rope_type": "default", "rope_theta": cfg["theta"]}
    # rope_theta for transformers 4, rope_parameters for 5.
    c = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["d"],
                    intermediate_size=cfg["ffn"], num_hidden_layers=cfg["n"],
                    num_attention_heads=cfg["h"], num_key_value_heads=cfg["kv"],
                    max_position_embeddings=seq, rms_norm_eps=cfg["eps"],
                    rope_theta=cfg["theta"], rope_parameters=rope,
                    tie_word_embeddings=False)
    c._attn_implementation = "sdpa"
    return c


def init_process_group(dev):
    """World size 1, through the env:// rendezvous torchrun would set up."""
    if "MASTER_PORT" not in os.environ:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        s.close()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def local(t):
    """The tensor to write into: a DTensor's local shard (at world size 1, the
    whole parameter) so that initialisation needs no DTensor random ops."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def init_weights(model, std, buffer_dev):
    """LlamaPreTrainedModel's initialisation (normal(0, initializer_range) for
    the linears and the embedding, ones for the norms), written out so that it
    works on FSDP2's DTensor parameters in any transformers version; seed 0.
    The rotary inv_freq buffers are non-persistent: to_empty left them
    uninitialised, so they are recomputed from the config."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            local(m.weight).normal_(0.0, std)
            if getattr(m, "bias", None) is not None:
                local(m.bias).zero_()
        elif "RMSNorm" in type(m).__name__:
            local(m.weight).fill_(1.0)
        elif "RotaryEmbedding" in type(m).__name__:
            if hasattr(m, "rope_init_fn"):  # transformers 4
                inv_freq, _ = m.rope_init_fn(m.config, device=buffer_dev)
            else:
                fn = getattr(m, "compute_default_rope_parameters", None)
                if m.rope_type != "default" or fn is None:
                    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
                    fn = ROPE_INIT_FUNCTIONS[m.rope_type]
                inv_freq, _ = fn(m.config, device=buffer_dev)
            m.inv_freq = inv_freq.to(buffer_dev, torch.float32)
            if hasattr(m, "original_inv_freq"):
                m.original_inv_freq = m.inv_freq.clone()


def cpu_fused_adamw_available():
    try:
        p = nn.Parameter(torch.zeros(4))
        p.grad = torch.ones(4)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


# CUDA's pinned-memory cache rounds every block up to a power of two: the
# offloaded fp32 parameters and gradients of Llama's MLP (172 or 224 MiB a
# matrix) would take 256 MiB each, 16 GiB more host memory at 7B, which a
# 128 GiB host cannot spare at 8B. Where this torch has the setting, blocks
# above 64 MiB keep their own size (unless the caller configured the
# allocator).
HOST_ALLOC_CONF = "pinned_max_round_threshold_mb:64"


def limit_pinned_rounding():
    """The allocator settings in effect for this run ('' where none)."""
    given = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if given or setter is None:
        return given
    try:
        setter(HOST_ALLOC_CONF)
        return HOST_ALLOC_CONF
    except (RuntimeError, TypeError, ValueError):  # a torch without the key
        return ""


def pinned_round_mb(conf):
    """The pinned allocator's rounding threshold in `conf` (MiB; None: it
    rounds every block)."""
    for kv in conf.split(","):
        k, _, v = kv.partition(":")
        if k.strip() == "pinned_max_round_threshold_mb":
            return int(v)
    return None


def host_bytes_needed(model, mode, dev, fused, alloc_conf):
    """What the host must hold when the optimizer lives there: fp32 parameters,
    gradients (both in pinned blocks when offloaded from a GPU) and both AdamW
    moments, a full-size temporary of foreach AdamW (its sqrt of
    exp_avg_sq), and 2 GiB for the process itself; 0 otherwise."""
    if mode != "fsdp2_offload" and dev.type != "cpu":
        return 0
    sizes = [q.numel() * 4 for q in model.parameters()]
    numel = sum(sizes) // 4
    if dev.type == "cuda":
        limit = pinned_round_mb(alloc_conf)
        limit = float("inf") if limit is None else limit * 2 ** 20
        sizes = [1 << (b - 1).bit_length() if b <= limit else b for b in sizes]
    return 2 * sum(sizes) + numel * (8 + (0 if fused else 4)) + 2 * 2 ** 30


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def is_oom(e):
    s = str(e)
    return (isinstance(e, torch.OutOfMemoryError) or "out of memory" in s
            or "can't allocate memory" in s)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama2-7b", choices=sorted(MODELS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default="fsdp2_offload", choices=["fsdp2_offload", "fsdp2", "plain"])
    p.add_argument("--seq", type=int, default=0, help="sequence length (0: 4096; 128 for llama-small-cpu)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--checkpointing", default="on", choices=["on", "off"])
    p.add_argument("--layers", type=int, default=0,
                   help="num_hidden_layers (0: the model's), to scale a model down")
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--no-host-check", action="store_true",
                   help="start even when the host's MemAvailable looks too small")
    p.add_argument("--out", default="")
    a = p.parse_args()
    alloc_conf = limit_pinned_rounding()  # before anything is pinned
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cfg = dict(MODELS[a.model])
    seq = a.seq or cfg["seq"]
    if a.layers:
        cfg["n"] = a.layers
    ckpt = a.checkpointing == "on"
    n = a.matmul_n if dev.type == "cuda" else min(a.matmul_n, 1024)
    rates = matmul_rates(dev, n)
    peak = statistics.median(rates)

    from transformers import LlamaForCausalLM

    init_process_group(dev)
    # The model is built on the meta device: at 7B/8B no fp32 copy may exist
    # on the device (or twice on the host) before sharding.
    with torch.device("meta"):
        model = LlamaForCausalLM(config(cfg, seq))
    params = sum(q.numel() for q in model.parameters())
    layer_params = sum(q.numel() for q in model.model.layers.parameters())
    offload = a.mode == "fsdp2_offload"
    # Fused AdamW wherever it exists. On the host it is one in-place pass
    # (torch 2.4+ has a CPU kernel), 4-6x faster than foreach on a 2-core
    # machine, and foreach's full-size temporaries are memory an 8B model's
    # host cannot spare.
    host_opt = offload or dev.type == "cpu"
    fused = cpu_fused_adamw_available() if host_opt else dev.type == "cuda"
    opt_kind = "fused" if fused else "foreach"
    optimizer = (f"AdamW({a.lr:g}, betas (0.9, 0.999), eps 1e-8, wd 0.01, {opt_kind}"
                 f"{', on the host' if offload else ''})")
    precision = ("bf16 autocast, fp32 parameters" if a.mode == "plain" else
                 "bf16 compute (FSDP2 MixedPrecisionPolicy), fp32 parameters and reduce")
    result = {
        "benchmark": "fsdp2_peer",
        "implementation": f"PyTorch {torch.__version__} {a.mode} (transformers LlamaForCausalLM)",
        "model": a.model, "parameters": params,
        "config": {"device": str(dev), "batch": a.batch, "seq_len": seq, "layers": cfg["n"],
                   "mode": a.mode, "checkpointing": a.checkpointing,
                   "precision": precision, "optimizer": optimizer,
                   "alloc_conf": alloc_conf,
                   "steps": a.steps, "warmup": a.warmup},
        "machine": machine(),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "matmul": {"n": n, "bf16_flops_median": peak, "bf16_flops_max": max(rates)},
    }
    # PaLM's model FLOPs: the input embedding is a lookup, the untied head a
    # matmul; with recompute each layer's forward runs twice.
    flops = 6.0 * (params - cfg["vocab"] * cfg["d"]) + 12.0 * cfg["n"] * cfg["d"] * seq
    flops_rc = flops + (2.0 * layer_params + 4.0 * cfg["n"] * cfg["d"] * seq if ckpt else 0.0)
    result.update({"flops_per_token": flops, "flops_per_token_with_recompute": flops_rc})

    try:
        need = host_bytes_needed(model, a.mode, dev, fused, alloc_conf)
        if need and not a.no_host_check and need > mem_available():
            raise MemoryError(f"out of memory: the host needs about {need / 2**30:.1f} GiB "
                              f"for fp32 parameters, gradients and AdamW states "
                              f"(--no-host-check to try anyway), "
                              f"MemAvailable is {mem_available() / 2**30:.1f} GiB")
        result.update(train(a, model, cfg, seq, dev, fused, ckpt))
        tps = result["tokens_per_s"]
        result.update({"mfu_measured": tps * flops / peak,
                       "mfu_measured_with_recompute": tps * flops_rc / peak,
                       "mfu_spec": tps * flops / SPEC_BF16_FLOPS})
    except (RuntimeError, MemoryError) as e:
        if not (isinstance(e, MemoryError) or is_oom(e)):
            raise
        does_not_fit(result, e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    write_result(a, result, dev)


def does_not_fit(result, e):
    """`result` for a run that ran out of memory: the reason, no timings."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if not msg.startswith("out of memory"):
        msg = "out of memory: " + msg
    result.update({"error": msg[:500], "step_ms": None,
                   "split_ms": None, "tokens_per_s": None, "mfu_measured": None,
                   "mfu_measured_with_recompute": None, "mfu_spec": None,
                   "final_loss": None})


def write_result(a, result, dev):
    """Adds the peaks to `result`, prints it (and writes --out), and one
    markdown row for a report on stderr, so that stdout stays JSON."""
    result["peak_device_bytes"] = (torch.cuda.max_memory_allocated(dev)
                                   if dev.type == "cuda" else -1)
    result["peak_host_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    r = result
    if r.get("error"):
        row = f"| {a.model} | {r['implementation']} | {r['error']} | | | |"
    else:
        mem = f"{r['peak_host_bytes'] / 2**30:.1f} GiB host"
        if r["peak_device_bytes"] >= 0:
            mem = f"{r['peak_device_bytes'] / 2**30:.1f} GiB device, " + mem
        row = (f"| {a.model} | {r['implementation']} | {r['step_ms']['median']:.1f} ms | "
               f"{r['tokens_per_s']:.1f} tok/s | MFU {100 * r['mfu_measured']:.1f}% "
               f"({100 * r['mfu_spec']:.2f}% of spec) | {mem} |")
    print(row, file=sys.stderr)


def timed_steps(forward, opt, dev, warmup, steps, splits=3):
    """`warmup` then `steps` timed training steps of loss = forward() (ms
    each), then `splits` more timed by phase (medians of forward, backward
    and optimizer ms); and every step's loss."""
    losses = []

    def step(split):
        sync(dev)
        t = [time.perf_counter()]
        loss = forward()
        if split:
            sync(dev)
            t.append(time.perf_counter())
        loss.backward()
        if split:
            sync(dev)
            t.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        t.append(time.perf_counter())
        losses.append(loss.item())
        return [(b - a) * 1e3 for a, b in zip(t, t[1:])]

    for _ in range(warmup):
        step(False)
    times = [step(False)[0] for _ in range(steps)]
    phases = [step(True) for _ in range(splits)]
    split_ms = {k: statistics.median(p[i] for p in phases)
                for i, k in enumerate(("forward", "backward", "optimizer"))}
    return times, split_ms, losses


def train(a, model, cfg, seq, dev, fused, ckpt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if ckpt:
        # transformers' own checkpointing of every decoder layer,
        # non-reentrant. Its GradientCheckpointingLayer checkpoints forward,
        # not __call__, so FSDP2's hooks stay outside the recomputed region
        # (no second all-gather); gradient_checkpointing_enable is the name
        # before transformers 5.
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    if a.mode == "plain":
        model.to_empty(device=dev)
    else:
        mesh = init_device_mesh(dev.type, (1,))
        offload = a.mode == "fsdp2_offload"
        kw = {"mesh": mesh,
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32)}
        if offload:
            # Pinned host memory needs CUDA; on a CPU-only run the "offload"
            # is to the device itself, so only the code path is exercised.
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=dev.type == "cuda")
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.to_empty(device="cpu" if offload else dev)
    std = model.config.initializer_range
    init_weights(model, std, dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01, **({"fused": True} if fused else {"foreach": True}))

    g = torch.Generator().manual_seed(100)
    tokens = torch.randint(0, cfg["vocab"], (a.batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous().to(dev), tokens[:, 1:].contiguous().to(dev)
    autocast = a.mode == "plain"

    def forward():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x, use_cache=False).logits
        # fp32 cross-entropy of our own shifted labels (not labels=, which
        # would shift them again).
        return F.cross_entropy(logits.float().reshape(-1, cfg["vocab"]), y.reshape(-1))

    times, split_ms, losses = timed_steps(forward, opt, dev, a.warmup, a.steps)
    return {"step_ms": stats(times), "split_ms": split_ms,
            "tokens_per_s": a.batch * seq / (statistics.median(times) * 1e-3),
            # At step 0 the final norm's output has unit rms and the head's
            # weights std 0.02, so the logits are about N(0, 0.02^2 d) and
            # the loss is about ln(vocab) + 0.02^2 d / 2 (11.19 at d 4096).
            "first_loss": losses[0], "ln_vocab": math.log(cfg["vocab"]),
            "expected_first_loss": math.log(cfg["vocab"]) + 0.5 * std ** 2 * cfg["d"],
            "final_loss": losses[-1]}


if __name__ == "__main__":
    main()
