"""The tiered store through a real attnd (docs/architecture.md#tiers): a server whose device holds
N sequences serves 4N round-robin with its host and disk tiers, every output and log-sum-exp bit
for bit those of a server holding all of them; OffloadSequences and PrefetchSequences; a page
corrupted on disk loses its sequence alone (DATA_LOSS); the tiers in ServerInfo, DescribeSequence,
ListSequences, attnctl and the metrics (checked by promtool); startup errors."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest

from attnd import AttndClient

from attnd_process import ATTND_BIN, free_port, start, stop
from attnd_testlib import expect, layer_inputs, scrape, step_details, wait_for

PROMPT = 40  # tokens: three pages of the tiny model's 16
DEVICE_SEQUENCES = 3  # N: the small server's device holds this many prompts



def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in metrics:\n{text}")




def _same_bits(got, want, what):
    for layer, (g, w) in enumerate(zip(got, want)):
        assert not np.isnan(g.out).any(), f"{what}, layer {layer}: NaN"
        assert g.out.dtype == w.out.dtype and g.out.shape == w.out.shape
        assert np.array_equal(g.out.view(np.uint32), w.out.view(np.uint32)), f"{what}, {layer}"
        assert np.array_equal(g.lse.view(np.uint32), w.lse.view(np.uint32)), f"{what}, {layer}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_a_device_holding_n_serves_4n_round_robin_bit_for_bit(attnd_server, tmp_path, dtype):
    big, _ = attnd_server([f"--cache-dtype={dtype}"], kv_pages=256)
    with AttndClient(big) as b:
        info = b.info()
    spec, page_bytes = info.model, info.devices[0].bytes_per_page
    pages = -(-PROMPT // spec.page_size)
    # The host tier holds 4 sequences' pages; the disk the rest (and room to spare).
    small, mport = attnd_server(
        [f"--cache-dtype={dtype}", f"--host-cache-bytes={4 * pages * page_bytes}",
         f"--disk-cache-dir={tmp_path}", f"--disk-cache-bytes={64 * pages * page_bytes}"],
        kv_pages=1 + DEVICE_SEQUENCES * pages + 1)
    rng = np.random.default_rng(31)
    ids = [f"s{i}" for i in range(4 * DEVICE_SEQUENCES)]
    seen_tiers, max_used = set(), {"host": 0, "disk": 0}

    def watch(client):
        for t in client.info().tiers:
            max_used[t.name] = max(max_used[t.name], t.pages_used)
        seen_tiers.update(s.tier for s in client.list_sequences())

    with AttndClient(small) as s, AttndClient(big) as b:
        assert [(t.name, t.pages_total > 0) for t in s.info().tiers] == [("host", True),
                                                                         ("disk", True)]
        for sid in ids:  # prefill, each step on one sequence: the device fills, then spills
            for c in (s, b):
                c.open_sequence(sid)
            x = layer_inputs(spec, PROMPT, rng)
            _same_bits(step_details(s, [(sid, PROMPT)], x),
                       step_details(b, [(sid, PROMPT)], x), f"{sid} prefill")
            watch(s)
        # Forks of spilled parents (a partial page copied, whole pages shared across tiers).
        for child, parent in (("f0", "s0"), ("f1", "s5")):
            for c in (s, b):
                c.open_sequence(child, parent, prefix_len=PROMPT - 11)
            ids.append(child)
        for rnd in range(3):  # round-robin decode, two sequences a step
            for i in range(0, len(ids), 2):
                batch = [(sid, 1) for sid in ids[i:i + 2]]
                x = layer_inputs(spec, len(batch), rng)
                _same_bits(step_details(s, batch, x),
                           step_details(b, batch, x), f"round {rnd}, {batch}")
                watch(s)
        assert {"device", "host", "disk"} <= seen_tiers, seen_tiers
        assert max_used["host"] > 0 and max_used["disk"] > 0, max_used
        assert all(s.describe_sequence(sid).length == b.describe_sequence(sid).length
                   for sid in ids)
        text = scrape(mport)
        assert _value(text, 'attnd_tier_bytes_total{from="device",to="host"}') > 0
        assert _value(text, 'attnd_tier_bytes_total{from="host",to="disk"}') > 0
        assert _value(text, 'attnd_tier_moves_total{kind="restore",reason="step"}') > 0
        assert _value(text, 'attnd_tier_move_seconds_count{kind="spill"}') > 0
        assert _value(text, "attnd_data_loss_total") == 0
        promtool = shutil.which("promtool")
        assert promtool, "promtool (Debian package prometheus): scripts/install-deps.sh"
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        for sid in ids:
            s.close_sequence(sid)
        assert [t.pages_used for t in s.info().tiers] == [0, 0]
        dev = s.info().devices[0]
        assert dev.pages_free == dev.pages_total and dev.sequences == 0



def test_prompt_tokens_are_counted_by_source_under_vllms_names(attnd_server, tmp_path):
    # vLLM's prompt_tokens_by_source_total sources (prefilled, from the prefix cache, kept by a
    # failover: tests/test_failover.py) and where each cached token was: a prompt opened on blocks
    # on the device, then on the same blocks spilled to the host, or (a server whose only tier
    # below is a disk) to the disk.
    rng = np.random.default_rng(11)
    for where, flags in (("host", ["--host-cache-bytes=4194304"]),
                         ("disk", [f"--disk-cache-dir={tmp_path}", "--disk-cache-bytes=4194304"])):
        target, mport = attnd_server(flags, kv_pages=64)
        with AttndClient(target) as c:
            spec = c.info().model
            P = spec.page_size
            shared = [int(t) for t in rng.integers(0, 150000, 2 * P)]
            c.open_sequence("a", prompt_token_ids=shared + [7, 8, 9])
            step_details(c, [("a", 2 * P + 3)], layer_inputs(spec, 2 * P + 3, rng))
            step_details(c, [("a", 1)], layer_inputs(spec, 1, rng))  # a decode: not a prompt's
            c.close_sequence("a")
            assert c.open_sequence("b", prompt_token_ids=shared + [1]).cached_tokens == 2 * P
            c.offload_sequences(["b"])
            assert c.describe_sequence("b").tier == where
            c.close_sequence("b")
            assert c.open_sequence("c", prompt_token_ids=shared + [2]).cached_tokens == 2 * P
            text = scrape(mport)

        def tokens(family, source, text=text):
            return _value(text, f'attnd_prompt_tokens_{family}_total{{source="{source}"}}')

        assert tokens("by_source", "local_compute") == 2 * P + 3, where
        assert tokens("by_source", "local_cache_hit") == 4 * P, where
        assert tokens("by_source", "external_kv_transfer") == 0, where
        cached = {s: tokens("cached_by_source", s) for s in ("device", "host", "disk", "standby")}
        want = {"device": 2 * P, "host": 0, "disk": 0, "standby": 0}
        want[where] = 2 * P
        assert cached == want, where


def test_offload_prefetch_and_a_corrupted_page_losing_its_sequence_alone(attnd_server, tmp_path):
    target, mport = attnd_server([f"--disk-cache-dir={tmp_path}", "--disk-cache-bytes=4194304"],
                                 kv_pages=64)
    twin, _ = attnd_server([], kv_pages=64)
    rng = np.random.default_rng(7)
    with AttndClient(target) as c, AttndClient(twin) as t:
        spec = c.info().model
        for sid in ("a", "b"):
            for x in (c, t):
                x.open_sequence(sid)
            inputs = layer_inputs(spec, PROMPT, rng)
            _same_bits(step_details(c, [(sid, PROMPT)], inputs),
                       step_details(t, [(sid, PROMPT)], inputs), sid)
        c.offload_sequences(["a", "b"])
        assert [(x.tier, x.num_pages) for x in c.list_sequences()] == [("disk", 0), ("disk", 0)]
        (disk,) = [x for x in c.info().tiers if x.name == "disk"]
        assert disk.sequences == 2 and disk.pages_used == 2 * -(-PROMPT // spec.page_size)
        c.prefetch_sequences(["a", "nobody"])  # unknown ids are skipped
        wait_for(lambda: c.describe_sequence("a").tier == "device", "prefetch of a")
        x = layer_inputs(spec, 1, rng)
        _same_bits(step_details(c, [("a", 1)], x),
                   step_details(t, [("a", 1)], x), "a after a prefetch")
        assert _value(scrape(mport), 'attnd_tier_moves_total{kind="restore",reason="prefetch"}') \
            == 1
        # b's pages on disk are overwritten behind attnd's back: its next use is DATA_LOSS, a's
        # steps go on, b can only be closed.
        (page_file,) = Path(tmp_path).glob("attnd-*.pages")
        size = page_file.stat().st_size
        assert size > 0
        page_file.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        e = expect(grpc.StatusCode.DATA_LOSS, c.begin_step, [("b", 1)])
        assert "sequence 'b' lost its cached pages" in str(e), str(e)
        assert str(tmp_path) not in str(e), str(e)  # the file is for the server's log
        assert c.describe_sequence("b").lost
        expect(grpc.StatusCode.DATA_LOSS, c.begin_step, [("b", 1)])
        x = layer_inputs(spec, 1, rng)
        _same_bits(step_details(c, [("a", 1)], x),
                   step_details(t, [("a", 1)], x), "a beside a lost b")
        assert _value(scrape(mport), "attnd_data_loss_total") == 1
        c.close_sequence("b")
        expect(grpc.StatusCode.NOT_FOUND, c.offload_sequences, ["b"])
        expect(grpc.StatusCode.INVALID_ARGUMENT, c.offload_sequences, ["x" * 10000])
        # attnctl shows where sequences are.
        c.offload_sequences(["a"])
        out = subprocess.run([str(ATTND_BIN.parent.parent / "client" / "attnctl"),
                              f"--target={target}", "list"], capture_output=True, text=True,
                             check=True).stdout
        assert "a\t42 tokens\t0 pages\tdisk" in out, out
        out = subprocess.run([str(ATTND_BIN.parent.parent / "client" / "attnctl"),
                              f"--target={target}", "info"], capture_output=True, text=True,
                             check=True).stdout
        assert "tier disk: 3/" in out, out
        # A server without tiers has nowhere to offload to.
        t.open_sequence("z")
        expect(grpc.StatusCode.FAILED_PRECONDITION, t.offload_sequences, ["z"])


def test_spilled_sequences_hand_off_and_drain_bit_for_bit(attnd_server, tmp_path):
    # A replica holding 2 prompts on its device, 2 in its host tier and the rest on disk hands
    # one sequence off by hand and the others by its SIGTERM drain: exports read them from
    # whatever tier they are in (never evicting the device's), and on the receiver they decode as
    # a twin that never moved.
    receiver, _ = attnd_server([], kv_pages=256)
    twin, _ = attnd_server([], kv_pages=256)
    with AttndClient(receiver) as r:
        page_bytes = r.info().devices[0].bytes_per_page
    pages = -(-PROMPT // 16)
    src, target, _ = start([f"--host-cache-bytes={2 * pages * page_bytes}",
                            f"--disk-cache-dir={tmp_path}",
                            f"--disk-cache-bytes={32 * pages * page_bytes}",
                            f"--drain-peers={receiver}", "--drain-timeout-ms=20000"],
                           kv_pages=1 + 2 * pages + 1)
    rng = np.random.default_rng(11)
    ids = [f"h{i}" for i in range(7)]
    try:
        with AttndClient(target) as s, AttndClient(twin) as t, AttndClient(receiver) as r:
            spec = s.info().model
            for sid in ids:
                for c in (s, t):
                    c.open_sequence(sid)
                x = layer_inputs(spec, PROMPT, rng)
                _same_bits(step_details(s, [(sid, PROMPT)], x),
                           step_details(t, [(sid, PROMPT)], x), sid)
            where = {x.sequence_id: x.tier for x in s.list_sequences()}
            assert {"device", "host", "disk"} <= set(where.values()), where
            by_hand = next(sid for sid in ids if where[sid] == "disk")
            s.handoff(by_hand, r, close_source=True)
            # Read where it was (up to the host tier): the sequences in use keep the device.
            after = {x.sequence_id: x.tier for x in s.list_sequences()}
            assert all(after[sid] == "device" for sid in ids if where[sid] == "device"), after
            # SGLang #31482's drift: after the handoff each tier's pages in use are exactly the
            # pages of the sequences there, and every sequence left decodes as its twin.
            info, held = s.info(), {"device": 0, "host": 0, "disk": 0}
            for x in s.list_sequences():
                held[x.tier] += -(-x.length // spec.page_size)
            dev = info.devices[0]
            used = {"device": dev.pages_total - dev.pages_free,
                    **{x.name: x.pages_used for x in info.tiers}}
            assert used == held, (used, held)
            x = layer_inputs(spec, 1, rng)
            _same_bits(step_details(r, [(by_hand, 1)], x), step_details(t, [(by_hand, 1)], x),
                       f"{by_hand} handed off from the disk")
            for sid in ids:
                if sid != by_hand:
                    x = layer_inputs(spec, 1, rng)
                    _same_bits(step_details(s, [(sid, 1)], x), step_details(t, [(sid, 1)], x),
                               f"{sid} ({where[sid]}) on the source after the handoff")
            src.send_signal(signal.SIGTERM)
            assert src.wait(timeout=60) == 0
            log = src.stdout.read()
            assert sorted(x.sequence_id for x in r.list_sequences()) == sorted(ids), log
            for rnd in range(2):
                for sid in ids:
                    x = layer_inputs(spec, 1, rng)
                    _same_bits(step_details(r, [(sid, 1)], x), step_details(t, [(sid, 1)], x),
                               f"{sid} ({where[sid]} before) on the receiver, round {rnd}")
    finally:
        if src.poll() is None:
            stop(src)


@pytest.mark.parametrize("below", ["host", "disk"])
def test_a_long_decode_through_repeated_spills_and_restores_never_repeats(attnd_server, tmp_path,
                                                                          below):
    # SGLang #36179's loop (a decode that went back to stale keys after restores): a sequence
    # spilled after every step and restored by the next, 40 steps across page boundaries, each
    # step's output and log-sum-exp bit for bit those of a twin that never moved, its length one
    # more each time, and every spill and restore counted.
    flags = (["--host-cache-bytes=4194304"] if below == "host" else
             [f"--disk-cache-dir={tmp_path}", "--disk-cache-bytes=4194304"])
    target, mport = attnd_server(flags, kv_pages=64)
    twin, _ = attnd_server([], kv_pages=64)
    rng = np.random.default_rng(36179)
    with AttndClient(target) as c, AttndClient(twin) as t:
        spec = c.info().model
        for x in (c, t):
            x.open_sequence("long")
        prompt = layer_inputs(spec, PROMPT, rng)
        _same_bits(step_details(c, [("long", PROMPT)], prompt),
                   step_details(t, [("long", PROMPT)], prompt), "prompt")
        last = None
        for i in range(40):
            c.offload_sequences(["long"])
            assert c.describe_sequence("long").tier == below, i
            x = layer_inputs(spec, 1, rng)
            got = step_details(c, [("long", 1)], x)
            _same_bits(got, step_details(t, [("long", 1)], x), f"decode {i} after a restore")
            d = c.describe_sequence("long")
            assert (d.length, d.tier) == (PROMPT + i + 1, "device"), (i, d)
            out = np.concatenate([g.out.ravel() for g in got])
            assert last is None or not np.array_equal(out, last), f"decode {i} repeats {i - 1}"
            last = out
        text = scrape(mport)
        spills = 'attnd_tier_moves_total{kind="spill",reason="room_or_idle_or_offload"}'
        assert _value(text, spills) == 40
        assert _value(text, 'attnd_tier_moves_total{kind="restore",reason="step"}') == 40


@pytest.mark.parametrize("flags, message", [
    (["--disk-cache-dir={missing}", "--disk-cache-bytes=1048576"], "--disk-cache-dir"),
    (["--disk-cache-dir={tmp}"], "--disk-cache-dir and --disk-cache-bytes go together"),
    (["--spill-idle-ms=100"], "--spill-idle-ms needs a tier"),
])
def test_unusable_tier_flags_stop_the_start_with_a_clear_message(tmp_path, flags, message):
    args = [f.format(missing=tmp_path / "absent", tmp=tmp_path) for f in flags]
    r = subprocess.run([str(ATTND_BIN), "--model=tiny", "--kv-pages=64",
                        f"--grpc-port={free_port()}", "--grpc-address=127.0.0.1",
                        f"--metrics-port={free_port()}", *args],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert message in r.stdout + r.stderr, r.stdout + r.stderr
