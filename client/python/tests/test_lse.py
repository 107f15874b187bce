"""LSE (docs/numerics.md) through a real server: a layer call may ask for each query head's
log-sum-exp; it equals the float64 log-sum-exp of the head's scaled (and, on dense layers,
soft-capped) scores over exactly the keys it attended, on every layer kind, unary and streamed;
outputs of one query over disjoint key sets merge (merge_attention) to the attention over their
union; and the request is refused where it means nothing."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from attnd import AttndClient, AttndError, LayerInputs, merge_attention

from attnd_process import start, stop
from attnd_testlib import decode_with_lse as _decode
from attnd_testlib import fp32_keys as _keys
from attnd_testlib import fp32_queries as _queries
from attnd_testlib import key_rows as _rows
from attnd_testlib import reference_attention as _reference
from attnd_testlib import rel_err as _rel
from attnd_testlib import run_sharded
from attnd_testlib import write_keys as _write

CAP = 30.0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    spec = tmp_path_factory.mktemp("lse") / "lse.json"
    # Every layer kind, a soft cap on the dense ones, fp32 throughout: the comparisons are exact.
    spec.write_text(json.dumps({"base": "tiny", "name": "lse", "layers": "DFSD",
                                "soft_cap": CAP}))
    proc, target, _ = start(["--cache-dtype=fp32", f"--model-file={spec}"], kv_pages=64)
    yield target
    stop(proc)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_lse_is_the_log_sum_exp_over_the_attended_keys_on_every_layer_kind(target, stream):
    rng = np.random.default_rng(5 + stream)
    with AttndClient(target, timeout=30) as c:
        spec = c.info().model
        sid = f"whole-{stream}"
        c.open_sequence(sid)
        n = 40  # more than K = 24: full and shared layers attend a selection
        keys, new_key, queries = _keys(spec, n, rng), _keys(spec, 1, rng), _queries(spec, rng)
        _write(c, sid, keys)
        results = _decode(c, sid, new_key, queries, stream=stream)
        for layer, (kind, r) in enumerate(zip(spec.layers, results)):
            assert r.lse.dtype == np.float32 and r.lse.shape == (1, spec.num_heads)
            assert not np.isnan(r.lse).any() and np.isfinite(r.lse).all()
            attended = r.attended[0]
            assert len(attended) == (n + 1 if kind == "dense" else spec.index_topk)
            ref_out, ref_lse = _reference(spec, kind, _rows(keys, new_key, layer)[attended],
                                          queries[layer])
            np.testing.assert_allclose(r.lse[0], ref_lse, rtol=1e-6, atol=1e-5,
                                       err_msg=f"layer {layer} ({kind})")
            assert _rel(r.out[0], ref_out) <= 1e-5, (layer, kind)
        # Without asking, nothing comes back.
        step = c.begin_step([(sid, 1)])
        plain = c.attend_layer_details(step.step_id,
                                       LayerInputs(0, **dict(new_key[0], **queries[0])))
        assert plain.lse is None
        c.abort_step(step.step_id)


def test_outputs_over_disjoint_keys_merge_to_the_attention_over_their_union(target):
    # One query over a sequence split in three (as across servers): each part attends its own
    # keys and the decode token's; merging the parts equals attention over all of them (the
    # decode token's key counted once per part), on the dense layers, which attend every key.
    rng = np.random.default_rng(9)
    with AttndClient(target, timeout=30) as c:
        spec = c.info().model
        keys, new_key, queries = _keys(spec, 45, rng), _keys(spec, 1, rng), _queries(spec, rng)
        bounds = [(0, 17), (17, 18), (18, 45)]  # one part holds a single key
        parts = []
        for i, (lo, hi) in enumerate(bounds):
            sid = f"part-{i}"
            c.open_sequence(sid)
            _write(c, sid, [{k: v[lo:hi] for k, v in x.items()} for x in keys])
            parts.append(_decode(c, sid, new_key, queries))
        for layer, kind in enumerate(spec.layers):
            if kind != "dense":
                continue  # sparse layers need the global top-k across parts (not this test)
            out, lse = merge_attention([p[layer].out for p in parts],
                                       [p[layer].lse for p in parts])
            rows = _rows(keys, new_key, layer)
            union = np.concatenate([np.concatenate([rows[lo:hi], rows[-1:]])
                                    for lo, hi in bounds])
            ref_out, ref_lse = _reference(spec, kind, union, queries[layer])
            assert out.dtype == np.float32 and lse.shape == (1, spec.num_heads)
            assert not np.isnan(out).any()
            assert _rel(out[0], ref_out) <= 1e-5, layer
            np.testing.assert_allclose(lse[0], ref_lse, rtol=1e-6, atol=1e-5)


def test_merge_attention_weights_parts_by_their_lse_and_skips_empty_ones():
    rng = np.random.default_rng(2)
    o1, o2 = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    l1, l2 = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    l2[1, 2] = -np.inf  # part 2 saw nothing for this head
    out, lse = merge_attention([o1, o2], [l1, l2])
    w1, w2 = np.exp(l1), np.exp(l2)
    np.testing.assert_allclose(out, (w1[..., None] * o1 + w2[..., None] * o2) /
                               (w1 + w2)[..., None], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, np.log(w1 + w2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[1, 2], o1[1, 2], rtol=1e-6)
    # No part saw a key: 0 and -inf, as one server attending nothing reports.
    none = np.full((2, 3), -np.inf)
    out, lse = merge_attention([o1, o2], [none, none])
    assert (out == 0).all() and np.isneginf(lse).all()
    # A NaN lse makes its row NaN; a part of weight 0 adds nothing even if its output is NaN.
    l3, o3 = l1.copy(), o2.copy()
    l3[0, 0] = np.nan
    o3[0, 1] = np.nan
    l4 = l2.copy()
    l4[0, 1] = -np.inf
    out, lse = merge_attention([o1, o3], [l3, l4])
    assert np.isnan(lse[0, 0]) and np.isnan(out[0, 0]).all()
    np.testing.assert_allclose(out[0, 1], o1[0, 1], rtol=1e-6)
    assert not np.isnan(out[1]).any()
    with pytest.raises(ValueError, match="one lse per output"):
        merge_attention([o1, o2], [l1])
    with pytest.raises(ValueError, match=r"\[T, H, L\]"):
        merge_attention([o1], [l1[:, :2]])


def test_lse_is_refused_on_write_only_steps_and_nothing_is_written(target):
    rng = np.random.default_rng(3)
    with AttndClient(target, timeout=30) as c:
        spec = c.info().model
        c.open_sequence("wo")
        keys = _keys(spec, 5, rng)
        step = c.begin_step([("wo", 5)], write_only=True)
        with pytest.raises(AttndError) as e:
            c.attend_layer_details(step.step_id, LayerInputs(0, return_lse=True, **keys[0]))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "return_lse: a write-only step attends nothing" in e.value.details
        assert c.describe_sequence("wo").length == 0


def test_each_shard_gets_its_heads_lse_as_the_unsharded_step_has_them(target):

    rng = np.random.default_rng(4)
    with AttndClient(target, timeout=30) as c, AttndClient(target, timeout=30) as c1:
        spec = c.info().model
        keys, new_key, queries = _keys(spec, 30, rng), _keys(spec, 1, rng), _queries(spec, rng)
        for sid in ("sh-x", "sh-y"):
            c.open_sequence(sid)
            _write(c, sid, keys)
        whole = _decode(c, "sh-y", new_key, queries)
        tensors = [dict(k, **q) for k, q in zip(new_key, queries)]
        sharded = run_sharded([c, c1], [("sh-x", 1)], tensors, 2,
                              layer_kwargs=lambda k, i, msg: dict(msg, return_lse=True),
                              details=True)
        for layer, parts in enumerate(sharded):
            assert [p.lse.shape for p in parts] == [(1, spec.num_heads // 2)] * 2
            got = np.concatenate([p.lse for p in parts], axis=1)
            assert np.array_equal(got, whole[layer].lse), layer  # one computation over all heads
