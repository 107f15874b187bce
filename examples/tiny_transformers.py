"""A tiny random DeepSeek-V3.2 whose attention runs on attnd, on a CPU in seconds: the config is
saved with save_pretrained, attnd serves it with --hf-config, and AttndModel's greedy tokens are
compared with the unmodified model's (ATTND_BIN overrides build/service/attnd)."""
import os
import subprocess
import sys
import tempfile

import torch
import transformers
from attnd import AttndClient
from attnd.integrations.transformers import AttndModel

config = transformers.DeepseekV32Config(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    index_n_heads=4, index_head_dim=32, index_topk=8, max_position_embeddings=256)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
prompt = torch.randint(0, config.vocab_size, (20,)).tolist()
with torch.no_grad():  # the reference: the unmodified model's greedy tokens
    want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          use_cache=False)[0, len(prompt):].tolist()

with tempfile.TemporaryDirectory() as checkpoint:
    model.save_pretrained(checkpoint)
    attnd = subprocess.Popen([os.environ.get("ATTND_BIN", "build/service/attnd"),
                              f"--hf-config={checkpoint}/config.json", "--cache-dtype=fp32",
                              "--grpc-port=0", "--metrics-port=0", "--kv-pages=64"],
                             stdout=subprocess.PIPE, text=True)
    target = attnd.stdout.readline().split(" on ")[1].split()[0]  # the serving line's address
    try:
        with AttndClient(target) as client, AttndModel(model, client) as served:
            got = served.generate("tiny-1", prompt, max_new_tokens=8, prefill_chunk=8)
    finally:
        attnd.terminate()
        attnd.wait()
print("attnd:", got)
print("model:", want)
sys.exit(0 if got == want else 1)
