#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzzer (fuzz/corpus/safetensors).

Standard library only. Run from anywhere: python3 fuzz/make_corpus.py
"""

import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "safetensors")


def safetensors(header, data, align=True):
    text = json.dumps(header, separators=(",", ":")).encode()
    if align:
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def main():
    os.makedirs(OUT, exist_ok=True)
    files = {
        "valid_two": safetensors(
            {"w": entry("F32", [2], 0, 8), "b": entry("I8", [3], 8, 11)},
            struct.pack("<2f", 1.5, -2.0) + struct.pack("<3b", 1, -2, 3),
        ),
        "valid_meta_empty": safetensors(
            {
                "__metadata__": {"format": "pt"},
                "empty": entry("F64", [0, 4], 0, 0),
                "flag": entry("BOOL", [2], 0, 2),
                "s": entry("BF16", [], 2, 4),
            },
            b"\x01\x00" + b"\x80\x3f",
        ),
        "valid_unpadded": safetensors(
            {"h": entry("F16", [2, 2], 0, 8), "l": entry("I64", [1], 8, 16)},
            struct.pack("<4e", 0.5, 1, -1, 2) + struct.pack("<q", -7),
            align=False,
        ),
        "bad_overlap": safetensors(
            {"a": entry("I32", [2], 0, 8), "b": entry("U8", [4], 4, 8)},
            bytes(8),
        ),
        "bad_dtype": safetensors({"a": entry("F8", [2], 0, 2)}, bytes(2)),
        "bad_truncated": struct.pack("<Q", 64) + b'{"a":{"dtype":"I16","shape":[1]',
    }
    for name, data in files.items():
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
