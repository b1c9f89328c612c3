"""Writes report.md and PNG plots from the JSON files bench/run leaves in a
results folder.

  /usr/bin/python3 bench/report.py bench/results/<date>

Reads whatever is there (collectives_n*.json, ddp_step_*.json,
torch_ddp_step_*.json, zero_step_n*.json, hybrid_adam.json,
checkpoint_io.json, gemini_budget.json, hybrid_step_n*.json,
pipeline_step_n*.json, moe_step_n*.json, lora_step.json, qlora.json, tokenizer.json, generate.json,
run.json) and skips the sections it has no data for.
Plots need matplotlib (Debian: python3-matplotlib); without it the report has
tables only.
"""
import glob
import json
import os
import re
import statistics
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:  # tables only
    plt = None

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
       "broadcast", "send_recv"]
SETUP_LABEL = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2",
               "fsdp": "FSDP (ZeRO-3)", "fsdp_noprefetch": "FSDP, no prefetch",
               "zero": "DDP + ZeroRedundancyOptimizer",
               "no_sync": "no-sync floor", "single": "single process"}
COLORS = {"ddp": "tab:blue", "zero1": "tab:orange", "zero2": "tab:green",
          "zero3": "tab:red"}


def load(path):
    with open(path) as f:
        return json.load(f)


def natural(paths):
    return sorted(paths, key=lambda p: [int(t) if t.isdigit() else t
                                        for t in re.split(r"(\d+)", p)])


def fmt_bytes(b):
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if b >= scale:
            v = b / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{b} B"


def ms(s):
    return f"{s['median']:.0f} ({s['p10']:.0f}-{s['p90']:.0f})"


def ms2(s):
    return f"{s['median']:.2f} ({s['p10']:.2f}-{s['p90']:.2f})"


def seconds(s):
    return f"{s['median']:.3f} ({s['p10']:.3f}-{s['p90']:.3f})"


def zero_formula(setup, psi, n, given=None):
    """fp32 model-state bytes per rank (AdamW): shared/NOTES.md's table."""
    if setup == "ddp":
        return 16.0 * psi
    if setup == "zero1":
        return (8.0 + 8.0 / n) * psi
    if setup == "zero2":
        return (4.0 + 12.0 / n) * psi
    if setup.startswith("fsdp") or setup == "zero3":
        return 16.0 / n * psi
    return given


def formula_key(setup):
    if setup.startswith("fsdp") or setup == "zero3":
        return "zero3"
    return setup


class Report:
    def __init__(self, folder):
        self.dir = folder
        self.lines = []
        self.plots = []

    def add(self, *lines):
        self.lines.extend(lines)

    def table(self, header, rows):
        self.add("| " + " | ".join(header) + " |",
                 "|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            self.add("| " + " | ".join(str(c) for c in r) + " |")
        self.add("")

    def figure(self, fig, name, caption):
        if fig is None:
            return
        fig.tight_layout()
        fig.savefig(os.path.join(self.dir, name), dpi=110)
        plt.close(fig)
        self.add(f"![{caption}]({name})", "")

    # ---- header ---------------------------------------------------------
    def header(self):
        run = {}
        if os.path.exists(os.path.join(self.dir, "run.json")):
            run = load(os.path.join(self.dir, "run.json"))
        machine = None
        for p in natural(glob.glob(os.path.join(self.dir, "*.json"))):
            d = load(p)
            if isinstance(d, dict) and "machine" in d:
                machine = d["machine"]
                break
        title = os.path.basename(os.path.normpath(self.dir))
        self.add(f"# Benchmark report: {title}", "")
        if machine:
            mem = machine.get("memory_bytes", 0) / (1 << 30)
            self.add(f"- Machine: {machine.get('cpu')}, {machine.get('cores')} cores, "
                     f"{mem:.0f} GiB memory")
        runs = run.get("runs", [run] if run else [])
        for run in runs:
            pkg = run.get("libtorch_package")
            self.add(f"- LibTorch {run.get('libtorch')}"
                     + (f" (Debian package {pkg})" if pkg and pkg != "unknown" else "")
                     + " for ours, "
                     f"PyTorch {run.get('python_torch')} for the Python peers, "
                     f"commit {run.get('commit')}",
                     f"- Command: `{run.get('command')}` ({run.get('mode')} mode), "
                     f"{run.get('seconds')} s of benchmarks")
            loads = ", ".join(f"{s['name']} {s['loadavg_before'].split()[0]}"
                              for s in run.get("steps", []))
            self.add(f"- 1-minute load average when each benchmark started: {loads}")
        self.add("", "Times are medians with p10-p90 in parentheses. Ratios compare "
                 "medians measured in alternation in the same run.", "")

    # ---- one process alone and beside a rank --------------------------------
    def single_process(self):
        """The plain single-process step of both programs, alone on the
        machine (--nproc 1) and beside a waiting rank (--nproc 2), with its
        forward / backward / optimizer phases, and DDP at world size 1."""
        runs = {}
        for label, pattern in (("ours alone", "ddp_alone_*.json"),
                               ("PyTorch alone", "torch_ddp_alone_*.json"),
                               ("ours beside a rank", "ddp_step_*.json"),
                               ("PyTorch beside a rank", "torch_ddp_step_*.json")):
            runs[label] = [load(p) for p in natural(glob.glob(os.path.join(self.dir, pattern)))]
        if not runs["ours alone"] and not runs["PyTorch alone"]:
            return
        self.add("## One process: alone and beside a rank", "")
        self.add("The plain (unboosted) step of each program on rank 0, alone on "
                 "the machine (`--nproc 1`) and while a second rank waits in a "
                 "barrier (`--nproc 2`), split into forward (zero_grad, forward, "
                 "loss), backward and AdamW step; then DDP at world size 1 "
                 "against the plain step of the same process. Medians pooled "
                 "over invocations.", "")

        def pooled(rs, get):
            vals = [get(r) for r in rs]
            vals = [v for v in vals if v]
            if not vals:
                return None
            return {"median": statistics.median(v["median"] for v in vals),
                    "p10": min(v["p10"] for v in vals),
                    "p90": max(v["p90"] for v in vals)}

        rows = []
        for label, rs in runs.items():
            if not rs:
                continue
            step = pooled(rs, lambda r: r.get("step_ms", {}).get("single"))
            ph = {k: pooled(rs, lambda r, k=k: r.get("single_phases_ms", {}).get(k))
                  for k in ("forward", "backward", "optimizer")}
            rows.append([label, ms(step) if step else "-"]
                        + [ms(ph[k]) if ph[k] else "-" for k in ("forward", "backward", "optimizer")])
        self.table(["program, where", "step ms", "forward ms", "backward ms",
                    "optimizer ms"], rows)

        def med_ratio(a, b, key):
            rs = [x["step_ms"][key]["median"] / y["step_ms"][key]["median"]
                  for x, y in zip(a, b)
                  if x.get("step_ms", {}).get(key) and y.get("step_ms", {}).get(key)]
            return statistics.median(rs) if rs else None

        def own_ratio(rs, a, b):
            v = [r["step_ms"][a]["median"] / r["step_ms"][b]["median"] for r in rs
                 if r.get("step_ms", {}).get(a) and r["step_ms"].get(b)]
            return statistics.median(v) if v else None

        f = lambda x: "-" if x is None else f"{x:.2f}x"
        self.table(["ratio", "value"], [
            ["ours / PyTorch, single step alone",
             f(med_ratio(runs["ours alone"], runs["PyTorch alone"], "single"))],
            ["ours / PyTorch, single step beside a rank",
             f(med_ratio(runs["ours beside a rank"], runs["PyTorch beside a rank"], "single"))],
            ["ours: DDP at world size 1 / plain step", f(own_ratio(runs["ours alone"], "ddp", "single"))],
            ["PyTorch: DDP at world size 1 / plain step",
             f(own_ratio(runs["PyTorch alone"], "ddp", "single"))],
        ])

    # ---- training steps ---------------------------------------------------
    def steps(self):
        ours = [load(p) for p in natural(glob.glob(os.path.join(self.dir, "ddp_step_*.json")))]
        peer = [load(p) for p in natural(glob.glob(os.path.join(self.dir, "torch_ddp_step_*.json")))]
        zero_path = os.path.join(self.dir, "zero_step_n2.json")
        zero = load(zero_path) if os.path.exists(zero_path) else None
        if not ours and not peer and not zero:
            return
        self.add("## Training step: gpt-small-cpu, 2 ranks x 1 thread, fp32 AdamW", "")
        self.add("5,289,472 parameters, micro-batch 8 x 128 tokens per rank. "
                 "`bench_ddp_step` (ours) and `torch_ddp_step.py` (PyTorch's "
                 "Python DDP on the same model, batch, optimizer and threads) "
                 "alternate invocation by invocation; inside each, the setups "
                 "alternate block by block. The ZeRO stages come from "
                 "`bench_zero_step`, where DDP and the stages alternate in the "
                 "same processes, so their column is relative to that run's DDP.", "")

        def pooled(runs, key):
            vals = [r["step_ms"][key] for r in runs if r.get("step_ms", {}).get(key)]
            if not vals:
                return None
            return {"median": statistics.median(v["median"] for v in vals),
                    "p10": min(v["p10"] for v in vals),
                    "p90": max(v["p90"] for v in vals)}

        rows, bars = [], []
        o = {k: pooled(ours, k) for k in ("ddp", "no_sync", "lockstep", "single")}
        t = {k: pooled(peer, k)
             for k in ("ddp", "zero", "fsdp2", "no_sync", "lockstep", "single")}
        # Per-invocation ratios, then their median: each is a ratio of
        # medians taken in alternation.
        def ratio(runs, a, b):
            rs = [r["step_ms"][a]["median"] / r["step_ms"][b]["median"]
                  for r in runs if r.get("step_ms", {}).get(a) and r["step_ms"].get(b)]
            return statistics.median(rs) if rs else None

        def cross(key_o, key_t):
            rs = [a["step_ms"][key_o]["median"] / b["step_ms"][key_t]["median"]
                  for a, b in zip(ours, peer)
                  if a.get("step_ms", {}).get(key_o) and b.get("step_ms", {}).get(key_t)]
            return statistics.median(rs) if rs else None

        f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}x"
        rows.append(["DDP", ms(o["ddp"]) if o["ddp"] else "-", f(ratio(ours, "ddp", "no_sync")),
                     ms(t["ddp"]) if t["ddp"] else "-", f(ratio(peer, "ddp", "no_sync")),
                     f(cross("ddp", "ddp"))])
        rows.append(["no-sync floor (2 processes, no communication)",
                     ms(o["no_sync"]) if o["no_sync"] else "-", "1.00x" if o["no_sync"] else "-",
                     ms(t["no_sync"]) if t["no_sync"] else "-", "1.00x" if t["no_sync"] else "-",
                     f(cross("no_sync", "no_sync"))])
        if o["lockstep"] or t["lockstep"]:
            rows.append(["lockstep floor (no communication, a barrier ends each step)",
                         ms(o["lockstep"]) if o["lockstep"] else "-",
                         f(ratio(ours, "lockstep", "no_sync")),
                         ms(t["lockstep"]) if t["lockstep"] else "-",
                         f(ratio(peer, "lockstep", "no_sync")),
                         f(cross("lockstep", "lockstep"))])
        rows.append(["single process (rank 0 alone)",
                     ms(o["single"]) if o["single"] else "-", f(ratio(ours, "single", "no_sync")),
                     ms(t["single"]) if t["single"] else "-", f(ratio(peer, "single", "no_sync")),
                     f(cross("single", "single"))])
        self.add("Step time and each program's ratio to its own no-sync floor:", "")
        self.table(["setup", "ours ms", "ours / floor", "PyTorch ms",
                    "PyTorch / floor", "ours / PyTorch"], rows)
        if o["lockstep"] or t["lockstep"]:
            cpu = {k: statistics.median(r["cpu_ms_per_step"][k]["median"] for r in ours
                                        if r.get("cpu_ms_per_step", {}).get(k))
                   for k in ("ddp", "no_sync", "lockstep")
                   if any(r.get("cpu_ms_per_step", {}).get(k) for r in ours)}
            line = ("The lockstep floor waits for the slower rank every step, as "
                    "any synchronous step must, so DDP / lockstep is what the "
                    f"gradient bytes cost: ours {f(ratio(ours, 'ddp', 'lockstep'))}, "
                    f"PyTorch {f(ratio(peer, 'ddp', 'lockstep'))}.")
            if cpu:
                line += (" Our rank 0's process CPU time per step (every thread): " +
                         ", ".join(f"{k.replace('_', '-')} {v:.0f} ms" for k, v in cpu.items()) +
                         "; what DDP adds to it is the collectives' own work, the "
                         "rest of its wall-time gap is waiting.")
            per_rank = [r["step_ms_median_per_rank"] for r in ours
                        if len(r.get("step_ms_median_per_rank", [])) > 1]
            if per_rank:
                line += (" Each rank's own no-sync median, per invocation (ms): " +
                         "; ".join(" / ".join(f"{x['no_sync']:.0f}" for x in pr)
                                   for pr in per_rank) +
                         ". The ratios above use rank 0's; a synchronous step "
                         "runs at the pace of the slower one.")
            self.add(line, "")

        zrows = []
        zdata = []
        if zero:
            base = zero["setups"]["ddp"]["step_ms"]
            for name, s in zero["setups"].items():
                theirs, theirs_ratio = "-", "-"
                if name == "zero1" and t["zero"]:
                    theirs = ms(t["zero"]) + " (ZeroRedundancyOptimizer)"
                    theirs_ratio = f(ratio(peer, "zero", "ddp"))
                if name == "fsdp" and t["fsdp2"]:
                    theirs = ms(t["fsdp2"]) + " (FSDP2 fully_shard)"
                    theirs_ratio = f(ratio(peer, "fsdp2", "ddp"))
                if name == "ddp" and t["ddp"]:
                    theirs, theirs_ratio = ms(t["ddp"]), "1.00x"
                zrows.append([SETUP_LABEL.get(name, name), f"{s['step_ms']:.0f}",
                              f"{s['step_ms'] / base:.2f}x",
                              f(s.get("vs_floor")), f(s.get("vs_lockstep_floor")),
                              theirs, theirs_ratio])
                zdata.append((SETUP_LABEL.get(name, name), s["step_ms"] / base))
            self.add("Sharded data parallelism against each program's own DDP "
                     "(ours: `bench_zero_step`; PyTorch: DDP + "
                     "ZeroRedundancyOptimizer, which shards optimizer states "
                     "like ZeRO-1), and ours against the same run's "
                     "no-communication floor (every rank trains a plain copy "
                     f"at the same time: {zero.get('floor_ms', 0):.0f} ms) and "
                     "its lockstep version (the same steps, each ending in a "
                     f"barrier: {zero.get('lockstep_floor_ms', 0):.0f} ms):", "")
            self.table(["setup", "ours ms", "ours / own DDP",
                        "ours / no-comm floor", "ours / lockstep floor", "PyTorch ms",
                        "PyTorch / own DDP"], zrows)
        if ours:
            b = ours[0].get("bytes_allreduced_per_step")
            rss = ours[0].get("peak_rss_bytes_per_rank")
            trss = peer[0].get("peak_rss_bytes_per_rank") if peer else None
            if b:
                self.add(f"Ours all-reduces {b / 1e6:.1f} MB per DDP step "
                         f"({ours[0].get('buckets')} buckets). Peak RSS per rank: "
                         f"ours {', '.join(f'{x / 1e6:.0f}' for x in rss)} MB "
                         "(DDP model, plus the single-process copy on rank 0)"
                         + (f"; PyTorch {', '.join(f'{x / 1e6:.0f}' for x in trss)} MB "
                            "(DDP and ZeRO models, plus the single copy on rank 0)"
                            if trss else "") + ".", "")

        if plt is None:
            return
        fig, axes = plt.subplots(1, 2 if zdata else 1, figsize=(12 if zdata else 7, 4.2),
                                 squeeze=False)
        ax = axes[0][0]
        labels = ["DDP", "DDP+ZeRO opt.", "no-sync floor", "single process"]
        keys = ["ddp", "zero", "no_sync", "single"]
        xs = range(len(keys))
        for off, (name, d, color) in zip((-0.2, 0.2), (("ours (C++)", o, "tab:blue"),
                                                        ("PyTorch (Python)", t, "tab:gray"))):
            vals = [d.get(k) for k in keys]
            pos = [x + off for x, v in zip(xs, vals) if v]
            med = [v["median"] for v in vals if v]
            err = [[v["median"] - v["p10"] for v in vals if v],
                   [v["p90"] - v["median"] for v in vals if v]]
            ax.bar(pos, med, 0.4, yerr=err, capsize=3, label=name, color=color)
            for p_, m_ in zip(pos, med):
                ax.text(p_, m_, f"{m_:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels)
        ax.set_ylabel("step time, ms (median, p10-p90)")
        ax.set_title("gpt-small-cpu, 2 ranks x 1 thread")
        ax.legend()
        if zdata:
            ax = axes[0][1]
            ax.bar([z[0] for z in zdata], [z[1] for z in zdata], color="tab:blue")
            ax.axhline(1.0, color="k", lw=0.8)
            for i, z in enumerate(zdata):
                ax.text(i, z[1], f"{z[1]:.2f}x", ha="center", va="bottom", fontsize=8)
            ax.set_ylabel("step time / DDP (same processes, alternated)")
            ax.set_title("ours: sharded setups vs DDP, 2 ranks")
            plt.setp(ax.get_xticklabels(), rotation=15)
        self.figure(fig, "step_time.png", "step time per strategy")

    # ---- memory -----------------------------------------------------------
    def memory(self):
        runs = {}
        for p in glob.glob(os.path.join(self.dir, "zero_step_n*.json")):
            d = load(p)
            runs[d["world_size"]] = d
        if not runs:
            return
        ns = sorted(runs)
        psi = next(iter(runs.values()))["parameters"]
        setups = []
        for n in ns:
            for s in runs[n]["setups"]:
                if s not in setups:
                    setups.append(s)
        self.add("## Model-state memory per rank vs world size", "")
        self.add(f"Bytes of parameters, gradients and AdamW states each rank holds "
                 f"after a step (`bench_zero_step`, fp32, Psi = {psi:,}), beside "
                 "the ZeRO formulas for fp32 training: DDP 16 Psi, ZeRO-1 "
                 "(8 + 8/N) Psi, ZeRO-2 (4 + 12/N) Psi, ZeRO-3/FSDP 16 Psi / N "
                 "(plus gathered units in flight). MB = 10^6 bytes.", "")
        header = ["setup"] + [f"N={n} measured / formula MB" for n in ns]
        rows = []
        for s in setups:
            row = [SETUP_LABEL.get(s, s)]
            for n in ns:
                e = runs[n]["setups"].get(s)
                if not e:
                    row.append("-")
                    continue
                fb = zero_formula(s, psi, n, e.get("formula_bytes"))
                row.append(f"{e['model_state_bytes'] / 1e6:.1f} / "
                           + (f"{fb / 1e6:.1f}" if fb else "-"))
            rows.append(row)
        rss_row = ["peak RSS per rank, all setups in one process (MB)"]
        for n in ns:
            r = runs[n].get("peak_rss_bytes_per_rank")
            rss_row.append(", ".join(f"{x / 1e6:.0f}" for x in r) if r else "-")
        rows.append(rss_row)
        self.table(header, rows)
        if plt is None:
            return
        fig, ax = plt.subplots(figsize=(7, 4.5))
        grid = [1 + i * 0.05 for i in range(int((max(ns) - 1) / 0.05) + 1)]
        drawn = set()
        for key, label in (("ddp", "DDP 16Ψ"), ("zero1", "ZeRO-1 (8+8/N)Ψ"),
                           ("zero2", "ZeRO-2 (4+12/N)Ψ"), ("zero3", "ZeRO-3 16Ψ/N")):
            ax.plot(grid, [zero_formula(key, psi, n) / 1e6 for n in grid], "--",
                    color=COLORS[key], lw=1, label=f"formula {label}")
        markers = "osD^v<>"
        for i, s in enumerate(setups):
            jitter = (i - (len(setups) - 1) / 2) * 0.04  # keep equal points visible
            pts = [(n + jitter, runs[n]["setups"][s]["model_state_bytes"] / 1e6)
                   for n in ns if s in runs[n]["setups"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], markers[i % len(markers)],
                    color=COLORS.get(formula_key(s), "k"), ms=8, mfc="none", mew=2,
                    label=f"measured {SETUP_LABEL.get(s, s)}")
        ax.set_xticks(ns)
        ax.set_xlabel("world size N (data-parallel ranks)")
        ax.set_ylabel("model-state MB per rank")
        ax.set_title("gpt-small-cpu, fp32 AdamW")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        self.figure(fig, "memory.png", "memory per rank vs world size")

    # ---- collectives ------------------------------------------------------
    def collectives(self):
        runs = {}
        for p in glob.glob(os.path.join(self.dir, "collectives_n*.json")):
            d = load(p)
            runs[d["world_size"]] = d
        if not runs:
            return
        ns = sorted(runs)
        shm = any(r["config"].get("shared_memory") for r in runs.values())
        self.add("## Collectives (ranks on one host, fp32)", "")
        if shm:
            self.add("Our all_reduce, all_gather, reduce_scatter and broadcast run through "
                     "a shared-memory segment here (all ranks on one host; NOTE "
                     "[Shared-memory collectives]); the other operations and "
                     "every c10d column go through Gloo's sockets. "
                     "`COLOSSALAI_SHM_COLLECTIVES=0` times ours on Gloo alone.", "")
        for n in ns:
            c = runs[n]["config"]
            if "transport" in c:
                self.add(f"- {n} ranks: the group's transport is "
                         f"{c['transport']} ({c.get('transport_reason', '')})")
        self.add("")
        self.add("Time of one operation (the slowest rank's), median over "
                 "alternating blocks; algbw = size / time, busbw = algbw x bus "
                 "factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, "
                 "all_to_all (n-1)/n; broadcast, send_recv 1), as nccl-tests "
                 "defines them. \"ours\" is `colossalai::distributed`, \"c10d\" "
                 "the Gloo backend called directly; c10d's Gloo backend has no "
                 "reduce_scatter (ours, on Gloo alone, sends each shard point to "
                 "point in chunks and sums them as they land; see the "
                 "same-tensor table). "
                 "send_recv: every rank sends to the next and receives from the "
                 "previous at once. GB/s = 10^9 bytes/s.", "")
        rows = []
        for op in OPS:
            for n in ns:
                res = [r for r in runs[n]["results"] if r["op"] == op]
                if not res:
                    continue
                best = max(res, key=lambda r: r["ours"]["busbw_GBps"])
                c = [r for r in res if r["c10d"]]
                cbest = max(c, key=lambda r: r["c10d"]["busbw_GBps"]) if c else None
                big = [r["ours_over_c10d_time"] for r in c if r["bytes"] >= (1 << 20)]
                small = [r for r in res if r["bytes"] <= 8192]
                lat = f"{small[0]['ours']['time_us']['median']:.0f}" if small else "-"
                rows.append([op, n,
                             f"{best['ours']['busbw_GBps']:.2f} @ {fmt_bytes(best['bytes'])}",
                             f"{cbest['c10d']['busbw_GBps']:.2f} @ {fmt_bytes(cbest['bytes'])}" if cbest else "-",
                             f"{statistics.median(big):.2f}x" if big else "-",
                             lat])
        self.table(["op", "ranks", "ours peak busbw GB/s", "c10d peak busbw GB/s",
                    "ours / c10d time, >= 1 MB (median)", f"ours at {fmt_bytes(runs[ns[0]]['results'][0]['bytes'])}, us"],
                   rows)
        st = [(n, r) for n in ns for r in runs[n]["results"]
              if r.get("same_tensor") and r["bytes"] >= (1 << 20)]
        if st:
            self.add("reduce_scatter against an all_reduce and an all_to_all of "
                     "the same tensor, timed in the same alternating blocks "
                     "(targets: at most 0.6x the all_reduce, within 1.2x the "
                     "all_to_all, from 1 MB up):", "")
            rows2 = []
            for n, r in st:
                ar = r["same_tensor"].get("all_reduce")
                a2a = r["same_tensor"].get("all_to_all")
                rows2.append([n, fmt_bytes(r["bytes"]),
                              f"{r['ours']['time_us']['median']:.0f}",
                              f"{ar['time_us']['median']:.0f}" if ar else "-",
                              f"{a2a['time_us']['median']:.0f}" if a2a else "-",
                              f"{ar['ours_over_this_time']:.2f}x" if ar else "-",
                              f"{a2a['ours_over_this_time']:.2f}x" if a2a else "-"])
            self.table(["ranks", "size", "reduce_scatter us", "all_reduce us",
                        "all_to_all us", "rs / all_reduce", "rs / all_to_all"], rows2)
        self.add("<details><summary>All sizes</summary>", "")
        for n in ns:
            self.add(f"**{n} ranks**", "")
            rows = []
            for r in runs[n]["results"]:
                c = r["c10d"]
                rows.append([r["op"], fmt_bytes(r["bytes"]),
                             f"{r['ours']['time_us']['median']:.1f}",
                             f"{r['ours']['algbw_GBps']:.3f}", f"{r['ours']['busbw_GBps']:.3f}",
                             f"{c['time_us']['median']:.1f}" if c else "-",
                             f"{c['busbw_GBps']:.3f}" if c else "-",
                             f"{r['ours_over_c10d_time']:.2f}" if c else "-"])
            self.table(["op", "size", "ours us", "algbw", "busbw", "c10d us",
                        "c10d busbw", "ours/c10d"], rows)
        self.add("</details>", "")
        if plt is None:
            return
        fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
        styles = {2: "tab:blue", 4: "tab:red"}
        for ax, op in zip(axes.flat, OPS):
            for n in ns:
                res = [r for r in runs[n]["results"] if r["op"] == op]
                if not res:
                    continue
                x = [r["bytes"] for r in res]
                ax.plot(x, [r["ours"]["busbw_GBps"] for r in res], "-o", ms=3,
                        color=styles.get(n, "k"), label=f"ours, {n} ranks")
                c = [r for r in res if r["c10d"]]
                if c:
                    ax.plot([r["bytes"] for r in c], [r["c10d"]["busbw_GBps"] for r in c],
                            "--x", ms=4, color=styles.get(n, "k"), alpha=0.6,
                            label=f"c10d, {n} ranks")
            ax.set_xscale("log", base=2)
            sizes = [r["bytes"] for n in ns for r in runs[n]["results"] if r["op"] == op]
            ticks = [b for b in (4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)
                     if sizes and min(sizes) <= b <= max(sizes) * 1.01]
            ax.set_xticks(ticks)
            ax.set_xticklabels([fmt_bytes(b) for b in ticks])
            ax.set_title(op)
            ax.set_xlabel("message size")
            ax.set_ylabel("bus bandwidth, GB/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        self.figure(fig, "busbw.png", "bus bandwidth vs message size")

    # ---- optimizer and checkpoints -----------------------------------------
    def hybrid_adam(self):
        p = os.path.join(self.dir, "hybrid_adam.json")
        if not os.path.exists(p):
            return
        d = load(p)
        self.add("## HybridAdam step (fused CPU Adam) vs torch AdamW", "")
        rmw = d.get("rmw_GBps")
        self.add(f"{d['threads']} threads, ISA {d['isa']}, medians of {d['reps']}; "
                 "optimizer traffic is 28 bytes per parameter. The limit is an "
                 "in-place read-modify-write stream with the same traffic"
                 + (f" ({rmw:.1f} GB/s in this run)" if rmw else "")
                 + f"; a copy into another buffer ({d['copy_GBps']:.1f} GB/s) "
                 "pays a read for ownership on every store that in-place updates "
                 "do not, so it is not a ceiling.", "")
        rows = [[f"{c['params'] / 1e6:.0f} M", f"{c['hybrid_adam_s'] * 1e3:.2f} ms",
                 f"{c['hybrid_adam_GBps']:.1f}"]
                + ([f"{c['fraction_of_rmw'] * 100:.0f}%"] if rmw else [])
                + [f"{c['fraction_of_copy'] * 100:.0f}%",
                   f"{c['torch_adamw_s'] * 1e3:.1f} ms", f"{c['speedup_vs_torch']:.1f}x"]
                for c in d["cases"]]
        self.table(["parameters", "HybridAdam", "GB/s"]
                   + (["of in-place stream"] if rmw else [])
                   + ["of copy", "torch AdamW", "speedup"], rows)

    def checkpoint_io(self):
        p = os.path.join(self.dir, "checkpoint_io.json")
        if not os.path.exists(p):
            return
        d = load(p)
        self.add("## Checkpoint save/load", "")
        into = d.get("read_into_GBps")
        self.add(f"{d['bytes'] / (1 << 30):.2f} GiB state dict, medians of {d['reps']}; "
                 f"plain copy {d['copy_GBps']:.2f} GB/s, plain read "
                 f"{d['read_GBps']:.2f} GB/s on the same disk (a 4 MB buffer "
                 "reused, so it stays in cache)"
                 + (f"; a read into resident memory of the state dict's size "
                    f"(what a load must do: write every byte to DRAM) "
                    f"{into:.2f} GB/s" if into else "") + ". Each load follows "
                 "its save, the file in the page cache.", "")
        rows = [[k, f"{c['save_GBps']:.2f}", f"{c['load_GBps']:.2f}",
                 f"{c['save_time_vs_copy']:.2f}x", f"{c['load_time_vs_read']:.2f}x"]
                + ([f"{c['load_time_vs_read_into']:.2f}x"] if into else [])
                for k, c in d["cases"].items()]
        self.table(["format", "save GB/s", "load GB/s", "save time / copy",
                    "load time / read"] + (["load time / read into memory"] if into else []),
                   rows)

    def gemini_budget(self):
        p = os.path.join(self.dir, "gemini_budget.json")
        if not os.path.exists(p):
            return
        d = load(p)
        budget = d["budget_bytes"]
        self.add(f"## The largest model one process trains within a "
                 f"{budget / 2**20:.0f} MB device budget", "")
        self.add("Device peak measured as the heap's peak in use during a step "
                 "minus the host tier minus the baseline (bench/gemini_budget.cpp).",
                 "")
        largest = d["largest_fitting_parameters"]
        self.table(["setup", "largest model that fits"],
                   [[k, f"{v / 1e6:.1f} M parameters"] for k, v in largest.items()])
        rows = [[r["setup"], r["layers"], f"{r['parameters'] / 1e6:.1f} M",
                 fmt_bytes(r["device_peak_bytes"]) if r["ran"] else "refused",
                 "yes" if r["fits"] else "no",
                 fmt_bytes(r["host_to_device_per_step"])
                 if r["host_to_device_per_step"] >= 0 else "-"]
                for r in d["runs"]]
        self.table(["setup", "blocks", "parameters", "device peak", "fits",
                    "host to device / step"], rows)
        if plt is None:
            return
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for setup in largest:
            pts = [(r["parameters"] / 1e6, r["device_peak_bytes"] / 2**20)
                   for r in d["runs"] if r["setup"] == setup and r["ran"]]
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=setup)
        ax.axhline(budget / 2**20, color="k", ls="--", lw=1, label="budget")
        ax.set_xscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel("device peak MB")
        ax.legend(fontsize=7)
        self.figure(fig, "gemini_budget.png", "device peak vs model size")

    def hybrid_step(self):
        runs = [load(p) for p in natural(glob.glob(
            os.path.join(self.dir, "hybrid_step_n*.json")))]
        if not runs:
            return
        self.add("## Tensor parallelism vs data parallelism "
                 "(HybridParallelPlugin)", "")
        self.add(f"Global batch {runs[0]['global_batch']} x 128 tokens at every "
                 "world size, fp32 AdamW, 1 thread per rank; setups alternate "
                 "inside one run (`bench_hybrid_step`). Bytes are per step per "
                 "rank, handed to collectives on the tensor group and on the "
                 "data-parallel group; the formula columns are Megatron's count "
                 "((4 L + 2) B T C x 4 bytes + 3 B T x 4 for the parallel cross "
                 "entropy) and all-reduce (4 Psi_local) or reduce-scatter + "
                 "all-gather (4 Psi_local (1 + 1/dp)) of the local gradients, dp counting the sequence-parallel ranks too (gradients average over dp x sp). "
                 "\"gap\" is the largest |measured - formula| over every rank. "
                 "Sequence-parallel setups (split_gather, ring on the tensor "
                 "group; all_to_all, ring_attn on their own sp axis, tp 1) have "
                 "no formula here (-); with dp 1 their sp axis is the "
                 "data-parallel group too, so its traffic is reported under dp "
                 "(\"in dp\"). Under all_to_all and ring_attn the LM head and "
                 "loss run on each rank's own tokens (parallel_output). "
                 "Activations: the heap in use after the forward minus before.",
                 "")
        rows = []
        for d in runs:
            for model, setups in d["models"].items():
                for name, r in setups.items():
                    layout = f"{r['tp']}x{r['dp']}"
                    if r.get("sp", 1) > 1:
                        layout += f" sp{r['sp']}"
                    if r.get("sp_mode"):
                        layout += f" {r['sp_mode']}"
                    if r["zero_stage"]:
                        layout += " ZeRO-1"
                    rows.append([
                        model, str(d["world_size"]), name, layout,
                        f"{r['step_ms']['median']:.0f}", f"{r['vs_dp']:.2f}x",
                        fmt_bytes(r["tp_bytes_per_step"]),
                        "-" if r["tp_formula_bytes"] < 0
                        else fmt_bytes(r["tp_formula_bytes"]),
                        fmt_bytes(r["dp_bytes_per_step"]),
                        "-" if r["dp_formula_bytes"] < 0
                        else fmt_bytes(r["dp_formula_bytes"]),
                        "in dp" if r.get("sp_bytes_per_step", 0) < 0
                        else fmt_bytes(r.get("sp_bytes_per_step", 0)),
                        f"{r['tp_gap_any_rank'] + r['dp_gap_any_rank']}",
                        fmt_bytes(r["model_state_bytes"]),
                        fmt_bytes(r["model_state_formula_bytes"]),
                        fmt_bytes(r["activation_bytes"])])
        self.table(["model", "ranks", "setup", "tp x dp", "step ms", "vs dp",
                    "tp bytes", "formula", "dp bytes", "formula", "sp bytes",
                    "gap B",
                    "model state", "16 Psi_local (ZeRO-1: 4 + 12/dp)",
                    "activations"], rows)
        if plt is None:
            return
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        labels, ms, mem = [], [], []
        for d in runs:
            for model, setups in d["models"].items():
                for name, r in setups.items():
                    labels.append(f"{model}\n{name}/{d['world_size']}")
                    ms.append(r["step_ms"]["median"])
                    mem.append((r["model_state_bytes"] / 2**20,
                                r["activation_bytes"] / 2**20))
        x = range(len(labels))
        axes[0].bar(x, ms)
        axes[0].set_ylabel("step ms (median)")
        axes[1].bar(x, [m[0] for m in mem], label="model state")
        axes[1].bar(x, [m[1] for m in mem], bottom=[m[0] for m in mem],
                    label="activations")
        axes[1].set_ylabel("MB per rank")
        axes[1].legend(fontsize=7)
        for ax in axes:
            ax.set_xticks(list(x))
            ax.set_xticklabels(labels, rotation=60, fontsize=6)
        fig.tight_layout()
        self.figure(fig, "hybrid_step.png",
                    "step time and memory per rank, tensor vs data parallel")

    def moe_step(self):
        runs = [load(p) for p in natural(glob.glob(
            os.path.join(self.dir, "moe_step_n*.json")))]
        if not runs:
            return
        d0 = runs[0]
        self.add("## Expert parallelism (MoeHybridParallelPlugin)", "")
        self.add(f"A Mixtral of gpt-small-cpu's size ({d0['experts']} experts, "
                 f"top {d0['top_k']}), global batch {d0['global_batch']} x "
                 f"{d0['seq']} tokens, every rank data-parallel, ZeRO-1, fp32 "
                 "AdamW, 1 thread per rank; ep1 holds every expert on every "
                 "rank (HybridParallelPlugin), ep2 / ep4 split them and send "
                 "tokens by all-to-all. Setups alternate inside one run "
                 "(`bench_moe_step`). Bytes are handed to the expert-parallel "
                 "group per step: the mean over ranks beside the formula "
                 "(per sparse layer 4 x N k C x 4 bytes: dispatch and combine, "
                 "forward and backward, plus the counts), and the most one "
                 "rank handed over (routing is uneven); \"-\" where ep spans "
                 "the whole data-parallel group, one group whose count holds "
                 "ZeRO's traffic too.", "")
        rows = []
        for d in runs:
            for name, r in d["setups"].items():
                rows.append([
                    str(d["world_size"]), name,
                    f"{r['step_ms']['median']:.0f}",
                    f"{r['step_ms']['p10']:.0f}-{r['step_ms']['p90']:.0f}",
                    f"{r['vs_ep1']:.2f}x", f"{r['tokens_per_s']:.0f}",
                    "-" if r["ep_bytes_per_step_mean"] < 0
                    else fmt_bytes(r["ep_bytes_per_step_mean"]),
                    fmt_bytes(r["ep_formula_bytes"]),
                    "-" if r["ep_bytes_per_step_max"] < 0
                    else fmt_bytes(r["ep_bytes_per_step_max"]),
                    f"{r['parameters_per_rank'] / 1e6:.1f}M",
                    fmt_bytes(r["model_state_bytes"])])
        self.table(["ranks", "setup", "step ms", "p10-p90", "vs ep1",
                    "tokens/s", "ep bytes (mean)", "formula", "most",
                    "parameters/rank", "model state/rank"], rows)
        if plt is None:
            return
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
        names = list(d0["setups"])
        axes[0].bar(names, [d0["setups"][n]["tokens_per_s"] for n in names])
        axes[0].set_ylabel("tokens/s")
        axes[1].bar(names, [d0["setups"][n]["model_state_bytes"] / 2**20
                            for n in names])
        axes[1].set_ylabel("model state MB per rank")
        self.figure(fig, "moe_step.png",
                    "tokens/s and model state per rank at ep 1, 2, 4")

    def pipeline_step(self):
        runs = [load(p) for p in natural(glob.glob(
            os.path.join(self.dir, "pipeline_step_n*.json")))]
        if not runs:
            return
        d0 = runs[0]
        self.add("## Pipeline parallelism (HybridParallelPlugin)", "")
        self.add(f"GPT-2 of gpt-small-cpu's width with {d0['n_layer']} blocks "
                 f"(vocab 4096, width 256), micro-batches of "
                 f"{d0['microbatch_size']} x {d0['seq']} tokens (global batch "
                 "2 m), fp32 AdamW, 1 thread per rank, pp_size = ranks (tp 1, "
                 "dp 1); interleaved and ZB-V with 2 model chunks per rank. "
                 "The schedules alternate inside one run "
                 f"(`bench_pipeline_step`, {d0['warmup']} warm-up step, "
                 f"{d0['rounds']} rounds of {d0['steps']} timed steps). Step: "
                 "execute_pipeline + optimizer step, slowest rank, median "
                 "(p10-p90). Bubble of a stage in the last timed step: "
                 "1 - busy / wall, wall = execute_pipeline on that rank. "
                 "*span*: busy = the sum of the schedule's timeline spans, "
                 "which include the blocking receive of each action's input, so "
                 "it sees only time outside the actions (the drain, the tied "
                 "embedding's gradient sync); *compute*: the same spans with "
                 "that receive wait cut off (a forward computes from the "
                 "policy's stage_forward on, a backward from when autograd "
                 "reaches the chunk's output). The 1F1B formula is "
                 "(p - 1) / (m + p - 1); *simulated* is pipeline::simulate's "
                 "unit-cost bubble of the same schedule (interleaved and ZB-V "
                 "have no closed form). *compute ms*: busy compute summed over "
                 "stages, split into forward / backward (B, or BI + W). "
                 "*CPU share*: the engine thread's CPU time / wall per stage. "
                 "Activations: the heap in use (mallinfo2), sampled after every "
                 "chunk forward and criterion and at every backward's start, "
                 "peak minus before the step, MB per stage.", "")
        rows = []
        for d in runs:
            for name, r in d["setups"].items():
                st = r["per_stage"]
                fwd = bwd = 0.0
                for t in r["timeline"]:
                    for e in t["events"]:
                        if e[0] == 0:
                            fwd += e[4] - e[5]
                        else:
                            bwd += e[4] - e[5]
                rows.append([
                    str(d["stages"]), r["schedule"], str(r["microbatches"]),
                    ms(r["step_ms"]),
                    f"{r['busy_compute_sum_ms']:.0f} ({fwd:.0f} / {bwd:.0f})",
                    f"{r['bubble_span_mean']:.3f}",
                    f"{r['bubble_compute_mean']:.2f} ("
                    + " / ".join(f"{s['bubble_compute']:.2f}" for s in st) + ")",
                    "-" if r["bubble_formula"] is None
                    else f"{r['bubble_formula']:.2f}",
                    f"{r['bubble_simulated']:.2f}",
                    " / ".join(f"{s['thread_cpu_ms'] / s['wall_ms']:.2f}"
                               for s in st),
                    " / ".join(f"{s['activation_peak_bytes'] / 1e6:.1f}"
                               for s in st)])
        self.table(["p", "schedule", "m", "step ms", "compute ms (F / B)",
                    "bubble span", "bubble compute (per stage)",
                    "1F1B formula", "simulated", "CPU share per stage",
                    "activations MB per stage"], rows)
        self.add("Reading it: (1) with more ranks than cores the stages "
                 "time-share the cores, so spans stretch whenever more stages "
                 "compute than there are cores; the measured bubble then mixes "
                 "the schedule's idle time with CPU contention, and the CPU "
                 "share column (about cores / ranks at most) shows how much of "
                 "a core each stage got, other jobs included (see the load "
                 "averages above). (2) ZB-V's W pass runs autograd again from "
                 "the chunk's output to the weights; the BI pass kept the graph "
                 "but not the intermediate gradients, so the activation-gradient "
                 "chain is computed twice and its backward costs more than "
                 "1F1B's B (compare the B column): a smaller bubble, more work. "
                 "(3) The stages are not balanced: the first holds the "
                 "embeddings, the last the LM head (256 x 4096) and the loss "
                 "(under ZB-V stage 0 holds both), which a unit-cost simulation "
                 "does not see. (4) 1F1B keeps at most p - s micro-batches in "
                 "flight on stage s, so its activation peak does not grow with "
                 "m.", "")
        if plt is None:
            return
        # Bubbles: measured (compute) vs simulated, every setup.
        fig, ax = plt.subplots(figsize=(9, 3.2))
        labels, meas, sim, form = [], [], [], []
        for d in runs:
            for name, r in d["setups"].items():
                labels.append(f"p{d['stages']}\n{r['schedule']}\nm{r['microbatches']}")
                meas.append(r["bubble_compute_mean"])
                sim.append(r["bubble_simulated"])
                form.append(r["bubble_formula"])
        x = list(range(len(labels)))
        ax.bar([i - 0.2 for i in x], meas, 0.4, label="measured (compute)")
        ax.bar([i + 0.2 for i in x], sim, 0.4, label="simulated (unit cost)")
        fx = [i for i, f in zip(x, form) if f is not None]
        ax.scatter([i + 0.2 for i in fx], [f for f in form if f is not None],
                   marker="_", s=200, color="k", label="(p-1)/(m+p-1)",
                   zorder=3)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel("bubble fraction (mean over stages)")
        ax.legend(fontsize=7)
        self.figure(fig, "pipeline_bubble.png",
                    "measured vs simulated pipeline bubble")
        # Timelines: the largest world size and micro-batch count.
        big = max(runs, key=lambda d: d["stages"])
        m_max = max(r["microbatches"] for r in big["setups"].values())
        chosen = [r for r in big["setups"].values()
                  if r["microbatches"] == m_max]
        if not chosen:
            return
        kind_name = ["F", "B", "BI", "W"]
        kind_color = ["tab:blue", "tab:red", "tab:orange", "tab:green"]
        fig, axes = plt.subplots(len(chosen), 1,
                                 figsize=(11, 1.1 + 0.55 * big["stages"] * len(chosen)),
                                 squeeze=False)
        for ax, r in zip(axes[:, 0], chosen):
            end = 0
            for t in r["timeline"]:
                y = t["stage"]
                ax.broken_barh([(t["call_ms"], t["return_ms"] - t["call_ms"])],
                               (y - 0.45, 0.9), facecolors="none",
                               edgecolors="0.6", linewidth=0.6)
                end = max(end, t["return_ms"])
                for k, c, mb, s0, s1, c0 in t["events"]:
                    if c0 > s0:  # waiting for the input inside the span
                        ax.broken_barh([(s0, c0 - s0)], (y - 0.12, 0.24),
                                       facecolors="0.85")
                    ax.broken_barh([(c0, s1 - c0)], (y - 0.4, 0.8),
                                   facecolors=kind_color[k],
                                   edgecolors="k", linewidth=0.3,
                                   hatch="///" if c == 1 else None,
                                   alpha=1.0 if c == 0 else 0.7)
                    if s1 - c0 > 0.025 * end:
                        ax.text((c0 + s1) / 2, y, str(mb), ha="center",
                                va="center", fontsize=5, color="white")
            ax.set_yticks(range(big["stages"]))
            ax.set_yticklabels([f"stage {i}" for i in range(big["stages"])],
                               fontsize=7)
            ax.invert_yaxis()
            ax.set_xlim(0, end * 1.01)
            ax.set_title(f"{r['schedule']}, p={big['stages']}, m={m_max}: "
                         f"measured bubble {r['bubble_compute_mean']:.2f}, "
                         f"simulated {r['bubble_simulated']:.2f}", fontsize=8)
        axes[-1, 0].set_xlabel("ms from the first rank's execute_pipeline call "
                               "(last timed step)")
        from matplotlib.patches import Patch
        handles = [Patch(facecolor=kind_color[i], label=kind_name[i])
                   for i in range(4)]
        handles += [Patch(facecolor="white", edgecolor="k", hatch="///",
                          label="chunk 1"),
                    Patch(facecolor="0.85", label="waiting for input"),
                    Patch(facecolor="none", edgecolor="0.6",
                          label="execute_pipeline")]
        axes[-1, 0].legend(handles=handles, fontsize=6, ncol=7,
                           loc="upper center", bbox_to_anchor=(0.5, -0.35))
        self.figure(fig, "pipeline_timeline.png",
                    f"one step of each schedule, p={big['stages']}, m={m_max}; "
                    "numbers are micro-batches")

    def lora_step(self):
        path = os.path.join(self.dir, "lora_step.json")
        if not os.path.exists(path):
            return
        d = load(path)
        self.add("## LoRA vs full fine-tuning", "")
        self.add(f"One process, 1 thread, fp32 AdamW, {d['batch']} x "
                 f"{d['seq']} tokens per step; LoRA rank {d['r']} "
                 "(lora_alpha 2 r) on the attention and MLP projections. "
                 "gpt-small-cpu is built from torch::nn::Linear, which LoRA "
                 "adapts by reparametrising the weight (W + s B A before every "
                 "forward); the GPT-2 of the same width uses colossalai's "
                 "Linear1D layers, which run LoRA's own adapter path (NOTE "
                 "[LoRA in C++]). Setups alternate inside one run "
                 f"(`bench_lora_step`, {d['rounds']} rounds of {d['steps']} "
                 "steps); step = forward + backward + optimizer step, median "
                 "(p10-p90).", "")
        by_model = {}
        for r in d["setups"]:
            by_model.setdefault(r["model"], {})[r["mode"]] = r
        rows = []
        for model, modes in by_model.items():
            full = modes.get("full")
            for mode, r in modes.items():
                rel = "" if full is None or r is full else (
                    f" ({r['step_ms']['median'] / full['step_ms']['median']:.2f}x)")
                st = "" if full is None or r is full else (
                    f" ({r['optimizer_state_bytes'] / full['optimizer_state_bytes']:.3f}x)")
                rows.append([model, mode,
                             f"{r['trainable']:,} of {r['params']:,}",
                             f"{r['grad_bytes'] / 1e6:.2f}",
                             f"{r['optimizer_state_bytes'] / 1e6:.2f}{st}",
                             ms(r["step_ms"]) + rel])
        self.table(["model", "training", "trainable params", "grads MB",
                    "optimizer states MB", "step ms"], rows)

    def qlora(self):
        path = os.path.join(self.dir, "qlora.json")
        if not os.path.exists(path):
            return
        d = load(path)
        self.add("## QLoRA: quantized base, LoRA adapters", "")
        self.add(f"One process, {d['threads']} thread(s), a LLaMA-shaped model "
                 f"(vocab {d['vocab']}, width {d['hidden']}, MLP "
                 f"{d['intermediate']}, {d['layers']} layers, {d['heads']} "
                 f"heads), LoRA r {d['r']} on q/k/v/o/gate/up/down, adapters "
                 "injected before the base is quantized (the LM head stays "
                 "in full precision). Bytes per quantized base parameter "
                 "(fp32: 4, bf16: 2): *formula* counts the codes, the "
                 "absmax per block of 64 (fp32, or 8-bit with double "
                 "quantization: + fp32 per 256 blocks + an offset), the int8 "
                 "row scales, and each layer's code tables (16 fp32 = 64 B; "
                 "double quant + 256 fp32 = 1 KiB); *asymptotic* leaves the "
                 "tables out (0.5 + 4/64, 0.5 + 1/64 + 4/(64 * 256), "
                 "1 + 4/in).", "")
        self.table(["format", "layers", "params", "bytes / param",
                    "formula", "asymptotic", "fp32 / it", "bf16 / it"],
                   [[m["name"], m["layers"], f"{m['params']:,}",
                     f"{m['bytes_per_param']:.4f}",
                     f"{m['formula_bytes_per_param']:.4f}",
                     f"{m['asymptotic_bytes_per_param']:.4f}",
                     f"{4 / m['bytes_per_param']:.2f}x",
                     f"{2 / m['bytes_per_param']:.2f}x"] for m in d["memory"]])
        self.add(f"Forward (no graph) and training step (forward, backward, "
                 f"AdamW on the adapters) on {d['batch']} x {d['seq']} "
                 f"tokens; setups alternate inside one run ({d['rounds']} "
                 f"rounds of {d['steps']}), median (p10-p90), ratios to the "
                 "fp32 base.", "")
        self.table(["base", "trainable", "model MB", "forward ms",
                    "vs fp32", "step ms", "vs fp32"],
                   [[r["name"], f"{r['trainable']:,}",
                     f"{r['model_bytes'] / 1e6:.1f}", ms(r["forward_ms"]),
                     f"{r['forward_vs_fp32']:.2f}x", ms(r["step_ms"]),
                     f"{r['step_vs_fp32']:.2f}x"] for r in d["setups"]])
        if d.get("generate"):
            self.add("Greedy generation with the KV cache (one token per "
                     "step): ms per new token with the few-row products "
                     "(`gemv_max_rows` 4) against dequantizing every step "
                     "(0), runs alternating; *same ids*: both produced the "
                     "same tokens.", "")
            self.table(["base", "fused ms / token", "dequantized ms / token",
                        "speedup", "same ids"],
                       [[r["name"], ms2(r["fused_ms_per_token"]),
                         ms2(r["dequantized_ms_per_token"]),
                         f"{r['speedup']:.2f}x",
                         "yes" if r["same_ids"] else "no"]
                        for r in d["generate"]])
        self.table(["dequantize 4096 x 4096", "ms", "GB/s output"],
                   [[k["name"], f"{k['ms']['median']:.2f}",
                     f"{k['gb_per_s']:.2f}"] for k in d["dequantize"]])
        if d.get("few_rows"):
            self.add("A few rows (a generation step's tokens) through one "
                     "quantized layer: the packed bytes read directly "
                     "(fused) against dequantize + matmul, alternating call "
                     "by call; plain fp32 / bf16 weights beside them.", "")
            self.table(["weight", "[out, in]", "rows", "fused ms",
                        "dequantized ms", "speedup", "fp32 W ms", "bf16 W ms"],
                       [[r["weight"], f"{r['out']} x {r['in']}",
                         str(r["rows"]), ms2(r["fused_ms"]),
                         ms2(r["dequantized_ms"]), f"{r['speedup']:.2f}x",
                         ms2(r["fp32_weight_ms"]), ms2(r["bf16_weight_ms"])]
                        for r in d["few_rows"]])

    def tokenizer(self):
        path = os.path.join(self.dir, "tokenizer.json")
        if not os.path.exists(path):
            return
        d = load(path)
        self.add("## Tokenizers: models::Tokenizer vs transformers", "")
        self.add(f"Encode of {d['corpus_bytes']:,} bytes of Debian's fortunes "
                 "as one text (no special tokens), one thread each, by four "
                 "tokenizers the Python libraries trained on it and "
                 "transformers saved: GPT-2's byte-level pipeline, LLaMA 3's "
                 "and Qwen 2's split regex (Qwen 2 with NFC), and a "
                 "SentencePiece BPE read from tokenizer.model. Ours and "
                 "transformers' `tokenizers` backend alternate round by round "
                 f"({d['rounds']} rounds); seconds are medians (p10-p90), the "
                 "ratio is the median of the per-round ratios; *equal* "
                 "compares the ids (count and hash). Peer: transformers "
                 f"{d['peer'].get('transformers', '?')}, tokenizers "
                 f"{d['peer'].get('tokenizers', '?')}. Ours makes ids only; "
                 "`tokenizers` also tracks offsets, and would spread a batch "
                 "of texts over threads.", "")
        self.table(["tokenizer", "vocab", "ids", "equal", "ours s",
                    "transformers s", "ours MB/s", "transformers / ours"],
                   [[t["name"], f"{t['vocab']:,}", f"{t['ids']:,}",
                     "yes" if t["ids_equal"] else "NO",
                     seconds(t["ours_s"]), seconds(t["transformers_s"]),
                     f"{d['corpus_bytes'] / 1e6 / t['ours_s']['median']:.2f}",
                     f"{t['transformers_over_ours']['median']:.2f}x"]
                    for t in d["tokenizers"]])

    def generate(self):
        path = os.path.join(self.dir, "generate.json")
        if not os.path.exists(path):
            return
        d = load(path)
        self.add("## Generation: models::generate vs transformers' generate", "")
        self.add(f"Greedy decoding of {d['batch']} prompts of "
                 f"{d['prompt_tokens']} tokens (two left-padded), "
                 f"{d['new_tokens']} new tokens each, one thread, on a "
                 f"{d['model']}: ours with its KV cache, transformers' "
                 "`generate` (SDPA, its dynamic cache) on the same directory, "
                 "and ours recomputing the whole sequence every step. Ours and "
                 "transformers alternate round by round "
                 f"({d['ours_seconds']['n']} rounds); seconds are medians "
                 "(p10-p90), ratios medians of the per-round ratios. "
                 "Sequences equal to transformers': "
                 f"{'yes' if d['sequences_equal'] else 'NO'}. Peer: torch "
                 f"{d['versions'].get('torch', '?')}, transformers "
                 f"{d['versions'].get('transformers', '?')}.", "")
        tokens = d["batch"] * d["new_tokens"]
        rows = [["ours (KV cache)", d["ours_seconds"], None],
                ["transformers generate", d["peer_seconds"], d["peer_over_ours"]],
                ["ours without a cache", d["uncached_seconds"],
                 d["uncached_over_ours"]]]
        self.table(["", "seconds", "new tokens/s", "its time / ours"],
                   [[name, seconds(t), f"{tokens / t['median']:.0f}",
                     "" if r is None else f"{r['median']:.2f}x"]
                    for name, t, r in rows])

    def write(self):
        self.header()
        self.steps()
        self.single_process()
        self.memory()
        self.collectives()
        self.hybrid_adam()
        self.checkpoint_io()
        self.gemini_budget()
        self.hybrid_step()
        self.pipeline_step()
        self.moe_step()
        self.lora_step()
        self.qlora()
        self.tokenizer()
        self.generate()
        self.add("## Reproduce", "",
                 "```sh",
                 "bench/run            # full suite; bench/run --quick for a short one",
                 "bench/run --only collectives,ddp_step --out-dir bench/results/mine",
                 "```", "")
        with open(os.path.join(self.dir, "report.md"), "w") as f:
            f.write("\n".join(self.lines))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    Report(sys.argv[1]).write()
    print(f"wrote {os.path.join(sys.argv[1], 'report.md')}")


if __name__ == "__main__":
    main()
