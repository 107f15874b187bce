#!/usr/bin/env python3
"""Standby replicas (docs/replication.md): what replication costs a decode step, what it ships,
and how long a worker stalls when its primary dies.

1. Steady state: BATCH sequences of CONTEXT tokens decoding together on one replica, timed per
   step (a Step stream, every layer) with no replication, with an async standby and with a sync
   one (the standby a second attnd on the same host), in the same run; the ratios to "none" are
   the result. Bytes shipped per step (attnd_replication_bytes_total / commits) against the
   keys the step committed (tokens x cached bytes per token).
2. Failover: three replicas, one sequence decoding; its primary is killed (SIGKILL: the
   connection is refused at once) or paused (SIGSTOP: only the call's deadline finds it). The
   stall runs from the start of the call that fails to the reply of the same step committed on
   the promoted standby: detection, PromoteSequence, the step again.

    python3 bench/failover_bench.py --model=demo --context=1024 --batch=8 --steps=150 --rounds=3 \
        --trials=5
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python" / "tests"))
from attnd import AttndClient, AttndError, LayerInputs, Router, name_replicas  # noqa: E402

from attnd_process import free_port, start  # noqa: E402

BF16 = ml_dtypes.bfloat16


def layers(spec, T, rng, write_only=False):
    out = []
    for kind in spec.layers:
        x = {"kv_latent": rng.standard_normal((T, spec.kv_lora_rank)).astype(BF16),
             "k_rope": rng.standard_normal((T, spec.qk_rope_head_dim)).astype(BF16)}
        if not write_only:
            x["q_latent"] = rng.standard_normal((T, spec.num_heads, spec.kv_lora_rank)
                                                ).astype(BF16)
            x["q_rope"] = rng.standard_normal((T, spec.num_heads, spec.qk_rope_head_dim)
                                              ).astype(BF16)
        if kind == "full":
            x["index_k"] = rng.standard_normal((T, spec.index_head_dim)).astype(BF16)
            if not write_only:
                x["index_q"] = rng.standard_normal((T, spec.index_n_heads, spec.index_head_dim)
                                                   ).astype(BF16)
                x["index_w"] = rng.standard_normal((T, spec.index_n_heads)).astype(BF16)
        out.append(x)
    return out


def metric(mport, name) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def cluster(n, extra, common, log_dir, tag):
    ports = [free_port() for _ in range(n)]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    flags = common + ([f"--standby-peers={peers}"] if extra is not None else []) + (extra or [])
    out = []
    for p in ports:
        out.append(start(flags, port=p, kv_pages=None, threads=1,
                         log=log_dir / f"failover-bench-{tag}-{p}.log"))
    if extra is not None:
        for _, target, _ in out:
            with AttndClient(target, timeout=30) as c:
                deadline = time.monotonic() + 30
                while len(c.info().replication.peers) < n - 1:
                    assert time.monotonic() < deadline, f"{target} never resolved its peers"
                    time.sleep(0.02)
    return out


def stop(procs):
    for p, _, _ in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)


def steady_state(a, common, log_dir, rng):
    """Per-step times with no standby, an async one and a sync one."""
    results = {}
    cores = os.sched_getaffinity(0)
    for mode in ("none", "async", "sync"):
        extra = None if mode == "none" else [f"--replication={mode}",
                                             "--replication-max-lag-steps=4"]
        procs = cluster(1 if mode == "none" else 2, extra, common, log_dir, mode)
        # The primary alone on core 0; the standby and this client on the others.
        if a.pin and len(cores) >= 2:
            others = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c != 0)
            subprocess.run(["taskset", "-a", "-p", "-c", "0", str(procs[0][0].pid)],
                           check=True, capture_output=True)
            for p, _, _ in procs[1:]:
                subprocess.run(["taskset", "-a", "-p", "-c", others, str(p.pid)], check=True,
                               capture_output=True)
            os.sched_setaffinity(0, {int(c) for c in others.split(",")})
        try:
            target, mport = procs[0][1], procs[0][2]
            with AttndClient(target, timeout=600) as c:
                spec = c.info().model
                ids = [f"{mode}-{i}" for i in range(a.batch)]
                prompt = layers(spec, a.context, rng, write_only=True)
                for sid in ids:  # the context, imported (no compute), then copied
                    c.open_sequence(sid)
                    step = c.begin_step([(sid, a.context)], write_only=True)
                    for i, x in enumerate(prompt):
                        c.attend_layer(step.step_id, LayerInputs(i, **x))
                if mode != "none":
                    deadline = time.monotonic() + 120
                    while metric(mport, "attnd_replication_lag_steps") > 0:
                        assert time.monotonic() < deadline
                        time.sleep(0.05)
                x = layers(spec, a.batch, rng)
                batch = [(sid, 1) for sid in ids]
                times = []
                with c.stream() as s:
                    for k in range(a.warmup + a.steps):
                        if k == a.warmup:
                            bytes0 = metric(mport, "attnd_replication_bytes_total")
                            cpu0 = metric(mport, "process_cpu_seconds_total")
                        t0 = time.perf_counter()
                        s.begin(batch)
                        for i, xi in enumerate(x):
                            s.layer(LayerInputs(i, **xi))
                        if k >= a.warmup:
                            times.append(time.perf_counter() - t0)
                cpu = metric(mport, "process_cpu_seconds_total") - cpu0
                if mode != "none":
                    deadline = time.monotonic() + 60
                    while metric(mport, "attnd_replication_lag_steps") > 0:
                        assert time.monotonic() < deadline
                        time.sleep(0.05)
                shipped = metric(mport, "attnd_replication_bytes_total") - (
                    bytes0 if mode != "none" else 0)
            results[mode] = {"median": statistics.median(times),
                             "p90": sorted(times)[int(0.9 * len(times))],
                             "shipped_per_step": shipped / a.steps, "spec": spec,
                             "cpu_per_step": cpu / a.steps}
        finally:
            stop(procs)
            os.sched_setaffinity(0, cores)
    return results


def stall_trial(a, common, log_dir, rng, mode, how, trial):
    procs = cluster(3, [f"--replication={mode}", "--replication-ack-timeout-ms=500"], common,
                    log_dir, f"{mode}-{how}-{trial}")
    try:
        addresses = [t for _, t, _ in procs]
        names = name_replicas(addresses)
        router = Router(names, timeout=a.deadline_s)
        spec = router.client_for("x").info().model
        sid = f"stall-{mode}-{how}-{trial}"
        with AttndClient(names[router.pick(sid)], timeout=120) as c:  # the prompt: no deadline
            info = c.open_sequence(sid)
            generation = info.generation
            prompt = layers(spec, a.stall_context, rng)
            step = c.begin_step([(sid, a.stall_context)], generations=[generation])
            for i, x in enumerate(prompt):
                c.attend_layer(step.step_id, LayerInputs(i, **x))
        length = a.stall_context
        x = layers(spec, 1, rng)

        def one_step(client):
            st = client.begin_step([(sid, 1)], generations=[generation])
            for i, xi in enumerate(x):
                client.attend_layer(st.step_id, LayerInputs(i, **xi))

        for _ in range(3):
            one_step(router.client_for(sid))
            length += 1
        victim = router.pick(sid)
        proc = procs[addresses.index(names[victim])][0]
        proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "kill":
            proc.wait(timeout=10)
        t0 = time.perf_counter()
        try:
            one_step(router.client_for(sid))
            raise AssertionError("the step on a dead primary answered")
        except AttndError as e:
            assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e
        t1 = time.perf_counter()
        client, info = router.failover(sid, generation=generation, length=length, failed=victim)
        generation = info.generation
        assert info.length == length or mode == "async", (info.length, length)
        t2 = time.perf_counter()
        one_step(client)
        t3 = time.perf_counter()
        if how == "stop":
            proc.send_signal(signal.SIGCONT)
        router.close()
        return t3 - t0, t1 - t0, t2 - t1, t3 - t2
    finally:
        stop(procs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="steady state: rounds of the three modes")
    ap.add_argument("--stall-context", type=int, default=256)
    ap.add_argument("--deadline-s", type=float, default=0.05,
                    help="the worker's per-call deadline (finds a paused primary)")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="steady state: the primary alone on core 0 (the standby, on another "
                    "host in production, and the client on the rest)")
    a = ap.parse_args()
    log_dir = Path(a.log_dir)
    common = [f"--model={a.model}", "--kv-cache-bytes=1073741824"]
    rng = np.random.default_rng(7)
    rounds = [steady_state(a, common, log_dir, rng) for _ in range(a.rounds)]
    spec = rounds[0]["none"]["spec"]
    # The keys a decode step commits, as a bf16 cache holds them.
    key_bytes = a.batch * sum(2 * (spec.kv_lora_rank + spec.qk_rope_head_dim
                                   + (spec.index_head_dim if kind == "full" else 0))
                              for kind in spec.layers)
    print(f"model {spec.name} ({len(spec.layers)} layers), batch {a.batch}, context {a.context},"
          f" {a.steps} steps after {a.warmup}; a step's keys: {key_bytes} B")
    print(f"{a.rounds} rounds of none, async, sync (each its own fresh replicas); per mode the "
          "median over rounds of the step median, and of the ratio to that round's none")
    print("| replication | step median (ms) | p90 (ms) | / none (median) | / none (min-max) | "
          "primary CPU per step (ms) | / none | bytes shipped per step | / key bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in ("none", "async", "sync"):
        med = statistics.median(r[mode]["median"] for r in rounds)
        p90 = statistics.median(r[mode]["p90"] for r in rounds)
        ratios = [r[mode]["median"] / r["none"]["median"] for r in rounds]
        shipped = statistics.median(r[mode]["shipped_per_step"] for r in rounds)
        cpu = statistics.median(r[mode]["cpu_per_step"] for r in rounds)
        cpu_none = statistics.median(r["none"]["cpu_per_step"] for r in rounds)
        print(f"| {mode} | {med * 1e3:.2f} | {p90 * 1e3:.2f} | {statistics.median(ratios):.3f} | "
              f"{min(ratios):.3f}-{max(ratios):.3f} | {cpu * 1e3:.2f} | {cpu / cpu_none:.3f} | "
              f"{shipped:.0f} | {shipped / key_bytes:.3f} |")
    print()
    print("| mode | primary | stall median (ms) | max (ms) | detect | promote | step again |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("sync", "async"):
        for how in ("kill", "stop"):
            runs = [stall_trial(a, common, log_dir, rng, mode, how, t) for t in range(a.trials)]
            med = [statistics.median(r[i] for r in runs) * 1e3 for i in range(4)]
            print(f"| {mode} | {'SIGKILL' if how == 'kill' else 'SIGSTOP'} | {med[0]:.1f} | "
                  f"{max(r[0] for r in runs) * 1e3:.1f} | {med[1]:.1f} | {med[2]:.1f} | "
                  f"{med[3]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
