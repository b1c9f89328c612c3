#!/usr/bin/env python3
"""Writes the seed corpus of the adapter_config fuzzer
(fuzz/corpus/adapter_config): adapter_config.json files as PEFT's
LoraConfig.save_pretrained writes them, for the fuzzer's small model (an
embedding "embed", a linear "c_attn", linears "layers.0" and "layers.1"):
target_modules as a list and as regular expressions (alternation, a
lookahead, a case-insensitive flag, classes and counts), with rslora, bias,
modules_to_save and Gaussian initialisation.

Needs peft (the test venv): .venv/bin/python fuzz/make_adapter_config_corpus.py
"""

import json
import os
import tempfile

from peft import LoraConfig

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "adapter_config")


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {
        "list": LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "layers.0"]),
        "regex": LoraConfig(r=2, lora_alpha=16, target_modules=r".*\.(0|1)|c_attn"),
        "lookahead": LoraConfig(r=4, target_modules=r"^(?!embed).*", use_rslora=True),
        "flags": LoraConfig(r=1, target_modules=r"(?i)C_ATTN|layers\.[0-9]{1,2}", bias="all"),
        "embedding": LoraConfig(
            r=8, target_modules=["embed"], modules_to_save=["c_attn"], init_lora_weights="gaussian"
        ),
        "behind": LoraConfig(r=4, target_modules=r".*(?<=layers\.)\d", bias="lora_only", lora_dropout=0.0),
    }
    for name, config in seeds.items():
        with tempfile.TemporaryDirectory() as d:
            config.save_pretrained(d)
            with open(os.path.join(d, "adapter_config.json"), encoding="utf-8") as f:
                text = json.dumps(json.load(f), separators=(",", ":"))
        with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
