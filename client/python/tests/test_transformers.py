"""attnd.integrations.transformers against transformers' own DeepSeek-V3.2 and GLM-MoE-DSA code:
tiny random-weight models (fixed seed; GLM with full and shared layers; index_topk 8, pruning at
the test's lengths) whose attention runs on a real attnd produce the unmodified model's greedy
tokens over a chunked prefill and 10 decode steps, with logits within 1e-4 (relative L2, fp32
cache); with a bf16 cache, the tokens of the model whose cached keys are rounded the same way and
logits within 5e-4. Needs torch and transformers: scripts/test.sh runs this file in the cached
torch venv
with ATTND_REQUIRE_TORCH=1, where a missing import fails instead of skipping."""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import signal

import pytest

if os.environ.get("ATTND_REQUIRE_TORCH") == "1":
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from attnd import AttndClient, LayerInputs
from attnd.hf_config import spec_from_hf_config
from attnd.integrations.transformers import AttndModel

from attnd_process import start

PROMPT_LEN, CHUNK, DECODE = 21, 8, 10


def tiny_config(model_type: str):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                  topk_group=1, first_k_dense_replace=1, num_attention_heads=4,
                  num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=16, v_head_dim=16, index_n_heads=8, index_head_dim=32,
                  index_topk=8, max_position_embeddings=256, tie_word_embeddings=False)
    if model_type == "deepseek_v32":  # YaRN, so the softmax scale carries mscale^2
        return transformers.DeepseekV32Config(
            num_hidden_layers=3, **common,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})
    return transformers.GlmMoeDsaConfig(
        num_hidden_layers=5, indexer_types=["full", "shared", "full", "shared", "shared"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)


def _serve(model_type, cache_dtype, tmp_path, absorb=False):
    config = tiny_config(model_type)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32).eval()
    # Random weights of the init's small scale make flat logits: widen them so greedy choices
    # are decided by margins far above fp32 rounding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    reference = copy.deepcopy(model)
    path = tmp_path / "config.json"
    config.to_json_file(path)
    flags = [f"--hf-config={path}", f"--cache-dtype={cache_dtype}"]
    if absorb:  # the checkpoint transformers writes: the server reads its kv_b_proj weights
        model.save_pretrained(tmp_path / "checkpoint")
        flags.append(f"--absorb-from={tmp_path / 'checkpoint'}")
    proc, target, _ = start(flags, kv_pages=64)
    client = AttndClient(target, timeout=60)
    yield AttndModel(model, client, server_absorbs=absorb), reference, json.loads(path.read_text())
    client.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.fixture(params=["deepseek_v32", "glm_moe_dsa"])
def served(request, tmp_path):
    yield from _serve(request.param, "fp32", tmp_path)


@pytest.fixture(params=["deepseek_v32", "glm_moe_dsa"])
def served_bf16(request, tmp_path):
    yield from _serve(request.param, "bf16", tmp_path)


@pytest.fixture(params=["deepseek_v32", "glm_moe_dsa"])
def served_absorbing(request, tmp_path):
    yield from _serve(request.param, "fp32", tmp_path, absorb=True)


@contextlib.contextmanager
def keys_rounded_to_bf16(model):
    """The unmodified model with every cached key rounded to bf16 as attnd's bf16 cache stores
    it: the latent c_kv (also the values), the RoPE key after rotation, and the indexer key (its
    RoPE part after rotation, the rest after k_norm). Queries stay fp32."""
    rnd = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
    module = importlib.import_module(type(model).__module__)
    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn
        hooks.append(attn.kv_a_layernorm.register_forward_hook(lambda m, i, o: rnd(o)))
        idx = getattr(attn, "indexer", None)
        if idx is not None:
            r = idx.qk_rope_head_dim

            def pass_part(m, i, o, r=r):
                return torch.cat([o[..., :r], rnd(o[..., r:])], dim=-1)
            hooks.append(idx.k_norm.register_forward_hook(pass_part))
    saved = {}
    for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):
        fn = getattr(module, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def rounded(q, k, *args, _fn=fn, **kwargs):
            q2, k2 = _fn(q, k, *args, **kwargs)
            return q2, rnd(k2)
        setattr(module, name, rounded)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for name, fn in saved.items():
            setattr(module, name, fn)


def reference_greedy(model, prompt, n):
    """The unmodified model, recomputing the whole sequence each step (no cache)."""
    seq, tokens, logits = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n + 1):
            out = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            logits.append(out)
            if len(tokens) == n:
                break
            tokens.append(int(out.argmax()))
            seq.append(tokens[-1])
    return tokens, logits


def rel_l2(a, b):
    return float((a - b).norm() / b.norm())


def test_the_server_serves_the_models_spec(served):
    adapter, _, config = served
    want = spec_from_hf_config(config)
    spec = adapter.spec
    assert spec.layers == want["layers"] and spec.index_topk == 8
    assert spec.sm_scale == pytest.approx(adapter.layers[0].attn.scaling, rel=1e-12)
    if config["model_type"] == "glm_moe_dsa":
        assert spec.layers == ("full", "shared", "full", "shared", "shared")


def test_greedy_tokens_and_logits_match_the_unmodified_model(served):
    adapter, reference, _ = served
    prompt = torch.randint(0, 96, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))
    want_tokens, want_logits = reference_greedy(reference, prompt.tolist(), DECODE)

    adapter.open("s")
    logits = None
    for start_tok in range(0, PROMPT_LEN, CHUNK):  # chunked prefill: 8 + 8 + 5 tokens
        (logits,) = adapter.forward([("s", prompt[start_tok:start_tok + CHUNK])])
    got_tokens = []
    for i in range(DECODE):
        err = rel_l2(logits[-1], want_logits[i])
        assert err < 1e-4, f"step {i}: logits differ by {err:.2e} (relative L2)"
        assert not torch.isnan(logits).any()
        got_tokens.append(int(logits[-1].argmax()))
        (logits,) = adapter.forward([("s", torch.tensor([got_tokens[-1]]))])
    assert rel_l2(logits[-1], want_logits[DECODE]) < 1e-4
    assert got_tokens == want_tokens
    assert adapter.client.describe_sequence("s").length == PROMPT_LEN + DECODE
    adapter.close("s")
    # The selection matters at these lengths: the same weights attending densely decide otherwise.
    dense = copy.deepcopy(reference)
    for layer in dense.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.index_topk = 10 ** 6
    _, dense_logits = reference_greedy(dense, prompt.tolist(), DECODE)
    assert max(rel_l2(d, w) for d, w in zip(dense_logits, want_logits)) > 1e-2


def test_mixed_batches_and_forks_equal_separate_runs(served):
    adapter, _, _ = served
    g = torch.Generator().manual_seed(9)
    a, b = torch.randint(0, 96, (12,), generator=g), torch.randint(0, 96, (9,), generator=g)
    # Alone: a prefilled, then one decode token; b prefilled.
    adapter.open("a1")
    adapter.forward([("a1", a)])
    (alone_a,) = adapter.forward([("a1", torch.tensor([3]))])
    adapter.open("b1")
    (alone_b,) = adapter.forward([("b1", b)])
    # Together: a's decode token and b's whole prefill in one step.
    adapter.open("a2")
    adapter.forward([("a2", a)])
    adapter.open("b2")
    mixed_a, mixed_b = adapter.forward([("a2", torch.tensor([3])), ("b2", b)])
    assert rel_l2(mixed_a, alone_a) < 1e-5 and rel_l2(mixed_b, alone_b) < 1e-5
    # A fork of a's first 10 tokens continued with a's last 2 equals a itself.
    adapter.fork("a3", "a1", 10)
    (forked,) = adapter.forward([("a3", a[10:])])
    (whole,) = adapter.forward([("a2", torch.tensor([4]))])  # a2 moves on; compare a1's prefill
    adapter.open("a4")
    (fresh,) = adapter.forward([("a4", a)])
    assert rel_l2(forked, fresh[10:]) < 1e-5
    for sid in ("a1", "b1", "a2", "b2", "a3", "a4"):
        adapter.close(sid)
    assert adapter.client.list_sequences() == []


def _bf16_layers(spec, T, g):
    """One step's layer inputs for T tokens as bf16 torch tensors (random, seeded by `g`)."""
    layers = []
    for kind in spec.layers:
        t = dict(q_latent=torch.randn(T, spec.num_heads, spec.kv_lora_rank, generator=g),
                 q_rope=torch.randn(T, spec.num_heads, spec.qk_rope_head_dim, generator=g),
                 kv_latent=torch.randn(T, spec.kv_lora_rank, generator=g),
                 k_rope=torch.randn(T, spec.qk_rope_head_dim, generator=g))
        if kind == "full":
            t.update(index_q=torch.randn(T, spec.index_n_heads, spec.index_head_dim, generator=g),
                     index_k=torch.randn(T, spec.index_head_dim, generator=g),
                     index_w=torch.randn(T, spec.index_n_heads, generator=g))
        layers.append({k: v.to(torch.bfloat16) for k, v in t.items()})
    return layers


def test_torch_tensors_go_on_the_wire_as_numpy_would(served):
    """CPU torch tensors (bf16 included, a grad-tracking one detached) give the bytes and outputs
    the ml_dtypes arrays give; mixed datatypes are refused before anything is sent."""
    import ml_dtypes
    import numpy as np

    from attnd import as_numpy, to_tensor

    adapter, _, _ = served
    c, spec = adapter.client, adapter.spec
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, generator=g, dtype=torch.float32)
    assert as_numpy(x).ctypes.data == x.data_ptr()  # shared, not copied
    b = x.to(torch.bfloat16)
    assert to_tensor(b).data == to_tensor(x.numpy().astype(ml_dtypes.bfloat16)).data
    assert to_tensor(x.requires_grad_()).datatype == "FP32"
    layers = _bf16_layers(spec, 2, g)
    outs = {}
    for name, convert in (("torch", lambda v: v), ("numpy", as_numpy)):
        c.open_sequence(name)
        step = c.begin_step([(name, 2)])
        outs[name] = [c.attend_layer(step.step_id,
                                     LayerInputs(i, **{k: convert(v) for k, v in x.items()}))
                      for i, x in enumerate(layers)]
        c.close_sequence(name)
    for a, b in zip(outs["torch"], outs["numpy"]):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
        assert not np.isnan(a.astype(np.float32)).any()
    c.open_sequence("mixed")
    step = c.begin_step([("mixed", 2)])
    mixed = dict(layers[0], index_w=layers[0]["index_w"].float())
    with pytest.raises(TypeError, match="one datatype per layer call"):
        c.attend_layer(step.step_id, LayerInputs(0, **mixed))
    c.abort_step(step.step_id)
    c.close_sequence("mixed")


def test_a_bf16_cache_matches_the_model_with_its_keys_rounded_the_same_way(served_bf16):
    adapter, reference, _ = served_bf16
    prompt = torch.randint(0, 96, (PROMPT_LEN,), generator=torch.Generator().manual_seed(6))
    with keys_rounded_to_bf16(reference):
        want_tokens, want_logits = reference_greedy(reference, prompt.tolist(), DECODE)
    _, exact_logits = reference_greedy(reference, prompt.tolist(), DECODE)
    adapter.open("s")
    for start_tok in range(0, PROMPT_LEN, CHUNK):
        (logits,) = adapter.forward([("s", prompt[start_tok:start_tok + CHUNK])])
    got_tokens, worst, rounding = [], 0.0, 0.0
    for i in range(DECODE):
        worst = max(worst, rel_l2(logits[-1], want_logits[i]))
        rounding = max(rounding, rel_l2(want_logits[i], exact_logits[i]))
        got_tokens.append(int(logits[-1].argmax()))
        (logits,) = adapter.forward([("s", torch.tensor([got_tokens[-1]]))])
    adapter.close("s")
    assert got_tokens == want_tokens
    # Measured: 9e-5 (DeepSeek) and 1.2e-4 (GLM), against 1e-6 with the fp32 cache; the
    # rounding itself moves these chaotic random models' logits by 0.16-1.6.
    assert worst < 5e-4, f"logits differ from the rounded-key model by {worst:.2e}"
    assert rounding > 100 * worst, (rounding, worst)


def test_outputs_and_shared_memory_as_torch_tensors(served):
    """as_torch=True gives the output as a torch tensor holding the numpy output's bytes; an
    arena takes torch tensors and reads back as torch (shared memory, no copies)."""
    import numpy as np

    from attnd import ShmArena

    adapter, _, _ = served
    c, spec = adapter.client, adapter.spec
    g = torch.Generator().manual_seed(4)
    layers = _bf16_layers(spec, 1, g)
    got = {}
    for name, as_torch in (("t", True), ("n", False)):
        c.open_sequence(name)
        step = c.begin_step([(name, 1)])
        got[name] = [c.attend_layer(step.step_id, LayerInputs(i, as_torch=as_torch, **x))
                     for i, x in enumerate(layers)]
        c.close_sequence(name)
    for t, n in zip(got["t"], got["n"]):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
        np.testing.assert_array_equal(t.view(torch.int16).numpy(), n.view(np.int16))
    arena = ShmArena(1 << 16)
    try:
        x = layers[0]["q_latent"]
        slot = arena.put(x)
        back = arena.read(slot, as_torch=True)
        assert back.dtype == torch.bfloat16 and torch.equal(back, x)
        del back  # a live view keeps the memory mapped: close() would refuse (BufferError)
    finally:
        arena.close()


def test_generate_from_a_forked_shared_prefix_equals_a_fresh_generate(served):
    """Two requests sharing a system prompt: the second forks the first's cached prefix and
    prefills only its own tail, and decodes exactly what a fresh request would."""
    adapter, reference, _ = served
    g = torch.Generator().manual_seed(11)
    system, tail = torch.randint(0, 96, (13,), generator=g), torch.randint(0, 96, (6,), generator=g)
    prompt = torch.cat([system, tail]).tolist()
    fresh = adapter.generate("fresh", prompt, 8, prefill_chunk=5)
    adapter.open("system")
    adapter.forward([("system", system)])
    forked = adapter.generate("forked", prompt, 8, prefill_chunk=5, prefix_of="system",
                              prefix_len=13)
    adapter.close("system")
    assert forked == fresh == reference_greedy(reference, prompt, 8)[0]
    assert adapter.client.list_sequences() == []


def test_server_side_absorption_from_save_pretrained_gives_the_models_tokens(served_absorbing):
    # attnd reads kv_b_proj from the checkpoint save_pretrained wrote; the worker sends q_nope
    # and gets the values back: the same greedy tokens, logits within 1e-4.
    adapter, reference, config = served_absorbing
    info = adapter.client.info().absorption
    assert (info.qk_nope_head_dim, info.v_head_dim) == (16, 16)
    prompt = torch.randint(0, 96, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    want_tokens, want_logits = reference_greedy(reference, prompt.tolist(), DECODE)
    adapter.open("s")
    logits = None
    for start_tok in range(0, PROMPT_LEN, CHUNK):
        (logits,) = adapter.forward([("s", prompt[start_tok:start_tok + CHUNK])])
    got_tokens = []
    for i in range(DECODE):
        err = rel_l2(logits[-1], want_logits[i])
        assert err < 1e-4, f"step {i}: logits differ by {err:.2e} (relative L2)"
        got_tokens.append(int(logits[-1].argmax()))
        (logits,) = adapter.forward([("s", torch.tensor([got_tokens[-1]]))])
    assert got_tokens == want_tokens


def test_the_patched_model_says_so_outside_a_step_and_detach_restores_it(served):
    adapter, reference, _ = served
    model = adapter.model
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(11))
    with pytest.raises(RuntimeError, match="patched by attnd's AttndModel"):
        model(input_ids=ids, use_cache=False)
    with torch.no_grad():
        want = reference(input_ids=ids, use_cache=False).logits
    adapter.detach()
    adapter.detach()  # idempotent
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want), "after detach the model is the unmodified one"
    with pytest.raises(RuntimeError, match="detach"):
        adapter.forward([("s", torch.tensor([1]))])


def test_the_readme_transformers_quick_start_runs_as_written_in_under_a_minute():
    # examples/tiny_transformers.py (shown verbatim in the README: test_quickstart.py checks)
    # exits 0 only when attnd's greedy tokens equal the unmodified model's.
    import subprocess
    import sys
    import time

    from attnd_process import ATTND_BIN, ROOT
    env = dict(os.environ, ATTND_BIN=str(ATTND_BIN),
               PYTHONPATH=os.pathsep.join([str(ROOT / "client" / "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_transformers.py")],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    assert time.monotonic() - t0 < 60
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("attnd: [") and lines[0][7:] == lines[1][7:], r.stdout
