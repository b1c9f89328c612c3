"""scale.json and scale.md from bench/gpu/run.sh --scale / --qlora / --load
results: each 7B-class setup of ours (scale_<model>_<setup>.json,
bench_gpu_scale_step) beside PyTorch FSDP2 + CPUOffloadPolicy on the same
model (scale_<model>_fsdp2_offload.json), QLoRA ours against transformers +
PEFT (qlora_<model>_ours.json, qlora_<model>_peer.json), and the loader's
numbers (load.json).

  python3 bench/gpu/scale_report.py RESULTS_DIR
"""
import glob
import json
import os
import sys

PEER = "fsdp2_offload"


def gib(b):
    return "" if b is None or b < 0 else f"{b / 2 ** 30:.1f}"


def pct(v):
    return "" if v is None else f"{100 * v:.1f}%"


def main():
    folder = sys.argv[1]
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "scale_*.json"))):
        with open(path) as f:
            r = json.load(f)
        setup = r.get("plugin") or r.get("config", {}).get("mode")
        runs[(r["model"], setup)] = r
    scale = {"full_finetune": [], "load": None, "qlora": None}
    lines = ["# 7B-class fine-tuning on one GPU", "",
             "| model | setup | step ms | tokens/s | MFU (measured; with recompute) | "
             "MFU of 989 TFLOP/s | peak device GiB | peak host GiB | "
             "model data: device / host GiB (formula) | vs FSDP2 offload |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, setup), r in sorted(runs.items()):
        peer = runs.get((model, PEER))
        peer_tps = peer.get("tokens_per_s") if peer else None
        tps = r.get("tokens_per_s")
        if setup != PEER:
            scale["full_finetune"].append({
                "model": model, "parameters": r.get("parameters"), "plugin": setup,
                "tokens_per_s": tps, "mfu_measured": r.get("mfu_measured"),
                "mfu_measured_with_recompute": r.get("mfu_measured_with_recompute"),
                "mfu_spec": r.get("mfu_spec"),
                "peak_device_bytes": r.get("peak_device_bytes"),
                "peak_host_bytes": r.get("peak_host_bytes"),
                "formula": r.get("formula"), "peer_tokens_per_s": peer_tps,
                "error": r.get("error")})
        if r.get("error"):
            lines.append(f"| {model} | {setup} | {r['error']} | | | | | | | |")
            continue
        formula = r.get("formula") or {}
        vs = f"{tps / peer_tps:.2f}x" if tps and peer_tps and setup != PEER else ""
        lines.append(
            f"| {model} | {setup} | {r['step_ms']['median']:.0f} | {tps:.0f} | "
            f"{pct(r.get('mfu_measured'))}; {pct(r.get('mfu_measured_with_recompute'))} | "
            f"{pct(r.get('mfu_spec'))} | {gib(r.get('peak_device_bytes'))} | "
            f"{gib(r.get('peak_host_bytes'))} | "
            f"{gib(formula.get('device_model_bytes'))} / {gib(formula.get('host_model_bytes'))} | {vs} |")
    load = os.path.join(folder, "load.json")
    if os.path.exists(load):
        with open(load) as f:
            ld = json.load(f)
        scale["load"] = {"model": ld["model"], "parameters": ld["parameters"],
                         "time_vs_read": ld["load"]["time_vs_read_warm"],
                         "time_vs_fresh_read": ld["load"]["time_vs_fresh_read_warm"],
                         "host_peak_vs_bytes": ld["load"]["host_peak_vs_bytes"]}
        lines += ["", f"Loading {ld['model']} ({ld['parameters'] / 1e9:.2f} B parameters, bf16): "
                  f"{ld['load']['time_vs_read_warm']:.2f}x a plain read of its files into a reused "
                  f"buffer, {ld['load']['time_vs_fresh_read_warm']:.2f}x a read into new memory; "
                  f"host peak {ld['load']['host_peak_vs_bytes']:.2f}x the model's bytes."]
    qlora = []
    for path in sorted(glob.glob(os.path.join(folder, "qlora_*_ours.json"))):
        with open(path) as f:
            ours = json.load(f)
        peer_path = path[:-len("_ours.json")] + "_peer.json"
        peer = None
        if os.path.exists(peer_path):
            with open(peer_path) as f:
                peer = json.load(f)
        peer_tps = peer.get("tokens_per_s") if peer else None
        qlora.append({"model": ours["model"], "tokens_per_s": ours.get("tokens_per_s"),
                      "peer_tokens_per_s": peer_tps, "peer_base": peer.get("base") if peer else None,
                      "peak_device_bytes": ours.get("peak_device_bytes"),
                      "peer_peak_device_bytes": peer.get("peak_device_bytes") if peer else None,
                      "trainable_parameters": ours.get("trainable_parameters"),
                      "generate": ours.get("generate")})
    if qlora:
        scale["qlora"] = qlora[0] if len(qlora) == 1 else qlora
        lines += ["", "| QLoRA | ours tokens/s | peer tokens/s (base) | ours / peer | "
                  "peak device GiB ours / peer |", "|---|---|---|---|---|"]
        for e in qlora:
            ratio = (f"{e['tokens_per_s'] / e['peer_tokens_per_s']:.2f}x"
                     if e["tokens_per_s"] and e["peer_tokens_per_s"] else "")
            lines.append(f"| {e['model']} | {e['tokens_per_s'] or 0:.0f} | "
                         f"{e['peer_tokens_per_s'] or 0:.0f} ({e['peer_base']}) | {ratio} | "
                         f"{gib(e['peak_device_bytes'])} / {gib(e['peer_peak_device_bytes'])} |")
        gens = [e for e in qlora if e.get("generate") and e["generate"].get("fused_ms_per_token")]
        if gens:
            lines += ["", "| QLoRA greedy generation | ms / token, packed weight read directly | "
                      "ms / token, dequantized | speedup | same tokens |", "|---|---|---|---|---|"]
            for e in gens:
                g = e["generate"]
                lines.append(f"| {e['model']} | {g['fused_ms_per_token']:.2f} | "
                             f"{g['dequantized_ms_per_token']:.2f} | "
                             f"{g['dequantized_ms_per_token'] / g['fused_ms_per_token']:.2f}x | "
                             f"{'yes' if g['same_ids'] else 'no'} |")
    with open(os.path.join(folder, "scale.json"), "w") as f:
        json.dump(scale, f, indent=2)
    with open(os.path.join(folder, "scale.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
