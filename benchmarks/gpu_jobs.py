"""Runs shell jobs on the GPUs of one host, one job per GPU at a time, each with its own limit.

    python3 benchmarks/gpu_jobs.py --out $OUT --deadline-s 420 jobs.txt

`jobs.txt` holds one job per line, `name | seconds | command` (blank lines and `#` comments
skipped); a job whose name starts with `all:` waits for every GPU and sees all of them (ring
attention, sharded tests), one starting `x<N>:` (say `x2:`) for N free GPUs and sees those, the others run on whichever GPU frees first, in file order, with
`CUDA_VISIBLE_DEVICES` set to it; commands run in the current directory and see `$OUT` and
`$REPO` (that directory). Each job's output goes to `$OUT/<name>.log`; `$OUT/jobs.json`
records exit codes and seconds, and is rewritten as jobs end, so a device call cut at its limit
still brings back what finished. Jobs that could not start before `--deadline-s` are skipped
(and listed), so the call ends in time to copy its results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time


def parse(path: str) -> list[tuple[str, float, str]]:
    jobs = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, seconds, command = (part.strip() for part in line.split("|", 2))
            jobs.append((name, float(seconds), command))
    return jobs


def gpus_wanted(name: str, gpus: int) -> int:
    """How many GPUs a job asks for by its name: `all:` every one, `x<N>:` N (at most all), else 1."""
    if name.startswith("all:"):
        return gpus
    group = re.match(r"x(\d+):", name)
    return min(gpus, int(group.group(1))) if group else 1


def gpu_count() -> int:
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return max(1, sum(1 for line in listing.splitlines() if line.startswith("GPU ")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jobs")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--deadline-s", type=float, default=480.0, help="start no job after this many seconds")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    gpus = gpu_count()
    queue = parse(args.jobs)
    start = time.monotonic()
    free = list(range(gpus))
    running: dict[int, tuple[subprocess.Popen, str, float, list[int], object]] = {}
    records: list[dict] = []

    def record(**row) -> None:
        records.append(row)
        with open(os.path.join(args.out, "jobs.json"), "w") as f:
            json.dump({"gpus": gpus, "jobs": records}, f, indent=1)

    while queue or running:
        while queue:
            name, limit, command = queue[0]
            if time.monotonic() - start > args.deadline_s:
                queue.pop(0)
                record(name=name, skipped="deadline")
                continue
            wanted = gpus_wanted(name, gpus)
            if len(free) < wanted:
                break
            needed = free[:wanted]
            queue.pop(0)
            for g in needed:
                free.remove(g)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, needed)), OUT=args.out, REPO=os.getcwd())
            log = open(os.path.join(args.out, re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".log"), "w")
            # SIGINT at the limit (pytest then still prints its failures), SIGKILL 20 s later.
            proc = subprocess.Popen(["timeout", "-s", "INT", "-k", "20", str(int(limit)), "bash", "-c", command], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
            running[proc.pid] = (proc, name, time.monotonic(), needed, log)
            print(f"[{time.monotonic() - start:6.1f}s] start {name} on GPU {','.join(map(str, needed))}", flush=True)
        finished = [pid for pid, (proc, *_rest) in running.items() if proc.poll() is not None]
        for pid in finished:
            proc, name, began, used, log = running.pop(pid)
            log.close()
            free.extend(used)
            free.sort()
            seconds = time.monotonic() - began
            print(f"[{time.monotonic() - start:6.1f}s] end {name} exit {proc.returncode} after {seconds:.0f}s", flush=True)
            record(name=name, gpus=used, exit=proc.returncode, seconds=round(seconds, 1), timed_out=proc.returncode == 124)
        if not finished:
            time.sleep(0.5)
    sys.exit(0)


if __name__ == "__main__":
    main()
