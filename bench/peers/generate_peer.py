"""transformers' side of bench_generate (bench/generate.cpp).

    generate_peer.py make DIR
    generate_peer.py run DIR NEW

make: a LLaMA-shaped model (vocab 4096, width 256, MLP 688, 4 layers, 4
heads over 2 key/value heads: gpt-small-cpu's size) with seeded random
weights, saved by save_pretrained in DIR, and prompts.safetensors: 4
prompts of 64 tokens, the last two left-padded (16 and 40 padding columns).
No stop token: every row runs to NEW tokens.

run: loads DIR (SDPA attention), generates NEW tokens greedily once to warm
up, then once timed; prints one JSON line {"seconds", "new_tokens", "fnv",
"versions"} (fnv: FNV-1a 64 of the sequences as little-endian int64, to
compare with ours).
"""

import json
import os
import struct
import sys
import time

import torch
from safetensors.torch import load_file, save_file


def make(d):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    # Larger than the default init, so that greedy paths have no near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    model.save_pretrained(d)
    ids = torch.randint(0, 4096, (4, 64), generator=g)
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[2, :16] = 0
    mask[3, :40] = 0
    ids[mask == 0] = 0
    save_file({"ids": ids, "attention_mask": mask},
              os.path.join(d, "prompts.safetensors"))


def fnv(t):
    h = 0xCBF29CE484222325
    for v in t.flatten().tolist():
        for b in struct.pack("<q", v):
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def run(d, new):
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="sdpa").eval()
    p = load_file(os.path.join(d, "prompts.safetensors"))
    kw = dict(input_ids=p["ids"], attention_mask=p["attention_mask"],
              max_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(**kw)
        t0 = time.perf_counter()
        out = model.generate(**kw)
        seconds = time.perf_counter() - t0
    print(json.dumps({
        "seconds": seconds,
        "new_tokens": int(out.shape[1] - p["ids"].shape[1]),
        "fnv": str(fnv(out)),
        "versions": {"torch": torch.__version__,
                     "transformers": transformers.__version__}}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "run":
        run(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)
