#!/usr/bin/env python3
"""The CPU time of each test: runs a build's ctest tests two at a time (as the test presets do),
each in a cgroup v1 cpuacct group of its own, so that its daemons and every process it starts
are counted; prints them, most CPU first, and the sum (see BENCHMARKS.md, CI time).

Usage: scripts/test_cpu.py BUILD_DIR [-j N] [--json OUT] [ctest selection args, e.g. -L e2e]
Needs root (cgroup v1 cpuacct). Tests labelled hosts run under /tmp/vrdma-hosts.lock, as the
cross-host tests must when several checkouts share a machine.
"""
import argparse
import json
import os
import subprocess
import sys
import time

CG_ROOT = "/sys/fs/cgroup/cpuacct"


def tests_of(build, select):
    out = subprocess.run(["ctest", "--test-dir", build, "--show-only=json-v1", *select],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["tests"]


def props(test):
    return {p["name"]: p["value"] for p in test.get("properties", [])}


def start(test, group, log):
    p = props(test)
    env = dict(os.environ)
    for kv in p.get("ENVIRONMENT", []):
        k, _, v = kv.partition("=")
        env[k] = v
    cmd = test["command"]
    if "hosts" in p.get("LABELS", []):
        cmd = ["flock", "/tmp/vrdma-hosts.lock", *cmd]  # the wait for it is not the test's
    os.makedirs(group, exist_ok=True)

    def enter():
        with open(os.path.join(group, "tasks"), "w") as f:
            f.write(str(os.getpid()))

    return subprocess.Popen(cmd, cwd=p.get("WORKING_DIRECTORY"), env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=enter,
                            start_new_session=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("-j", type=int, default=2)
    ap.add_argument("--json")
    args, select = ap.parse_known_args()
    tests = tests_of(args.build, select)
    root = os.path.join(CG_ROOT, f"test_cpu.{os.getpid()}")
    os.makedirs(root)
    logdir = os.path.join(args.build, "Testing", "test_cpu")
    os.makedirs(logdir, exist_ok=True)
    pending = sorted(tests, key=lambda t: -float(props(t).get("COST", 0)))
    running, results = {}, []
    while pending or running:
        while pending and len(running) < args.j:
            t = pending.pop(0)
            group = os.path.join(root, str(len(results) + len(running)))
            log = open(os.path.join(logdir, t["name"].replace("/", "_") + ".log"), "w")
            proc = start(t, group, log)
            timeout = float(props(t).get("TIMEOUT", 1500))
            if "hosts" in props(t).get("LABELS", []):
                timeout += 900  # the lock's wait: the test's own deadline starts after it
            running[proc.pid] = (t, proc, group, time.monotonic(), timeout, log)
        time.sleep(0.05)
        for pid, (t, proc, group, t0, timeout, log) in list(running.items()):
            rc = proc.poll()
            if rc is None and time.monotonic() - t0 > timeout:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
            if rc is None:
                continue
            wall = time.monotonic() - t0
            time.sleep(0.2)  # what the test's children still do on their way out
            with open(os.path.join(group, "cpuacct.usage")) as f:
                cpu = int(f.read()) / 1e9
            skip = props(t).get("SKIP_RETURN_CODE")
            status = "passed" if rc == 0 else "skipped" if rc == skip else f"FAILED({rc})"
            results.append({"name": t["name"], "cpu": cpu, "wall": wall, "status": status,
                            "labels": props(t).get("LABELS", [])})
            print(f"{cpu:8.2f} {wall:8.2f} {status:10} {t['name']}", flush=True)
            log.close()
            del running[pid]
            try:
                os.rmdir(group)
            except OSError:
                pass  # something of the test's is still alive in it
    try:
        os.rmdir(root)
    except OSError:
        pass
    results.sort(key=lambda r: -r["cpu"])
    print("== by CPU")
    for r in results:
        print(f"{r['cpu']:8.2f} {r['wall']:8.2f} {r['status']:10} {r['name']}")
    print(f"sum: {sum(r['cpu'] for r in results):.1f} CPU-s, {sum(r['wall'] for r in results):.1f} "
          f"test-s, {len(results)} tests, "
          f"{sum(1 for r in results if r['status'].startswith('FAILED'))} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
