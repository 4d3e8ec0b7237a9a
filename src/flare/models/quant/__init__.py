"""Weight formats of the linear layers: chosen by `prepare`, stored in the package, run here.

A format says how the 2-D weights of a dense (`llama` recipe) model are stored and
multiplied; activations, norms, biases and the KV cache stay in the serving dtype.

- `full`: every weight in the serving dtype. On CPU with a float32 serving dtype the 2-D
  weights are packed at load into 16-output panels (`dense_panel_bytes`) and multiplied
  by Flare's row-invariant float32 kernel (`f32_linear`, below); elsewhere `F.linear`.
- `fp16`: the 2-D weights (q/k/v/o, gate/up/down, token embedding, output layer) stored
  as float16 (round to nearest even), for a float32 serving dtype. On CPU they are
  packed at load into Flare's float16 panel layout ([ceil(out/16), in, 16], the output
  axis padded to a multiple of 16 with zeros, no input-axis padding) and multiplied by
  Flare's dense kernel (`flare.kernels`, dense.cpp: `f16_linear`), which widens them to
  float32 in registers exactly (F16C) and accumulates in float32. The result is a float32
  product with the float16-rounded weights: what transformers computes on the same
  weights upcast to float32, up to summation order. Decode reads half the bytes of
  `full`. The token embedding is looked up from its float16 table and widened exactly.
  On other devices the weights are widened to the serving dtype at load (no speed gain,
  same values).

  Row invariance: the dense kernels compute every output element as one FMA chain over
  the input axis in order from 0.0 (then + bias, one rounding), whatever the number of
  rows in the call, the register tile that computes it or the thread count. A row's
  result is bit for bit the same alone, in a prompt, or beside other sequences
  (tests/unit/test_dense_kernels.py). fbgemm's fp16 GEMM and MKL's sgemm, which these
  formats ran on before, are not: they pick their blocking (so their summation order) by
  the row count (fbgemm's rows differed between 1-2 rows and 3+, MKL's for many row
  counts). Where Flare's kernels cannot be had (`flare.kernels.KernelUnavailable`: no
  AVX2/FMA/F16C, no compiler or ninja) `fp16` falls back to fbgemm's fp16 GEMM
  (`quantized::linear_dynamic_fp16`, its own packed layout: `fbgemm_fp16_packed_bytes`)
  and `full` to `F.linear`, without row invariance.

  Measured on the 2-core AVX2 machine (Zen 3, shared with other jobs, so absolute
  figures are low), the 30 layers' four matmuls of the embedded model (float16 weights,
  streamed from memory), one thread, medians of 7 interleaved runs (3 at 512 rows),
  fbgemm / Flare:
  30.4 / 17.1 ms at 1 row, 35.7 / 23.9 at 2, 35.9 / 30.1 at 4, 61.2 / 49.7 at 8,
  87.6 / 83.6 at 16, 287 / 269 at 64, 1975 / 1941 at 512 (the kernel's 6 x 16 prompt
  tile runs at about 28 GMAC/s per core). Engine, embedded model in `fp16`, one thread,
  medians of 4 interleaved rounds, fbgemm / Flare: decode at batch 1 40.5 / 53.8 tok/s,
  8 streams 159.8 / 171.5 aggregate, prefill 512 tokens 316 / 318 tok/s; weights held
  494 / 326 MB (fbgemm pads the 576-wide input axis to 1024).

Earlier measurement (same machine, one thread, thread CPU time, one layer's four matmuls
of the embedded model with 30 layers' weights streamed from memory, medians of 5) of
fp32 (MKL) against fbgemm fp16: fp32 1.22 ms at 1 token, 2.82 ms at 8, 50.8 ms at 512;
fp16 0.78 / 1.37 / 46.3 ms. PyTorch's weight-only int8 and int4 CPU kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) have no AVX2 path in torch 2.13:
5.2 ms at 1 token (4x slower than fp32), 52.6 ms at 8, 3.2 s at 512 (int4 slower still);
`torch._int_mm` is slower again. They are not offered as formats.

- `q4`: Flare's own 4-bit format with an AVX2/FMA C++ kernel (`flare.kernels`), for a
  float32 serving dtype on x86-64 CPUs with AVX2 and FMA, recipe `llama`. Every 2-D
  projection weight [out, in] (`in` a multiple of 32) is stored in blocks of 32 along
  `in` with Q4_1's scheme (`quantize_q4`): per block a scale d and a min m (float32) and
  32 codes q in 0..15 packed two per byte; value = d * q + m. The token embedding and
  the output layer are stored Q8_0-style (`quantize_q8`): per block of 32 a float32
  scale d = amax / 127 and int8 codes; value = d * q. A package stores the parts under
  the weight's name plus a suffix (`Q4_SUFFIXES`, `Q8_SUFFIXES`). Activations stay
  float32 and are never quantized: the kernel computes, per block,
  d * sum_j(x_j * q_j) + m * sum_j(x_j) in float32, so its result is the float32
  product with the dequantized weights up to summation order. The GGUF of the embedded
  model holds Q4_1 layers and a Q8_0 embedding; re-quantizing its dequantized floats
  gives back the same codes and, for d and m, the file's float16 values within float32
  rounding: measured over all 211 2-D weights of the embedded model, the dequantized
  `q4` weights equal the GGUF's dequantized floats exactly (max abs difference 0.0).
  Decode reads 0.75 bytes per layer weight (24 bytes
  per block of 32; float16 scales would make it 20, 17% less, at the cost of rounding
  non-GGUF scales: not done, float32 keeps the reproduction exact) and 1.125 per
  embedding weight: 111 MB per token for the embedded model against 270 MB for `fp16`.
  Up to `Q_KERNEL_MAX_ROWS` rows per call (decode) run in the kernel; larger calls
  (prefill) dequantize the weight into a float32 scratch buffer and use `F.linear`
  (MKL). Where the kernel cannot be built (no AVX2/FMA, no compiler or ninja) `prepare`
  refuses `q4` naming why; a `q4` package served on such a machine is dequantized to
  float32 at load (with a warning), so it still runs, with `full`'s speed and memory.

  Measured on the 2-core AVX2 machine (Zen 3), one thread, CPU time, min of 5, while
  other jobs ran on the machine (so absolute figures are low; compare columns): the 30
  layers' four matmuls of the embedded model, fbgemm fp16 / q4 kernel: 17.9 / 9.8 ms at 1
  row (1.8x), 18.8 / 17.9 at 2, 20.7 / 22.8 at 4, 30.4 / 45.3 at 8, 45.8 / 90.8 at 16;
  dequantize + MKL 89.2 at 17 rows and 1341 / 1251 (fp16) at 512. The output layer,
  fbgemm fp16 / q8 kernel: 3.4 / 2.3 ms at 1 row, 7.7 / 6.4 at 8. Per row the kernel
  spends 4 FP ops per 8 weights turning nibbles into floats (shift, mask, convert,
  scale) where fbgemm spends 1 (fp16 convert), so it wins where decode is bound by
  reading weights (1-2 rows) and loses where it is bound by arithmetic (4+ rows).
  Engine, one thread: decode at batch 1 29.1 (fp16) / 40.0 (q4) tok/s, 8 streams
  130.5 / 105.2 aggregate tok/s, prefill 512 tokens 301 / 267 tok/s, 2048 tokens
  213 / 205 tok/s (bench/peers.py prints the same rows at 2 threads).

- `q4x8`: `q4`'s blocks (same quantizers, same bytes) with llama.cpp's arithmetic for
  them: every linear layer's input row is quantized per block of 32 to int8 exactly as
  `quantize_q8` quantizes a weight, and each block's dot product is an integer sum
  (AVX2 `vpmaddubsw`), scaled in float32 (`flare.kernels` qdot8.cpp; Q4_1 x Q8_1 for the
  layers, Q8_0 x Q8_0 for the embedding / output layer). The result is the float32
  product of the dequantized weights and the dequantized activations (tests check it
  against transformers with every linear layer's input so rounded). The weights are
  stored with 8 rows interleaved (`Q4x8Weight`, `Q8x8Weight`: one 32-byte load feeds 8
  outputs), so every 2-D weight needs a multiple of 8 rows, and with float16 scales and
  mins, as the GGUF holds them (exact for the embedded model; other weights' scales are
  rounded to float16): 20 bytes per layer block and 34 per output-layer block, 96 MB per
  decoded token of the embedded model. The kernel runs every batch
  size, prompts included (no dequantize + MKL path): a linear layer's result for a row
  never depends on the rows beside it, and with the rest of the serving path fixed-order
  too (attention, norms, activation rounding: docs/preparation-contract.md,
  "Exactness") a request's logits do not depend on chunking, reuse or batch. It is the
  default for a GGUF of Q4_1 or Q4_0 layers (`default_weight_format`), built from the
  file's own blocks (`convert_tensors(..., blocks=)`, `native_weight`): Q4_1 blocks as
  they are, a Q4_0 block (d, codes q, value d * (q - 8)) as its scale d and codes with no
  min held (4.5 bits a value, as in the file: the kernel and `dequantize` compute the
  min -8d, exact); a Q8_0, Q4_0 or Q4_1 embedding / output layer as
  its own blocks, an F16 / BF16 / F32 one as a float tensor run by the dense kernels.
  Activation rounding moves
  the embedded model's logits by up to about 1.7 against the float product (next-token
  agreement 92 of 96 teacher-forced positions, KL mean 2.8e-3, see
  tests/unit/test_quant_parity.py);
  `q4` keeps float32 activations.

  Measured on the 2-core AVX2 machine (`bench/peers.py --weights fp16,q4,q4x8 --repeat
  3`, medians of 3 interleaved rounds, 2 threads), fp16 / q4 / q4x8 / llama.cpp on the
  same GGUF: decode at batch 1 48.9 / 72.9 / 108.0 / 101.5 tok/s, 8 streams 218.9 /
  179.3 / 351.1 / - aggregate, prefill 512 tokens 490 / 451 / 612 / 187, 2,048 tokens
  383 / 362 / 455 / 157 tok/s. Kernel alone, 2 threads, weights in cache, float32
  scales: gate/up (3072 x 576) and q/k/v (960 x 576) one after the other 41 us at 1 row,
  190 at 8; gate/up alone about 70 GMAC/s from 4 rows up.

- `q8x8`: every 2-D weight in Q8_0 blocks (float16 d, 32 int8 codes, value d * q) in
  `q4x8`'s 8-row interleaved layout (`Q8x8Weight`, 34 bytes a block), run by the same
  Q8_0 x Q8_0 kernel as `q4x8`'s output layer (`q8x8_linear`): int8 activations per
  block of 32, integer dot products, then the scales; the same row invariance. The
  default for a GGUF of Q8_0 layers (Q4_0 layers beside them become Q8_0 blocks with
  codes q - 8, exact), built from the file's blocks as `q4x8` is; from floats (a
  safetensors folder, other GGUF types, asked for with --weights q8x8) `quantize_q8`,
  which gives back a reference-quantized Q8_0 file's codes and float16 scales exactly.
  Decode reads 1.06 bytes per weight against `fp16`'s 2.

- `kx8`: a GGUF's blocks as the file stores them, whatever mix of Q4_K, Q5_K, Q6_K, Q5_0,
  Q5_1, Q8_0, Q4_0 and Q4_1 it holds (llama.cpp's Q4_K_M, Q5_K_M, Q6_K, and the Q5_0 /
  Q5_1 / Q8_0 its quantizer falls back to where an input axis is not a multiple of 256),
  on the int8-activation
  kernels with `q4x8`'s row invariance: Q4_K as `Q4Kx8Weight` (`q4x8`'s codes and kernel,
  each block's scale d * sc and min -(dmin * m) computed from the 6-bit sc, m and the
  float16 d, dmin: exact float32 products, so the arithmetic is Q4_1's with float32
  scales, 4.625 bits a weight against the file's 4.5), Q6_K as `Q6Kx8Weight` (codes
  q - 32 one byte each, integer sums per 16 values times their int8 scale in int32, then
  d * dx; 8.5625 bits against 6.5625), Q5_0 / Q5_1 as `Q5x8Weight` and Q5_K as
  `Q5Kx8Weight` (`q4x8`'s low nibbles plus a plane of fifth bits, with `q4x8`'s float16
  scale and min (Q5_0 holds no min: the kernel computes its -16d, exact), or Q4_K's
  scales, exact: 5.5 bits as Q5_0's, 6 as Q5_1's, 5.625 against Q5_K's 5.5), the rest
  as `q8x8` / `q4x8` hold them. A fused
  q/k/v or
  gate/up of two kinds is a `StackedWeight`: one kernel call a kind, the outputs
  concatenated. Every served value equals `gguf.quants.dequantize` of the file bit for
  bit (tests/unit/test_kquant.py). The default for such files (`native_format`).

GGUF types no format holds as stored (Q2_K, Q3_K, i-quants, F16 layers) are
dequantized and served as `fp16` by default; asked for, `q4x8` / `q8x8` / `kx8`
re-quantize them from the dequantized floats (not the file's values).

The package, one job a module: `formats` (the format names, which applies where,
`default_weight_format`), `blocks` (`q4`'s row-order blocks and the quantizers),
`interleaved` (`q4x8` / `q8x8`'s 8-row layout), `kquants` (`kx8`'s Q4_K / Q6_K weights),
`q5` (`kx8`'s 5-bit Q5_0 / Q5_1 / Q5_K weights),
`gguf_blocks` (a GGUF's own blocks and `native_weight`), `stacked` (the weight kinds and
fusing, `StackedWeight`), `storage` (what a package stores: `convert_tensors`,
`weight_getter`), `dense` and `linear` (the kernels a weight runs on, `Linear`) and
`sizes` (the bytes a served model holds).
"""
