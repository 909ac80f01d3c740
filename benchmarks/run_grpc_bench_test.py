#!/usr/bin/env python3
"""Smoke test of the README's main job: benchmarks/run_grpc_bench.py end to
end with small sizes and short measures, then checks of what it wrote
(every transport measured, the RDMA runs proven to ride RDMA, CPU time
counted for both processes, the emulated device's part only over RDMA).
Figures are not judged: this machine's speed is not a test's business.

usage: run_grpc_bench_test.py --build BUILD_DIR
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}", file=sys.stderr)


def positive(v):
    return isinstance(v, (int, float)) and v > 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    a = ap.parse_args()
    # In the ASan build the TCP and in-process runs are plain processes whose
    # leak report at exit (gRPC's, at shutdown) would fail them: leaks are
    # the unit tests' business, not this one's.
    os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    bench = os.path.join(a.build, "benchmarks", "grpc_bench")

    # A bad --server-pid is refused with a message that names it.
    r = subprocess.run([bench, "run", "--inprocess", "rate", "--server-pid", "x"],
                       capture_output=True, text=True, timeout=60)
    check(r.returncode == 2 and "--server-pid" in r.stderr,
          f"grpc_bench --server-pid x: exit {r.returncode}, stderr {r.stderr!r}")

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(HERE, "run_grpc_bench.py"), "--build", a.build,
               "--out", out, "--reps", "1", "--seconds", "0.2", "--no-ps",
               "--latency-sizes", "64,65536", "--stream-sizes", "65536,1048576", "--clients", "2"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=800)
        sys.stderr.write(r.stderr[-4000:])
        check(r.returncode == 0, f"runner exit {r.returncode}")
        if r.returncode != 0:
            return
        with open(os.path.join(out, "results.json")) as f:
            res = json.load(f)
        with open(os.path.join(out, "results.md")) as f:
            md = f.read()
    s = res["summary"]
    check([row["size"] for row in s["latency"]] == [64, 65536], "latency rows are the sizes asked for")
    for row in s["latency"]:
        for t in ("tcp", "rdma", "inproc"):
            check(positive(row[f"{t}_p50_us"]), f"latency {row['size']} B {t}: p50 {row[f'{t}_p50_us']}")
    for row in s["stream"]:
        for t in ("tcp", "rdma", "inproc"):
            check(positive(row[f"{t}_mb_per_s"]), f"stream {row['size']} B {t}: {row[f'{t}_mb_per_s']}")
    for t in ("tcp", "rdma", "inproc"):
        check(positive(s["rate"][0][f"{t}_calls_per_s"]), f"rate {t}")
    proof = res.get("rdma_proof") or {}
    check(proof.get("rdma_client_connections", 0) >= 1 and proof.get("tcp_client_connections") == 0,
          f"the RDMA runs rode RDMA: {proof}")

    # CPU: both processes of TCP and RDMA measured (the server through
    # --server-pid), the emulated device's threads only over RDMA, and for
    # 1 MiB messages the device did work (softverbs' agents move them).
    for t in ("tcp", "rdma"):
        for e in res["raw"][t]:
            if e["suite"] in ("rate", "stream"):
                check(positive(e.get("cpu_client_us")) and positive(e.get("cpu_server_us")),
                      f"{t} {e['suite']}: client and server CPU measured: {e}")
    for e in res["raw"]["inproc"]:
        if e["suite"] in ("rate", "stream"):
            check(positive(e.get("cpu_client_us")) and e.get("cpu_server_us") == 0,
                  f"inproc {e['suite']}: one process: {e}")
    cpu = {row["what"]: row for row in s["cpu"]}
    check(len(cpu) == 3, f"three CPU rows (rate, two stream sizes): {list(cpu)}")
    for what, row in cpu.items():
        for t in ("tcp", "rdma", "inproc"):
            check(positive(row[f"{t}_cpu"]), f"{what}: {t} CPU {row[f'{t}_cpu']}")
        check(row["tcp_cpu_device"] == 0 and row["inproc_cpu_device"] == 0,
              f"{what}: no emulated device without RDMA: {row}")
        check(row["rdma_cpu_device"] is not None and row["rdma_cpu_device"] < row["rdma_cpu"],
              f"{what}: the device's part is part of the whole: {row}")
    big = [row for what, row in cpu.items() if "1 MiB" in what]
    check(len(big) == 1 and positive(big[0]["rdma_cpu_device"]),
          f"1 MiB streaming: the emulated device's threads did the copying: {big}")
    check("RDMA host/TCP" in md and "| 64 KiB |" in md, "results.md has the tables")


if __name__ == "__main__":
    main()
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("run_grpc_bench smoke test: all checks passed")
