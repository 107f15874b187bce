"""Random layer tensors for the tests that start their own attnd (float32, N(0, 1))."""

from __future__ import annotations

import numpy as np


def random_layer(spec, kind, T, rng, q_nope_dim=None):
    """One layer call's tensors for T tokens: the query (q_latent, or q_nope [T, H, q_nope_dim]
    for server-side absorption), q_rope, the new keys and, on full layers, the indexer's."""
    x = {"q_nope" if q_nope_dim else "q_latent":
         rng.standard_normal((T, spec.num_heads, q_nope_dim or spec.kv_lora_rank)),
         "q_rope": rng.standard_normal((T, spec.num_heads, spec.qk_rope_head_dim)),
         "kv_latent": rng.standard_normal((T, spec.kv_lora_rank)),
         "k_rope": rng.standard_normal((T, spec.qk_rope_head_dim))}
    if kind == "full":
        x["index_q"] = rng.standard_normal((T, spec.index_n_heads, spec.index_head_dim))
        x["index_k"] = rng.standard_normal((T, spec.index_head_dim))
        x["index_w"] = rng.standard_normal((T, spec.index_n_heads))
    return {k: v.astype(np.float32) for k, v in x.items()}
