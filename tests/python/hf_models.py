"""transformers' side of tests/test_hf_models.cpp.

    hf_models.py make DIR        one directory per case, written by
                                 transformers' save_pretrained, with
                                 reference.safetensors beside config.json
    hf_models.py check DIR OURS [DIR OURS ...]
                                 loads each OURS (our save_pretrained of case
                                 DIR) with transformers and compares its
                                 logits on DIR's inputs with DIR's reference;
                                 prints the largest difference, exit 1 when
                                 any is above the bound
    hf_models.py sampler         torch's DistributedSampler orders
    hf_models.py peft_make DIR OUT
                                 a PEFT adapter on case DIR's model saved in
                                 OUT, with its logits (OUT/logits.safetensors)
    hf_models.py peft_check DIR ADAPTER OURS
                                 PEFT loads ADAPTER (ours) on case DIR's model;
                                 its logits against OURS' "logits"

Small configs with random weights (no download). Each case's reference holds
ids [2, T], attention_mask (row 1 right-padded), position_ids (0 .. T - 1
shifted by 3), labels (ids for causal LMs, which shift them inside; every
third token for the masked LM, -100 elsewhere), and transformers' outputs:
logits without a mask, with the mask, with the position ids (not Bloom's:
ALiBi has none), with packed position ids (causal LMs but Bloom), the loss of the labels and every parameter's gradient of
that loss ("grad.<name>").
"""

import os
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    BertForMaskedLM,
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
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB, T, B = 100, 24, 2


def cases():
    common = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,  # not hidden_size / heads (6)
        max_position_embeddings=64,
    )
    return {
        # Saved as one model.safetensors.
        "gpt2": (GPT2LMHeadModel, GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
            embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0,
            bos_token_id=0, eos_token_id=0), {}),
        # A bare GPT2Model (no "transformer." prefix) in pytorch_model.bin.
        "gpt2_bare_bin": (GPT2LMHeadModel, GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
            n_inner=48, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0,
            bos_token_id=0, eos_token_id=0),
            {"bare": True, "safe_serialization": False}),
        # GQA, explicit head_dim, Llama 3.1's rope scaling (T beyond the
        # original context), sharded safetensors.
        "llama3": (LlamaForCausalLM, LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}),
            {"max_shard_size": "20KB"}),
        # Tied head (Llama 3.2 1B / 3B), linear rope scaling, biases.
        "llama_tied": (LlamaForCausalLM, LlamaConfig(
            **common, tie_word_embeddings=True, attention_bias=True,
            mlp_bias=True, rope_parameters={
                "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
            {}),
        # A sliding window shorter than the sequence.
        "mistral": (MistralForCausalLM, MistralConfig(
            **common, sliding_window=8), {}),
        # q, k, v biases, tied head.
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(
            **common, tie_word_embeddings=True), {}),
        # Per-head q and k norms.
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common), {}),
        # Mixtures of experts: 4 experts, top 2, the balancing loss in the
        # loss (a coefficient large enough to show in it).
        "mixtral": (MixtralForCausalLM, MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=8, output_router_logits=True,
            router_aux_loss_coef=0.05), {}),
        # A dense first layer (mlp_only_layers), a shared expert, top-k
        # probabilities not renormalised.
        "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=40,
            mlp_only_layers=[0], norm_topk_prob=False,
            output_router_logits=True, router_aux_loss_coef=0.05), {}),
        # Renormalised top-k, q/k norms, no balancing loss in the loss.
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True), {}),
        # Learned positions with OPT's offset, pre-LN, a projected
        # embedding (opt-350m's shape, post-LN) in the second.
        "opt": (OPTForCausalLM, OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
            pad_token_id=1), {}),
        "opt_post_ln": (OPTForCausalLM, OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, do_layer_norm_before=False,
            word_embed_proj_dim=16, bos_token_id=0, eos_token_id=0,
            pad_token_id=1), {}),
        # ALiBi.
        "bloom": (BloomForCausalLM, BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
            hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
            eos_token_id=0, pad_token_id=1), {}),
        # An encoder with a masked-LM head: bidirectional, padding masks.
        "bert": (BertForMaskedLM, BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0), {}),
    }


def attn_for(case):
    # transformers has no SDPA path for Bloom (ALiBi).
    return "eager" if case.startswith("bloom") else "sdpa"


def is_encoder(model):
    return isinstance(model, BertForMaskedLM)


def randomize(model, g):
    # transformers' init (std 0.02) leaves logits near zero, which would hide
    # most errors: larger weights, norms near one.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0)
                        + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def inputs(g):
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 5:] = 0
    pos = torch.arange(T).unsqueeze(0).expand(B, T) + 3
    return ids, mask, pos


def outputs(model, ids, mask, pos):
    with torch.no_grad():
        ref = {
            "logits": model(input_ids=ids).logits,
            "logits_masked": model(input_ids=ids, attention_mask=mask).logits,
        }
        if not isinstance(model, BloomForCausalLM):  # ALiBi: no positions
            ref["logits_pos"] = model(input_ids=ids, position_ids=pos).logits
        if not isinstance(model, BloomForCausalLM) and not is_encoder(model):
            # Two documents packed in each row (positions restarting at 10,
            # no mask, no cache, as in training): GPT-2 and the LLaMA family
            # keep attention inside each; OPT's masks do not read positions.
            packed = torch.cat([torch.arange(10), torch.arange(T - 10)])
            ref["position_ids_packed"] = packed.unsqueeze(0).expand(B, T)
            ref["logits_packed"] = model(
                input_ids=ids, position_ids=ref["position_ids_packed"],
                use_cache=False).logits
    # Causal LMs shift labels = ids inside; the masked LM predicts every
    # third token.
    labels = ids.clone()
    if is_encoder(model):
        labels[:, torch.arange(T) % 3 != 0] = -100
    ref["labels"] = labels
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    ref["loss"] = out.loss.detach().reshape(1)
    for name, p in model.named_parameters():
        ref.update(hub_grads(model, name, p.grad.detach().clone()))
    if hasattr(model.config, "router_aux_loss_coef"):
        with torch.no_grad():
            ref["aux_masked"] = model(
                input_ids=ids, attention_mask=mask,
                output_router_logits=True).aux_loss.reshape(1)
    return {k: v.contiguous() for k, v in ref.items()}


def hub_grads(model, name, grad):
    """{"grad." + name: grad}, with transformers 5's fused expert tensors
    ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) split per expert under
    the names save_pretrained writes (Mixtral: block_sparse_moe, w1/w3/w2)."""
    mixtral = isinstance(model, MixtralForCausalLM)
    if mixtral:
        name = name.replace(".mlp.", ".block_sparse_moe.")
    if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return {"grad." + name: grad}
    prefix = name[:name.rindex(".") + 1]
    out = {}
    for e in range(grad.shape[0]):
        p = f"grad.{prefix}{e}."
        if name.endswith("gate_up_proj"):
            gate, up = grad[e].chunk(2, dim=0)
            out[p + ("w1" if mixtral else "gate_proj") + ".weight"] = gate.clone()
            out[p + ("w3" if mixtral else "up_proj") + ".weight"] = up.clone()
        else:
            out[p + ("w2" if mixtral else "down_proj") + ".weight"] = grad[e].clone()
    return out


GEN_T, GEN_NEW = 7, 12


def generation(model, seed):
    """transformers' generate on two prompts, the second left-padded (3 of
    its 7 columns padding): greedy with a stop token that rarely comes
    (VOCAB - 1), greedy again with the token the first row produced fourth
    as a second stop token (that row stops early, padded after), sampling
    after torch.manual_seed(7), and greedy with a repetition penalty and
    min_new_tokens. Each with the logits of every step (output_logits) and
    the processed scores (output_scores), the stop tokens and the padding
    token used."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 2, (B, GEN_T), generator=g)
    mask = torch.ones(B, GEN_T, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = VOCAB - 2  # the padding token
    pad = VOCAB - 2
    out = {"gen_ids": ids, "gen_mask": mask, "gen_pad": torch.tensor([pad])}

    if hasattr(model.config, "router_aux_loss_coef"):
        # Its balancing loss in a cached step fails (a step's router logits
        # against the whole mask), and generation needs none.
        extra = {"output_router_logits": False}
    else:
        extra = {}

    def run(name, eos, **kw):
        kw.update(extra)
        torch.manual_seed(7)
        with torch.no_grad():
            r = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=GEN_NEW,
                eos_token_id=eos, pad_token_id=pad, output_logits=True,
                output_scores=True, return_dict_in_generate=True, **kw)
        out[name] = r.sequences
        out[name + "_eos"] = torch.tensor(eos)
        out[name + "_logits"] = torch.stack(r.logits, 0)  # [steps, B, V]
        out[name + "_scores"] = torch.stack(r.scores, 0)  # processed

    run("greedy", [VOCAB - 1], do_sample=False)
    run("greedy_stop", [int(out["greedy"][0, GEN_T + 3]), VOCAB - 1],
        do_sample=False)
    run("sampled", [VOCAB - 1], do_sample=True, temperature=0.8, top_k=20,
        top_p=0.9)
    # A repetition penalty, and min_new_tokens holding back the token row 0
    # would otherwise choose first (made a stop token).
    run("penalized", [VOCAB - 1], do_sample=False, repetition_penalty=1.3)
    run("penalized", [int(out["penalized"][0, GEN_T]), VOCAB - 1],
        do_sample=False, repetition_penalty=1.3, min_new_tokens=3)
    out["torch_version"] = torch.tensor(
        [int(x) for x in torch.__version__.split("+")[0].split(".")[:3]])
    return out


def make(root):
    g = torch.Generator().manual_seed(1234)
    for name, (cls, config, how) in cases().items():
        torch.manual_seed(0)
        config._attn_implementation = attn_for(name)
        model = cls(config).eval()
        randomize(model, g)
        d = os.path.join(root, name)
        kwargs = {"safe_serialization": how.get("safe_serialization", True)}
        if "max_shard_size" in how:
            kwargs["max_shard_size"] = how["max_shard_size"]
        # transformers 5 writes safetensors only; torch.save's layout for
        # the .bin case.
        if not kwargs["safe_serialization"]:
            target = model.transformer if how.get("bare") else model
            target.config.save_pretrained(d)
            torch.save(target.state_dict(), os.path.join(d, "pytorch_model.bin"))
        else:
            model.save_pretrained(d, **kwargs)
        ids, mask, pos = inputs(g)
        ref = outputs(model, ids, mask, pos)
        ref.update({"ids": ids, "attention_mask": mask, "position_ids": pos})
        save_file(ref, os.path.join(d, "reference.safetensors"))
        if not is_encoder(model):
            gen = generation(model, 99 + len(name))
            save_file({k: v.contiguous() for k, v in gen.items()},
                      os.path.join(d, "generate.safetensors"))
    print("transformers", transformers.__version__, "torch", torch.__version__)


def check(case_dir, ours):
    ref = load_file(os.path.join(case_dir, "reference.safetensors"))
    auto = AutoModelForMaskedLM if "bert" in os.path.basename(case_dir) else AutoModelForCausalLM
    model = auto.from_pretrained(
        ours, attn_implementation=attn_for(os.path.basename(case_dir))).eval()
    with torch.no_grad():
        logits = model(input_ids=ref["ids"]).logits
    diff = (logits - ref["logits"]).abs().max().item()
    scale = max(1.0, ref["logits"].abs().max().item())
    print(f"{type(model).__name__} {os.path.basename(case_dir)}: "
          f"max |logits - reference| = {diff:.3g} (scale {scale:.3g})")
    return 0 if diff <= 1e-5 * scale else 1


def peft_make(case_dir, out):
    """A PEFT adapter (random A and B, so it changes the output) on the case's
    model, saved by PEFT, and the adapted logits."""
    from peft import LoraConfig, get_peft_model

    ref = load_file(os.path.join(case_dir, "reference.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(case_dir, attn_implementation="sdpa")
    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                        task_type="CAUSAL_LM", init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    model.save_pretrained(out)
    with torch.no_grad():
        logits = model(input_ids=ref["ids"]).logits
    save_file({"logits": logits.contiguous()}, os.path.join(out, "logits.safetensors"))


def peft_check(case_dir, adapter, ours):
    """Loads OUR adapter with PEFT on the case's model: its logits against
    ours (OURS, a safetensors file with "logits") on the case's ids."""
    from peft import PeftModel

    ref = load_file(os.path.join(case_dir, "reference.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(case_dir, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logits = model(input_ids=ref["ids"]).logits
    want = load_file(ours)["logits"]
    diff = (logits - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    print(f"PEFT {type(model.base_model).__name__} on {os.path.basename(case_dir)}: "
          f"max |logits - ours| = {diff:.3g} (scale {scale:.3g})")
    return 0 if diff <= 2e-5 * scale else 1


def sampler_orders():
    """torch.utils.data.DistributedSampler's index order (ColossalAI's
    prepare_dataloader samples through it), one line per setting:
    size replicas rank shuffle seed epoch drop_last: indices."""
    from torch.utils.data import DistributedSampler

    for size, replicas, shuffle, drop_last, epoch in [
            (10, 3, True, False, 0), (10, 3, True, True, 2),
            (10, 3, False, False, 0), (1000, 4, True, False, 7)]:
        for rank in range(replicas):
            s = DistributedSampler(range(size), num_replicas=replicas, rank=rank,
                                   shuffle=shuffle, seed=1024, drop_last=drop_last)
            s.set_epoch(epoch)
            print(size, replicas, rank, int(shuffle), 1024, epoch, int(drop_last),
                  ":", " ".join(str(i) for i in s))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) >= 4 and len(sys.argv) % 2 == 0 and sys.argv[1] == "check":
        pairs = zip(sys.argv[2::2], sys.argv[3::2])
        sys.exit(max(check(case, ours) for case, ours in list(pairs)))
    elif len(sys.argv) == 2 and sys.argv[1] == "sampler":
        sampler_orders()
    elif len(sys.argv) == 4 and sys.argv[1] == "peft_make":
        peft_make(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 5 and sys.argv[1] == "peft_check":
        sys.exit(peft_check(sys.argv[2], sys.argv[3], sys.argv[4]))
    else:
        sys.exit(__doc__)
