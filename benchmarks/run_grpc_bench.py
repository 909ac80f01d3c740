#!/usr/bin/env python3
"""The gRPC point-to-point benchmark runner: README's main job.

Runs benchmarks/grpc_bench over three transports in one invocation on one
machine, interleaved, with warm-up and repetitions:

  tcp      gRPC over TCP loopback, as gRPC ships
  rdma     gRPC over RDMA: libgrpc_rdma.so preloaded, over softverbs
  inproc   gRPC's in-process transport: the floor for any transport

Server and client are two processes for tcp and rdma; inproc is one. Each
rdma run proves from the library's stats (TF_RDMA_STATS) that its calls rode
RDMA. The rate and streaming measures also give the CPU time client and
server spend per call or per GB (the emulated RDMA device's work apart: its
threads, and what it does on the application's threads).

Every repetition measures every transport, one after the other, so a ratio
is taken within a repetition (RDMA's figure over TCP's of the same
repetition) and the table gives the median ratio with its minimum and
maximum over the repetitions; a ratio whose spread crosses 1.0 is marked:
that run cannot say which transport was faster. --keep-awake runs one
idle-priority spinner per CPU for the whole run, so that idle vCPUs do not
halt and wake slowly (as hosts tuned for RDMA run with deep C-states off);
the table says which mode it used and the load average around it.

Every process runs with glibc's malloc thresholds raised as the plugin's
TF_RDMA_MALLOC_TUNE raises them in the RDMA processes (GLIBC_TUNABLES), so
the ratios compare transports; --glibc-malloc-defaults leaves TCP and
in-process at glibc's defaults instead (what a user who adds the plugin to
an untuned process gets).

Writes results.json, results.md (the table, with ratios) and PNG plots into
--out, and prints the table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LATENCY_SIZES = [1, 64, 1024, 8192, 16384, 65536, 262144, 1048576, 4194304]
STREAM_SIZES = [65536, 4194304]
TRANSPORTS = ["tcp", "rdma", "inproc"]
# grpc_bench's stream suite measures both ways: (its suite name, the direction).
STREAM_DIRECTIONS = [("stream", "client to server"), ("download", "server to client")]
# glibc's malloc as TF_RDMA_MALLOC_TUNE leaves it (src/config/malloc_tune.h).
MALLOC_TUNED = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Runner:
    def __init__(self, args):
        self.a = args
        b = os.path.abspath(args.build)
        self.bench = os.path.join(b, "benchmarks", "grpc_bench")
        self.lib = os.path.join(b, "src", "glue", "libgrpc_rdma.so")
        self.launcher = os.path.join(b, "softverbs", "softverbs-run")
        for f in (self.bench, self.lib, self.launcher):
            if not os.path.exists(f):
                sys.exit(f"run_grpc_bench: {f} is missing: build first (scripts/setup.sh)")
        self.tmp = tempfile.mkdtemp(prefix="grpc_bench.")
        self.env = dict(os.environ, SOFTVERBS_DEVICES="mlx5_0:127.0.0.1")
        for k in list(self.env):
            if k.startswith("TF_RDMA_") or k == "LD_PRELOAD" or k == "GLIBC_TUNABLES":
                del self.env[k]
        if not args.glibc_malloc_defaults:
            # The thresholds TF_RDMA_MALLOC_TUNE sets in the RDMA processes,
            # for every process: the ratios then compare transports, not
            # allocators (the plugin leaves a process's own setting alone).
            self.env["GLIBC_TUNABLES"] = MALLOC_TUNED

    def prefix(self, transport, role):
        if transport != "rdma":
            return [], dict(self.env)
        # softverbs keeps the device work it does on application threads in
        # this directory, one file per process, for grpc_bench's CPU figures.
        env = dict(self.env, TF_RDMA_STATS=os.path.join(self.tmp, f"{role}.stats"),
                   SOFTVERBS_DEVICE_CPU_DIR=self.tmp)
        if role == "client":
            # Every byte of these measures rides RDMA from the first: by
            # default a connection starts on TCP and moves within a few ms,
            # well inside each measure's warm-up, onto the same path. The
            # default's first call has its own row (default_connect). The
            # server keeps the default, so it joins that row's connections.
            env["TF_RDMA_TCP_FIRST"] = "0"
        return [self.launcher, "--preload", self.lib], env

    def start_server(self, transport):
        pre, env = self.prefix(transport, "server")
        p = subprocess.Popen(pre + [self.bench, "serve", "127.0.0.1:0"], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline()
        if not line.startswith("port "):
            p.kill()
            sys.exit(f"run_grpc_bench: the {transport} server did not start")
        return p, int(line.split()[1])

    def client(self, transport, port, suite_args, server_pid=None):
        pre, env = self.prefix(transport, "client")
        target = ["--inprocess"] if transport == "inproc" else ["--target", f"127.0.0.1:{port}"]
        cmd = pre + [self.bench, "run"] + target + suite_args + ["--seconds", str(self.a.seconds)]
        if server_pid:
            cmd += ["--server-pid", str(server_pid)]
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=1800)
        if r.returncode != 0:
            sys.exit(f"run_grpc_bench: {transport} {' '.join(suite_args)} failed:\n{r.stderr}")
        if transport == "rdma":
            self.prove_rdma(suite_args)
        return [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]

    def prove_rdma(self, suite_args):
        path = os.path.join(self.tmp, "client.stats")
        try:
            with open(path) as f:
                st = json.load(f)
        except (OSError, ValueError):
            sys.exit("run_grpc_bench: the rdma client wrote no stats: was the plugin loaded?")
        if st["rdma_client_connections"] < 1 or st["tcp_client_connections"] != 0:
            sys.exit(f"run_grpc_bench: rdma run {' '.join(suite_args)} did not ride RDMA: {st}")
        self.rdma_proof = st

    def default_connect(self, port, server_pid):
        """The first call on a new channel again, with the plugin's default
        (TF_RDMA_TCP_FIRST on): the call rides TCP while RDMA CM connects
        beside it. These channels close before RDMA is up, so a short run
        of small calls on one channel then proves that such a connection
        does move to RDMA."""
        pre, env = self.prefix("rdma", "client")
        del env["TF_RDMA_TCP_FIRST"]
        base = pre + [self.bench, "run", "--target", f"127.0.0.1:{port}"]
        rows = []
        for suite_args, keep in ((["connect", "--seconds", str(self.a.seconds)], True),
                                 (["latency", "--sizes", "64", "--seconds", "1"], False)):
            r = subprocess.run(base + suite_args + ["--server-pid", str(server_pid)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=600)
            if r.returncode != 0:
                sys.exit(f"run_grpc_bench: rdma (default TF_RDMA_TCP_FIRST) {' '.join(suite_args)} "
                         f"failed:\n{r.stderr}")
            if keep:
                rows = [dict(json.loads(l), suite="connect_tcp_first")
                        for l in r.stdout.splitlines() if l.startswith("{")]
        with open(os.path.join(self.tmp, "client.stats")) as f:
            st = json.load(f)
        if st.get("tcp_first_moved", 0) < 1:
            sys.exit(f"run_grpc_bench: with TF_RDMA_TCP_FIRST on (the default) the connection never moved to "
                     f"RDMA: {st}")
        return rows

    def suites(self):
        s = [("latency", ["latency", "--sizes", ",".join(map(str, self.a.latency_sizes))]),
             ("stream", ["stream", "--sizes", ",".join(map(str, self.a.stream_sizes))]),
             ("rate", ["rate", "--clients", str(self.a.clients)]),
             ("connect", ["connect"])]
        if not self.a.no_ps:
            # 10 steps: the pools' first growth (page faults) weighs less in
            # a figure that stands for training runs of thousands of steps.
            s.append(("ps resnet50", ["ps", "--model", "resnet50", "--workers", "2", "--steps", "10"]))
            if not self.a.quick:
                s.append(("ps vgg16", ["ps", "--model", "vgg16", "--workers", "2", "--steps", "2"]))
        return s

    def start_spinners(self):
        """One idle-priority (SCHED_IDLE) busy loop per CPU: it runs only
        when nothing else wants that CPU, so a vCPU never goes idle and halts,
        and it takes next to nothing from the measured processes."""
        def idle():  # in the child before exec: the policy is set before it spins
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=idle)
                for _ in range(os.cpu_count() or 1)]

    def run(self):
        spinners = self.start_spinners() if self.a.keep_awake else []
        try:
            return self.run_all()
        finally:
            for p in spinners:
                p.kill()
                p.wait()

    def run_all(self):
        results = {t: [] for t in TRANSPORTS}
        total = self.a.reps * len(TRANSPORTS)
        k = 0
        t_start = time.time()
        for rep in range(self.a.reps):
            for t in TRANSPORTS:
                k += 1
                server, port = (None, 0) if t == "inproc" else self.start_server(t)
                try:
                    for name, args in self.suites():
                        t0 = time.time()
                        log(f"[{k}/{total}] rep {rep + 1} {t:6s} {name} ...")
                        results[t] += [dict(r, rep=rep) for r in
                                       self.client(t, port, args, server.pid if server else None)]
                        log(f"[{k}/{total}] rep {rep + 1} {t:6s} {name} done in "
                            f"{time.time() - t0:.1f} s (total {time.time() - t_start:.0f} s)")
                    if t == "rdma":
                        log(f"[{k}/{total}] rep {rep + 1} {t:6s} connect, default TF_RDMA_TCP_FIRST ...")
                        results[t] += [dict(r, rep=rep) for r in
                                       self.default_connect(port, server.pid)]
                finally:
                    if server:
                        server.stdin.close()
                        server.wait(timeout=30)
        return results


def matching(rows, suite, key):
    return [r for r in rows if r["suite"] == suite and all(r.get(k) == v for k, v in key.items())]


def median_of(rows, suite, key, field):
    vals = [r[field] for r in matching(rows, suite, key)]
    return statistics.median(vals) if vals else None


def spread_of(results, suite, key, field, num="rdma", den="tcp", num_suite=None):
    """num's figure over den's, repetition by repetition (both measured in
    the same repetition, one after the other): median, min and max over the
    repetitions, and whether the spread crosses 1.0; None without pairs.
    num_suite: num's rows are of that suite (a variant of `suite`)."""
    a = {r.get("rep", 0): r[field] for r in matching(results[num], num_suite or suite, key)}
    b = {r.get("rep", 0): r[field] for r in matching(results[den], suite, key)}
    ratios = [a[k] / b[k] for k in sorted(a) if k in b and a[k] and b[k]]
    if not ratios:
        return None
    lo, hi = min(ratios), max(ratios)
    return {"median": statistics.median(ratios), "min": lo, "max": hi, "n": len(ratios),
            "crosses_1": lo < 1.0 < hi}


def human(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def copies_of(results, suite, key):
    """Host copies per stream byte in the RDMA client (medians), as
    grpc_bench reads them from the plugin's counters."""
    rows = [r for r in matching(results["rdma"], suite, key) if "copies_per_byte_sent" in r]
    if not rows:
        return {"rdma_copies_sent": None, "rdma_copies_received": None}
    return {"rdma_copies_sent": statistics.median(r["copies_per_byte_sent"] for r in rows),
            "rdma_copies_received": statistics.median(r["copies_per_byte_received"] for r in rows)}


def summarize(results, clients, latency_sizes=LATENCY_SIZES, stream_sizes=STREAM_SIZES):
    """Medians per transport, and for each RDMA/TCP (and RDMA/in-process)
    ratio its spread over the repetitions (keys ending in _ratio)."""
    rows = {"latency": [], "stream": [], "rate": [], "connect": [], "ps": []}
    for n in latency_sizes:
        m = {t: {f: median_of(results[t], "latency", {"size": n}, f) for f in ("p50_us", "p99_us")}
             for t in TRANSPORTS}
        rows["latency"].append({"size": n, **{f"{t}_{f}": m[t][f] for t in TRANSPORTS for f in m[t]},
                                "rdma_tcp_p50_ratio": spread_of(results, "latency", {"size": n}, "p50_us"),
                                "rdma_inproc_p50_ratio": spread_of(results, "latency", {"size": n}, "p50_us",
                                                                   den="inproc"),
                                "rdma_tcp_p99_ratio": spread_of(results, "latency", {"size": n}, "p99_us"),
                                **copies_of(results, "latency", {"size": n})})
    for suite, direction in STREAM_DIRECTIONS:
        for n in stream_sizes:
            rows["stream"].append({"size": n, "suite": suite, "direction": direction,
                                   **{f"{t}_mb_per_s": median_of(results[t], suite, {"size": n}, "mb_per_s")
                                      for t in TRANSPORTS},
                                   "rdma_tcp_ratio": spread_of(results, suite, {"size": n}, "mb_per_s"),
                                   **copies_of(results, suite, {"size": n})})
    rows["rate"].append({"clients": clients, **{f"{t}_calls_per_s": median_of(results[t], "rate", {}, "calls_per_s")
                                                 for t in TRANSPORTS},
                         "rdma_tcp_ratio": spread_of(results, "rate", {}, "calls_per_s")})
    if any(matching(results["tcp"], "connect", {})):
        rows["connect"].append({**{f"{t}_p50_us": median_of(results[t], "connect", {}, "p50_us")
                                   for t in TRANSPORTS},
                                "rdma_tcp_ratio": spread_of(results, "connect", {}, "p50_us")})
    if any(matching(results["rdma"], "connect_tcp_first", {})):
        rows["connect"].append({"variant": "tcp_first",
                                **{f"{t}_p50_us": median_of(results[t], "connect", {}, "p50_us")
                                   for t in TRANSPORTS},
                                "rdma_p50_us": median_of(results["rdma"], "connect_tcp_first", {},
                                                         "p50_us"),
                                "rdma_tcp_ratio": spread_of(results, "connect", {}, "p50_us",
                                                            num_suite="connect_tcp_first")})
    for model in ("resnet50", "vgg16"):
        v = {t: median_of(results[t], "ps", {"model": model}, "steps_per_s") for t in TRANSPORTS}
        if v["tcp"] is not None:
            rows["ps"].append({"model": model, **{f"{t}_steps_per_s": v[t] for t in TRANSPORTS},
                               "rdma_tcp_ratio": spread_of(results, "ps", {"model": model}, "steps_per_s")})
    rows["cpu"] = summarize_cpu(results, clients, stream_sizes)
    return rows


def cpu_of(rows, suite, key):
    """Median over repetitions of CPU per unit (client + server), and of
    the emulated device's part of it; None when not measured."""
    tot, dev = [], []
    for r in rows:
        if r["suite"] != suite or any(r.get(k) != v for k, v in key.items()) or "cpu_client_us" not in r:
            continue
        tot.append(r["cpu_client_us"] + r["cpu_server_us"])
        dev.append(r["cpu_client_device_us"] + r["cpu_server_device_us"])
    if not tot:
        return None, None
    return statistics.median(tot), statistics.median(dev)


def host_cpu_spread(results, suite, key):
    """RDMA's host CPU (without the emulated device's threads) over TCP's
    CPU, repetition by repetition, as spread_of gives it."""
    def per_rep(t):
        return {r.get("rep", 0): r["cpu_client_us"] + r["cpu_server_us"]
                - r["cpu_client_device_us"] - r["cpu_server_device_us"]
                for r in matching(results[t], suite, key) if "cpu_client_us" in r}
    return spread_of({"rdma": [dict(suite=suite, rep=k, v=v, **key) for k, v in per_rep("rdma").items()],
                      "tcp": [dict(suite=suite, rep=k, v=v, **key) for k, v in per_rep("tcp").items()]},
                     suite, key, "v")


def summarize_cpu(results, clients, stream_sizes):
    out = []
    for suite, key, what, scale in [("rate", {}, f"64 B unary call, {clients} clients: CPU us per call", 1.0)] + [
            (suite, {"size": n}, f"streaming {human(n)} messages, {direction}: CPU s per GB", 1e-6)
            for suite, direction in STREAM_DIRECTIONS for n in stream_sizes]:
        row = {"what": what}
        for t in TRANSPORTS:
            tot, dev = cpu_of(results[t], suite, key)
            row[f"{t}_cpu"] = tot * scale if tot is not None else None
            row[f"{t}_cpu_device"] = dev * scale if dev is not None else None
        row["rdma_host_tcp_ratio"] = host_cpu_spread(results, suite, key)
        out.append(row)
    # The parameter server's steps, where it ran (not with --no-ps): CPU
    # bound on a small machine, so host CPU per step is what an HCA's
    # steps per second would follow once the device's copies leave the CPUs.
    for model in ("resnet50", "vgg16"):
        key = {"model": model}
        if not any(matching(results[t], "ps", key) for t in TRANSPORTS):
            continue
        row = {"what": f"parameter server, {model}, 2 workers: CPU ms per step"}
        for t in TRANSPORTS:
            tot, dev = cpu_of(results[t], "ps", key)
            row[f"{t}_cpu"] = tot * 1e-3 if tot is not None else None
            row[f"{t}_cpu_device"] = dev * 1e-3 if dev is not None else None
        row["rdma_host_tcp_ratio"] = host_cpu_spread(results, "ps", key)
        out.append(row)
    return out


def ratio(sp):
    """A ratio cell: the median, then [min-max] over the repetitions when
    there are several, marked with * when that spread crosses 1.0."""
    if not sp:
        return "-"
    if sp["n"] < 2:
        return f"{sp['median']:.2f}"
    return f"{sp['median']:.2f} [{sp['min']:.2f}-{sp['max']:.2f}]" + (" *" if sp["crosses_1"] else "")


def num(v, fmt):
    return "-" if v is None else format(v, fmt)


def conditions(meta):
    mode = ("vCPUs kept awake by idle-priority spinners (--keep-awake)" if meta.get("keep_awake")
            else "idle vCPUs free to halt (default; --keep-awake keeps them busy)")
    la = meta.get("loadavg_before"), meta.get("loadavg_after")
    load = (f"; 1-minute load average {la[0]:.2f} before, {la[1]:.2f} after" if None not in la else "")
    malloc = ("glibc's malloc defaults in TCP and in-process, the plugin's tuning "
              "(TF_RDMA_MALLOC_TUNE) in RDMA: what a user who adds the plugin gets "
              "(--glibc-malloc-defaults)" if meta.get("glibc_malloc_defaults")
              else "malloc thresholds raised in every process as TF_RDMA_MALLOC_TUNE raises "
              "them in RDMA's, so ratios compare transports")
    return f"Conditions: {meta.get('cpus', '?')} CPUs, {mode}{load}; {malloc}."


def table(rows, reps, meta=None):
    out = [f"Medians of {reps} interleaved repetitions; ratios are RDMA over the other transport, "
           "taken within each repetition: median [min-max] over the repetitions, "
           "* where that spread crosses 1.0 (no verdict from this run).", conditions(meta or {}), ""]
    out += ["| unary payload | TCP p50 us | RDMA p50 us | in-proc p50 us | RDMA/TCP p50 | RDMA/in-proc p50 "
            "| TCP p99 us | RDMA p99 us | RDMA/TCP p99 |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows["latency"]:
        out.append(f"| {human(r['size'])} | {num(r['tcp_p50_us'], '.1f')} | {num(r['rdma_p50_us'], '.1f')} | "
                   f"{num(r['inproc_p50_us'], '.1f')} | {ratio(r['rdma_tcp_p50_ratio'])} | "
                   f"{ratio(r['rdma_inproc_p50_ratio'])} | {num(r['tcp_p99_us'], '.1f')} | {num(r['rdma_p99_us'], '.1f')} | "
                   f"{ratio(r['rdma_tcp_p99_ratio'])} |")
    out += ["", "| streaming message | direction | TCP MB/s | RDMA MB/s | in-proc MB/s | RDMA/TCP |",
            "|---:|---|---:|---:|---:|---:|"]
    for r in rows["stream"]:
        out.append(f"| {human(r['size'])} | {r['direction']} | {num(r['tcp_mb_per_s'], '.0f')} | "
                   f"{num(r['rdma_mb_per_s'], '.0f')} | "
                   f"{num(r['inproc_mb_per_s'], '.0f')} | {ratio(r['rdma_tcp_ratio'])} |")
    out += ["", "| workload | TCP | RDMA | in-proc | RDMA/TCP |", "|---|---:|---:|---:|---:|"]
    for r in rows["rate"]:
        out.append(f"| 64 B unary calls/s, {r['clients']} clients | {num(r['tcp_calls_per_s'], '.0f')} | "
                   f"{num(r['rdma_calls_per_s'], '.0f')} | {num(r['inproc_calls_per_s'], '.0f')} | "
                   f"{ratio(r['rdma_tcp_ratio'])} |")
    for r in rows.get("connect", []):
        what = ("first 64 B call on a new channel, default (`TF_RDMA_TCP_FIRST` on: the call "
                "rides TCP, RDMA joins beside it)" if r.get("variant") == "tcp_first"
                else "first 64 B call on a new channel, `TF_RDMA_TCP_FIRST=0` (waits for RDMA CM)")
        out.append(f"| {what}: p50 us | {num(r['tcp_p50_us'], '.0f')} | "
                   f"{num(r['rdma_p50_us'], '.0f')} | {num(r['inproc_p50_us'], '.0f')} | {ratio(r['rdma_tcp_ratio'])} |")
    for r in rows["ps"]:
        out.append(f"| parameter server, {r['model']}, 2 workers: steps/s | {num(r['tcp_steps_per_s'], '.3f')} | "
                   f"{num(r['rdma_steps_per_s'], '.3f')} | {num(r['inproc_steps_per_s'], '.3f')} | "
                   f"{ratio(r['rdma_tcp_ratio'])} |")
    copy_rows = [(f"unary {human(r['size'])}", r) for r in rows["latency"]] + \
                [(f"streaming {human(r['size'])} "
                  f"(client {'sends' if r['suite'] == 'stream' else 'receives'})", r) for r in rows["stream"]]
    if any(r.get("rdma_copies_sent") is not None for _, r in copy_rows):
        out += ["", "Host copies per stream byte in the RDMA client process (the plugin's counters: "
                "into registered buffers on send, out of them on receive; 0 = zero copy).", "",
                "| work | copies per byte sent | copies per byte received |", "|---|---:|---:|"]
        for what, r in copy_rows:
            out.append(f"| {what} | {num(r.get('rdma_copies_sent'), '.2f')} | "
                       f"{num(r.get('rdma_copies_received'), '.2f')} |")
    if rows.get("cpu"):
        def f(v):
            return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")
        out += ["", "CPU time of client and server together per unit of work (RDMA: the emulated "
                "device's work, which an HCA would take off the CPUs, also shown apart: its threads "
                "and what it does on the application's threads; RDMA host = RDMA without it).", "",
                "| work | TCP | RDMA | of it the emulated device | RDMA host | in-proc | RDMA host/TCP |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows["cpu"]:
            host = None if r["rdma_cpu"] is None else r["rdma_cpu"] - (r["rdma_cpu_device"] or 0)
            out.append(f"| {r['what']} | {f(r['tcp_cpu'])} | {f(r['rdma_cpu'])} | {f(r['rdma_cpu_device'])} | "
                       f"{f(host)} | {f(r['inproc_cpu'])} | {ratio(r.get('rdma_host_tcp_ratio'))} |")
    return "\n".join(out) + "\n"


def plots(rows, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("run_grpc_bench: no matplotlib: plots skipped (apt-get install python3-matplotlib)")
        return []
    made = []
    sizes = [r["size"] for r in rows["latency"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, label in (("tcp", "gRPC over TCP"), ("rdma", "gRPC over RDMA (softverbs)"), ("inproc", "gRPC in-process")):
        ax.plot(sizes, [r[f"{t}_p50_us"] for r in rows["latency"]], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("unary payload (bytes)")
    ax.set_ylabel("p50 round trip (us)")
    ax.set_title("gRPC unary latency, one host")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    p = os.path.join(out_dir, "latency.png")
    fig.savefig(p, dpi=110, bbox_inches="tight")
    made.append(p)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [f"{human(r['size'])}\n{'up' if r['suite'] == 'stream' else 'down'}" for r in rows["stream"]]
    w = 0.27
    for i, (t, label) in enumerate((("tcp", "TCP"), ("rdma", "RDMA (softverbs)"), ("inproc", "in-process"))):
        ax.bar([x + (i - 1) * w for x in range(len(labels))], [r[f"{t}_mb_per_s"] for r in rows["stream"]], w, label=label)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("streaming message size")
    ax.set_ylabel("MB/s")
    ax.set_title("gRPC streaming bandwidth, one host (up: client to server, down: server to client)")
    ax.legend()
    p = os.path.join(out_dir, "bandwidth.png")
    fig.savefig(p, dpi=110, bbox_inches="tight")
    made.append(p)
    return made


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build", help="the build directory (default: build)")
    ap.add_argument("--out", default=None, help="where results go (default: BUILD/bench-results)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every measure (default 3)")
    ap.add_argument("--seconds", type=float, default=0.5, help="time per measure (default 0.5)")
    ap.add_argument("--clients", type=int, default=4, help="clients of the rate measure (default 4)")
    ap.add_argument("--quick", action="store_true", help="leave out the VGG-16 workload")
    ap.add_argument("--no-ps", action="store_true", help="leave out the parameter-server workloads")
    ap.add_argument("--keep-awake", action="store_true",
                    help="run an idle-priority spinner per CPU so idle vCPUs do not halt")
    ap.add_argument("--glibc-malloc-defaults", action="store_true",
                    help="leave glibc's malloc at its defaults in the TCP and in-process runs "
                         "(the RDMA ones keep the plugin's TF_RDMA_MALLOC_TUNE); by default "
                         "every run gets the plugin's thresholds")

    def sizes(text):
        try:
            v = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of byte counts")
        if not v or min(v) < 1:
            raise argparse.ArgumentTypeError(f"'{text}': sizes must be at least 1 byte")
        return v
    ap.add_argument("--latency-sizes", type=sizes, default=LATENCY_SIZES,
                    help="unary payloads in bytes (default: %(default)s)")
    ap.add_argument("--stream-sizes", type=sizes, default=STREAM_SIZES,
                    help="streaming message sizes in bytes (default: %(default)s)")
    a = ap.parse_args()
    if a.reps < 1 or a.seconds <= 0:
        ap.error("--reps must be at least 1 and --seconds above 0")
    out_dir = a.out or os.path.join(a.build, "bench-results")
    os.makedirs(out_dir, exist_ok=True)
    r = Runner(a)
    meta = {"cpus": os.cpu_count(), "keep_awake": a.keep_awake,
            "glibc_malloc_defaults": a.glibc_malloc_defaults, "loadavg_before": os.getloadavg()[0]}
    results = r.run()
    meta["loadavg_after"] = os.getloadavg()[0]
    rows = summarize(results, a.clients, a.latency_sizes, a.stream_sizes)
    md = table(rows, a.reps, meta)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"raw": results, "summary": rows, "rdma_proof": getattr(r, "rdma_proof", None),
                   "when": time.strftime("%Y-%m-%d %H:%M:%S"), "reps": a.reps, "seconds": a.seconds,
                   "conditions": meta},
                  f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md)
    made = plots(rows, out_dir)
    print(md)
    print(f"results: {out_dir}/results.json, results.md" + "".join(f", {os.path.basename(p)}" for p in made))


if __name__ == "__main__":
    main()
