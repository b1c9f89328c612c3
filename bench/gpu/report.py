"""Writes report.md for a bench/gpu/run.sh results folder: one row per
variant (<variant>_<round>.json), the median over rounds of each run's
median step with the spread of those medians, and the ratio to PyTorch
eager's default step.

  python3 bench/gpu/report.py bench/results/<date>-gpu
"""
import glob
import json
import os
import re
import statistics
import sys


def runs(folder, prefix):
    out = []
    for p in sorted(glob.glob(os.path.join(folder, f"{prefix}_[0-9]*.json"))):
        if re.sub(r"_[0-9]+\.json$", "", os.path.basename(p)) != prefix:
            continue
        with open(p) as f:
            out.append(json.load(f))
    return out


def main():
    folder = sys.argv[1]
    order = ["ours", "ours_fused_adamw", "ours_fused", "ours_hybrid_adam",
             "ours_zero1_bf16_logits", "ours_zero1_bf16", "ours_zero1_bf16_recompute", "ours_zero1_bf16_graph", "ours_zero1_bf16_fp8", "ours_fp16",
             "ours_zero1_fp16_graph", "torch", "torch_fused", "torch_fused_fp16",
             "torch_compile", "torch_loop", "hf_ours_fused", "hf_ours_zero1_bf16", "hf_torch_fused", "llama_ours", "llama_ours_fused_adamw",
             "llama_ours_fused", "llama_ours_fused_recompute", "llama_ours_fused_cast_each", "llama_ours_fused_graph", "llama_ours_fused_sdpa_flash",
             "llama_ours_fused_sdpa_cudnn", "llama_ours_zero1_bf16", "llama_ours_zero1_bf16_fp8", "llama_torch_fused",
             "llama_torch_compile"]
    found = sorted({re.sub(r"_[0-9]+\.json$", "", os.path.basename(p))
                    for p in glob.glob(os.path.join(folder, "*_[0-9]*.json"))},
                   key=lambda n: (order.index(n) if n in order else len(order), n))
    groups = [(n, runs(folder, n)) for n in found]
    groups = [(k, v) for k, v in groups if v]
    if not groups:
        sys.exit("no results in " + folder)
    first = groups[0][1][0]
    lines = [f"# GPU benchmark report: {os.path.basename(os.path.normpath(folder))}", "",
             f"- Device: {first.get('device_name')}; host {first['machine']['cpu']}, "
             f"{first['machine']['cores']} cores; LibTorch {first['machine']['torch']}",
             "- Each variant's runs alternate with the others' run by run; a run times "
             "its steps after warm-up steps and reports their median. MFU is model "
             "FLOPs (6 x matmul parameters + 12 x layers x width x sequence per token) "
             "against the bf16 matmul rate the run measured on the device (8192^3).", ""]
    ops_file = os.path.join(folder, "ops.json")
    if os.path.exists(ops_file):
        with open(ops_file) as f:
            ops = json.load(f)
        lines += ["## Fused ops alone against their ATen composition",
                  "", f"Median ms of {ops['reps']} runs after warm-up (p10-p90); GB/s: the "
                  "fewest bytes the op must move over its median time; TFLOP/s: its "
                  "matmuls' operations over it.", "",
                  "| op | shape | ours ms | ATen ms | ATen / ours | ours GB/s | ours TFLOP/s |",
                  "|---|---|---|---|---|---|---|"]
        for o in ops["ops"]:
            om, am = o["ours_ms"]["median"], o["aten_ms"]["median"]
            bw = f"{o['bytes'] / (om * 1e-3) / 1e9:,.0f}" if o["bytes"] else "-"
            tf = f"{o['flops'] / (om * 1e-3) / 1e12:,.0f}" if o.get("flops") else "-"
            lines.append(f"| {o['op']} | {o['shape']} | {om:.3f} ({o['ours_ms']['p10']:.3f}-"
                         f"{o['ours_ms']['p90']:.3f}) | {am:.3f} | {am / om:.2f}x | {bw} | {tf} |")
        lines.append("")
    models = []
    for _, rs in groups:
        if rs[0]["model"] not in models:
            models.append(rs[0]["model"])
    for model in models:
        rows = [(n, rs) for n, rs in groups if rs[0]["model"] == model]
        names = [n for n, _ in rows]
        base_name = next((n for n in names if n.endswith("torch")),
                         next((n for n in names if n.endswith("torch_fused")), names[0]))
        base = dict(rows)[base_name]
        base_ms = statistics.median(r["step_ms"]["median"] for r in base)
        c = rows[0][1][0]
        lines += [f"## {model}: {c['parameters']:,} parameters, batch {c['config']['batch']} x "
                  f"{c['config']['seq_len']} tokens, {c['config']['steps']} timed steps after "
                  f"{c['config']['warmup']}, {c['flops_per_token'] / 1e9:.2f} GFLOP per token", "",
                  "| variant | implementation | step ms (median of runs) | runs' medians, min-max | "
                  f"tokens/s | MFU | bf16 matmul TFLOP/s | peak device GiB | step vs {base_name} |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, rs in rows:
            meds = [r["step_ms"]["median"] for r in rs]
            step = statistics.median(meds)
            tps = statistics.median(r["tokens_per_s"] for r in rs)
            mfu = statistics.median(r["mfu"] for r in rs)
            mm = statistics.median(r["matmul"]["bf16_flops_median"] for r in rs)
            mem = max(r.get("peak_device_bytes", -1) for r in rs)
            lines.append(f"| {name} | {rs[0]['implementation']} | {step:.2f} | "
                         f"{min(meds):.2f}-{max(meds):.2f} ({len(rs)}) | {tps:,.0f} | "
                         f"{100 * mfu:.1f}% | {mm / 1e12:.1f} | {mem / (1 << 30):.2f} | "
                         f"{step / base_ms:.3f}x |")
        lines.append("")
        kernels = sorted({r["sdpa_backend"] for _, rs in rows for r in rs
                          if r.get("sdpa") == "default" and r.get("sdpa_backend")})
        if kernels:
            lines += ["Attention kernel ATen picks for our model's causal attention "
                      "(bf16, by default): " + ", ".join(kernels) + ".", ""]
        split = [(n, rs) for n, rs in rows if rs[0].get("split_ms", {}).get("steps", 0) > 0]
        if split:
            lines += ["Where a step's time goes (ours): steps that synchronise after the "
                      "forward (with the loss) and the backward, median ms over their runs.", "",
                      "| variant | forward | backward | optimizer |", "|---|---|---|---|"]
            for name, rs in split:
                med = {k: statistics.median(r["split_ms"][k] for r in rs)
                       for k in ("forward", "backward", "optimizer")}
                lines.append(f"| {name} | {med['forward']:.2f} | {med['backward']:.2f} | "
                             f"{med['optimizer']:.2f} |")
            lines.append("")
    for path in sorted(glob.glob(os.path.join(folder, "profile_*.json"))):
        with open(path) as f:
            prof = json.load(f)
        k = prof.get("kernels")
        if not k:
            continue
        name = os.path.basename(path)[len("profile_"):-len(".json")]
        total = k["device_ms_per_step"]
        lines += [f"## Where the device's time goes: {name} ({prof['model']}, "
                  f"{k['steps']} profiled steps, {total:.2f} ms of kernels per step "
                  f"against a {prof['step_ms']['median']:.2f} ms step)", "",
                  "| kind of kernel | ms per step | share |", "|---|---|---|"]
        for kind, ms in sorted(k["by_kind"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {kind} | {ms:.2f} | {100 * ms / total:.1f}% |")
        lines += ["", "| kernel (name's first 90 characters) | kind | ms per step | calls per step |",
                  "|---|---|---|---|"]
        for t in k["top"][:12]:
            lines.append(f"| `{t['name'][:90]}` | {t['kind']} | {t['ms']:.3f} | "
                         f"{t['calls_per_step']} |")
        attention = k.get("attention_kernels", [])
        lines += ["", "Attention kernels that ran (SDPA's backend): " +
                  (", ".join(f"`{n[:80]}`" for n in attention) if attention
                   else "none by name (the math path: matmuls and a softmax)"), ""]
    summary = {"models": {}}
    found_runs = dict(groups)

    def fastest(prefix, fp16=False):
        # Ours in summary.json: the fastest of our variants in this folder
        # (bf16 ones, or fp16 ones for the fp16 rows).
        mine = [n for n in found_runs if re.fullmatch(prefix + r"(_.*)?", n)
                and ("fp16" in n) == fp16]
        return min(mine, key=lambda n: statistics.median(
            r["step_ms"]["median"] for r in found_runs[n]), default=None)
    # Which variant stands for ours / eager / compile in summary.json:
    # PyTorch's default eager step, and with fused AdamW.
    # For GPT-2 also transformers' own model (hf_torch_fused) and ours with
    # the transformers-compatible family (the fastest hf_ours variant).
    roles = {"gpt2-medium": {"ours": fastest("ours"), "eager": "torch",
                             "eager_fused_adamw": "torch_fused", "compile": "torch_compile",
                             "ours_fp16": fastest("ours", fp16=True),
                             "eager_fused_adamw_fp16": "torch_fused_fp16",
                             "ours_transformers_family": fastest("hf_ours"),
                             "transformers": "hf_torch_fused"},
             "llama-1b": {"ours": fastest("llama_ours"), "eager": "llama_torch_fused",
                          "compile": "llama_torch_compile"}}
    for model, role in roles.items():
        entry = {}
        for r, name in role.items():
            rs = found_runs.get(name) if name else None
            if not rs:
                continue
            tps = statistics.median(x["tokens_per_s"] for x in rs)
            entry[r] = {"variant": name,
                        "step_ms": statistics.median(x["step_ms"]["median"] for x in rs),
                        "tokens_per_s": tps,
                        "mfu_measured": statistics.median(x["mfu"] for x in rs),
                        "mfu_spec": tps * rs[0]["flops_per_token"] / 989e12,
                        "peak_bytes": max(x.get("peak_device_bytes", -1) for x in rs),
                        "runs": len(rs)}
        if entry:
            summary["models"][model] = entry
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    lines += ["", "`summary.json` holds the medians of ours (the fastest of our variants "
              "here), PyTorch eager and torch.compile per model (for GPT-2 medium also "
              "transformers' GPT2LMHeadModel and ours with models::GPT2LMHeadModel); "
              "`mfu_spec` is against 989 TFLOP/s (dense bf16, datasheet).", ""]
    lines += ["", "Reproduce on a GPU machine with a PyTorch 2.x wheel: `bench/gpu/run.sh`.", ""]
    with open(os.path.join(folder, "report.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.join(folder, 'report.md')}")


if __name__ == "__main__":
    main()
