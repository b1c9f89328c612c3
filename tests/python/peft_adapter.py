"""Writes a LoRA adapter in PEFT's layout with torch alone, for test_lora.

Usage: peft_adapter.py DIR. DIR holds base.bin (the state dict of a
torch::nn::Sequential(Linear(8, 16), ReLU, Linear(16, 4))) and x.bin ({"x"}).
Writes DIR/adapter/{adapter_config.json, adapter_model.bin} as PEFT's
save_pretrained does (r 4, lora_alpha 8, target_modules ["0", "2"]), and
DIR/y.bin: the adapted model's output for x, computed here.
"""
import json
import os
import sys

import torch


def main():
    d = sys.argv[1]
    base = torch.load(os.path.join(d, "base.bin"))
    x = torch.load(os.path.join(d, "x.bin"))["x"]
    r, alpha = 4, 8.0
    scaling = alpha / r
    g = torch.Generator().manual_seed(0)
    adapter = {}
    for name in ("0", "2"):
        out_f, in_f = base[name + ".weight"].shape
        adapter[f"base_model.model.{name}.lora_A.weight"] = (
            torch.randn(r, in_f, generator=g) * 0.1)
        adapter[f"base_model.model.{name}.lora_B.weight"] = (
            torch.randn(out_f, r, generator=g) * 0.1)

    def lora_linear(name, h):
        a = adapter[f"base_model.model.{name}.lora_A.weight"]
        b = adapter[f"base_model.model.{name}.lora_B.weight"]
        return (torch.nn.functional.linear(
            h, base[name + ".weight"], base[name + ".bias"]) +
                (h @ a.t() @ b.t()) * scaling)

    y = lora_linear("2", torch.relu(lora_linear("0", x)))
    out = os.path.join(d, "adapter")
    os.makedirs(out, exist_ok=True)
    torch.save(adapter, os.path.join(out, "adapter_model.bin"))
    config = {
        "peft_type": "LORA", "task_type": None, "r": r, "lora_alpha": alpha,
        "lora_dropout": 0.0, "target_modules": ["0", "2"], "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True,
        "modules_to_save": None, "use_rslora": False, "inference_mode": True,
        "base_model_name_or_path": None, "revision": None,
        "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    torch.save({"y": y}, os.path.join(d, "y.bin"))


if __name__ == "__main__":
    main()
