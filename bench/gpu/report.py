"""Writes report.md for a bench/gpu/run.sh results folder (ours_*.json,
torch_*.json, torch_loop_*.json).

  python3 bench/gpu/report.py bench/results/<date>-gpu
"""
import glob
import json
import os
import statistics
import sys


def runs(folder, prefix):
    out = []
    for p in sorted(glob.glob(os.path.join(folder, f"{prefix}_[0-9]*.json"))):
        with open(p) as f:
            out.append(json.load(f))
    return out


def main():
    folder = sys.argv[1]
    groups = [("ours (C++, Booster bf16)", runs(folder, "ours")),
              ("PyTorch eager, AdamW default (foreach)", runs(folder, "torch")),
              ("PyTorch eager, AdamW foreach off", runs(folder, "torch_loop"))]
    groups = [(k, v) for k, v in groups if v]
    if not groups:
        sys.exit("no results in " + folder)
    first = groups[0][1][0]
    ours_ms = statistics.median(r["step_ms"]["median"] for r in groups[0][1])
    lines = [f"# GPU benchmark report: {os.path.basename(os.path.normpath(folder))}", "",
             f"- Device: {first.get('device_name')}; host {first['machine']['cpu']}, "
             f"{first['machine']['cores']} cores; LibTorch {first['machine']['torch']}",
             f"- Workload: {first['model']} ({first['parameters']:,} parameters), batch "
             f"{first['config']['batch']} x {first['config']['seq_len']} tokens, "
             f"{first['config']['precision']}, AdamW(3e-4, wd 0.01); "
             f"{first['config']['steps']} timed steps after {first['config']['warmup']} "
             f"warm-up steps per run; programs alternated run by run ({len(groups[0][1])} runs each)",
             f"- Model FLOPs per token {first['flops_per_token'] / 1e9:.2f} GFLOP "
             "(6 x non-embedding parameters + 12 x layers x width x sequence); MFU is "
             "against the bf16 matmul rate each run measured on the device "
             f"({first['matmul']['n']}^3 matmuls)", "",
             "| implementation | step ms (median) | tokens/s | MFU | bf16 matmul TFLOP/s | "
             "peak device GiB | step time vs ours |",
             "|---|---|---|---|---|---|---|"]
    for name, rs in groups:
        step = statistics.median(r["step_ms"]["median"] for r in rs)
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        mfu = statistics.median(r["mfu"] for r in rs)
        mm = statistics.median(r["matmul"]["bf16_flops_median"] for r in rs)
        mem = max(r.get("peak_device_bytes", -1) for r in rs)
        lines.append(f"| {name} | {step:.1f} | {tps:,.0f} | {100 * mfu:.1f}% | "
                     f"{mm / 1e12:.1f} | {mem / (1 << 30):.1f} | {step / ours_ms:.2f}x |"
                     .replace("| -0.0 |", "| - |"))
    lines += ["", "Reproduce on a GPU machine with a PyTorch 2.x wheel: `bench/gpu/run.sh`.", ""]
    with open(os.path.join(folder, "report.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.join(folder, 'report.md')}")


if __name__ == "__main__":
    main()
