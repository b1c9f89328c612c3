#!/usr/bin/env python3
"""Writes the seed corpus of the pickle fuzzer (fuzz/corpus/pickle).

Each seed is the data.pkl of a torch.save archive: model and optimizer state
dicts as Python's torch writes them (AdamW, Adam, SGD), a one-entry dict, a
nested list. Needs Python's torch (Debian: python3-torch, run with
/usr/bin/python3). Tensors stay under 4 KiB so the fuzzer's in-memory archive
(records data/0 .. data/3 of 4 KiB) holds them.
"""

import collections
import io
import os
import zipfile

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "pickle")


def data_pkl(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        return z.read(name)


def trained(make):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = make(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return model, opt


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {}
    for name, make in {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
        "adam": lambda p: torch.optim.Adam(p),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    }.items():
        model, opt = trained(make)
        seeds["optim_" + name] = opt.state_dict()
        seeds["model_" + name] = model.state_dict()
    seeds["one_entry"] = {"only": torch.arange(3)}
    seeds["nested"] = [[1, 2.5, None, True], ("a", b"b"), {"k": [torch.zeros(2)]}]
    seeds["ordered"] = collections.OrderedDict([("x", torch.ones(2, 2).t())])
    for name, obj in seeds.items():
        with open(os.path.join(OUT, name + ".pkl"), "wb") as f:
            f.write(data_pkl(obj))


if __name__ == "__main__":
    main()
