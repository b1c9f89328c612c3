"""QLoRA fine-tuning on one GPU in PyTorch: the peer of our QLoRA step on
Llama-3-8B / Llama-2-7B. transformers' LlamaForCausalLM (SDPA attention) with
PEFT LoRA adapters (r 16, alpha 32, dropout 0, fp32) on q/k/v/o/gate/up/down
of every decoder layer, over a frozen base that is

  nf4   4-bit NF4 (bitsandbytes Linear4bit, no double quantization, bf16
        compute) for every linear but the head, which stays bf16 like the
        embedding and the norms: QLoRA's usual setup. Chosen by --base auto
        when bitsandbytes imports and works on a CUDA device.
  bf16  the whole base in bf16 (--base bf16, or auto without bitsandbytes).

There is no model hub: the base has random weights (fsdp2_peer.py's
initialisation), built on the meta device, materialised in bf16 on the device
and then quantized in place (quantize_base). bf16 autocast for both bases;
AdamW (fused on CUDA, weight decay 0) over the adapters only. Random token
ids, fp32 cross-entropy of the logits, activation checkpointing of every
decoder layer by default. A CUDA out-of-memory error is reported in the JSON
("error", tokens_per_s null) with exit status 0.

  python3 bench/gpu/qlora_peer.py [--model llama3-8b|llama2-7b|llama-small-cpu]
      [--device cuda] [--base auto|nf4|bf16] [--seq 2048] [--batch 4]
      [--steps 10] [--warmup 2] [--r 16] [--alpha 32] [--checkpointing on|off]
      [--layers N] [--lr 2e-4] [--matmul-n 8192] [--out FILE.json]
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from torch_ddp_step import machine, stats  # noqa: E402
from torch_gpt_step import matmul_rates, sync  # noqa: E402

from fsdp2_peer import (MODELS, SPEC_BF16_FLOPS, config,  # noqa: E402
                        cpu_fused_adamw_available, init_weights, is_oom,
                        does_not_fit, timed_steps, write_result)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bnb_version():
    """bitsandbytes' version, or None when it does not import."""
    try:
        import bitsandbytes
        return bitsandbytes.__version__
    except Exception:  # ImportError, or a broken native library
        return None


def bnb_smoke_test(dev):
    """None when a small NF4 Linear4bit quantizes on dev and runs forward and
    backward under bf16 autocast; else why not (checked before the model is
    touched, so that --base auto can fall back to bf16 cleanly)."""
    try:
        g = torch.Generator().manual_seed(0)
        w = (0.02 * torch.randn(192, 128, generator=g)).to(dev, torch.bfloat16)
        lin = nn.Sequential(nn.Linear(128, 192, bias=False, device="meta"))
        lin[0].weight = nn.Parameter(w.clone(), requires_grad=False)
        quantize_base(lin, dev, skip=())
        x = torch.randn(4, 128, generator=g).to(dev).requires_grad_(True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = lin(x)
        y.float().sum().backward()
        sync(dev)
        ref = x.detach().to(torch.bfloat16).float() @ w.float().t()
        err = (y.float() - ref).abs().max().item()
        if not math.isfinite(err) or err > 0.25 * ref.abs().max().item() + 1e-3:
            return f"NF4 smoke test error {err:.3g}"
        if x.grad is None or not torch.isfinite(x.grad).all():
            return "NF4 smoke test: no finite input gradient"
        return None
    except Exception as e:  # noqa: BLE001 - any failure means: no nf4 here
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return f"{type(e).__name__}: {msg}"


def pick_base(want, dev):
    """("nf4" | "bf16", the label for the JSON's "base")."""
    ver = bnb_version()
    if want == "bf16":
        return "bf16", "bf16 (--base bf16)"
    if ver is None:
        if want == "nf4":
            sys.exit("--base nf4: bitsandbytes does not import")
        return "bf16", "bf16 (bitsandbytes not available)"
    if want == "auto" and dev.type != "cuda":
        return "bf16", f"bf16 (bitsandbytes {ver} not used off CUDA)"
    why = bnb_smoke_test(dev)
    if why is not None:
        if want == "nf4":
            sys.exit(f"--base nf4: bitsandbytes {ver} does not work on {dev}: {why}")
        return "bf16", f"bf16 (bitsandbytes {ver} failed on {dev}: {why})"
    return "nf4", f"nf4 (bitsandbytes {ver})"


@torch.no_grad()
def quantize_base(model, dev, skip=("lm_head",)):
    """Swap every nn.Linear of model (but those named in skip) for a
    bitsandbytes Linear4bit holding its current weight in NF4: block size 64,
    no double quantization, bf16 compute, uint8 storage; that is
    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=False)
    as from_pretrained would apply it, but on weights already in memory (there
    is no checkpoint to load). Linear by linear, so that only one bf16 weight
    at a time has a quantized copy beside it. Marks the model
    is_loaded_in_4bit, which is what makes PEFT wrap the Linear4bit layers in
    its bitsandbytes LoRA layer. Returns the number of layers swapped."""
    import bitsandbytes as bnb

    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if (not isinstance(child, nn.Linear) or isinstance(child, bnb.nn.Linear4bit)
                    or name in skip or full in skip):
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                  bias=child.bias is not None, compute_dtype=torch.bfloat16,
                                  compress_statistics=False, quant_type="nf4",
                                  quant_storage=torch.uint8, device="meta")
            w = child.weight.data.to(dev, torch.bfloat16)
            q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=False,
                                         quant_type="nf4", quant_storage=torch.uint8, module=q)
            q.weight.to(dev)  # quantizes here (Params4bit._quantize), in place
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data.to(dev, torch.bfloat16),
                                      requires_grad=False)
            q.train(child.training)
            setattr(parent, name, q)
            # The old module stays referenced (by the lists above) until the
            # end; its bf16 weight goes now.
            child.weight = None
            child.bias = None
            del w
            swapped += 1
    model.is_loaded_in_4bit = True
    return swapped


def lora_parameters(model, r):
    """r (in + out) for every targeted linear of the decoder layers (A is
    r x in, B is out x r), counted on the meta model."""
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name.split(".")[-1] in TARGETS:
            total += r * (m.in_features + m.out_features)
    return total


def base_bytes(model):
    """Bytes of the frozen base as stored: bf16 tensors, and for NF4 layers
    the packed codes plus their fp32 block absmax."""
    total = 0
    for q in model.parameters():
        if q.requires_grad:
            continue
        total += q.numel() * q.element_size()
        qs = getattr(q, "quant_state", None)
        if qs is not None and getattr(qs, "absmax", None) is not None:
            total += qs.absmax.numel() * qs.absmax.element_size()
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--base", default="auto", choices=["auto", "nf4", "bf16"],
                   help="frozen base (auto: nf4 where bitsandbytes works on CUDA, else bf16)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--checkpointing", default="on", choices=["on", "off"])
    p.add_argument("--layers", type=int, default=0,
                   help="num_hidden_layers (0: the model's), to scale a model down")
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    cfg = dict(MODELS[a.model])
    seq = a.seq
    if a.layers:
        cfg["n"] = a.layers
    ckpt = a.checkpointing == "on"
    n = a.matmul_n if dev.type == "cuda" else min(a.matmul_n, 1024)
    rates = matmul_rates(dev, n)
    peak = statistics.median(rates)
    base, base_label = pick_base(a.base, dev)

    from transformers import LlamaForCausalLM

    # Built on the meta device: no fp32 copy of the model is ever allocated.
    with torch.device("meta"):
        model = LlamaForCausalLM(config(cfg, seq))
    params = sum(q.numel() for q in model.parameters())
    layer_params = sum(q.numel() for q in model.model.layers.parameters())
    lora = lora_parameters(model, a.r)
    layer_lora = lora // cfg["n"]
    fused = dev.type == "cuda" or cpu_fused_adamw_available()
    optimizer = (f"AdamW({a.lr:g}, betas (0.9, 0.999), eps 1e-8, wd 0, "
                 f"{'fused' if fused else 'foreach'}, adapters only)")
    result = {
        "benchmark": "qlora_peer",
        "implementation": f"PyTorch {torch.__version__} QLoRA {base} base "
                          f"(transformers LlamaForCausalLM + PEFT LoRA)",
        "model": a.model, "parameters": params, "trainable_parameters": lora,
        "base": base_label,
        "config": {"device": str(dev), "batch": a.batch, "seq_len": seq, "layers": cfg["n"],
                   "base": base, "lora_r": a.r, "lora_alpha": a.alpha, "lora_dropout": 0.0,
                   "lora_targets": TARGETS, "checkpointing": a.checkpointing,
                   "precision": ("bf16 autocast, NF4 base (bf16 compute, no double quant; "
                                 "head, embedding and norms bf16), fp32 adapters"
                                 if base == "nf4" else
                                 "bf16 autocast, bf16 base, fp32 adapters"),
                   "optimizer": optimizer, "steps": a.steps, "warmup": a.warmup},
        "machine": machine(),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "matmul": {"n": n, "bf16_flops_median": peak, "bf16_flops_max": max(rates)},
    }
    # Model FLOPs of a QLoRA step: the frozen base's matmuls run forward (2P)
    # and backward for the input gradient only (2P): frozen weights need no
    # weight gradient, so 4P where full fine-tuning has 6P. The adapters get
    # all three (6P_lora). The input embedding is a lookup (not counted), the
    # untied head a frozen matmul; attention's score and value matmuls
    # 12 L d T as in PaLM. With recompute each layer's forward (base and
    # adapters) runs twice.
    flops = (4.0 * (params - cfg["vocab"] * cfg["d"]) + 6.0 * lora
             + 12.0 * cfg["n"] * cfg["d"] * seq)
    flops_rc = flops + (2.0 * (layer_params + layer_lora) + 4.0 * cfg["n"] * cfg["d"] * seq
                        if ckpt else 0.0)
    result.update({"flops_per_token": flops, "flops_per_token_with_recompute": flops_rc})

    try:
        result.update(train(a, model, cfg, seq, dev, base, fused, ckpt, lora))
        tps = result["tokens_per_s"]
        result.update({"mfu_measured": tps * flops / peak,
                       "mfu_measured_with_recompute": tps * flops_rc / peak,
                       "mfu_spec": tps * flops / SPEC_BF16_FLOPS})
    except (RuntimeError, MemoryError) as e:
        if not (isinstance(e, MemoryError) or is_oom(e)):
            raise
        does_not_fit(result, e)
    # The training peak (the counter is reset once the model is built: the
    # bf16 base held before quantization is the build's, reported beside it).
    write_result(a, result, dev)


def train(a, model, cfg, seq, dev, base, fused, ckpt, lora_expected):
    from peft import LoraConfig, get_peft_model

    build = {}
    # bf16 on the meta device costs nothing; to_empty then allocates the
    # base in bf16 on the device (16 GB at 8B, never 32 GB of fp32).
    model.to(torch.bfloat16)
    model.to_empty(device=dev)
    std = model.config.initializer_range
    init_weights(model, std, dev)  # the rotary inv_freq buffers back in fp32
    model.requires_grad_(False)
    if base == "nf4":
        t0 = time.perf_counter()
        build["quantized_layers"] = quantize_base(model, dev)
        sync(dev)
        build["quantize_s"] = time.perf_counter() - t0
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if ckpt:
        # transformers' own checkpointing of every decoder layer,
        # non-reentrant, as fsdp2_peer does it (gradient_checkpointing_enable
        # is the name before transformers 5). The adapters inside a layer are
        # recomputed with it.
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        # With every base weight frozen the embedding's output does not
        # require grad; PEFT's recipe makes it, so that checkpointed layers
        # see an input that needs a gradient (transformers 5 already did it
        # above; transformers 4 only for its own PEFT integration).
        if getattr(model, "_require_grads_hook", None) is None:
            model.enable_input_require_grads()
    lcfg = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    # autocast_adapter_dtype (the default) keeps the adapters fp32 on a bf16
    # base.
    model = get_peft_model(model, lcfg)
    trainable = [q for q in model.parameters() if q.requires_grad]
    n_trainable = sum(q.numel() for q in trainable)
    if n_trainable != lora_expected:
        raise ValueError(f"{n_trainable} trainable parameters, expected r (in + out) "
                         f"summed over the targets = {lora_expected}")
    dtypes = sorted({str(q.dtype).replace("torch.", "") for q in trainable})
    lora_layers = sum(1 for m in model.modules() if hasattr(m, "lora_A"))
    kinds = sorted({type(m).__module__.split(".")[-1] + "." + type(m).__name__
                    for m in model.modules() if hasattr(m, "lora_A")})
    build.update({"adapter_dtypes": dtypes, "lora_layers": lora_layers, "lora_layer_types": kinds,
                  "base_bytes": base_bytes(model)})
    model.train()
    if dev.type == "cuda":
        build["peak_device_bytes_build"] = torch.cuda.max_memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    opt = torch.optim.AdamW(trainable, lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0, **({"fused": True} if fused else {"foreach": True}))

    g = torch.Generator().manual_seed(100)
    tokens = torch.randint(0, cfg["vocab"], (a.batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous().to(dev), tokens[:, 1:].contiguous().to(dev)

    def forward():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
        # fp32 cross-entropy of our own shifted labels (not labels=, which
        # would shift them again).
        return F.cross_entropy(logits.float().reshape(-1, cfg["vocab"]), y.reshape(-1))

    times, split_ms, losses = timed_steps(forward, opt, dev, a.warmup, a.steps)
    return {"build": build, "step_ms": stats(times), "split_ms": split_ms,
            "tokens_per_s": a.batch * seq / (statistics.median(times) * 1e-3),
            # LoRA's B starts at zero, so step 0 is the base's loss: about
            # ln(vocab) + 0.02^2 d / 2 (fsdp2_peer's note; NF4 changes it
            # little).
            "first_loss": losses[0], "ln_vocab": math.log(cfg["vocab"]),
            "expected_first_loss": math.log(cfg["vocab"]) + 0.5 * std ** 2 * cfg["d"],
            "final_loss": losses[-1]}


if __name__ == "__main__":
    main()
