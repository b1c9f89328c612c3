"""Hugging Face-layout GPT-2 and LLaMA checkpoints and their logits, for the
C++ zoo models to reproduce (tests/test_interop_python.cpp).

    hf_reference.py DIR

Writes DIR/gpt2.safetensors and DIR/llama.safetensors (random weights under
the parameter names and shapes of transformers' GPT2LMHeadModel and
LlamaForCausalLM, tied lm_head omitted for GPT-2 as save_pretrained does),
DIR/ids.safetensors (a [2, 16] int64 batch) and DIR/logits.safetensors
("gpt2", "llama": [2, 16, 100] float32) computed by the plain PyTorch
implementations below, written from the models' published definitions.
The configs equal GPT2Config::tiny_test() and LlamaConfig::tiny_test().
"""

import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interop import write_safetensors  # noqa: E402

VOCAB, T, B = 100, 16, 2


def gpt2_weights(g):
    c, layers = 32, 2
    w = {}

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    w["transformer.wte.weight"] = rnd(VOCAB, c)
    w["transformer.wpe.weight"] = rnd(32, c)
    for i in range(layers):
        p = f"transformer.h.{i}."
        w[p + "ln_1.weight"] = 1 + rnd(c, std=0.1)
        w[p + "ln_1.bias"] = rnd(c, std=0.1)
        w[p + "attn.c_attn.weight"] = rnd(c, 3 * c)  # Conv1D: [in, out]
        w[p + "attn.c_attn.bias"] = rnd(3 * c, std=0.1)
        w[p + "attn.c_proj.weight"] = rnd(c, c)
        w[p + "attn.c_proj.bias"] = rnd(c, std=0.1)
        w[p + "ln_2.weight"] = 1 + rnd(c, std=0.1)
        w[p + "ln_2.bias"] = rnd(c, std=0.1)
        w[p + "mlp.c_fc.weight"] = rnd(c, 4 * c)
        w[p + "mlp.c_fc.bias"] = rnd(4 * c, std=0.1)
        w[p + "mlp.c_proj.weight"] = rnd(4 * c, c)
        w[p + "mlp.c_proj.bias"] = rnd(c, std=0.1)
    w["transformer.ln_f.weight"] = 1 + rnd(c, std=0.1)
    w["transformer.ln_f.bias"] = rnd(c, std=0.1)
    return w


def gpt2_forward(w, ids, n_head=4, layers=2):
    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][: ids.shape[1]]
    c = x.shape[-1]
    d = c // n_head
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    for i in range(layers):
        p = f"transformer.h.{i}."
        h = F.layer_norm(x, (c,), w[p + "ln_1.weight"], w[p + "ln_1.bias"], 1e-5)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = qkv.split(c, dim=-1)
        q, k, v = (t.view(B, T, n_head, d).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, c)
        x = x + y @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = F.layer_norm(x, (c,), w[p + "ln_2.weight"], w[p + "ln_2.bias"], 1e-5)
        h = F.gelu(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"], approximate="tanh")
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = F.layer_norm(x, (c,), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], 1e-5)
    return x @ w["transformer.wte.weight"].t()  # tied head


def llama_weights(g, c=32, inter=64, layers=2, heads=8, kv=4):
    d = c // heads
    w = {}

    def rnd(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    w["model.embed_tokens.weight"] = rnd(VOCAB, c)
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(heads * d, c)
        w[p + "self_attn.k_proj.weight"] = rnd(kv * d, c)
        w[p + "self_attn.v_proj.weight"] = rnd(kv * d, c)
        w[p + "self_attn.o_proj.weight"] = rnd(c, heads * d)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, c)
        w[p + "mlp.up_proj.weight"] = rnd(inter, c)
        w[p + "mlp.down_proj.weight"] = rnd(c, inter)
        w[p + "input_layernorm.weight"] = 1 + rnd(c, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(c, std=0.1)
    w["model.norm.weight"] = 1 + rnd(c, std=0.1)
    w["lm_head.weight"] = rnd(VOCAB, c)
    return w


def rms_norm(x, weight, eps=1e-6):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def llama_forward(w, ids, heads=8, kv=4, layers=2, theta=10000.0):
    x = w["model.embed_tokens.weight"][ids]
    c = x.shape[-1]
    d = c // heads
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    for i in range(layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].t()).view(B, T, heads, d).transpose(1, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].t()).view(B, T, kv, d).transpose(1, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].t()).view(B, T, kv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv, dim=1)
        v = v.repeat_interleave(heads // kv, dim=1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, c)
        x = x + y @ w[p + "self_attn.o_proj.weight"].t()
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate = F.silu(h @ w[p + "mlp.gate_proj.weight"].t())
        x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].t())) @ w[p + "mlp.down_proj.weight"].t()
    x = rms_norm(x, w["model.norm.weight"])
    return x @ w["lm_head.weight"].t()


def main(argv):
    out = argv[1]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(VOCAB, (B, T), generator=g)
    gw, lw = gpt2_weights(g), llama_weights(g)
    with torch.no_grad():
        logits = {"gpt2": gpt2_forward(gw, ids), "llama": llama_forward(lw, ids)}
    meta = {"format": "pt"}
    write_safetensors(os.path.join(out, "gpt2.safetensors"), gw, meta)
    write_safetensors(os.path.join(out, "llama.safetensors"), lw, meta)
    write_safetensors(os.path.join(out, "ids.safetensors"), {"ids": ids}, meta)
    write_safetensors(os.path.join(out, "logits.safetensors"), logits, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
