"""The prefix cache through a real attnd (docs/prefix_cache.md): a sequence opened with its prompt's
token ids (or block hashes) on blocks a closed sequence left decodes bit for bit as the same
sequence prefilled cold on another server; malformed or mismatched prompts are refused with
nothing changed; a real ZeroMQ subscriber decodes the KV events with vLLM's schema and replays them
to the replica's exact block set; the metrics count hits; the prefix-aware router sends a prompt
to the replica holding its prefix, from the events or (a gap, no events) by asking; a restarted
replica's view starts empty."""

from __future__ import annotations

import time

import grpc
import msgpack
import numpy as np
import pytest
import zmq
from vllm_kv_events import DECODER as VLLM_DECODER  # vLLM's current structs

from attnd import (
    AttndClient,
    BlockIndex,
    PrefixRouter,
    decode_batch,
    hash_blocks,
)
from attnd.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from attnd_process import free_port
from attnd_testlib import expect, layer_inputs, scrape, step_details, wait_for


def _same_bits(got, want, what):
    for layer, (g, w) in enumerate(zip(got, want)):
        assert not np.isnan(g.out).any(), f"{what}, layer {layer}: NaN"
        assert np.array_equal(g.out.view(np.uint32), w.out.view(np.uint32)), f"{what}, {layer}"
        assert np.array_equal(g.lse.view(np.uint32), w.lse.view(np.uint32)), f"{what}, {layer}"



def _subscribe(port):
    """A ZeroMQ context and a SUB socket on the replica's KV events (5 s receive timeout)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return ctx, sub


def _tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 150000, n)]



@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_a_prompt_opened_on_cached_blocks_decodes_bit_for_bit_as_cold(attnd_server, dtype):
    warm, mport = attnd_server([f"--cache-dtype={dtype}"], kv_pages=64)
    cold, _ = attnd_server([f"--cache-dtype={dtype}"], kv_pages=64)
    rng = np.random.default_rng(7)
    with AttndClient(warm) as w, AttndClient(cold) as c:
        spec = w.info().model
        P = spec.page_size
        shared = _tokens(2 * P, 1)
        a_prompt, b_prompt = shared + _tokens(5, 2), shared + _tokens(P + 3, 3)
        assert w.open_sequence("A", prompt_token_ids=a_prompt).cached_tokens == 0
        prefix = layer_inputs(spec, 2 * P, rng)
        step_details(w, [("A", 2 * P)], prefix)
        step_details(w, [("A", 5)], layer_inputs(spec, 5, rng))
        w.close_sequence("A")
        info = w.info()
        assert info.prefix_cache.cached_only_pages == 2 and info.devices[0].pages_cached == 2
        # Pages only the cache holds are "cached", not "used": a full prefix cache is no alert.
        text = scrape(mport)
        assert 'attnd_cache_pages{device="cpu:0",state="cached"} 2' in text
        assert 'attnd_cache_pages{device="cpu:0",state="used"} 0' in text
        assert 'attnd_cache_utilization{device="cpu:0"} 0' in text
        # B's first two blocks are A's: it opens 32 tokens long and prefills the rest.
        b = w.open_sequence("B", prompt_token_ids=b_prompt)
        assert (b.cached_tokens, b.length) == (2 * P, 2 * P)
        c.open_sequence("B")
        step_details(c, [("B", 2 * P)], prefix)
        for q in (len(b_prompt) - 2 * P, 1, 1):
            x = layer_inputs(spec, q, rng)
            _same_bits(step_details(w, [("B", q)], x), step_details(c, [("B", q)], x), f"q_len {q}")
        # By hashes alone (a worker that keeps its tokens): the same blocks.
        hashes = hash_blocks(b_prompt, P)
        assert w.lookup_prefix(block_hashes=hashes).cached_blocks == 3  # B's third block too
        assert w.open_sequence("C", prompt_block_hashes=hashes[:2]).cached_tokens == 2 * P
        text = scrape(mport)
        assert f"attnd_prefix_cache_tokens_total {4 * P}" in text
        assert 'attnd_prefix_cache_lookup_blocks_total{result="hit"} 4' in text


def test_a_handed_off_sequence_brings_its_blocks_to_the_receivers_prefix_cache(attnd_server):
    # Issue 53: prefix blocks travel with a handoff (ExportChunk.block_hashes into the
    # receiver's write-only steps): the receiver indexes and announces them, and a later prompt
    # there maps them, decoding bit for bit as on the sender.
    src, _ = attnd_server([], kv_pages=64)
    dst, dport = attnd_server([], kv_pages=64)
    rng = np.random.default_rng(17)
    with AttndClient(src) as s, AttndClient(dst) as d:
        spec = s.info().model
        P = spec.page_size
        prompt = _tokens(3 * P + 5, 21)
        hashes = hash_blocks(prompt, P)
        s.open_sequence("A", prompt_token_ids=prompt)
        step_details(s, [("A", len(prompt))], layer_inputs(spec, len(prompt), rng))
        assert d.lookup_prefix(block_hashes=hashes).cached_blocks == 0
        s.handoff("A", d, close_source=True)
        assert d.lookup_prefix(block_hashes=hashes).cached_blocks == 3, "the blocks came along"
        assert d.info().prefix_cache.blocks == 3
        assert 'attnd_prefix_cache_stored_blocks_total 3' in scrape(dport)
        d.close_sequence("A")
        b = d.open_sequence("B", prompt_token_ids=prompt + [1])
        assert b.cached_tokens == 3 * P


def test_malformed_or_mismatched_prompts_are_refused_with_nothing_changed(attnd_server):
    target, _ = attnd_server([], kv_pages=32)
    with AttndClient(target) as c:
        P = c.info().model.page_size
        prompt = _tokens(2 * P + 1, 4)
        hashes = hash_blocks(prompt, P)
        bad = grpc.StatusCode.INVALID_ARGUMENT
        e = expect(bad, c.open_sequence, "x", prompt_block_hashes=[hashes[0][:31]])
        assert "31 bytes; a block hash is 32" in str(e)
        expect(bad, c.open_sequence, "x", prompt_block_hashes=hashes, prefix_salt=b"s")
        e = expect(bad, c.open_sequence, "x", prompt_token_ids=prompt,
                   prompt_block_hashes=hashes[::-1])
        assert "not those of the 2 full blocks" in str(e)
        expect(bad, c.open_sequence, "x", prompt_token_ids=prompt, prefix_salt=b"s" * 257)
        c.open_sequence("parent")
        expect(bad, c.open_sequence, "x", "parent", 0, prompt_token_ids=prompt)
        expect(bad, c.open_sequence, "x", import_length=16, prompt_token_ids=prompt)
        expect(bad, c.lookup_prefix, block_hashes=[b"\0" * 33])
        # A step's hashes: one per block it completes, matching what the prompt says.
        c.open_sequence("y", prompt_token_ids=prompt)
        spec = c.info().model
        x = layer_inputs(spec, 2 * P, np.random.default_rng(5))
        e = expect(bad, step_details, c, [("y", 2 * P)], x, [[hashes[0]]])
        assert "1 block hashes for the 2 blocks" in str(e)
        e = expect(bad, step_details, c, [("y", 2 * P)], x, [[hashes[1], hashes[0]]])
        assert "differs from its prompt's" in str(e)
        assert sorted(s.sequence_id for s in c.list_sequences()) == ["parent", "y"]
        assert c.describe_sequence("y").length == 0
        assert c.info().prefix_cache.blocks == 0


def test_tenants_never_see_each_others_blocks(attnd_server, tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("pc-token-a-0123456789 a\npc-token-b-0123456789 b\n")
    port = free_port()
    target, _ = attnd_server(["--auth=token", f"--auth-tokens={tokens}", "--replica-name=t0",
                              f"--kv-events=tcp://127.0.0.1:{port}"], kv_pages=64)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@t0@")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        with AttndClient(target, token="pc-token-a-0123456789") as a, \
                AttndClient(target, token="pc-token-b-0123456789") as b:
            spec = a.info().model
            P = spec.page_size
            time.sleep(0.3)
            prompt = _tokens(2 * P + 1, 50)
            a.open_sequence("s", prompt_token_ids=prompt)
            step_details(a, [("s", 2 * P)], layer_inputs(spec, 2 * P, np.random.default_rng(1)))
            a.close_sequence("s")
            assert a.lookup_prefix(token_ids=prompt).cached_blocks == 2
            assert b.lookup_prefix(token_ids=prompt).cached_blocks == 0
            assert b.open_sequence("s", prompt_token_ids=prompt).cached_tokens == 0
            assert a.open_sequence("t", prompt_token_ids=prompt).cached_tokens == 2 * P
            topic, _, payload = sub.recv_multipart()
            assert topic == b"kv@t0@a"  # the tenant's own topic: a router keeps them apart
            assert isinstance(decode_batch(payload).events[0], BlockStored)
    finally:
        sub.close()
        ctx.term()


def test_kv_events_decode_with_vllms_schema_and_replay_to_the_block_set(attnd_server):
    port = free_port()
    target, mport = attnd_server([f"--kv-events=tcp://127.0.0.1:{port}", "--replica-name=r0"],
                                 kv_pages=9)
    ctx, sub = _subscribe(port)
    index = BlockIndex()
    raw = []
    try:
        with AttndClient(target) as c:
            info = c.info()
            assert info.prefix_cache.kv_events == f"tcp://127.0.0.1:{port}"
            spec, P = info.model, info.model.page_size
            time.sleep(0.3)  # a PUB socket drops what it sends before the subscription lands
            rng = np.random.default_rng(9)
            prompts = [_tokens(3 * P + 1, 10 + i) for i in range(4)]
            for i, prompt in enumerate(prompts):  # 3 blocks each on 8 pages: older ones go
                sid = f"s{i}"
                c.open_sequence(sid, prompt_token_ids=prompt)
                step_details(c, [(sid, 3 * P)], layer_inputs(spec, 3 * P, rng))
                c.close_sequence(sid)
            blocks = c.info().prefix_cache.blocks
            stored = removed = 0
            # Every prompt's 3 blocks were stored once; the removals came before the last stores.
            while stored < 3 * len(prompts) or stored - removed != blocks:
                topic, seq, payload = sub.recv_multipart()
                raw.append(msgpack.unpackb(payload, raw=False))
                batch = decode_batch(payload)
                vllm = VLLM_DECODER.decode(payload)  # vLLM's own rules agree
                assert vllm.data_parallel_rank == batch.data_parallel_rank
                assert [type(e).__name__ for e in vllm.events] == \
                    [type(e).__name__ for e in batch.events]
                assert [list(e.block_hashes) for e in vllm.events] == \
                    [list(e.block_hashes) for e in batch.events]
                assert topic == b"kv@r0@"
                index.apply("r0", "", int.from_bytes(seq, "big"), batch)
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        stored += len(ev.block_hashes)
                        assert ev.block_size == P and ev.medium == "CPU" and ev.lora_id is None
                        assert all(len(h) == 32 for h in ev.block_hashes)
                        owner = next(p for p in prompts
                                     if ev.block_hashes[0] in hash_blocks(p, P))
                        first = hash_blocks(owner, P).index(ev.block_hashes[0])
                        assert list(ev.token_ids) == owner[first * P:
                                                           (first + len(ev.block_hashes)) * P]
                    elif isinstance(ev, BlockRemoved):
                        removed += len(ev.block_hashes)
                assert batch.data_parallel_rank == 0
            assert removed > 0 and index.gaps == 0 and not index.stale
            # The replay is the replica's exact block set.
            want = set()
            for prompt in prompts:
                hashes = hash_blocks(prompt, P)
                n = c.lookup_prefix(token_ids=prompt).cached_blocks
                assert index.cached_blocks("r0", "", hashes) == n
                want.update(hashes[:n])
            assert set(index.blocks("r0")) == want and len(want) == blocks > 0
            text = scrape(mport)
            assert f'attnd_kv_events_total{{result="published"}} {stored + removed}' in text
    finally:
        sub.close()
        ctx.term()
    # The wire form itself: vLLM's tagged maps in an array batch.
    first = next(e for batch in raw for e in batch[1] if e["type"] == "BlockStored")
    assert first["parent_block_hash"] is None  # a prompt's first block: no parent
    assert isinstance(first["block_hashes"][0], bytes) and isinstance(raw[0][0], float)
    assert raw[0][2] == 0


def test_blocks_spilled_down_a_tier_are_announced_with_their_new_medium(attnd_server, tmp_path):
    # Issue 53 item 1: a tier move of indexed blocks is announced in vLLM's terms: each block
    # removed from the medium it left (the CPU backend's device: "CPU") and stored on the one it
    # is on now (the disk tier: "STORAGE"), parent and all; vLLM's decoder reads both, and a
    # block index following the events still holds every block.
    port = free_port()
    target, _ = attnd_server([f"--kv-events=tcp://127.0.0.1:{port}", "--replica-name=r0",
                              f"--disk-cache-dir={tmp_path}", "--disk-cache-bytes=4194304"],
                             kv_pages=32)
    ctx, sub = _subscribe(port)
    index = BlockIndex()
    try:
        with AttndClient(target) as c:
            spec = c.info().model
            P = spec.page_size
            time.sleep(0.3)  # a PUB socket drops what it sends before the subscription lands
            prompt = _tokens(3 * P + 1, 77)
            hashes = hash_blocks(prompt, P)[:3]
            c.open_sequence("s", prompt_token_ids=prompt)
            step_details(c, [("s", 3 * P)], layer_inputs(spec, 3 * P, np.random.default_rng(4)))
            c.offload_sequences(["s"])
            assert c.describe_sequence("s").tier == "disk"
            events = []
            while sum(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in events) < 3:
                _, seq, payload = sub.recv_multipart()
                batch = decode_batch(payload)
                vllm = VLLM_DECODER.decode(payload)
                assert [type(e).__name__ for e in vllm.events] == \
                    [type(e).__name__ for e in batch.events]
                index.apply("r0", "", int.from_bytes(seq, "big"), batch)
                events += batch.events
            first = [(type(e).__name__, e.medium, list(e.block_hashes)) for e in events
                     if e.medium == "CPU"]
            assert ("BlockStored", "CPU", hashes) in first, first  # the prefill's
            moved_out = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"
                         for h in e.block_hashes]
            moved_in = {e.block_hashes[0]: e.parent_block_hash for e in events
                        if isinstance(e, BlockStored) and e.medium == "STORAGE"}
            assert sorted(moved_out) == sorted(hashes)
            assert moved_in == {hashes[0]: None, hashes[1]: hashes[0], hashes[2]: hashes[1]}
            assert index.cached_blocks("r0", "", hashes) == 3
            assert c.lookup_prefix(block_hashes=hashes).cached_blocks == 3
    finally:
        sub.close()
        ctx.term()


def test_the_block_index_sees_gaps_restarts_and_cleared_caches():
    h = [bytes([i]) * 32 for i in range(4)]

    def stored(*hashes):
        return KVEventBatch(0.0, (BlockStored(tuple(hashes), None, (), 16, None, "GPU"),), 0)

    ix = BlockIndex()
    ix.apply("a", "", 0, stored(h[0], h[1]))
    ix.apply("a", "", 1, stored(h[2]))
    assert ix.cached_blocks("a", "", h) == 3 and ix.cached_blocks("a", "t", h) == 0
    ix.apply("a", "", 2, KVEventBatch(0.0, (BlockRemoved((h[1],), "GPU"),), 0))
    assert ix.cached_blocks("a", "", h) == 1
    ix.apply("a", "", 4, stored(h[1]))  # 3 never came: a gap
    assert ix.stale == {"a"} and ix.gaps == 1
    ix.apply("a", "", 0, stored(h[3]))  # counting from 0 again: a restarted replica
    assert ix.stale == set() and ix.restarts == 1
    assert ix.cached_blocks("a", "", h) == 0 and set(ix.blocks("a")) == {h[3]}
    ix.apply("a", "", 1, KVEventBatch(0.0, (AllBlocksCleared(),), None))
    assert ix.blocks("a") == {}
    # Blocks on two devices: a run counts on one device.
    ix.apply("b", "", 0, stored(h[0], h[1]))
    ix.apply("b", "", 1, KVEventBatch(0.0, (BlockStored((h[2],), None, (), 16, None, "GPU"),), 1))
    assert ix.cached_blocks("b", "", h) == 2
    with pytest.raises(ValueError):
        decode_batch(b"\xc1")


def test_the_prefix_router_sends_a_prompt_to_the_replica_holding_its_prefix(attnd_server):
    ports = [free_port(), free_port()]
    targets = [attnd_server([f"--kv-events=tcp://127.0.0.1:{p}", f"--replica-name=r{i}"],
                            kv_pages=64)[0] for i, p in enumerate(ports)]
    replicas = {"r0": targets[0], "r1": targets[1]}
    events = {f"r{i}": f"tcp://127.0.0.1:{p}" for i, p in enumerate(ports)}
    router = PrefixRouter(replicas, events, block_size=16, load=lambda name: (0, 0))
    try:
        time.sleep(0.3)
        spec = router.client("r0").info().model
        P = spec.page_size
        rng = np.random.default_rng(3)
        prompts = [_tokens(2 * P + 4, 20 + i) for i in range(6)]
        homes = {}
        for i, prompt in enumerate(prompts):  # nothing cached: the rendezvous hash decides
            name, expected = router.choose(f"first{i}", prompt)
            assert expected == 0
            client = router.client_for(f"first{i}")
            assert client.open_sequence(f"first{i}", prompt_token_ids=prompt).cached_tokens == 0
            step_details(client, [(f"first{i}", 2 * P)], layer_inputs(spec, 2 * P, rng))
            client.close_sequence(f"first{i}")
            homes[i] = name
        assert set(homes.values()) == {"r0", "r1"}, "the rendezvous hash spreads new prompts"
        wait_for(lambda: all(router.index.cached_blocks(homes[i], "", hash_blocks(p, P)) == 2
                          for i, p in enumerate(prompts)), "the events arrive")
        for i, prompt in enumerate(prompts):  # the next turn: its home, whatever its id hashes to
            name, expected = router.choose(f"next{i}", prompt + _tokens(P, 40 + i))
            assert (name, expected) == (homes[i], 2)
            opened = router.client_for(f"next{i}").open_sequence(
                f"next{i}", prompt_token_ids=prompt + _tokens(P, 40 + i))
            assert opened.cached_tokens == 2 * P
        # A gap in r0's events: it is asked directly (LookupPrefix), and still found.
        router.index.stale.add("r0")
        r0_prompt = next(p for i, p in enumerate(prompts) if homes[i] == "r0")
        assert router.choose("asked", r0_prompt) == ("r0", 2)
    finally:
        router.close()
