"""Exchanges state-dict files with the C++ library (tests/test_interop_python.cpp).

    interop.py check DIR
    interop.py optim DIR
    interop.py groups DIR
    interop.py sched DIR

Reads DIR/cpp.safetensors with a minimal reader written from the format's
spec and DIR/cpp.bin with torch.load, compares both with `expected()`, then
writes DIR/py.safetensors (own minimal writer), DIR/py.bin (torch.save of a
state-dict-like OrderedDict) and DIR/py_one.bin (a one-entry dict) for the C++
side to read. Exits non-zero, with a traceback, on any mismatch.

`optim` trains a Linear(4, 3) for two steps with each of AdamW, Adam (integer
weight_decay=0, as Python writes it) and SGD with momentum, and writes
DIR/model_<name>.bin and DIR/optim_<name>.bin (torch.save of the model's and
the optimizer's state_dict), DIR/expect_<name>.bin (the optimizer's state as
flat tensors "<param id>.<key>") and DIR/after_<name>.bin (the model after a
third step) for the C++ side to load, step and compare.

`groups` takes what the C++ side wrote after two steps of each of AdamW,
Adam, SGD, RMSprop and Adagrad on the same Linear(4, 3) (DIR/model_<name>.bin,
DIR/optim_<name>.bin, DIR/after_<name>.bin: the model after its third step),
checks that every param group holds at least the keys this torch's own
optimizer writes, installs the groups verbatim (as ColossalAI's sharded and
HybridParallel loaders do, no load_state_dict) and the states, takes the third
step and compares it with the C++ one; and that HybridAdam's
DIR/optim_hybrid_adam.bin holds `step` as a Python int, as ColossalAI does.

`sched` exchanges learning-rate scheduler files, the dicts of
`scheduler.state_dict()`, for each of torch's schedulers in SCHEDULERS: it
loads DIR/cpp_<name>.pt (the C++ scheduler after `steps` steps, as the C++
booster saved it) with torch.load (weights_only=True from torch 2.4) into the
same torch scheduler, steps once and writes the learning rates and momenta to
DIR/from_cpp_next.bin; and it steps a fresh scheduler `steps` times, writes
torch.save(scheduler.state_dict()) to DIR/py_<name>.pt and the values after
one more step to DIR/py_next.bin, for the C++ side to compare.
"""

import collections
import json
import os
import struct
import sys
import warnings

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


def expected():
    """The tensors both sides write; test_interop_python.cpp builds the same."""
    return collections.OrderedDict(
        [
            ("f32", torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4 - 1),
            ("bf16", ((torch.arange(10) - 5) * 0.5).to(torch.bfloat16)),
            ("i64", torch.arange(6, dtype=torch.int64).reshape(2, 3) * (1 << 40) - 3),
            ("f16", ((torch.arange(8) - 4) / 8).to(torch.float16).reshape(2, 2, 2)),
            ("bool", torch.arange(5) % 2 == 0),
            ("scalar", torch.tensor(3.25, dtype=torch.float64)),
        ]
    )


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0, f"header of {n} bytes leaves the data unaligned"
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    tensors = collections.OrderedDict()
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        chunk = bytearray(data[8 + n + begin : 8 + n + end])
        if chunk:
            flat = torch.frombuffer(chunk, dtype=dtype)
        else:
            flat = torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    covered = sum(i["data_offsets"][1] - i["data_offsets"][0] for i in header.values())
    assert 8 + n + covered == len(data), "data section not exactly covered"
    return tensors, metadata


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    chunks = []
    offset = 0
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)


def same(name, want, got):
    assert isinstance(got, torch.Tensor), f"{name}: {type(got).__name__}, not a tensor"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{name}: values differ:\n{got}\n!=\n{want}"


def check(directory):
    want = expected()

    tensors, metadata = read_safetensors(os.path.join(directory, "cpp.safetensors"))
    assert metadata == {"writer": "colossalai"}, f"metadata {metadata}"
    assert list(tensors) == list(want), f"key order {list(tensors)}"
    for name, t in want.items():
        same("cpp.safetensors:" + name, t, tensors[name])

    loaded = torch.load(os.path.join(directory, "cpp.bin"))
    assert isinstance(loaded, dict), f"cpp.bin holds a {type(loaded).__name__}"
    assert list(loaded) == list(want), f"key order {list(loaded)}"
    for name, t in want.items():
        same("cpp.bin:" + name, t, loaded[name])

    # Written the other way round, so the C++ side cannot rely on our order.
    reversed_want = collections.OrderedDict(reversed(list(want.items())))
    write_safetensors(
        os.path.join(directory, "py.safetensors"), reversed_want, {"writer": "python"}
    )
    # Like nn.Module.state_dict(): an OrderedDict with `_metadata`, a
    # Parameter and a view sharing another entry's storage.
    state = collections.OrderedDict(want)
    state["f32"] = torch.nn.Parameter(want["f32"].clone())
    state["f32_t"] = state["f32"].data.t()
    state._metadata = collections.OrderedDict({"": {"version": 1}})
    torch.save(state, os.path.join(directory, "py.bin"))
    torch.save({"only": torch.arange(3)}, os.path.join(directory, "py_one.bin"))


def optim_batch():
    """The batch of every step; test_interop_python.cpp builds the same."""
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8
    y = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 6 - 0.5
    return x, y


def optim(directory):
    makers = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
        "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    }
    x, y = optim_batch()
    for name, make in makers.items():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = make(model.parameters())

        def step():
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()

        step()
        step()
        torch.save(model.state_dict(), os.path.join(directory, f"model_{name}.bin"))
        torch.save(opt.state_dict(), os.path.join(directory, f"optim_{name}.bin"))
        flat = {}
        for pid, state in opt.state_dict()["state"].items():
            for key, value in state.items():
                flat[f"{pid}.{key}"] = torch.as_tensor(value)
        torch.save(flat, os.path.join(directory, f"expect_{name}.bin"))
        step()
        torch.save(model.state_dict(), os.path.join(directory, f"after_{name}.bin"))


def groups(directory):
    # Other hyperparameters than the C++ side's: the checkpoint's must win.
    makers = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1.0),
        "adam": lambda p: torch.optim.Adam(p, lr=1.0),
        "sgd": lambda p: torch.optim.SGD(p, lr=1.0),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1.0),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=1.0),
    }
    x, y = optim_batch()
    for name, make in makers.items():
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(torch.load(os.path.join(directory, f"model_{name}.bin")))
        opt = make(model.parameters())
        saved = torch.load(os.path.join(directory, f"optim_{name}.bin"))
        own = set(opt.state_dict()["param_groups"][0])
        for group in saved["param_groups"]:
            missing = own - set(group)
            assert not missing, f"{name}: param group lacks {sorted(missing)}"
        params = [p for g in opt.param_groups for p in g["params"]]
        installed = []
        for old, new in zip(opt.param_groups, saved["param_groups"]):
            group = dict(new)
            group["params"] = old["params"]
            installed.append(group)
        opt.param_groups = installed
        for pid, state in saved["state"].items():
            opt.state[params[pid]] = dict(state)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        after = torch.load(os.path.join(directory, f"after_{name}.bin"))
        for key, value in model.state_dict().items():
            diff = (value - after[key]).abs().max().item()
            assert torch.allclose(value, after[key], rtol=1e-5, atol=1e-6), (
                f"{name}: {key} differs from the C++ step by {diff}")
    # HybridAdam's step is a Python int, as ColossalAI's HybridAdam keeps it
    # (its load_state_dict turns a tensor into one; torch's optimizers keep a
    # float tensor). Two steps were taken.
    saved = torch.load(os.path.join(directory, "optim_hybrid_adam.bin"))
    assert saved["state"], "HybridAdam saved no state"
    for pid, state in saved["state"].items():
        assert type(state["step"]) is int and state["step"] == 2, (
            f"HybridAdam state {pid}: step {state['step']!r}")
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, sorted(state)
    for group in saved["param_groups"]:
        for key in ("lr", "betas", "eps", "weight_decay", "bias_correction"):
            assert key in group, f"HybridAdam param group lacks {key}"


SCHED_LRS = (0.1, 0.03)  # the two parameter groups' learning rates

# name: (the torch scheduler on an optimizer, steps before the save). Keep in
# sync with scheduler_cases() in test_interop_python.cpp.
SCHEDULERS = {
    "StepLR": (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 8),
    "MultiStepLR": (
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[3, 8, 8, 12], gamma=0.5),
        7,
    ),
    "ExponentialLR": (lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9), 5),
    "CosineAnnealingLR": (
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=0.001),
        6,
    ),
    "OneCycleLR": (
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=list(SCHED_LRS), total_steps=20),
        6,
    ),
    "LambdaLR": (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.97**e), 5),
    "MultiplicativeLR": (
        lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda e: 0.9 + 0.002 * e),
        5,
    ),
}


def sched_optimizer():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in SCHED_LRS]
    groups = [{"params": [p], "lr": lr} for p, lr in zip(params, SCHED_LRS)]
    return torch.optim.SGD(groups, lr=SCHED_LRS[0], momentum=0.9)


def sched_step(opt, scheduler):
    """One step; the learning rates and momenta it leaves, as one tensor."""
    opt.step()  # no gradients: changes nothing, keeps torch from warning
    scheduler.step()
    values = list(scheduler.get_last_lr()) + [g["momentum"] for g in opt.param_groups]
    return torch.tensor(values, dtype=torch.float64)


def sched(directory):
    warnings.simplefilter("ignore")
    # weights_only=True where torch's restricted unpickler takes floats
    # (torch 1.13's refuses BINFLOAT, its own state dicts' floats included).
    restricted = hasattr(torch.serialization, "add_safe_globals")
    load_args = {"weights_only": True} if restricted else {}
    from_cpp, own = {}, {}
    for name, (make, steps) in SCHEDULERS.items():
        state = torch.load(os.path.join(directory, f"cpp_{name}.pt"), **load_args)
        assert isinstance(state, dict), f"{name}: cpp file holds a {type(state).__name__}"
        assert state["last_epoch"] == steps, f"{name}: last_epoch {state['last_epoch']}"
        opt = sched_optimizer()
        scheduler = make(opt)
        scheduler.load_state_dict(state)
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
        state = scheduler.state_dict()
        # Before torch 2.1 OneCycleLR keeps its annealing function as a bound
        # method, which pickles the scheduler and its optimizer; no reader
        # that runs nothing takes that, and the C++ side does not read it.
        state.pop("anneal_func", None)
        torch.save(state, os.path.join(directory, f"py_{name}.pt"))
        own[name] = sched_step(opt, scheduler)
    torch.save(from_cpp, os.path.join(directory, "from_cpp_next.bin"))
    torch.save(own, os.path.join(directory, "py_next.bin"))


def main(argv):
    if len(argv) != 3 or argv[1] not in ("check", "optim", "groups", "sched"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[1] == "optim":
        optim(argv[2])
    elif argv[1] == "groups":
        groups(argv[2])
    elif argv[1] == "sched":
        sched(argv[2])
    else:
        check(argv[2])
    print("interop.py: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
