"""bitsandbytes', transformers' and PEFT's side of tests/test_qlora.cpp.

    qlora_reference.py layers IN OUT
        IN (safetensors) holds weights "w.<case>", biases "b.<case>" and
        inputs "x.<case>"; OUT receives bitsandbytes' layers on them, on the
        CPU: Linear8bitLt (threshold 6, eval: LLM.int8) with its int8 rows
        ("cb", "scb"), and Linear4bit (nf4 with double quantization, fp4;
        fp32 and bf16 compute): outputs "y.<kind>.<case>" and the input's
        gradient of sum(y * g) ("dx.<kind>.<case>", g = "g.<case>" of IN).
    qlora_reference.py models ROOT
        small LLaMA and GPT-2 models with random weights, each saved by
        transformers in ROOT/<model>, a PEFT adapter on it (random A and B)
        in ROOT/<model>/adapter, and in ROOT/<model>/reference.safetensors
        the ids and the adapted model's logits with the base loaded in full
        precision ("logits.full"), in 4-bit NF4 with double quantization
        ("logits.nf4") and in 8-bit ("logits.int8").
"""

import os
import sys

import torch
from safetensors.torch import load_file, save_file

import bitsandbytes as bnb

from hf_models import randomize  # the weights' scale of the hf tests

VOCAB, T, B = 100, 16, 2


def nearest_blockwise(A, code, blocksize):
    """bitsandbytes' reference 8-bit blockwise quantizer (its PyTorch
    kernel: each value scaled by its block's absmax, then the nearest code,
    ties to the lower). Its native CPU kernel, which it would pick here, finds
    the code with an approximate search that is not the nearest for about
    0.1% of values near a midpoint; in double quantization that moves a
    block's absmax by one 8-bit step (about 1%), which would swamp the
    comparison. The CUDA kernel and ours take the nearest."""
    flat = A.reshape(-1).float()
    n = flat.numel()
    rem = n % blocksize
    full = n - rem
    com = flat[:full].reshape(-1, blocksize)
    absmax = com.abs().max(dim=-1)[0]
    scaled = torch.clamp(com * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if rem:
        am = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
    bounds = (code[:-1] + code[1:]) / 2
    q = torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)
    return q.reshape(A.shape), absmax


def use_nearest_blockwise():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a registered kernel"
        torch.library.register_kernel(
            "bitsandbytes::quantize_blockwise", "cpu", nearest_blockwise)


def layers(src, dst):
    inp = load_file(src)
    out = {}
    for key in [k for k in inp if k.startswith("w.")]:
        case = key[2:]
        w, b, x, g = inp[key], inp["b." + case], inp["x." + case], inp["g." + case]
        o, i = w.shape
        l8 = bnb.nn.Linear8bitLt(i, o, bias=True, has_fp16_weights=False, threshold=6.0)
        l8.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
        l8.bias = torch.nn.Parameter(b.clone(), requires_grad=False)
        l8 = l8.to("cpu").eval()
        out["cb." + case] = l8.weight.data.clone()
        out["scb." + case] = l8.weight.SCB.clone()
        kinds = {"int8": l8}
        for name, qt, nested, compute in (("nf4", "nf4", True, torch.float32),
                                          ("fp4", "fp4", False, torch.float32),
                                          ("nf4bf16", "nf4", True, torch.bfloat16)):
            l4 = bnb.nn.Linear4bit(i, o, bias=True, compute_dtype=compute,
                                   quant_type=qt, compress_statistics=nested)
            l4.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False,
                                          quant_type=qt, compress_statistics=nested)
            l4.bias = torch.nn.Parameter(b.clone(), requires_grad=False)
            kinds[name] = l4.to("cpu").eval()
        for name, layer in kinds.items():
            xr = x.clone().requires_grad_(True)
            y = layer(xr)
            (y * g).sum().backward()
            out[f"y.{name}.{case}"] = y.detach().contiguous()
            out[f"dx.{name}.{case}"] = xr.grad.contiguous()
    save_file(out, dst)


def models(root):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import (AutoModelForCausalLM, BitsAndBytesConfig,
                              GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)

    g = torch.Generator().manual_seed(77)
    cases = {
        "llama": (LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, attn_implementation="eager")),
            ["q_proj", "v_proj", "down_proj"]),
        "gpt2": (GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            bos_token_id=0, eos_token_id=0,
            attn_implementation="eager")),
            ["c_attn", "c_fc"]),
    }
    for name, (model, targets) in cases.items():
        d = os.path.join(root, name)
        randomize(model.eval(), g)
        model.save_pretrained(d)
        torch.manual_seed(11)
        peft = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
            fan_in_fan_out=name == "gpt2"))
        peft.save_pretrained(os.path.join(d, "adapter"))
        ids = torch.randint(0, VOCAB, (B, T), generator=g)
        ref = {"ids": ids}
        quant = {
            "full": None,
            "nf4": BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32),
            "int8": BitsAndBytesConfig(load_in_8bit=True),
        }
        for kind, qc in quant.items():
            kw = {"attn_implementation": "eager"}
            if qc is not None:
                kw.update(quantization_config=qc, device_map="cpu")
            base = AutoModelForCausalLM.from_pretrained(d, **kw)
            for mod in base.modules():
                # On CPUs with AVX512-BF16, bitsandbytes' 4-bit inference
                # repacks the weight for a kernel that multiplies in bf16
                # (about 1e-2 of the logits here); elsewhere it multiplies
                # the fp32-dequantized weight in the compute dtype, as the
                # training path always does. The reference is that one, on
                # any CPU.
                if isinstance(mod, bnb.nn.Linear4bit):
                    mod.support_avx512bf16_for_cpu = False
            m = PeftModel.from_pretrained(base, os.path.join(d, "adapter")).eval()
            with torch.no_grad():
                ref["logits." + kind] = m(input_ids=ids).logits.contiguous()
        save_file(ref, os.path.join(d, "reference.safetensors"))


if __name__ == "__main__":
    use_nearest_blockwise()
    if len(sys.argv) == 4 and sys.argv[1] == "layers":
        layers(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "models":
        models(sys.argv[2])
    else:
        sys.exit(__doc__)
