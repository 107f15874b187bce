"""Model specs from Hugging Face configs: what ``attnd --hf-config=config.json`` serves, computed
the same way on the worker's side so it can check the server matches its model (common/hf_config.h
is the C++ twin; tests compare the two)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Union

# transformers' defaults for absent fields (configuration_deepseek_v32.py,
# configuration_glm_moe_dsa.py).
_DEFAULTS = {
    "deepseek_v32": dict(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, index_n_heads=64,
                         index_head_dim=128, index_topk=2048, max_position_embeddings=163840),
    "glm_moe_dsa": dict(num_hidden_layers=78, num_attention_heads=64, kv_lora_rank=512,
                        qk_rope_head_dim=64, qk_nope_head_dim=192, index_n_heads=32,
                        index_head_dim=128, index_topk=2048, max_position_embeddings=202752),
}


def _int(c: Mapping[str, Any], key: str, default: int) -> int:
    """An integer field as the C++ reader takes it: a JSON number without a fraction (not a
    bool or a string); absent or null: the default."""
    v = c.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise ValueError(f"--hf-config: '{key}' must be an integer, not {v!r}")
    return int(v)


def _layers(c: Mapping[str, Any], model_type: str, n: int) -> List[str]:
    if model_type == "deepseek_v32":
        return ["full"] * n
    for key in ("indexer_types", "index_topk_pattern"):
        v = c.get(key)
        if v is None:
            continue
        kinds = [{"F": "full", "S": "shared", "full": "full", "shared": "shared"}.get(k)
                 for k in (list(v) if isinstance(v, str) else v)]
        if None in kinds or len(kinds) != n:
            raise ValueError(f"{key}: {v!r} is not {n} of full/shared")
        return kinds
    freq = max(_int(c, "index_topk_freq", 1), 1)
    offset = _int(c, "index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _mscale_squared(c: Mapping[str, Any]) -> float:
    """As the C++ reader: the first of rope_parameters / rope_scaling that is present and not
    null decides (an empty one means the default type)."""
    key = next((k for k in ("rope_parameters", "rope_scaling") if c.get(k) is not None), None)
    if key is None:
        return 1.0
    rope = c[key]
    if not isinstance(rope, Mapping):
        raise ValueError(f"--hf-config: '{key}' must be an object")
    kind = rope["rope_type"] if "rope_type" in rope else rope.get("type", "default")
    if not isinstance(kind, str):
        raise ValueError(f"--hf-config {key}: 'rope_type' must be a string, not {kind!r}")
    all_dim = rope.get("mscale_all_dim") or 0
    if kind == "default" or not all_dim:
        return 1.0
    factor = float(rope["factor"])
    m = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
    return m * m


def spec_from_hf_config(config: Union[Mapping[str, Any], Any]) -> Dict[str, Any]:
    """The attnd model spec of a DeepSeek-V3.2 (``deepseek_v32``) or GLM-5 (``glm_moe_dsa``)
    config — a config.json dict or a transformers ``PretrainedConfig`` — as a dict with the
    fields of :class:`attnd.ModelSpec` that the model determines: name, layers, kv_lora_rank,
    qk_rope_head_dim, num_heads, index_n_heads, index_head_dim, index_topk, sm_scale,
    max_context. Raises ValueError for another model type."""
    c = config if isinstance(config, Mapping) else config.to_dict()
    model_type = c.get("model_type")
    if model_type not in _DEFAULTS:
        raise ValueError(f"model_type {model_type!r}: attnd reads deepseek_v32 and glm_moe_dsa")
    get = lambda k: _int(c, k, _DEFAULTS[model_type][k])  # noqa: E731
    n = get("num_hidden_layers")
    return dict(
        name=model_type,
        layers=tuple(_layers(c, model_type, n)),
        kv_lora_rank=get("kv_lora_rank"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        num_heads=get("num_attention_heads"),
        index_n_heads=get("index_n_heads"),
        index_head_dim=get("index_head_dim"),
        index_topk=get("index_topk"),
        sm_scale=(get("qk_nope_head_dim") + get("qk_rope_head_dim")) ** -0.5
        * _mscale_squared(c),
        max_context=get("max_position_embeddings"),
    )


def check_spec_matches(server_spec, config) -> None:
    """Raises ValueError naming every field where the server's spec (ServerInfo.model) differs
    from the model's config."""
    want = spec_from_hf_config(config)
    bad = []
    for k, v in want.items():
        if k == "name":
            continue
        got = getattr(server_spec, k)
        if k == "sm_scale":
            same = math.isclose(got, v, rel_tol=1e-12)
        else:
            same = (tuple(got) if k == "layers" else got) == v
        if not same:
            bad.append(f"{k}: server {got!r}, model {v!r}")
    if bad:
        raise ValueError("the attnd server does not serve this model (start it with "
                         "--hf-config=config.json): " + "; ".join(bad))
