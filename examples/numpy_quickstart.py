"""attnd from numpy: open a sequence, a 16-token prefill, one decode step (start the server first:
build/service/attnd --model=tiny; ATTND_TARGET overrides localhost:50051)."""
import os

import numpy as np
from attnd import AttndClient, LayerInputs

rng = np.random.default_rng(0)
with AttndClient(os.environ.get("ATTND_TARGET", "localhost:50051")) as client:
    spec = client.info().model  # the served model: layer kinds, heads, dims
    client.open_sequence("hello")
    for tokens in (16, 1):  # a prefill chunk, then one decode token
        step = client.begin_step([("hello", tokens)])
        for layer, kind in enumerate(spec.layers):
            shapes = {"q_latent": (spec.num_heads, spec.kv_lora_rank),
                      "q_rope": (spec.num_heads, spec.qk_rope_head_dim),
                      "kv_latent": (spec.kv_lora_rank,), "k_rope": (spec.qk_rope_head_dim,)}
            if kind == "full":  # the lightning indexer's inputs
                shapes.update(index_q=(spec.index_n_heads, spec.index_head_dim),
                              index_k=(spec.index_head_dim,), index_w=(spec.index_n_heads,))
            x = {k: rng.standard_normal((tokens, *s), dtype=np.float32) for k, s in shapes.items()}
            out = client.attend_layer(step.step_id, LayerInputs(layer, **x))  # [T, H, L]
        print(f"{tokens} token(s): last layer's output {out.shape}, "
              f"sequence length {client.describe_sequence('hello').length}")
    client.close_sequence("hello")
