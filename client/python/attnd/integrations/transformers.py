"""Serving a transformers DeepSeek-V3.2 or GLM-MoE-DSA model's attention through attnd.

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with AttndClient("attnd:50051") as client:
        served = AttndModel(model, client)  # attnd started with --hf-config=path/config.json
        tokens = served.generate("req-1", prompt_ids, max_new_tokens=32, prefill_chunk=512)

The worker keeps everything but the attention core: embeddings, norms, the q/kv projections, RoPE,
the indexer's projections, W_UV, o_proj, the MLPs and MoE. Per layer it sends attnd the absorbed
query and the new keys; attnd owns the paged latent and indexer-key caches, runs the lightning
indexer and exact top-k (or reuses the last full layer's selection on GLM's "shared" layers), and
returns the latent output. The KV cache lives only on attnd: the model runs with use_cache=False.

How the model's semantics are bridged:
- Absorption: kv_b_proj's weight [H*(nope+v), L] is split per head into W_UK [H, nope, L] and
  W_UV [H, v, L]; the query sent is q_latent = q_nope @ W_UK (so q_latent . c = q_nope . k_nope)
  and the output is out_latent @ W_UV^T, exactly the model's per-head keys and values. With
  ``server_absorbs`` the server does both from the checkpoint (q_nope sent, values returned).
- RoPE: the model's own functions on the model's own cos/sin: interleaved pairs for MLA (both
  models), half-split for DeepSeek-V3.2's indexer, interleaved for GLM's.
- Indexer constants: the model scores relu(softmax_scale * q.k) * w * Hi^-0.5; both constants
  are positive, so they are folded into index_w (attnd scores sum_h w_h relu(q_h.k)).
- Softmax scale: attnd's spec must carry the module's `scaling` (YaRN's mscale^2 included):
  checked when the adapter is made.
- Selection: each query its own causal top-k over the keys it sees (prefill like decode), all of
  them while it sees at most index_topk. Exact ties go to the lower position in attnd; the model's
  torch.topk breaks them arbitrarily. They are not rare with few indexer heads: a key whose every
  head's q.k is negative scores exactly 0 after relu (one key in four with 2 heads), so two such
  keys at the top-k boundary can be selected differently. With DeepSeek's 64 heads (or the 8 of
  the tests) that is vanishingly rare.
- Batches: every sequence's new tokens are packed into one row with their own position ids, so a
  batch may mix prefill chunks and decode tokens of different sequences.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..client import AttndClient, LayerInputs
from ..hf_config import check_spec_matches

_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")


class _Layer:
    """One attention module's replacement forward."""

    def __init__(self, owner: AttndModel, index: int, attn, rope_module) -> None:
        self.owner, self.index, self.attn, self.rope = owner, index, attn, rope_module
        w = attn.kv_b_proj.weight.detach().float()
        h, nope, v = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
        w = w.view(h, nope + v, attn.kv_lora_rank)
        self.w_uk = w[:, :nope, :].contiguous()  # [H, nope, L]
        self.w_uv = w[:, nope:, :].contiguous()  # [H, v, L]
        self.returns_topk = owner.model_type == "glm_moe_dsa"

    def forward(self, hidden_states, position_embeddings, attention_mask=None, *args, **kwargs):
        attn, owner = self.attn, self.owner
        if owner._step is None:
            raise RuntimeError(
                "this model's attention is patched by attnd's AttndModel: run it through "
                "AttndModel.forward() or .generate() (a plain model(...) or model.generate() has "
                "no attnd step to attend in), or call AttndModel.detach() to restore it")
        b, s, _ = hidden_states.shape
        if b != 1:
            raise ValueError("AttndModel packs every sequence into one row (batch size 1)")
        cos, sin = position_embeddings
        dtype = owner.wire_dtype
        # Queries and keys, exactly as the module computes them.
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden_states))
        q = attn.q_b_proj(q_resid).view(b, s, attn.num_heads, attn.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        ckv = attn.kv_a_proj_with_mqa(hidden_states)
        kv, k_rot = torch.split(ckv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        c_kv = attn.kv_a_layernorm(kv)  # [1, S, L]
        k_rot = k_rot.view(b, 1, s, attn.qk_rope_head_dim)
        q_rot, k_rot = self.rope.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        # Absorbed query [T, H, L], its RoPE part [T, H, R]; the keys [T, L], [T, R].
        if owner.server_absorbs:  # the server holds W_UK and W_UV: q_nope goes as it is
            tensors = dict(q_nope=q_nope[0].transpose(0, 1))
        else:
            tensors = dict(q_latent=torch.einsum("hsn,hnl->shl", q_nope[0].float(), self.w_uk))
        tensors.update(q_rope=q_rot[0].transpose(0, 1), kv_latent=c_kv[0], k_rope=k_rot[0, 0])
        indexer = getattr(attn, "indexer", None)
        if indexer is not None:
            tensors.update(self._indexer(indexer, hidden_states, q_resid, cos, sin))
        wire = {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}
        out = owner._attend(self.index, wire)  # [T, H, L], or the values [T, H, V] if absorbed
        if not owner.server_absorbs:
            out = torch.einsum("shl,hvl->shv", out.float(), self.w_uv)
        o = out.reshape(b, s, -1)
        o = attn.o_proj(o.to(hidden_states.dtype))
        return (o, None, None) if self.returns_topk else (o, None)

    def _indexer(self, idx, hidden_states, q_resid, cos, sin):
        b, s, _ = hidden_states.shape
        q = idx.wq_b(q_resid).view(b, s, idx.n_heads, idx.head_dim)
        rope = idx.qk_rope_head_dim
        q_rot, q_pass = torch.split(q, [rope, idx.head_dim - rope], dim=-1)
        k = idx.k_norm(idx.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [rope, idx.head_dim - rope], dim=-1)
        if self.owner.model_type == "deepseek_v32":  # half-split RoPE in V3.2's indexer
            q_rot, k_rot = self.rope.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        else:  # GLM's indexer: interleaved
            q_rot, k_rot = self.rope.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin,
                                                                      unsqueeze_dim=2)
        index_q = torch.cat([q_rot, q_pass], dim=-1)[0]  # [T, Hi, Di]
        index_k = torch.cat([k_rot, k_pass], dim=-1)[0, :, 0]  # [T, Di]
        weights = idx.weights_proj(hidden_states.to(idx.weights_proj.weight.dtype)).float()
        # relu(c * q.k) * w * Hi^-0.5 == relu(q.k) * (w * c * Hi^-0.5) for c > 0.
        index_w = weights[0] * (idx.n_heads ** -0.5) * idx.softmax_scale
        return dict(index_q=index_q, index_k=index_k, index_w=index_w)


class AttndModel:
    """A transformers DeepSeek-V3.2 / GLM-MoE-DSA causal LM whose attention runs on attnd.

    It patches ``model`` in place: every attention module's ``forward`` (the instance's, the
    class stays untouched) is replaced by one that sends the layer to attnd, so the model then
    runs only through this object's :meth:`forward` and :meth:`generate`; called directly it
    raises a RuntimeError saying so. :meth:`detach` (or leaving a ``with AttndModel(...)``
    block) restores the model's own attention.

    ``wire_dtype``: the datatype of what is sent (torch.float32 or torch.bfloat16); the cache's
    is the server's --cache-dtype. ``server_absorbs``: the server holds this checkpoint's
    kv_b_proj (attnd --absorb-from): send q_nope, receive the values (80 KB per token per layer
    instead of 288 KB at DeepSeek dims). Sequences are opened by :meth:`open` or
    :meth:`fork` (a shared
    prefix), extended by :meth:`forward` (any mix of prefill chunks and decode tokens) and
    :meth:`generate`, and closed by :meth:`close`. Not thread-safe (one step at a time)."""

    def __init__(self, model, client: AttndClient, *, wire_dtype=torch.float32,
                 server_absorbs: bool = False) -> None:
        config = model.config
        self.model_type = config.model_type
        if self.model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r}: AttndModel serves {_MODEL_TYPES}")
        self.model, self.client, self.wire_dtype = model, client, wire_dtype
        self.server_absorbs = server_absorbs
        info = client.info()
        check_spec_matches(info.model, config)
        if server_absorbs:
            a = info.absorption
            want = (config.qk_nope_head_dim, config.v_head_dim)
            if a is None or (a.qk_nope_head_dim, a.v_head_dim) != want:
                raise ValueError(f"server_absorbs: the server holds {a} (start attnd with "
                                 f"--absorb-from=<this checkpoint>); the model needs "
                                 f"qk_nope_head_dim, v_head_dim = {want}")
        self.spec = info.model
        rope_module = importlib.import_module(type(model).__module__)
        self.layers: List[_Layer] = []
        for i, decoder in enumerate(model.model.layers):
            attn = decoder.self_attn
            if abs(attn.scaling - self.spec.sm_scale) > 1e-9 * attn.scaling:
                raise ValueError(f"layer {i}: the module's softmax scale {attn.scaling} is not the "
                                 f"server's sm_scale {self.spec.sm_scale}")
            layer = _Layer(self, i, attn, rope_module)
            attn.forward = layer.forward  # the instance's forward: the class stays untouched
            self.layers.append(layer)
        self.lengths: Dict[str, int] = {}
        self._step: Optional[int] = None

    def detach(self) -> None:
        """Restores every attention module's own forward: the model runs as before it was
        patched (its sequences on attnd stay open; close them first). Idempotent."""
        for layer in self.layers:
            layer.attn.__dict__.pop("forward", None)
        self.layers = []

    def __enter__(self) -> AttndModel:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- sequences --

    def open(self, sequence_id: str) -> None:
        self.client.open_sequence(sequence_id)
        self.lengths[sequence_id] = 0

    def fork(self, sequence_id: str, parent: str, prefix_len: int) -> None:
        """A new sequence holding the first ``prefix_len`` tokens of ``parent`` (shared pages)."""
        self.client.open_sequence(sequence_id, fork_parent=parent, prefix_len=prefix_len)
        self.lengths[sequence_id] = prefix_len

    def close(self, sequence_id: str) -> None:
        self.client.close_sequence(sequence_id)
        self.lengths.pop(sequence_id, None)

    # -- steps --

    def _attend(self, layer: int, tensors) -> torch.Tensor:
        return self.client.attend_layer(self._step, LayerInputs(layer, as_torch=True, **tensors))

    @torch.no_grad()
    def forward(self, batch: Sequence[Tuple[str, torch.Tensor]]) -> List[torch.Tensor]:
        """One step: each (sequence id, new token ids [n]) appended to its sequence; returns each
        entry's logits [n, vocab]. A failure aborts the step: every sequence stays as it was."""
        if not self.layers:
            raise RuntimeError("AttndModel.detach() was called: the model no longer runs on attnd")
        ids = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for _, t in batch]
        positions = [torch.arange(self.lengths[sid], self.lengths[sid] + len(t))
                     for (sid, _), t in zip(batch, ids)]
        step = self.client.begin_step([(sid, len(t)) for (sid, _), t in zip(batch, ids)])
        self._step = step.step_id
        try:
            out = self.model(input_ids=torch.cat(ids)[None],
                             position_ids=torch.cat(positions)[None], use_cache=False)
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_step(step.step_id)
            raise
        finally:
            self._step = None
        for (sid, _), t in zip(batch, ids):
            self.lengths[sid] += len(t)
        return list(torch.split(out.logits[0], [len(t) for t in ids]))

    @torch.no_grad()
    def generate(self, sequence_id: str, prompt: Sequence[int], max_new_tokens: int, *,
                 prefill_chunk: int = 512, prefix_of: Optional[str] = None,
                 prefix_len: int = 0) -> List[int]:
        """Greedy decoding: opens the sequence, prefills ``prompt`` in chunks, decodes
        ``max_new_tokens``, closes it; returns the new tokens. ``prefix_of``: a sequence already
        holding the first ``prefix_len`` tokens of ``prompt`` (a shared system prompt): the new
        one is forked from it (its pages shared, not recomputed) and only the rest is
        prefilled."""
        prompt = torch.as_tensor(prompt, dtype=torch.long)
        if prefix_of is not None:
            if not 0 < prefix_len < len(prompt):
                raise ValueError(f"prefix_len {prefix_len} must be in (0, {len(prompt)})")
            self.fork(sequence_id, prefix_of, prefix_len)
        else:
            self.open(sequence_id)
        try:
            logits = None
            for start in range(self.lengths[sequence_id], len(prompt), prefill_chunk):
                (logits,) = self.forward([(sequence_id, prompt[start:start + prefill_chunk])])
            tokens: List[int] = []
            for _ in range(max_new_tokens):
                tokens.append(int(logits[-1].argmax()))
                (logits,) = self.forward([(sequence_id, torch.tensor([tokens[-1]]))])
            return tokens
        finally:
            self.close(sequence_id)
