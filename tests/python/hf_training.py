"""transformers' own training: the reference of tests/test_hf_training.cpp.

    hf_training.py make DIR     one directory per family (DIR/<family>/,
                                written by save_pretrained) with one
                                <case>.safetensors per data case

Small configs with random weights (no download), four layers (interleaved
and ZB-V pipelines hold two chunks of two stages). Each case is a batch of 4
rows as a user feeds transformers: labels = ids with -100 where no loss is
wanted (transformers shifts them inside); trained 3 AdamW steps on the whole
batch. The file holds ids, attention_mask (all ones when the case has none),
targets (the labels shifted as our models take them: targets[:, t] =
labels[:, t + 1], -100 at the end), the loss of each step ("loss", [3]) and
every parameter after the steps ("final.<name>"). Cases:
    shifted     no padding: only the shifted labels' last position is ignored
    left_pad    rows left-padded to 16, 11, 7 and 13 real tokens, with the mask
    right_pad   the same lengths right-padded, with the mask
    pad_ids     the pad token (pad_token_id 0) in the left-padded positions,
                no mask, their labels -100: the real tokens see the padding,
                whose embedding row gets no gradient where transformers
                gives it a padding_idx
"""

import os
import sys

import torch
from safetensors.torch import save_file

import hf_models  # beside this file

import transformers
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB, T, B, STEPS, LR = 64, 16, 4, 3, 1e-2
LENGTHS = [16, 11, 7, 13]
PAD = 0


def families():
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=PAD)
    return {
        "gpt2": (GPT2LMHeadModel, GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=4,
            embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0,
            bos_token_id=1, eos_token_id=1, pad_token_id=PAD)),
        "llama": (LlamaForCausalLM, LlamaConfig(**common)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
        "mistral": (MistralForCausalLM, MistralConfig(**common,
                                                      sliding_window=8)),
        "opt": (OPTForCausalLM, OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, bos_token_id=1, eos_token_id=1,
            pad_token_id=PAD)),
        "bloom": (BloomForCausalLM, BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=4,
            hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1,
            eos_token_id=1, pad_token_id=PAD)),
    }


def randomize(model, g):
    # hf_models.py's weights (larger than transformers' init, so that errors
    # show), the padding row at zero as nn.Embedding's padding_idx keeps it.
    hf_models.randomize(model, g)
    with torch.no_grad():
        emb = model.get_input_embeddings()
        if emb.padding_idx is not None:
            emb.weight[emb.padding_idx].zero_()


def batch(case, g):
    # Real tokens are never the pad id, so only padding is padding.
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if case != "shifted":
        for r, n in enumerate(LENGTHS):
            if case in ("left_pad", "pad_ids"):
                mask[r, :T - n] = 0
            else:
                mask[r, n:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if case == "pad_ids":
        ids = ids.masked_fill(mask == 0, PAD)
    return ids, mask, labels


def train(model, ids, mask, labels, with_mask):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        out = model(input_ids=ids, attention_mask=mask if with_mask else None,
                    labels=labels)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def make(root):
    g = torch.Generator().manual_seed(4321)
    for name, (cls, config) in families().items():
        torch.manual_seed(0)
        config._attn_implementation = "eager" if name == "bloom" else "sdpa"
        model = cls(config)
        randomize(model, g)
        d = os.path.join(root, name)
        model.save_pretrained(d)
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for case in ["shifted", "left_pad", "right_pad", "pad_ids"]:
            model.load_state_dict(start)
            ids, mask, labels = batch(case, g)
            with_mask = case in ("left_pad", "right_pad")
            losses = train(model.train(), ids, mask, labels, with_mask)
            targets = torch.full_like(labels, -100)
            targets[:, :-1] = labels[:, 1:]
            ref = {"ids": ids, "attention_mask": mask, "targets": targets,
                   "loss": losses}
            for k, p in model.named_parameters():
                ref["final." + k] = p.detach().clone()
            save_file({k: v.contiguous() for k, v in ref.items()},
                      os.path.join(d, case + ".safetensors"))
    print("transformers", transformers.__version__, "torch", torch.__version__)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        sys.exit(__doc__)
