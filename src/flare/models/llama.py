"""Recipe `llama`: Llama, SmolLM2, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

The math follows transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM`
(pre-norm blocks, RoPE with `rotate_half`, GQA, SwiGLU MLP), so greedy tokens match theirs.
Weights arrive in Hugging Face naming; q/k/v and gate/up are fused once at load so a layer
is four matmuls, each a `flare.models.quant.linear.Linear` (on CPU with float32 Flare's
row-invariant kernels for every weight format but `q4`). The forward is a plain function of the
step's flat token list over a paged KV cache: x is [T, hidden] for all T tokens of the
step, whatever sequence they belong to. Per layer it runs few tensor operations: one
RMSNorm kernel, RoPE once over the q and k heads together, K/V written by index, one
attention call; decode at batch 1 spends most of its time in the matmuls.

Fused ops. For float32 serving on CPU the small steps between the matmuls run as Flare's
fused C++ ops (`flare.kernels.fused_ops`, built into the kernel extension with the q4
GEMMs): RMSNorm, residual add + RMSNorm in one pass, per-head q/k RMSNorm (Qwen3) + RoPE +
K/V store in one call, SiLU(gate) * up, and attention for decode and prefill rows alike
through one fixed-order routine (see `flare.models.attention`): with them the forward is
batch- and chunk-invariant (a token's logits never depend on chunking, reuse or batch). The choice is made once, at
construction: `LlamaModel(..., fused=None)` (the default) takes the kernel module when the
serving dtype is float32 on CPU and the module loads, else the torch path;
`fused=False`, or $FLARE_FUSED_OPS=0 in the environment, forces the torch path (the
reference, used by the tests to compare); `fused=True` requires the fused ops. Where the
kernel cannot be built the torch path below runs unchanged. The two paths agree to about
1e-6 relative (different summation order in norms, a polynomial exp in SiLU and softmax);
`forward` on a cache of another dtype runs the torch path. Where the weights allow
(`flare.models.native_layers`), the fused path runs all layers of a step in one native
call of the same kernels, bit-identical to its per-op Python loop, and `forward_logits`
adds the output layer on the sampling rows to that call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from flare.models import exact_math
from flare.models.attention import (FUSED_CACHE_DTYPES, AttentionBatch, paged_attention,
                                    static_decode_attention)
from flare.models.config import ModelConfig
from flare.models.native_layers import native_embedding, native_forward, native_layers
from flare.models.quant.linear import Linear
from flare.models.quant.stacked import cat_weights
from flare.models.quant.storage import weight_getter
from flare.state.pools import KVCache


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [hidden] -> [(H + 2 KVH) * D], q/k/v fused (with Qwen2's bias)
    qk_norm: torch.Tensor | None  # [H + KVH, D]: q_norm for q heads, k_norm for k (Qwen3)
    o_proj: Linear  # [H * D] -> [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [hidden] -> [2 * intermediate], gate/up fused
    down: Linear  # [intermediate] -> [hidden]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp32) for the config's RoPE, with its scaling.

    Follows transformers' `ROPE_INIT_FUNCTIONS` for "default", "linear" and "llama3".

    Raises:
        ValueError: an unsupported `rope_scaling` type, naming it.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class LlamaModel:
    """The dense decoder of recipe `llama`, over a paged KV cache.

    Args:
        config: model hyper-parameters.
        tensors: Hugging Face-named weights (`model.layers.N.self_attn.q_proj.weight`, ...)
            on the serving device. The serving dtype is that of `model.norm.weight`; 2-D
            weights are in it too, or float16 under float32 (weight format `fp16`), or
            stored as q4/q8 block parts (weight format `q4`; see `flare.models.quant`).
            The model keeps fused copies, not the tensors given.
        max_positions: size of the RoPE table (the plan's max sequence length).
        fused: None (default) to use Flare's fused C++ ops when serving float32 on CPU and
            the kernel module loads (and $FLARE_FUSED_OPS is not "0"); False for the torch
            path; True to require the fused ops.

    Raises:
        ValueError: a missing tensor, or a weight dtype the serving dtype cannot use, or
            `fused=True` where the fused ops cannot serve (not float32 on CPU, or the
            kernel module is unavailable).
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 max_positions: int, fused: bool | None = None) -> None:
        self.config = config
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.eps = c.rms_norm_eps

        w = weight_getter(tensors)  # a tensor, or q4/q8 blocks (format `q4`)
        self.final_norm = w("model.norm.weight")
        dtype, device = self.final_norm.dtype, self.final_norm.device
        self.dtype = dtype
        # fp32 serving: torch's RMSNorm kernel computes transformers' formula bit for bit
        # (checked on random inputs); other dtypes keep transformers' fp32 round trip
        self._fused_norm = dtype == torch.float32

        def linear(names: list[str], bias: list[str] | None = None) -> Linear:
            weight = cat_weights([w(n) for n in names])
            b = torch.cat([w(n) for n in bias]) if bias else None
            return Linear(weight, b, dtype)

        self.embed = w("model.embed_tokens.weight")  # [V, hidden], lookup table
        # tied: the very tensor (a mapping may hand out a new one per read)
        self.lm_head = Linear(self.embed if c.tie_word_embeddings else w("lm_head.weight"),
                              None, dtype)
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qk_norm = None
            if c.qk_norm:
                qk_norm = torch.cat([w(a + "q_norm.weight").expand(self.num_heads, -1),
                                     w(a + "k_norm.weight").expand(self.num_kv_heads, -1)])
            self.layers.append(_Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=linear([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                           [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
                           if c.attention_bias else None),
                qk_norm=qk_norm,
                o_proj=linear([a + "o_proj.weight"]),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=linear([p + "mlp.down_proj.weight"]),
            ))
        # [P, D], not torch's cos/sin: see flare.models.exact_math
        cos, sin = exact_math.rope_cos_sin(rope_inv_freq(c), max_positions)
        self.cos = cos.to(dtype=dtype, device=device)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]: the sign moves into the
        # table (negation is exact), so RoPE is a swap of halves, two multiplies and an add
        half = c.head_dim // 2
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(
            dtype=dtype, device=device)
        self.fused_ops: ModuleType | None = None  # the kernel module, or None: torch path
        if fused is not False:
            servable = dtype == torch.float32 and device.type == "cpu"
            if servable:
                from flare.kernels import fused_ops

                self.fused_ops = fused_ops()
            if fused and self.fused_ops is None:
                raise ValueError("fused=True: Flare's fused ops serve float32 on CPU with the "
                                 "kernel module built" + ("" if servable else
                                 f", not {dtype} on {device}") + " (is FLARE_FUSED_OPS=0 "
                                 "set, or the kernel unavailable?)")
        if self.fused_ops is not None:  # the ops take contiguous float32 rows
            for layer in self.layers:
                layer.input_norm = layer.input_norm.contiguous()
                layer.post_norm = layer.post_norm.contiguous()
                if layer.qk_norm is not None:
                    layer.qk_norm = layer.qk_norm.contiguous()
            self.final_norm = self.final_norm.contiguous()
        # all layers of a step in one native call (same kernels, same order), or None
        self.native = native_layers(self)
        # the fused path's token lookup in one native call (the same bits), or None
        self._embed_rows = native_embedding(self.embed, self.fused_ops)

    @property
    def weights_nbytes(self) -> int:
        """Bytes of weights this model holds (fused, packed), norms and tables included."""
        n = self.embed.nbytes + self.final_norm.nbytes + self.lm_head.nbytes
        if self.lm_head.weight is self.embed:  # tied and unpacked: one table
            n -= self.embed.nbytes
        for layer in self.layers:
            n += layer.input_norm.nbytes + layer.post_norm.nbytes
            n += layer.qkv.nbytes + layer.o_proj.nbytes + layer.gate_up.nbytes
            n += layer.down.nbytes
            if layer.qk_norm is not None:
                n += layer.qk_norm.nbytes
        return n

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm over the last axis: normalize in fp32, scale in the
        model dtype. `weight` broadcasts against x ([hidden], or [heads, D] for q/k)."""
        if self._fused_norm and weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        """Run the decoder over the step's tokens, writing their K/V into `kv`.

        Args:
            input_ids: int64 [T], the step's new tokens (decode tokens first, then chunks).
            positions: int64 [T], each token's position in its sequence.
            batch: where to write and read K/V (see `AttentionBatch`).
            kv: the paged cache; slots in `batch.slot_mapping` are overwritten.

        Returns:
            Final hidden states [T, hidden] after the last norm, in the serving dtype.
        """
        if self._fused_serves(kv):
            return self._forward_fused(input_ids, positions, batch, kv)
        k_cache, v_cache = kv.k_layers, kv.v_layers  # per-layer views
        scale = self.scale
        return self._torch_layers(
            input_ids, positions, batch.slot_mapping, kv,
            lambda i, q: paged_attention(q, k_cache[i], v_cache[i], batch, scale))

    @torch.inference_mode()
    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       batch: AttentionBatch, kv: KVCache, rows: list[int]
                       ) -> torch.Tensor | None:
        """`forward`, then `logits` of the rows `rows`: fp32 [len(rows), vocab], or None
        (after the forward) when `rows` is empty. Where the native call holds the output
        layer, it runs there too, on the same rows with the same kernel (bit-identical).

        Args:
            input_ids, positions, batch, kv: as `forward`.
            rows: indices into the step's T tokens (each sampling sequence's last token).
        """
        native = self.native
        if rows and native is not None and native.has_lm_head and self._fused_serves(kv):
            x, positions64, slots = self._fused_inputs(input_ids, positions, batch)
            logits = native_forward(native, x, positions64, slots, batch, kv, rows)
            if logits is not None:
                return logits
            # the SDPA fallback: x is untouched, so the loop takes it as it is
            hidden = self._fused_layers(x, positions64, slots, batch, kv)
        else:
            hidden = self.forward(input_ids, positions, batch, kv)
        if not rows:
            return None
        return self.logits(hidden[torch.tensor(rows, device=hidden.device)])

    @torch.inference_mode()
    def decode_static(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, block_table: torch.Tensor,
                      context_lens: torch.Tensor, kv: KVCache,
                      attention: str = "sdpa") -> torch.Tensor:
        """One decode token for each of B rows, over fixed shapes (CUDA-graph capturable).

        The torch path of `forward` (never the fused CPU ops) with attention over a block
        table and a length mask (`flare.models.attention.static_decode_attention`): no
        data-dependent shape, no host sync, no Python branch on a tensor value. Every
        input lives on the cache's device.

        Args:
            input_ids: int64 [B], each row's new token.
            positions: int64 [B], its position (= context length - 1).
            slot_mapping: int64 [B], the cache slot its K/V is written to.
            block_table: int32 or int64 [B, P], each row's page table; entries past a
                row's last page may name any page whose K/V are finite (the engine's
                padding page): they are masked.
            context_lens: int64 [B], tokens each row attends to, its new token included,
                1 <= len <= P * page_size.
            kv: the paged cache; the B slots of `slot_mapping` are overwritten.
            attention: "sdpa" or "math" (`static_decode_attention`).

        Returns:
            Final hidden states [B, hidden] after the last norm, in the serving dtype.
        """
        ps = kv.page_size
        b, p = block_table.shape
        offsets = torch.arange(ps, dtype=torch.int64, device=block_table.device)
        gather = (block_table.to(torch.int64)[:, :, None] * ps + offsets).view(b, p * ps)
        span = torch.arange(p * ps, dtype=torch.int64, device=block_table.device)
        mask = (span[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, M]
        k_cache, v_cache = kv.k_layers, kv.v_layers
        scale = self.scale
        return self._torch_layers(
            input_ids, positions, slot_mapping, kv,
            lambda i, q: static_decode_attention(q, k_cache[i], v_cache[i], gather, mask,
                                                 scale, attention))

    def _torch_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, kv: KVCache,
                      attend: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The decoder's torch path over T tokens: K/V written at `slots` ([T] int64), then
        `attend(layer, q [T, H, D]) -> [T, H, D]` reads them; returns [T, hidden] after the
        final norm."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = input_ids.shape[0]
        x = self.embed[input_ids].to(self.dtype)  # [T, hidden] (widens float16 / q8 rows)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin_signed[positions].unsqueeze(1)
        nqk = (h + kvh) * d
        k_cache, v_cache = kv.k_layers, kv.v_layers  # per-layer views
        for i, layer in enumerate(self.layers):
            y = self._norm(x, layer.input_norm)
            qkv = layer.qkv(y)  # [T, (H + 2 KVH) * D]
            qk = qkv[:, :nqk].view(t, h + kvh, d)  # q heads, then k heads
            if layer.qk_norm is not None:
                qk = self._norm(qk, layer.qk_norm)
            # RoPE on q and k at once; the flip of the two halves is roll(x, D/2)
            qk = qk * cos + qk.view(t, h + kvh, 2, d // 2).flip(2).view(t, h + kvh, d) * sin
            k = qk[:, h:]  # [T, KVH, D]
            # into the pool's dtype (a float16 kv_dtype rounds here, as rope_store does)
            k_cache[i].index_copy_(0, slots, k.to(k_cache[i].dtype))
            v_cache[i].index_copy_(0, slots, qkv[:, nqk:].view(t, kvh, d).to(v_cache[i].dtype))
            o = attend(i, qk[:, :h])  # [T, H, D]
            x = x + layer.o_proj(o.reshape(t, h * d))
            gate, up = layer.gate_up(self._norm(x, layer.post_norm)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)  # [T, hidden]
        return self._norm(x, self.final_norm)

    def _fused_serves(self, kv: KVCache) -> bool:
        """Whether `forward` on `kv` runs the fused ops (float32 serving, a float32 or
        float16 cache, some layers)."""
        return (self.fused_ops is not None and self.dtype == torch.float32
                and kv.k.dtype in FUSED_CACHE_DTYPES and bool(self.layers))

    def _fused_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      batch: AttentionBatch
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused path's inputs: the embedded tokens float32 [T, hidden] (a fresh
        contiguous tensor, the residual stream), positions and slots int64 [T]."""
        if self._embed_rows is not None:
            x = self._embed_rows(input_ids.to(torch.int64).contiguous())
        else:
            x = self.embed[input_ids].to(self.dtype).contiguous()
        return (x, positions.to(torch.int64).contiguous(),
                batch.slot_mapping.to(torch.int64).contiguous())

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        """`forward` through the fused ops (float32, CPU): same arguments and result.

        The residual stream x is updated in place by `add_rms_norm`, which also yields the
        next norm's output (the post-attention norm, the next layer's input norm, or the
        final norm). Where `self.native` (`flare.models.native_layers`) covers the
        weights and the step, all layers run in one native call of the same kernels in
        the same order (bit-identical); `_fused_layers` is that call's reference."""
        x, positions, slots = self._fused_inputs(input_ids, positions, batch)
        if self.native is not None:
            y = native_forward(self.native, x, positions, slots, batch, kv)
            if y is not None:
                return y
        return self._fused_layers(x, positions, slots, batch, kv)

    def _fused_layers(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        """The fused ops' layer loop on `_fused_inputs`' x (float32 [T, hidden], updated in
        place), positions and slots (int64 [T]): the final norm's output [T, hidden]."""
        ops = self.fused_ops
        h, kvh, d, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        t = x.shape[0]
        k_cache, v_cache = kv.k_layers, kv.v_layers
        layers = self.layers
        y = ops.rms_norm(x, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            qkv = layer.qkv(y).contiguous()  # [T, (H + 2 KVH) * D]
            q = ops.rope_store(qkv, self.cos, self.sin_signed, positions, k_cache[i],
                               v_cache[i], slots, h, kvh, layer.qk_norm, eps)  # [T, H, D]
            o = paged_attention(q, k_cache[i], v_cache[i], batch, self.scale, ops)
            y = ops.add_rms_norm(x, layer.o_proj(o.reshape(t, h * d)).contiguous(),
                                 layer.post_norm, eps)
            m = layer.down(ops.silu_mul(layer.gate_up(y).contiguous())).contiguous()
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else self.final_norm
            y = ops.add_rms_norm(x, m, nxt, eps)  # x += m; the next norm's output
        return y

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits, fp32 [N, vocab], from final hidden states [N, hidden]."""
        return self.lm_head(hidden).float()
