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


def check_summary():
    """The ratio arithmetic on figures made up here: ratios taken within a
    repetition, their spread, the mark when it crosses 1.0."""
    sys.path.insert(0, HERE)
    import run_grpc_bench as rb

    def lat(rep, p50):
        return {"suite": "latency", "size": 64, "rep": rep, "p50_us": p50, "p99_us": 2 * p50}
    # RDMA 10, 30, 20 us against TCP 20, 20, 40 us: ratios 0.5, 1.5, 0.5.
    res = {"rdma": [lat(0, 10), lat(1, 30), lat(2, 20)],
           "tcp": [lat(0, 20), lat(1, 20), lat(2, 40)],
           "inproc": [lat(0, 5), lat(1, 5), lat(2, 5)]}
    sp = rb.spread_of(res, "latency", {"size": 64}, "p50_us")
    check(sp is not None and abs(sp["median"] - 0.5) < 1e-9 and abs(sp["min"] - 0.5) < 1e-9
          and abs(sp["max"] - 1.5) < 1e-9 and sp["n"] == 3 and sp["crosses_1"],
          f"spread of 0.5, 1.5, 0.5: {sp}")
    check(rb.ratio(sp) == "0.50 [0.50-1.50] *", f"ratio cell: {rb.ratio(sp)!r}")
    inp = rb.spread_of(res, "latency", {"size": 64}, "p50_us", den="inproc")
    check(inp and not inp["crosses_1"] and rb.ratio(inp) == "4.00 [2.00-6.00]",
          f"RDMA/in-process 2, 6, 4: {inp}")
    # A repetition one transport lacks is no pair.
    res["tcp"].pop()
    sp = rb.spread_of(res, "latency", {"size": 64}, "p50_us")
    check(sp["n"] == 2 and abs(sp["median"] - 1.0) < 1e-9, f"two pairs: {sp}")
    check(rb.ratio(None) == "-", "no pairs: -")
    md = rb.table(rb.summarize(res, 2, [64], []), 3, {"cpus": 2, "keep_awake": True,
                                                       "loadavg_before": 0.5, "loadavg_after": 1.0})
    check("idle-priority spinners" in md and "0.50 before, 1.00 after" in md,
          f"the table says its conditions: {md[:400]!r}")
    check("malloc thresholds raised in every process" in md, f"and the allocator's: {md[:500]!r}")
    md = rb.table(rb.summarize(res, 2, [64], []), 3, {"cpus": 2, "glibc_malloc_defaults": True})
    check("glibc's malloc defaults in TCP" in md, f"--glibc-malloc-defaults said: {md[:500]!r}")
    # The parameter server's CPU per step: RDMA's host part (without the
    # emulated device) over TCP's, repetition by repetition; no row
    # without parameter-server runs.
    check(not any("parameter server" in row["what"] for row in rb.summarize(res, 2, [64], [])["cpu"]),
          "no parameter-server CPU row without parameter-server runs")

    def ps(rep, total_us, device_us):
        return {"suite": "ps", "model": "resnet50", "rep": rep, "steps_per_s": 1.0,
                "cpu_client_us": total_us / 2, "cpu_client_device_us": device_us,
                "cpu_server_us": total_us / 2, "cpu_server_device_us": 0}
    # RDMA 300 ms per step of which the device 100, then 260 of which 60;
    # TCP 400 both times: host ratios 0.5 and 0.5.
    res = {"rdma": [ps(0, 300e3, 100e3), ps(1, 260e3, 60e3)],
           "tcp": [ps(0, 400e3, 0), ps(1, 400e3, 0)], "inproc": [ps(0, 150e3, 0), ps(1, 150e3, 0)]}
    rows = [row for row in rb.summarize(res, 2, [], [])["cpu"] if "parameter server" in row["what"]]
    check(len(rows) == 1 and rows[0]["what"] == "parameter server, resnet50, 2 workers: CPU ms per step"
          and abs(rows[0]["rdma_cpu"] - 280) < 1e-6 and abs(rows[0]["rdma_cpu_device"] - 80) < 1e-6
          and rb.ratio(rows[0]["rdma_host_tcp_ratio"]) == "0.50 [0.50-0.50]",
          f"parameter-server CPU row: {rows}")
    # --keep-awake's spinners run at idle priority, one per CPU.
    r = rb.Runner.__new__(rb.Runner)
    spinners = r.start_spinners()
    try:
        check(len(spinners) == (os.cpu_count() or 1), f"{len(spinners)} spinners")
        check(all(os.sched_getscheduler(p.pid) == os.SCHED_IDLE for p in spinners),
              "spinners are SCHED_IDLE")
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main():
    check_summary()
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
    check(sorted((row["suite"], row["size"]) for row in s["stream"]) ==
          [("download", 65536), ("download", 1048576), ("stream", 65536), ("stream", 1048576)],
          f"stream rows: both directions of each size asked for: {s['stream']}")
    for row in s["stream"]:
        for t in ("tcp", "rdma", "inproc"):
            check(positive(row[f"{t}_mb_per_s"]),
                  f"stream {row['direction']} {row['size']} B {t}: {row[f'{t}_mb_per_s']}")
    for t in ("tcp", "rdma", "inproc"):
        check(positive(s["rate"][0][f"{t}_calls_per_s"]), f"rate {t}")
        check(len(s["connect"]) == 2 and all(positive(c[f"{t}_p50_us"]) for c in s["connect"]),
              f"first call on a new channel, RDMA-first and TCP-first, {t}: {s['connect']}")
    check(s["connect"][1].get("variant") == "tcp_first" and
          s["connect"][1]["rdma_p50_us"] != s["connect"][0]["rdma_p50_us"],
          f"the TCP-first row has its own RDMA figure: {s['connect']}")
    proof = res.get("rdma_proof") or {}
    check(proof.get("rdma_client_connections", 0) >= 1 and proof.get("tcp_client_connections") == 0,
          f"the RDMA runs rode RDMA: {proof}")

    # CPU: both processes of TCP and RDMA measured (the server through
    # --server-pid), the emulated device's threads only over RDMA, and for
    # 1 MiB messages the device did work (softverbs' agents move them).
    for t in ("tcp", "rdma"):
        for e in res["raw"][t]:
            if e["suite"] in ("rate", "stream", "download"):
                check(positive(e.get("cpu_client_us")) and positive(e.get("cpu_server_us")),
                      f"{t} {e['suite']}: client and server CPU measured: {e}")
    for e in res["raw"]["inproc"]:
        if e["suite"] in ("rate", "stream", "download"):
            check(positive(e.get("cpu_client_us")) and e.get("cpu_server_us") == 0,
                  f"inproc {e['suite']}: one process: {e}")
    cpu = {row["what"]: row for row in s["cpu"]}
    check(len(cpu) == 5, f"five CPU rows (rate, two stream sizes each way): {list(cpu)}")
    for what, row in cpu.items():
        for t in ("tcp", "rdma", "inproc"):
            check(positive(row[f"{t}_cpu"]), f"{what}: {t} CPU {row[f'{t}_cpu']}")
        check(row["tcp_cpu_device"] == 0 and row["inproc_cpu_device"] == 0,
              f"{what}: no emulated device without RDMA: {row}")
        check(row["rdma_cpu_device"] is not None and row["rdma_cpu_device"] < row["rdma_cpu"],
              f"{what}: the device's part is part of the whole: {row}")
    big = [row for what, row in cpu.items() if "1 MiB" in what]
    check(len(big) == 2 and all(positive(row["rdma_cpu_device"]) for row in big),
          f"1 MiB streaming, both ways: the emulated device's threads did the copying: {big}")
    # Copies per byte, from the plugin's counters in the RDMA client: a byte
    # sent below 1 MiB is copied once into a registered buffer; from 1 MiB
    # at most once (zero-copy writes of 1 MiB and more, announced chunks or
    # whole messages in large standing grants, are not copied); a received
    # byte at most once (large messages: none).
    for row in s["latency"] + [r for r in s["stream"] if r["suite"] == "stream"]:
        sent = row.get("rdma_copies_sent")
        ok = isinstance(sent, (int, float)) and (
            0 <= sent <= 1.05 if row["size"] >= 1 << 20 else 0.5 < sent <= 1.5)
        check(ok, f"{row['size']} B: copies per byte sent {sent}")
    for row in [r for r in s["stream"] if r["suite"] == "download"]:
        check(isinstance(row.get("rdma_copies_received"), (int, float))
              and 0 <= row["rdma_copies_received"] <= 1.05,
              f"{row['size']} B downloaded: copies per byte received {row.get('rdma_copies_received')}")
    check("RDMA host/TCP" in md and "| 64 KiB | server to client |" in md and "new channel" in md,
          "results.md has the tables")


if __name__ == "__main__":
    main()
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        sys.exit(1)
    print("run_grpc_bench smoke test: all checks passed")
