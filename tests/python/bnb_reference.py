"""bitsandbytes' side of tests/test_qlora.cpp.

    bnb_reference.py IN OUT

IN (safetensors) holds the tensors to quantize ("x.<case>"); OUT receives,
for each case and each of nf4 / fp4 (blocksize 64 and 128) and double
quantization off / on, what bitsandbytes.functional.quantize_4bit gives on
the CPU (packed, absmax or the nested state), its reference dequantization
("deq") and what F.dequantize_4bit returns ("native"), plus
create_dynamic_map().
"""

import sys

import torch
from safetensors.torch import load_file, save_file

import bitsandbytes.functional as F
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
from bitsandbytes.backends.utils import _get_4bit_code


def main(src, dst):
    out = {"dynamic_map": F.create_dynamic_map(signed=True)}
    for key, x in load_file(src).items():
        case = key[len("x."):]
        for qt in ("nf4", "fp4"):
            for bs in (64, 128):
                for nested in (False, True):
                    tag = f"{case}.{qt}.{bs}.{int(nested)}"
                    q, st = F.quantize_4bit(x, blocksize=bs, quant_type=qt,
                                            compress_statistics=nested)
                    out[f"packed.{tag}"] = q.contiguous()
                    out[f"absmax.{tag}"] = st.absmax.contiguous()
                    if nested:
                        out[f"offset.{tag}"] = st.offset.reshape(1).float()
                        out[f"absmax2.{tag}"] = st.state2.absmax.contiguous()
                    # bitsandbytes' reference dequantization (its default
                    # kernel): 0.50.2's native CPU kernel, which
                    # F.dequantize_4bit picks for an even last dimension,
                    # returns wrong values for some layouts on this CPU.
                    absmax = st.absmax
                    if nested:
                        absmax = F.dequantize_blockwise(st.absmax, st.state2) + st.offset
                    out[f"deq.{tag}"] = _dequantize_4bit_compute(
                        q.reshape(-1), absmax, _get_4bit_code(qt, q.device), bs,
                        list(x.shape), x.dtype).contiguous()
                    out[f"native.{tag}"] = F.dequantize_4bit(q, st).contiguous()
    save_file(out, dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
