#!/usr/bin/env python3
"""vrdma against what a user would pick instead, side by side in one run (issue 5).

Same host: Debian's unmodified perftest through vrdma (two guests of one backend, through the
backend and on the direct path of same-uid guests, --direct-path) against UCX's
ucx_perftest over shared memory (posix, and sysv+cma) and against the machine's limits (a
two-process shared-memory ping-pong, single-thread memcpy). Every point is the median of
--repeat runs, with min and max; the systems run interleaved, so load changes hit all of them.

Writes bench/results/compare-DATE.{json,md} and, when matplotlib is there, compare-DATE.png
(latency and bandwidth vs size, one line per system). Prints the Markdown.

Usage: bench/compare.py [--bin build/release/bin] [--repeat 3] [--quick] [--out bench/results]
(bench/compare.sh installs the packages and builds first.)
"""

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [8, 64, 512, 4096, 65536, 1 << 20, 4 << 20]


def log(msg):
    print(f"[compare {time.strftime('%T')}] {msg}", file=sys.stderr, flush=True)


def listening(port):
    out = subprocess.run(["ss", "-Htln", f"sport = :{port}"], capture_output=True, text=True)
    return bool(out.stdout.strip())


def free_port():
    # Below Linux's ephemeral range (32768-60999), where clients' own ports would collide.
    while True:
        p = random.randint(20000, 32000)
        if not listening(p):
            return p


class Runner:
    """Runs server/client pairs: perftest through vrdma, ucx_perftest, and the baselines."""

    def __init__(self, bin_dir, tmp):
        self.bin = bin_dir
        self.tmp = tmp
        self.env = dict(os.environ, VRDMA_SOCKET=os.path.join(tmp, "vrdmad.sock"))
        self.env.pop("VRDMA_GUEST", None)
        self.backend = None

    def start_backend(self, spin_us=None, direct=False):
        self.stop_backend()
        cmd = [os.path.join(self.bin, "vrdmad"), "--socket", self.env["VRDMA_SOCKET"],
               "--idle-exit", "0"]
        if spin_us is not None:
            cmd += ["--spin-us", str(spin_us)]
        # Named either way: the direct path is the default (issue 25), and the mediated rows
        # must stay mediated.
        cmd += ["--direct-path" if direct else "--no-direct-path"]
        self.backend = subprocess.Popen(cmd, env=self.env, stderr=open(
            os.path.join(self.tmp, "vrdmad.log"), "a"))
        for _ in range(100):
            if os.path.exists(self.env["VRDMA_SOCKET"]):
                return
            time.sleep(0.05)
        raise RuntimeError("vrdmad did not start")

    def stop_backend(self):
        if self.backend:
            self.backend.send_signal(signal.SIGTERM)
            self.backend.wait(10)
            self.backend = None

    def pair(self, server, client, env=None, timeout=120):
        """Starts `server` (a list with PORT in it), waits for it to listen, runs `client`;
        returns the client's stdout. Raises on failure; a port taken meanwhile gets another."""
        for attempt in range(3):
            try:
                return self.pair_on(free_port(), server, client, env, timeout)
            except RuntimeError as e:
                if "Address already in use" not in str(e) or attempt == 2:
                    raise
                log(f"port taken, retrying: {str(e)[-120:]}")

    def pair_on(self, port, server, client, env, timeout):
        sub = lambda cmd: [str(port) if a == "PORT" else a for a in cmd]
        env = env or self.env
        srv = subprocess.Popen(sub(server), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        try:
            for _ in range(400):
                if listening(port):
                    break
                if srv.poll() is not None:
                    raise RuntimeError(f"server exited: {srv.stdout.read()}")
                time.sleep(0.05)
            cli = subprocess.run(sub(client), env=env, capture_output=True, text=True,
                                 timeout=timeout)
            if cli.returncode != 0:
                raise RuntimeError(f"{' '.join(client)}: exit {cli.returncode}: "
                                   f"{cli.stdout[-500:]}{cli.stderr[-500:]}")
            srv.wait(30)
            return cli.stdout
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()

    def perftest(self, tool, size, iters):
        """One perftest run through vrdma; returns its result row as floats."""
        vrdma = os.path.join(self.bin, "vrdma")
        args = [tool, "-p", "PORT", "-s", str(size), "-n", str(iters)]
        out = self.pair([vrdma, "run", "--guest", "pt-srv", "--"] + args,
                        [vrdma, "run", "--guest", "pt-cli", "--"] + args + ["localhost"])
        rows, started = [], False
        for line in out.splitlines():
            f = line.split()
            if f and f[0] == "#bytes":
                started = True
            elif started and len(f) >= 4 and f[0].isdigit():
                rows.append([float(x) for x in f])
        if not rows:
            raise RuntimeError(f"{tool}: no result row in: {out[-500:]}")
        return rows[-1]

    def ucx(self, tls, test, size, iters):
        """One ucx_perftest run; returns the 'Final:' row (iters, lat50, lat avg, lat overall,
        bw avg, bw overall, rate avg, rate overall). Latency: the median (as perftest's
        t_typical); bandwidth and rate: overall (the whole run, as perftest's BW average)."""
        env = dict(os.environ, UCX_TLS=tls)
        base = ["ucx_perftest", "-p", "PORT"]
        out = self.pair(base, base + ["-t", test, "-s", str(size), "-n", str(iters), "localhost"],
                        env=env)
        for line in out.splitlines():
            if line.startswith("Final:"):
                return [float(x) for x in line.split()[1:]]
        raise RuntimeError(f"ucx_perftest {test}: no Final line in: {out[-500:]}")

    def shm_pingpong(self, size, iters):
        out = subprocess.run([os.path.join(self.bin, "shm_pingpong"), "-s", str(size), "-n",
                              str(iters)], capture_output=True, text=True, timeout=120).stdout
        return float(re.search(r"([0-9.]+) usec one-way", out).group(1))

    def memcpy(self, size):
        out = subprocess.run([os.path.join(self.bin, "memcpy_bw"), str(size)],
                             capture_output=True, text=True, timeout=120).stdout
        return float(out.split()[1]) * 1000  # GB/s -> MB/s


def lat_iters(size, quick):
    n = 2000 if size <= 65536 else 200
    return max(n // 10, 50) if quick else n


def bw_iters(size, quick):
    # Enough messages that a rate is not mostly start-up (the first post of a direct QP asks
    # for its grant, the first messages may wait for the peer's first receives): a million
    # small ones take ~0.2 s at UCX's rate; with 100000 the direct 8 B rate spread 1.6-3.6 Mpps.
    n = (1000000 if size <= 512 else 100000 if size <= 4096 else 20000 if size <= 65536
         else 2000 if size <= 1 << 20 else 500)
    return max(n // 10, 50) if quick else n


def same_host(r, sizes, repeat, quick):
    """Returns {metric: {system: {size: [values]}}}."""
    lat, bw, rate = {}, {}, {}

    def add(table, system, size, value):
        table.setdefault(system, {}).setdefault(size, []).append(value)

    for rep in range(repeat):
        log(f"same host: round {rep + 1}/{repeat}")
        # vrdma twice: through the backend (any two guests), and on the direct path (guests of
        # one uid; --direct-path), each with its own backend.
        for v, direct in [("vrdma", False), ("vrdma direct", True)]:
            r.start_backend(direct=direct)
            for s in sizes:
                li, bi = lat_iters(s, quick), bw_iters(s, quick)
                # Latency: one-way µs (perftest's t_typical).
                add(lat, f"{v} ib_send_lat", s, r.perftest("ib_send_lat", s, li)[4])
                add(lat, f"{v} ib_write_lat", s, r.perftest("ib_write_lat", s, li)[4])
                # Bandwidth MB/s, and message rate (Mpps) from the same runs.
                w = r.perftest("ib_write_bw", s, bi)
                add(bw, f"{v} ib_write_bw", s, w[3])
                sd = r.perftest("ib_send_bw", s, bi)
                add(bw, f"{v} ib_send_bw", s, sd[3])
                if s == 8:
                    add(rate, f"{v} ib_send_bw", s, sd[4])
                    add(rate, f"{v} ib_write_bw", s, w[4])
            r.stop_backend()
        for s in sizes:
            li, bi = lat_iters(s, quick), bw_iters(s, quick)
            # UCX's median one-way latency; half the round trip of the shm ping-pong.
            add(lat, "UCX posix tag_lat", s, r.ucx("posix,self", "tag_lat", s, li)[1])
            add(lat, "UCX sysv+cma tag_lat", s, r.ucx("sysv,cma,self", "tag_lat", s, li)[1])
            add(lat, "shm ping-pong (limit)", s, r.shm_pingpong(s, li * 10))
            u = r.ucx("posix,self", "ucp_put_bw", s, bi)
            add(bw, "UCX posix ucp_put_bw", s, u[5])
            u2 = r.ucx("sysv,cma,self", "ucp_put_bw", s, bi)
            add(bw, "UCX sysv+cma ucp_put_bw", s, u2[5])
            add(bw, "memcpy 1 thread (limit)", s, r.memcpy(s))
            if s == 8:
                t = r.ucx("posix,self", "tag_bw", s, bi)
                add(rate, "UCX posix tag_bw", s, t[7] / 1e6)
                t2 = r.ucx("sysv,cma,self", "tag_bw", s, bi)
                add(rate, "UCX sysv+cma tag_bw", s, t2[7] / 1e6)
    return {"latency_us": lat, "bandwidth_MBps": bw, "msg_rate_Mpps": rate}


def spin_policy(r, repeat, quick):
    """8-byte ib_send_lat and ib_write_lat under the backend's polling policies: sleep at once
    (doorbell every message), spin-then-sleep (the default 200 µs), and busy-poll for ever."""
    res = {}
    for name, spin in [("sleep at once (--spin-us 0)", 0), ("adaptive (--spin-us 200, default)", 200),
                       ("busy-poll (--spin-us 10000000)", 10_000_000)]:
        r.start_backend(spin)
        for _ in range(repeat):
            for tool in ["ib_send_lat", "ib_write_lat"]:
                v = r.perftest(tool, 8, lat_iters(8, quick))[4]
                res.setdefault(tool, {}).setdefault(name, []).append(v)
        r.stop_backend()
    return res


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": len(values)}


def fmt(v):
    return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})"


def markdown(meta, data, spin):
    out = [f"Run {meta['date']} on {meta['machine']}; command `{meta['command']}`; "
           f"median (min–max) of {meta['repeat']} runs per point.", ""]
    titles = {"latency_us": "One-way latency, µs (lower is better)",
              "bandwidth_MBps": "Bandwidth, MB/s (higher is better)",
              "msg_rate_Mpps": "Message rate at 8 B, million messages/s (higher is better)"}
    for metric, systems in data.items():
        if not systems:
            continue
        names = list(systems)
        sizes = sorted({s for v in systems.values() for s in v})
        out += [f"#### {titles[metric]}", "", "| size | " + " | ".join(names) + " |",
                "|---|" + "---|" * len(names)]
        for s in sizes:
            cells = [fmt(summary(systems[n][s])) if s in systems[n] else "–" for n in names]
            out.append(f"| {s} | " + " | ".join(cells) + " |")
        out.append("")
    if spin:
        out += ["#### Backend polling policy, 8 B one-way latency, µs", "",
                "| policy | ib_send_lat | ib_write_lat |", "|---|---|---|"]
        for policy in spin["ib_send_lat"]:
            out.append(f"| {policy} | {fmt(summary(spin['ib_send_lat'][policy]))} | "
                       f"{fmt(summary(spin['ib_write_lat'][policy]))} |")
        out.append("")
    out += ["#### Targets (issue 5), ratios of medians from this run", ""]
    out += targets(data)
    return "\n".join(out)


def ratio(data, metric, a, b, size):
    try:
        va = statistics.median(data[metric][a][size])
        vb = statistics.median(data[metric][b][size])
        return va / vb
    except (KeyError, ZeroDivisionError):
        return None


def targets(data):
    rows = []

    def line(what, r, goal, ok):
        if r is None:
            rows.append(f"- {what}: not measured")
        else:
            rows.append(f"- {what}: **{r:.2f}** (target {goal}) — {'met' if ok(r) else 'not met'}")

    for v in ["vrdma direct", "vrdma"]:
        r = ratio(data, "latency_us", f"{v} ib_send_lat", "UCX posix tag_lat", 8)
        line(f"8 B latency, {v} ib_send_lat / UCX posix", r, "≤ 2", lambda x: x <= 2)
        r = ratio(data, "bandwidth_MBps", f"{v} ib_write_bw", "memcpy 1 thread (limit)", 1 << 20)
        line(f"1 MiB WRITE bandwidth, {v} / single-thread memcpy", r, "≥ 0.8", lambda x: x >= 0.8)
        r = ratio(data, "msg_rate_Mpps", f"{v} ib_send_bw", "UCX posix tag_bw", 8)
        line(f"8 B message rate, {v} ib_send_bw / UCX posix", r, "≥ 0.5", lambda x: x >= 0.5)
    return rows


def plot(data, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing (apt-get install python3-matplotlib): no plot")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, metric, label in [(axes[0], "latency_us", "one-way latency (µs)"),
                              (axes[1], "bandwidth_MBps", "bandwidth (MB/s)")]:
        for system, by_size in data[metric].items():
            sizes = sorted(by_size)
            med = [statistics.median(by_size[s]) for s in sizes]
            lo = [med[i] - min(by_size[s]) for i, s in enumerate(sizes)]
            hi = [max(by_size[s]) - med[i] for i, s in enumerate(sizes)]
            ax.errorbar(sizes, med, yerr=[lo, hi], marker="o", capsize=3, label=system)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("vrdma vs UCX shared memory vs the machine's limits, same host")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build/release/bin"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer iterations and sizes")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
    ap.add_argument("--no-spin-policy", action="store_true")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON")
    a = ap.parse_args()
    if a.plot:
        with open(a.plot) as f:
            data = json.load(f)["same_host"]
        # JSON turned the sizes into strings.
        data = {m: {sys_: {int(k): v for k, v in by.items()} for sys_, by in systems.items()}
                for m, systems in data.items()}
        out = os.path.splitext(a.plot)[0] + ".png"
        sys.exit(0 if plot(data, out) else 1)
    for tool in ["ib_send_lat", "ucx_perftest", "ss"]:
        if not shutil.which(tool):
            sys.exit(f"compare: {tool} not found (run bench/compare.sh, which installs it)")
    sizes = [8, 4096, 1 << 20] if a.quick else SIZES
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.machine())
    meta = {"date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}",
            "cpus": os.cpu_count(), "repeat": a.repeat,
            "command": "bench/compare.py " + " ".join(sys.argv[1:])}
    log(f"{meta['cpus']} CPUs available: the backend polls, and each busy-polling guest wants a "
        f"CPU too; with fewer than 3, they share")
    tmp = tempfile.mkdtemp(prefix="vrdma-compare.")
    r = Runner(os.path.abspath(a.bin), tmp)
    try:
        data = same_host(r, sizes, a.repeat, a.quick)
        spin = None if a.no_spin_policy else spin_policy(r, a.repeat, a.quick)
    finally:
        r.stop_backend()
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"compare-{meta['date']}")
    md = markdown(meta, data, spin)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "same_host": data, "spin_policy": spin}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(md + "\n")
    if plot(data, stem + ".png"):
        md += f"\n![plot]({os.path.relpath(stem + '.png', ROOT)})\n"
    print(md)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
