"""llama.cpp's GGUF tensor names of a transformer block and of the model around the blocks,
mapped to the Hugging Face module names, shared by the dense reader (`flare.loading.gguf`:
llama, qwen2, qwen3) and the hybrid one (`flare.loading.gguf_hybrid`: qwen35's attention
layers). Keys drop the `blk.N.` prefix and the `.weight` / `.bias` suffix (llama.cpp's
gguf-py `constants.py` TENSOR_NAMES)."""

from __future__ import annotations

# the embedding, the final norm and the LM head
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# an attention block with its input norm, q/k norms (Qwen3) and a gated MLP; the norm
# before the MLP is named differently by each architecture, so it is not here
TRANSFORMER_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
