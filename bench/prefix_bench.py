#!/usr/bin/env python3
"""Prefix-aware routing against round robin, the rendezvous hash and an oracle, in one run
(docs/prefix_cache.md): four attnd replicas on loopback, a multi-turn chat workload with shared
system prompts and more conversations than one replica's cache holds. Every turn is a new sequence
(a new request id) whose prompt is its conversation so far: the system prompt, every earlier user
message and answer, and the new user message. The worker opens it with the prompt's token ids,
prefills only what the chosen replica did not have cached (write-only steps: the routing is
measured, not the attention), generates the answer (a write-only step whose entry carries the
hashes of the blocks it completes) and closes it; its blocks stay in that replica's prefix cache.

Policies (each on four fresh replicas, the same workload): round robin; the rendezvous hash of the
sequence id (attnd.Router's rule); the prefix router weighing the cache alone (PrefixWeights(1, 0,
0)); the weighted prefix router (attnd.PrefixRouter's defaults: cached blocks against free room and
work, following the replicas' KV events); and an oracle with the same weights that asks every
replica what it holds (LookupPrefix) and how full it is (ServerInfo) before each choice. Two
workloads: the system prompts shared evenly, and skewed (one system prompt 60% of the
conversations); several seeds. Reported: prompt tokens, tokens served from cache (prefill
avoided), hit rate, per policy, workload and seed, and the means. --sweep also runs the weighted
router over a range of free-room weights (how the defaults were chosen).

    python3 bench/prefix_bench.py --out bench/results/prefix.md --sweep
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "python" / "tests"))
from attnd import (  # noqa: E402
    AttndClient,
    LayerInputs,
    PrefixRouter,
    PrefixWeights,
    hash_blocks,
    route,
)
from drain_bench import CHUNK, chunk_keys  # noqa: E402

from attnd_process import free_port, start, stop  # noqa: E402

REPLICAS = 4


class Keys:
    """Random keys per layer (drain_bench's), sliced to each write (the bench routes; it does not
    attend)."""

    def __init__(self, spec, rng):
        self.layers = chunk_keys(spec, rng)

    def write(self, client, sid, n, block_hashes=None):
        step = client.begin_step([(sid, n)], write_only=True,
                                 block_hashes=None if block_hashes is None else [block_hashes])
        for i, layer in enumerate(self.layers):
            client.attend_layer(step.step_id, LayerInputs(i, **{k: v[:n] for k, v in
                                                               layer.items()}))


def workload(a, rng, skewed=False):
    """[(conversation, turn, system prompt index, user tokens, answer tokens)] in arrival order:
    turn by turn, conversations shuffled within each turn. Skewed: 60% of the conversations on
    system prompt 0, the rest spread over the others."""
    systems = [list(rng.integers(0, 150000, a.system_tokens)) for _ in range(a.system_prompts)]
    convs = []
    for c in range(a.conversations):
        turns = [(list(rng.integers(0, 150000, a.user_tokens)),
                  list(rng.integers(0, 150000, a.answer_tokens))) for _ in range(a.turns)]
        if skewed:
            hot = c < round(0.6 * a.conversations)
            prompt = 0 if hot else 1 + c % (a.system_prompts - 1)
        else:
            prompt = c % a.system_prompts
        convs.append((prompt, turns))
    order = []
    for t in range(a.turns):
        for c in rng.permutation(a.conversations):
            order.append((int(c), t))
    return systems, convs, order


WEIGHTS = {"cache-only": PrefixWeights(1.0, 0.0, 0.0), "weighted": PrefixWeights(),
           "oracle": PrefixWeights()}


def run_policy(policy, a, systems, convs, order, weights=None):
    ports = [free_port() for _ in range(REPLICAS)]
    procs, targets = [], {}
    for i, port in enumerate(ports):
        proc, target, _ = start([f"--replica-name=r{i}", f"--kv-events=tcp://127.0.0.1:{port}",
                                 "--metrics-port=0"], kv_pages=a.kv_pages, threads=1)
        procs.append(proc)
        targets[f"r{i}"] = target
    names = sorted(targets)
    events = {f"r{i}": f"tcp://127.0.0.1:{p}" for i, p in enumerate(ports)}
    clients = {n: AttndClient(t, timeout=120) for n, t in targets.items()}
    spec = clients["r0"].info().model
    P = spec.page_size
    assert a.system_tokens + a.turns * (a.user_tokens + a.answer_tokens) <= CHUNK
    keys = Keys(spec, np.random.default_rng(5))
    router = None
    weights = weights or WEIGHTS.get(policy)
    if policy == "oracle":  # asks every replica, every time
        router = PrefixRouter(targets, None, block_size=P, timeout=120, weights=weights,
                              load_ttl_s=0.0)
    elif weights is not None:
        router = PrefixRouter(targets, events, block_size=P, timeout=120, weights=weights)
    time.sleep(0.3)  # the subscriptions land before the first event
    rr = itertools.cycle(names)
    prompt_tokens = cached_tokens = 0
    t0 = time.perf_counter()
    try:
        for i, (c, turn) in enumerate(order):
            sys_idx, turns = convs[c]
            prompt = list(systems[sys_idx])
            for user, answer in turns[:turn]:
                prompt += user + answer
            prompt += turns[turn][0]
            sid = f"c{c}-t{turn}-{i}"
            if policy == "round-robin":
                name = next(rr)
            elif policy == "rendezvous":
                name = route(names, sid)
            else:
                name, _ = router.choose(sid, prompt)
            client = clients[name]
            opened = client.open_sequence(sid, prompt_token_ids=prompt)
            prompt_tokens += len(prompt)
            cached_tokens += opened.cached_tokens
            keys.write(client, sid, len(prompt) - opened.cached_tokens)
            full = hash_blocks(prompt + turns[turn][1], P)
            keys.write(client, sid, a.answer_tokens, full[len(prompt) // P:])
            client.close_sequence(sid)
            if router is not None:
                router.forget(sid)
    finally:
        seconds = time.perf_counter() - t0
        if router is not None:
            router.close()
        for cl in clients.values():
            cl.close()
        for proc in procs:
            stop(proc)
    return {"policy": policy, "requests": len(order), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens, "hit_rate": cached_tokens / prompt_tokens,
            "seconds": seconds}


POLICIES = ("round-robin", "rendezvous", "cache-only", "weighted", "oracle")


def summary(rows, policy):
    rates = [r["hit_rate"] for r in rows if r["policy"] == policy]
    return sum(rates) / len(rates), min(rates), max(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--kv-pages", type=int, default=1101, help="per replica (page 0 included)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--workloads", default="even,skewed")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sweep", default="", help="free-room weights to try, e.g. 0.25,0.5,1,2,4")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    P = 16  # the tiny model's page
    last = a.system_tokens + a.turns * (a.user_tokens + a.answer_tokens)
    lines = [
        f"workload: {a.conversations} conversations x {a.turns} turns over {a.system_prompts} "
        f"system prompts of {a.system_tokens} tokens; {a.user_tokens} user + {a.answer_tokens} "
        f"answer tokens a turn (a conversation ends {last} tokens long); {REPLICAS} replicas x "
        f"{a.kv_pages - 1} usable pages of the tiny model's {P} tokens (the conversations end "
        f"holding {a.conversations * -(-last // P)} pages); seeds {a.seeds}; weighted = "
        f"{PrefixWeights()}",
        "",
    ]
    sweep = [float(x) for x in a.sweep.split(",") if x]
    for kind in a.workloads.split(","):
        rows = []
        for seed in (int(x) for x in a.seeds.split(",")):
            systems, convs, order = workload(a, np.random.default_rng(seed), kind == "skewed")
            for p in a.policies.split(","):
                rows.append({**run_policy(p, a, systems, convs, order), "seed": seed})
                print(kind, seed, p, f"{rows[-1]['hit_rate']:.3f}", flush=True)
            for w in sweep:
                weights = PrefixWeights(free=w)
                name = f"weighted free={w:g}"
                rows.append({**run_policy("weighted", a, systems, convs, order, weights),
                             "policy": name, "seed": seed})
                print(kind, seed, name, f"{rows[-1]['hit_rate']:.3f}", flush=True)
        lines += [f"### {kind} system prompts" + (" (one of them 60% of the conversations)"
                                                  if kind == "skewed" else ""), "",
                  "| policy | seed | prompt tokens | from cache (prefill avoided) | hit rate "
                  "| wall s |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['policy']} | {r['seed']} | {r['prompt_tokens']} | "
                         f"{r['cached_tokens']} | {r['hit_rate']:.3f} | {r['seconds']:.1f} |")
        lines += ["", "| policy | mean hit rate | min | max |", "|---|---|---|---|"]
        for p in dict.fromkeys(r["policy"] for r in rows):
            mean, lo, hi = summary(rows, p)
            lines.append(f"| {p} | {mean:.3f} | {lo:.3f} | {hi:.3f} |")
        by = {}
        for r in rows:
            by.setdefault(r["policy"], 0)
            by[r["policy"]] += r["cached_tokens"]
        if "weighted" in by and "oracle" in by:
            lines.append(f"\nweighted / oracle, tokens avoided (all seeds): "
                         f"{by['weighted'] / by['oracle']:.3f}")
        for other in ("rendezvous", "round-robin", "cache-only"):
            if "weighted" in by and other in by:
                lines.append(f"weighted / {other}, tokens avoided: "
                             f"{by['weighted'] / max(1, by[other]):.2f}x")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
