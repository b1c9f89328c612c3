"""Runs a self-launching benchmark program as N local ranks (torchrun's
environment variables) and records each rank's peak resident set size from
the kernel's accounting of that child, so that benchmarks which do not report
memory themselves still get a per-rank peak RSS. Afterwards it adds
"peak_rss_bytes_per_rank" (and "machine", when missing) to the JSON file the
program wrote.

  launch_ranks.py --nproc N --json FILE -- PROGRAM [ARGS...]
"""
import argparse
import json
import os
import socket
import sys


def machine(torch_version):
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem,
            "torch": torch_version}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--json", required=True, help="the JSON the program writes")
    p.add_argument("--torch-version", default="unknown")
    p.add_argument("program", nargs=argparse.REMAINDER)
    a = p.parse_args()
    prog = a.program[1:] if a.program and a.program[0] == "--" else a.program
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    pids = {}
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(a.nproc), LOCAL_WORLD_SIZE=str(a.nproc),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        pid = os.fork()
        if pid == 0:
            try:
                os.execvpe(prog[0], prog, env)
            finally:
                os._exit(127)
        pids[pid] = r
    rss = [0] * a.nproc
    rc = 0
    while pids:
        pid, status, usage = os.wait4(-1, 0)
        if pid not in pids:
            continue
        r = pids.pop(pid)
        rss[r] = usage.ru_maxrss * 1024  # kB on Linux
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rc == 0:
            rc = code if code > 0 else 128 - code
            for other in pids:  # a failed rank would leave the rest hanging
                try:
                    os.kill(other, 15)
                except ProcessLookupError:
                    pass
    if rc != 0:
        sys.exit(rc)
    with open(a.json) as f:
        data = json.load(f)
    data.setdefault("peak_rss_bytes_per_rank", rss)
    data.setdefault("machine", machine(a.torch_version))
    with open(a.json, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
