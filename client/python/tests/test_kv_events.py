"""KV events as today's consumers read them (issue 53): a real attnd's events decoded by decoders
written from vLLM's and llm-d's own definitions (tests/vllm_kv_events.py), in vLLM's current
tagged maps by default and the older arrays behind --kv-events-format=array; topics that split
into three parts for any tenant name; vLLM's replay protocol on --kv-events-replay, after a missed
range and for a subscriber that missed a restart."""

from __future__ import annotations

import time

import msgpack
import msgspec
import numpy as np
import pytest
import zmq
from vllm_kv_events import (
    DECODER,
    OLD_DECODER,
    AllBlocksCleared,
    llmd_decode,
    llmd_topic,
)

from attnd import AttndClient, KvEventSubscriber, hash_blocks
from attnd.kv_events import END_SEQ, parse_topic, replay, topic_of

from attnd_process import free_port, start, stop
from attnd_testlib import layer_inputs, step_details, wait_for


def _tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 150000, n)]


def _cache(c, sid, prompt, rng):
    """Prefills `prompt` as sequence `sid` and closes it: its full blocks stay cached."""
    spec = c.info().model
    n = len(prompt) - 1
    c.open_sequence(sid, prompt_token_ids=prompt)
    step_details(c, [(sid, n)], layer_inputs(spec, n, rng))
    c.close_sequence(sid)


def _subscriber(ctx, endpoint):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription lands
    return sub


def _dealer(ctx, endpoint):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def test_vllms_and_llm_ds_decoders_read_the_events_in_both_forms(attnd_server):
    ctx = zmq.Context()
    try:
        for form in ("map", "array"):
            port = free_port()
            target, _ = attnd_server([f"--kv-events=tcp://127.0.0.1:{port}", "--replica-name=r0",
                                      f"--kv-events-format={form}"], kv_pages=7)
            sub = _subscriber(ctx, f"tcp://127.0.0.1:{port}")
            rng = np.random.default_rng(5)
            with AttndClient(target) as c:
                assert c.info().prefix_cache.kv_events_format == form
                P = c.info().model.page_size
                prompts = [_tokens(3 * P + 1, 20 + i) for i in range(3)]  # 9 blocks, 6 pages
                for i, p in enumerate(prompts):
                    _cache(c, f"s{i}", p, rng)
            stored, removed, seen = [], [], []
            while len(stored) < 9 or not removed:
                topic, seq, payload = sub.recv_multipart()
                assert llmd_topic(topic) == ("r0", "")
                raw = msgpack.unpackb(payload, raw=False)
                assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
                assert all(isinstance(e, dict if form == "map" else list) for e in raw[1])
                # vLLM's decoder of this form reads it; the other form's decoder refuses it.
                good, other = (DECODER, OLD_DECODER) if form == "map" else (OLD_DECODER, DECODER)
                batch = good.decode(payload)
                # Byte for byte what vLLM's own structs encode for the same events.
                assert msgspec.msgpack.encode(batch) == payload
                with pytest.raises(msgspec.ValidationError):
                    other.decode(payload)
                llmd = llmd_decode(payload)
                assert [e["type"] for e in llmd] == [type(e).__name__.removeprefix("Old")
                                                     for e in batch.events]
                for e, d in zip(batch.events, llmd):
                    if type(e).__name__.endswith("BlockStored"):
                        stored += e.block_hashes
                        assert e.block_size == P and e.medium == "CPU" and e.lora_id is None
                        owner = next(p for p in prompts if e.block_hashes[0] in hash_blocks(p, P))
                        first = hash_blocks(owner, P).index(e.block_hashes[0])
                        assert list(e.token_ids) == owner[first * P:(first + len(e.block_hashes))
                                                          * P]
                        assert d["tokens"] == list(e.token_ids) and d["medium"] == "cpu"
                        assert d["hashes"] == [int.from_bytes(h[-8:], "big")
                                               for h in e.block_hashes]
                        assert d["lora_name"] is None
                        if form == "map":
                            assert e.lora_name is None and e.group_idx == 0
                            assert e.extra_keys is None  # the tenant's salt is in the hash
                    else:
                        removed += e.block_hashes
                        assert d["medium"] == "cpu"
                seen.append(int.from_bytes(seq, "big"))
            assert seen == list(range(seen[0], seen[0] + len(seen))), seen  # one topic, no gap
            # Counted from the start in microseconds: past any number an earlier run used.
            assert abs(seen[0] / 1e6 - time.time()) < 600
            sub.close()
    finally:
        ctx.destroy(linger=0)


def test_topics_split_into_three_parts_for_any_tenant_name():
    for tenant in ["", "plain", "a@b", "50%", "%40", "@@%%"]:
        topic = topic_of("r-0", tenant)
        assert topic.count(b"@") == 2
        assert llmd_topic(topic)[0] == "r-0"
        assert parse_topic(topic) == ("r-0", tenant)
    for bad in [b"metrics", b"kv@r", b"kv@r@a@b", b"kv@r@%41"]:
        with pytest.raises(ValueError):
            parse_topic(bad)


def test_replay_answers_vllms_protocol_from_a_bounded_buffer(attnd_server):
    port, rport = free_port(), free_port()
    target, _ = attnd_server([f"--kv-events=tcp://127.0.0.1:{port}", "--replica-name=r0",
                              f"--kv-events-replay=tcp://127.0.0.1:{rport}",
                              "--kv-events-replay-bytes=2K"], kv_pages=64)
    ctx = zmq.Context()
    sub = _subscriber(ctx, f"tcp://127.0.0.1:{port}")
    dealer = _dealer(ctx, f"tcp://127.0.0.1:{rport}")
    try:
        rng = np.random.default_rng(8)
        with AttndClient(target) as c:
            info = c.info().prefix_cache
            assert info.kv_events_replay == f"tcp://127.0.0.1:{rport}"
            P = c.info().model.page_size
            for i in range(12):
                _cache(c, f"s{i}", _tokens(2 * P + 1, 40 + i), rng)
        live = [sub.recv_multipart() for _ in range(12)]
        numbers = [int.from_bytes(s, "big") for _, s, _ in live]
        # From the start: the start's AllBlocksCleared (kept, however old), then what the 2 KiB
        # buffer still holds: the newest messages, exactly as they were published.
        got = replay(dealer, 0)
        cleared = DECODER.decode(got[0][2])
        assert got[0][0] == b"kv@r0@" and got[0][1] == numbers[0] - 1
        assert [type(e) for e in cleared.events] == [AllBlocksCleared]
        kept = got[1:]
        assert 0 < len(kept) < 12 and sum(len(p) for _, _, p in kept) <= 2048
        assert [(t, s.to_bytes(8, "big"), p) for t, s, p in kept] == \
            [tuple(m) for m in live[-len(kept):]]
        # From a number on, and of one topic only: the start's message is older, so not sent.
        assert replay(dealer, numbers[-2]) == [(t, int.from_bytes(s, "big"), p)
                                               for t, s, p in live[-2:]]
        assert replay(dealer, numbers[-1], b"kv@r0@") == [(b"kv@r0@", numbers[-1], live[-1][2])]
        assert replay(dealer, numbers[-1], b"kv@r0@other") == []
        assert replay(dealer, numbers[-1] + 1) == []
        # Malformed requests get no answer; the next good one is answered.
        for frames in ([b"", b"\x00" * 7], [b"x", b"\x00" * 8], [b"", b"\x00" * 8, b"t", b"u"]):
            dealer.send_multipart(frames)
        assert not dealer.poll(300)
        dealer.send_multipart([b"", numbers[-1].to_bytes(8, "big")])
        frames = dealer.recv_multipart()
        assert frames[1:3] == [b"kv@r0@", numbers[-1].to_bytes(8, "big")]
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
    finally:
        sub.close()
        dealer.close()
        ctx.destroy(linger=0)


def test_a_subscriber_fills_a_missed_range_and_sees_a_restart_it_missed():
    port, rport = free_port(), free_port()
    flags = [f"--kv-events=tcp://127.0.0.1:{port}", "--replica-name=r0",
             f"--kv-events-replay=tcp://127.0.0.1:{rport}"]
    proc, target, _ = start(flags, kv_pages=64)
    sub = KvEventSubscriber({"r0": f"tcp://127.0.0.1:{port}"},
                            replay={"r0": f"tcp://127.0.0.1:{rport}"})
    rng = np.random.default_rng(11)
    try:
        time.sleep(0.3)
        with AttndClient(target) as c:
            P = c.info().model.page_size
            first = _tokens(2 * P + 1, 60)
            _cache(c, "a", first, rng)
        wait_for(lambda: len(sub.index.blocks("r0")) == 2, "the first prompt's blocks")
        # The index misses a range (as a subscriber whose socket dropped messages would): the
        # next message shows the gap and the replica's buffer fills it.
        held = sub.index.last_seq("r0", "")
        with sub.index._mu:  # what the index knew before the last message, as if it never came
            sub.index._last_seq[("r0", "")] = held - 1
        with AttndClient(target) as c:
            _cache(c, "b", _tokens(2 * P + 1, 61), rng)
        wait_for(lambda: len(sub.index.blocks("r0")) == 4, "the second prompt's blocks")
        assert sub.replayed >= 1 and sub.index.gaps == 0 and not sub.index.stale
        # A restart on the same endpoints: the new run's AllBlocksCleared goes out before the
        # subscriber has reconnected; its next message's number jumps, the replay brings the
        # announcement, and the view is the new run's alone.
        stop(proc)
        proc, target, _ = start(flags, kv_pages=64)
        time.sleep(0.5)  # the subscriber reconnects
        again = _tokens(2 * P + 1, 62)
        with AttndClient(target) as c:
            _cache(c, "c", again, rng)
        want = set(hash_blocks(again, P)[:2])
        wait_for(lambda: set(sub.index.blocks("r0")) == want, "only the new run's blocks")
        # (Had the subscriber reconnected in time for the announcement itself, its jump counts
        # as a gap that the clear then makes good: either way the replica is fresh, not stale.)
        assert not sub.index.stale and not sub.errors
        assert sub.index.cached_blocks("r0", "", hash_blocks(first, P)) == 0
    finally:
        sub.close()
        stop(proc)


def test_without_replay_a_missed_restart_leaves_the_replica_stale():
    port = free_port()
    flags = [f"--kv-events=tcp://127.0.0.1:{port}", "--replica-name=r0"]
    proc, target, _ = start(flags, kv_pages=64)
    sub = KvEventSubscriber({"r0": f"tcp://127.0.0.1:{port}"})
    rng = np.random.default_rng(12)
    try:
        time.sleep(0.3)
        with AttndClient(target) as c:
            P = c.info().model.page_size
            _cache(c, "a", _tokens(2 * P + 1, 70), rng)
        wait_for(lambda: len(sub.index.blocks("r0")) == 2, "the first prompt's blocks")
        stop(proc)
        proc, target, _ = start(flags, kv_pages=64)
        time.sleep(0.5)
        with AttndClient(target) as c:
            _cache(c, "b", _tokens(2 * P + 1, 71), rng)
        # The jump is a gap: the view may hold blocks the replica no longer has, so routers ask.
        wait_for(lambda: sub.index.stale == {"r0"}, "the replica marked stale")
        assert sub.index.gaps == 1
    finally:
        sub.close()
        stop(proc)
