"""Two micro-batches in flight (attention-FFN disaggregation, docs/data-plane.md): while attnd
runs one micro-batch's attention for a layer, the worker runs the other's FFN. One StepStream per
micro-batch, each driven by its own thread, so a layer call waits only when its attention took
longer than the other micro-batch's FFN. Start the server first (build/service/attnd --model=tiny
--data-plane=ucx; ATTND_TARGET overrides localhost:50051); without the plane it works the same,
tensors in the messages."""
import os
import threading
import time

import numpy as np
from attnd import AttndClient, AttndError, LayerInputs

FFN_SECONDS = 0.002  # a stand-in for the worker's own FFN of a layer


def layer_inputs(spec, kind, tokens, rng):
    shapes = {"q_latent": (spec.num_heads, spec.kv_lora_rank),
              "q_rope": (spec.num_heads, spec.qk_rope_head_dim),
              "kv_latent": (spec.kv_lora_rank,), "k_rope": (spec.qk_rope_head_dim,)}
    if kind == "full":
        shapes.update(index_q=(spec.index_n_heads, spec.index_head_dim),
                      index_k=(spec.index_head_dim,), index_w=(spec.index_n_heads,))
    return {k: rng.standard_normal((tokens, *s), dtype=np.float32) for k, s in shapes.items()}


def run(client, name, batch, turns, waits):
    """One micro-batch: a step per decode token; each layer's attention, then its FFN. The turn
    it must wait for is the other micro-batch's FFN (taken from `turns`)."""
    rng = np.random.default_rng(len(name))
    spec = client.info().model
    with client.stream() as stream:
        for _ in range(3):  # three decode steps
            stream.begin([(sid, 1) for sid in batch])
            for layer, kind in enumerate(spec.layers):
                x = layer_inputs(spec, kind, len(batch), rng)
                start = time.monotonic()
                stream.layer(LayerInputs(layer, **x))  # the other micro-batch's FFN runs now
                waits.append(time.monotonic() - start)
                with turns:  # this micro-batch's FFN, one at a time on the worker
                    time.sleep(FFN_SECONDS)


with AttndClient(os.environ.get("ATTND_TARGET", "localhost:50051")) as client:
    try:  # the plane now rather than after the first calls (they would ask in the background)
        client.connect_data_plane()
    except AttndError:
        pass  # no plane on this server: tensors go in the messages
    batches = {m: [f"mb{m}-{i}" for i in range(4)] for m in range(2)}
    for batch in batches.values():
        for sid in batch:
            client.open_sequence(sid)
    turns, waits = threading.Lock(), []
    threads = [threading.Thread(target=run, args=(client, f"mb{m}", batches[m], turns, waits))
               for m in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    plane = client.data_plane_name or "none (bytes in the messages)"
    print(f"data plane: {plane}; {len(waits)} layer calls, "
          f"median wait {1e3 * float(np.median(waits)):.2f} ms")
    for batch in batches.values():
        for sid in batch:
            client.close_sequence(sid)
