"""Checkpoints crossing between this library and Python ColossalAI.

Runs in the ColossalAI venv (./scripts/setup.sh --colossalai), one process
(world size 1, gloo, CPU), driven by test_interop_colossalai.cpp:

  colossalai_interop.py base DIR
      DIR/base: a small random LlamaForCausalLM (transformers' save_pretrained).
  colossalai_interop.py train DIR PLUGIN...
      For each PLUGIN: ColossalAI's Booster trains DIR/base two steps (AdamW,
      CosineAnnealingWarmupLR), saves the model (sharded), the optimizer
      (sharded) and the scheduler into DIR/py_PLUGIN/, takes a third step and
      writes DIR/py_PLUGIN/next.safetensors: the weights after it, "__loss__"
      (its loss, before the update) and "__lr__" (its learning rate).
  colossalai_interop.py resume DIR PLUGIN=SRC...
      For each pair: ColossalAI's Booster with PLUGIN loads DIR/SRC/ (written by
      the C++ side, strictly), takes the third step and compares it with
      DIR/SRC/next.safetensors; DIR/SRC/model must be a model directory that
      transformers' from_pretrained reads.
  colossalai_interop.py tied DIR / tied_check DIR
      GPT-2's tied head through sharded .bin files both ways (tied()).
  colossalai_interop.py sched DIR
      Every scheduler of colossalai.nn.lr_scheduler: ColossalAI loads the C++
      side's DIR/cpp_<name>.pt and steps on; its own files go the other way
      (sched()).

ColossalAI runs on CPU without a plugin, with TorchDDPPlugin and with
HybridParallelPlugin at zero_stage 0 in fp32; LowLevelZeroPlugin, GeminiPlugin
and HybridParallelPlugin's ZeRO stages assert that a device is present, and
HybridAdam has no CPU kernel without CUDA ("No usable kernel found for
CPUAdamLoader"), so they are not run here.
"""

import os
import sys

import torch

# The optimizer and step both scheduler exchanges use (torch's, ColossalAI's).
from interop import sched_optimizer, sched_step

PORT = os.environ.get("COLOSSALAI_INTEROP_PORT", "29631")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", PORT)
for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                   ("LOCAL_WORLD_SIZE", "1")):
    os.environ.setdefault(key, value)

VOCAB = 128  # a multiple of 64: HybridParallelPlugin pads others, and its
# sharded save then fails on CPU (AttributeError: _unpad_detach)
LR = 1e-3
WEIGHT_DECAY = 0.01
TOTAL_STEPS = 10
WARMUP_STEPS = 2
# Tolerances (kept equal to test_interop_colossalai.cpp's, which says why).
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-3 * LR


def batch(step):
    """Step `step`'s ids, [4, 16]; the C++ side builds the same."""
    b = torch.arange(4).view(4, 1)
    t = torch.arange(16).view(1, 16)
    return (step * 131 + b * 17 + t * 7 + 3) % VOCAB


def base(directory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(os.path.join(directory, "base"))


def booster_for(plugin):
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

    if plugin == "none":
        return Booster()
    if plugin == "ddp":
        return Booster(plugin=TorchDDPPlugin())
    if plugin == "hybrid":
        return Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp32"))
    raise ValueError(f"unknown plugin {plugin}")


def boosted(directory, plugin):
    from colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(os.path.join(directory, "base"),
                                             torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=TOTAL_STEPS,
                                        warmup_steps=WARMUP_STEPS)
    booster = booster_for(plugin)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer,
                                                      lr_scheduler=scheduler)
    return booster, model, optimizer, scheduler


def step(booster, model, optimizer, scheduler, s):
    """One training step; returns its loss and learning rate."""
    ids = batch(s)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    if hasattr(optimizer, "backward"):
        booster.backward(loss, optimizer)
    else:  # no plugin: the optimizer is torch's own
        loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.detach(), lr


def weights(model):
    inner = model.unwrap() if hasattr(model, "unwrap") else model
    return {k: v.detach().clone().contiguous() for k, v in inner.state_dict().items()}


def train(directory, plugins):
    from safetensors.torch import save_file

    for i, plugin in enumerate(plugins):
        booster, model, optimizer, scheduler = boosted(directory, plugin)
        for s in range(2):
            step(booster, model, optimizer, scheduler, s)
        out = os.path.join(directory, f"py_{plugin}")
        # Both formats of ColossalAI's sharded save, one per plugin.
        booster.save_model(model, os.path.join(out, "model"), shard=True,
                           use_safetensors=i % 2 == 0)
        booster.save_optimizer(optimizer, os.path.join(out, "optim"), shard=True)
        booster.save_lr_scheduler(scheduler, os.path.join(out, "sched.pt"))
        loss, lr = step(booster, model, optimizer, scheduler, 2)
        after = weights(model)
        after["__loss__"] = loss.reshape(1).to(torch.float64)
        after["__lr__"] = torch.tensor([lr], dtype=torch.float64)
        save_file(after, os.path.join(out, "next.safetensors"))
        print(f"train {plugin}: step 3 loss {loss.item():.8f} lr {lr:.3e}")


def resume(directory, pairs):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    for pair in pairs:
        plugin, src = pair.split("=")
        where = os.path.join(directory, src)
        # Item 4 of the checkpoint format: the sharded model is a model
        # directory (config.json beside the shards).
        hf = LlamaForCausalLM.from_pretrained(os.path.join(where, "model"),
                                              torch_dtype=torch.float32)
        booster, model, optimizer, scheduler = boosted(directory, plugin)
        booster.load_model(model, os.path.join(where, "model"), strict=True)
        booster.load_optimizer(optimizer, os.path.join(where, "optim"))
        booster.load_lr_scheduler(scheduler, os.path.join(where, "sched.pt"))
        loaded = weights(model)
        for k, v in hf.state_dict().items():
            assert torch.equal(v, loaded[k]), f"{pair}: from_pretrained's {k} differs"
        loss, lr = step(booster, model, optimizer, scheduler, 2)
        want = load_file(os.path.join(where, "next.safetensors"))
        want_loss = want.pop("__loss__").item()
        want_lr = want.pop("__lr__").item()
        assert abs(lr - want_lr) <= 1e-12 * want_lr, f"{pair}: lr {lr} vs {want_lr}"
        assert abs(loss.item() - want_loss) <= LOSS_RTOL * abs(want_loss), (
            f"{pair}: loss {loss.item()} vs {want_loss}")
        after = weights(model)
        assert set(after) == set(want), f"{pair}: keys {sorted(set(after) ^ set(want))}"
        worst = max((after[k] - want[k]).abs().max().item() for k in want)
        assert worst <= PARAM_ATOL, f"{pair}: weights differ by {worst}"
        print(f"resume {pair}: loss {loss.item():.8f} vs {want_loss:.8f}, "
              f"weights within {worst:.2e}")


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)


def tied(directory, check):
    """GPT-2's tied head through .bin files, which hold it under both names
    as torch.save(model.state_dict()) does (ColossalAI cannot write a tied
    model to safetensors: "Some tensors share memory"). Without `check`:
    DIR/gpt2_base (save_pretrained) and DIR/py_gpt2 (ColossalAI's sharded
    .bin save of it). With it: ColossalAI loads the C++ side's DIR/cpp_gpt2
    strictly, without a plugin and under TorchDDPPlugin, and must hold
    DIR/gpt2_base's weights."""
    from colossalai.booster import Booster
    from colossalai.booster.plugin import TorchDDPPlugin
    from transformers import GPT2LMHeadModel

    base = os.path.join(directory, "gpt2_base")
    if not check:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(gpt2_config())
        model.save_pretrained(base)
        booster = Booster()
        model, *_ = booster.boost(model)
        booster.save_model(model, os.path.join(directory, "py_gpt2"), shard=True)
        return
    want = GPT2LMHeadModel.from_pretrained(base).state_dict()
    for name, booster in (("none", Booster()), ("ddp", Booster(plugin=TorchDDPPlugin()))):
        torch.manual_seed(1)
        model, *_ = booster.boost(GPT2LMHeadModel(gpt2_config()))
        booster.load_model(model, os.path.join(directory, "cpp_gpt2"), strict=True)
        got = weights(model)
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for k in want:
            assert torch.equal(got[k], want[k]), f"{name}: {k} differs"
        print(f"tied {name}: ColossalAI loaded our GPT-2 strictly, bit for bit")


def schedulers():
    """name: (ColossalAI's scheduler on an optimizer, steps before the save).
    Keep in sync with scheduler_cases() in test_interop_colossalai.cpp."""
    from colossalai.nn import lr_scheduler as ls

    return {
        "CosineAnnealingLR": (lambda o: ls.CosineAnnealingLR(o, 20, eta_min=0.001), 6),
        "CosineAnnealingWarmupLR.warmup": (
            lambda o: ls.CosineAnnealingWarmupLR(o, 20, warmup_steps=5, eta_min=0.001), 3),
        "CosineAnnealingWarmupLR": (
            lambda o: ls.CosineAnnealingWarmupLR(o, 20, warmup_steps=5, eta_min=0.001), 8),
        "FlatAnnealingLR": (lambda o: ls.FlatAnnealingLR(o, 20, pct_start=0.5), 12),
        "FlatAnnealingWarmupLR": (
            lambda o: ls.FlatAnnealingWarmupLR(o, 20, warmup_steps=4, pct_start=0.5,
                                               eta_min=0.001), 9),
        "LinearWarmupLR": (lambda o: ls.LinearWarmupLR(o, 20, warmup_steps=5), 7),
        "MultiStepLR": (lambda o: ls.MultiStepLR(o, 20, milestones=[4, 9], gamma=0.5), 6),
        "MultiStepWarmupLR": (
            lambda o: ls.MultiStepWarmupLR(o, 20, warmup_steps=3, milestones=[6, 11],
                                           gamma=0.5), 8),
        "OneCycleLR": (lambda o: ls.OneCycleLR(o, 20), 7),
        "PolynomialLR": (lambda o: ls.PolynomialLR(o, 20, end_lr=1e-4, power=2.0), 5),
        "PolynomialWarmupLR": (
            lambda o: ls.PolynomialWarmupLR(o, 20, warmup_steps=4, end_lr=1e-4, power=2.0), 6),
        "ExponentialLR": (lambda o: ls.ExponentialLR(o, 20, gamma=0.9), 5),
        "StepLR": (lambda o: ls.StepLR(o, 20, step_size=3, gamma=0.5), 7),
        "LambdaLR": (lambda o: ls.LambdaLR(o, 20, lr_lambda=lambda e: 0.97**e), 5),
        "MultiplicativeLR": (
            lambda o: ls.MultiplicativeLR(o, 20, lr_lambda=lambda e: 0.9 + 0.002 * e), 5),
    }


def same_state(where, got, want):
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (
            f"{where}: keys {sorted(set(got) ^ set(want))} differ")
        for key in want:
            same_state(f"{where}.{key}", got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (
            f"{where}: {got!r} vs {want!r}")
        for i, (g, w) in enumerate(zip(got, want)):
            same_state(f"{where}[{i}]", g, w)
    elif isinstance(want, float) and isinstance(got, (int, float)):
        assert abs(got - want) <= 1e-12 * max(abs(got), abs(want)), (
            f"{where}: {got!r} vs {want!r}")
    elif callable(want):  # LambdaLR's functions are not in files
        pass
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def sched(directory):
    """Writes DIR/py_<name>.pt (ColossalAI's scheduler after its steps, as
    booster.save_lr_scheduler writes it) and DIR/py_next.safetensors (the
    step after); loads the C++ side's DIR/cpp_<name>.pt into ColossalAI's
    scheduler and writes its next step to DIR/from_cpp_next.safetensors."""
    import warnings

    from colossalai.booster import Booster
    from safetensors.torch import save_file

    warnings.simplefilter("ignore")
    booster = Booster()
    from_cpp, own = {}, {}
    for name, (make, steps) in schedulers().items():
        opt = sched_optimizer()
        scheduler = make(opt)
        booster.load_lr_scheduler(scheduler, os.path.join(directory, f"cpp_{name}.pt"))
        # Strictly: the state equals the one ColossalAI's own scheduler has
        # after the same steps (no key missing or extra, ColossalAI's
        # last_epoch), numbers within 1e-12 relative.
        reference = make(sched_optimizer())
        for _ in range(steps):
            reference.optimizer.step()
            reference.step()
        same_state(name, scheduler.state_dict(), reference.state_dict())
        # Python restores the groups' lr with the optimizer's checkpoint;
        # the recursive schedules go on from it.
        for group, lr in zip(opt.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        from_cpp[name] = sched_step(opt, scheduler)

        opt = sched_optimizer()
        scheduler = make(opt)
        for _ in range(steps):
            opt.step()
            scheduler.step()
        booster.save_lr_scheduler(scheduler, os.path.join(directory, f"py_{name}.pt"))
        own[name] = sched_step(opt, scheduler)
    save_file(from_cpp, os.path.join(directory, "from_cpp_next.safetensors"))
    save_file(own, os.path.join(directory, "py_next.safetensors"))


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    mode, directory = argv[1], argv[2]
    if mode == "base":
        base(directory)
        return 0
    import colossalai
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    # ColossalAI 0.5.0's sharded optimizer load calls the accelerator's
    # synchronize(), which its CPU accelerator refuses ("not supported for
    # cpu accelerator"); on a CPU there is nothing to wait for.
    CpuAccelerator.synchronize = lambda self, device=None: None
    colossalai.launch_from_torch(backend="gloo")
    if mode == "train":
        train(directory, argv[3:])
    elif mode == "resume":
        resume(directory, argv[3:])
    elif mode == "sched":
        sched(directory)
    elif mode in ("tied", "tied_check"):
        tied(directory, mode == "tied_check")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
