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
server spend per call or per GB (the emulated RDMA device's threads apart).
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
            if k.startswith("TF_RDMA_") or k == "LD_PRELOAD":
                del self.env[k]

    def prefix(self, transport, role):
        if transport != "rdma":
            return [], dict(self.env)
        env = dict(self.env, TF_RDMA_STATS=os.path.join(self.tmp, f"{role}.stats"))
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

    def suites(self):
        s = [("latency", ["latency", "--sizes", ",".join(map(str, self.a.latency_sizes))]),
             ("stream", ["stream", "--sizes", ",".join(map(str, self.a.stream_sizes))]),
             ("rate", ["rate", "--clients", str(self.a.clients)])]
        if not self.a.no_ps:
            s.append(("ps resnet50", ["ps", "--model", "resnet50", "--workers", "2", "--steps", "3"]))
            if not self.a.quick:
                s.append(("ps vgg16", ["ps", "--model", "vgg16", "--workers", "2", "--steps", "2"]))
        return s

    def run(self):
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
                finally:
                    if server:
                        server.stdin.close()
                        server.wait(timeout=30)
        return results


def median_of(rows, suite, key, field):
    vals = [r[field] for r in rows if r["suite"] == suite and all(r.get(k) == v for k, v in key.items())]
    return statistics.median(vals) if vals else None


def human(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def summarize(results, clients, latency_sizes=LATENCY_SIZES, stream_sizes=STREAM_SIZES):
    rows = {"latency": [], "stream": [], "rate": [], "ps": []}
    for n in latency_sizes:
        m = {t: {f: median_of(results[t], "latency", {"size": n}, f) for f in ("p50_us", "p99_us")}
             for t in TRANSPORTS}
        rows["latency"].append({"size": n, **{f"{t}_{f}": m[t][f] for t in TRANSPORTS for f in m[t]}})
    for n in stream_sizes:
        rows["stream"].append({"size": n, **{f"{t}_mb_per_s": median_of(results[t], "stream", {"size": n}, "mb_per_s")
                                               for t in TRANSPORTS}})
    rows["rate"].append({"clients": clients, **{f"{t}_calls_per_s": median_of(results[t], "rate", {}, "calls_per_s")
                                                 for t in TRANSPORTS}})
    for model in ("resnet50", "vgg16"):
        v = {t: median_of(results[t], "ps", {"model": model}, "steps_per_s") for t in TRANSPORTS}
        if v["tcp"] is not None:
            rows["ps"].append({"model": model, **{f"{t}_steps_per_s": v[t] for t in TRANSPORTS}})
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


def summarize_cpu(results, clients, stream_sizes):
    out = []
    for suite, key, what, scale in [("rate", {}, f"64 B unary call, {clients} clients: CPU us per call", 1.0)] + [
            ("stream", {"size": n}, f"streaming {human(n)} messages: CPU s per GB", 1e-6) for n in stream_sizes]:
        row = {"what": what}
        for t in TRANSPORTS:
            tot, dev = cpu_of(results[t], suite, key)
            row[f"{t}_cpu"] = tot * scale if tot is not None else None
            row[f"{t}_cpu_device"] = dev * scale if dev is not None else None
        out.append(row)
    return out


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def table(rows, reps):
    out = [f"Medians of {reps} interleaved repetitions; ratios are RDMA over the other transport.", ""]
    out += ["| unary payload | TCP p50 us | RDMA p50 us | in-proc p50 us | RDMA/TCP p50 | RDMA/in-proc p50 | TCP p99 us | RDMA p99 us |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows["latency"]:
        out.append(f"| {human(r['size'])} | {r['tcp_p50_us']:.1f} | {r['rdma_p50_us']:.1f} | "
                   f"{r['inproc_p50_us']:.1f} | {ratio(r['rdma_p50_us'], r['tcp_p50_us'])} | "
                   f"{ratio(r['rdma_p50_us'], r['inproc_p50_us'])} | {r['tcp_p99_us']:.1f} | {r['rdma_p99_us']:.1f} |")
    out += ["", "| streaming message | TCP MB/s | RDMA MB/s | in-proc MB/s | RDMA/TCP |", "|---:|---:|---:|---:|---:|"]
    for r in rows["stream"]:
        out.append(f"| {human(r['size'])} | {r['tcp_mb_per_s']:.0f} | {r['rdma_mb_per_s']:.0f} | "
                   f"{r['inproc_mb_per_s']:.0f} | {ratio(r['rdma_mb_per_s'], r['tcp_mb_per_s'])} |")
    out += ["", "| workload | TCP | RDMA | in-proc | RDMA/TCP |", "|---|---:|---:|---:|---:|"]
    for r in rows["rate"]:
        out.append(f"| 64 B unary calls/s, {r['clients']} clients | {r['tcp_calls_per_s']:.0f} | "
                   f"{r['rdma_calls_per_s']:.0f} | {r['inproc_calls_per_s']:.0f} | "
                   f"{ratio(r['rdma_calls_per_s'], r['tcp_calls_per_s'])} |")
    for r in rows["ps"]:
        out.append(f"| parameter server, {r['model']}, 2 workers: steps/s | {r['tcp_steps_per_s']:.3f} | "
                   f"{r['rdma_steps_per_s']:.3f} | {r['inproc_steps_per_s']:.3f} | "
                   f"{ratio(r['rdma_steps_per_s'], r['tcp_steps_per_s'])} |")
    if rows.get("cpu"):
        def f(v):
            return "-" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")
        out += ["", "CPU time of client and server together per unit of work (RDMA: the emulated "
                "device's threads, which an HCA would take off the CPUs, also shown apart; "
                "RDMA host = RDMA without them).", "",
                "| work | TCP | RDMA | of it the emulated device | RDMA host | in-proc | RDMA host/TCP |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows["cpu"]:
            host = None if r["rdma_cpu"] is None else r["rdma_cpu"] - (r["rdma_cpu_device"] or 0)
            out.append(f"| {r['what']} | {f(r['tcp_cpu'])} | {f(r['rdma_cpu'])} | {f(r['rdma_cpu_device'])} | "
                       f"{f(host)} | {f(r['inproc_cpu'])} | {ratio(host, r['tcp_cpu'])} |")
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
    labels = [human(r["size"]) for r in rows["stream"]]
    w = 0.27
    for i, (t, label) in enumerate((("tcp", "TCP"), ("rdma", "RDMA (softverbs)"), ("inproc", "in-process"))):
        ax.bar([x + (i - 1) * w for x in range(len(labels))], [r[f"{t}_mb_per_s"] for r in rows["stream"]], w, label=label)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_xlabel("streaming message size")
    ax.set_ylabel("MB/s")
    ax.set_title("gRPC client-streaming bandwidth, one host")
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
    results = r.run()
    rows = summarize(results, a.clients, a.latency_sizes, a.stream_sizes)
    md = table(rows, a.reps)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"raw": results, "summary": rows, "rdma_proof": getattr(r, "rdma_proof", None),
                   "when": time.strftime("%Y-%m-%d %H:%M:%S"), "reps": a.reps, "seconds": a.seconds},
                  f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md)
    made = plots(rows, out_dir)
    print(md)
    print(f"results: {out_dir}/results.json, results.md" + "".join(f", {os.path.basename(p)}" for p in made))


if __name__ == "__main__":
    main()
