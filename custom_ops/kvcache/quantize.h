// Cold-page quantization: the page-level codecs of KVCache (docs/API.md, "Quantized pages").
// Pure functions over page bytes; no locks, no pool.
//
// int8 page layout (CacheGeometry::quant_page_bytes): K int8 [page_tokens, head_dim], V int8
// in row pairs [page_tokens / 2, v_head_dim, 2] (int8_value_index, kernels/kv_block.h),
// K scales float32 [head_dim], V scales float32 [page_tokens].
// Scheme (symmetric, no zero point, scales from the page's own rows, no calibration):
//   K: scale[d] = max_r |k[r][d]| / 127 per channel d over the page's rows (channel outliers
//      stay within their own channel), q = round_half_even(k / scale[d]) in [-127, 127];
//   V: scale[r] = max_d |v[r][d]| / 127 per row r, q = round_half_even(v / scale[r]);
//   a zero scale (an all-zero channel or row) stores q = 0. Arithmetic in float32 (the
//   cache dtype converted exactly); dequantized value = q * scale in float32.
//
// int4 page layout: K codes [page_tokens, head_dim / 2] bytes (int4_key_byte), V codes in row
// pairs [page_tokens / 2, v_head_dim] bytes (int4_value_byte), then float32 K scales
// [head_dim], V scales [page_tokens], K minimums [head_dim], V minimums [page_tokens].
// Scheme (asymmetric: a minimum and a step per channel of K and per row of V, so a skewed
// channel uses all 16 levels):
//   K: min[d] = min_r k[r][d], scale[d] = (max_r k[r][d] - min[d]) / 15,
//      q = round_half_even((k - min[d]) / scale[d]) clamped to [0, 15];
//   V: min[r] = min_d v[r][d], scale[r] = (max_d v[r][d] - min[r]) / 15, likewise;
//   a zero scale stores q = 0; dequantized value = min + q * scale in float32 (a multiply, then
//   an add, each rounded).
#pragma once

#include <cstdint>

#include "kernels/kv_block.h"
#include "kvcache/geometry.h"

namespace olep {
namespace quant {

/// Quantizes a full native page (`src`, g.page_bytes(), page_tokens valid rows) into `dst`
/// (g.quant_page_bytes()) as g.kv_quant says. Returns false, with dst unspecified, when any K or
/// V element is not finite or has magnitude >= 2^126 (the page then stays native: a code cannot
/// hold inf or NaN, and the scale arithmetic could round up to inf).
bool quantize_page(const CacheGeometry& g, const char* src, char* dst);

/// Whether a quantized page (g.kv_quant, g.quant_page_bytes()) holds only what quantize_page
/// writes: K/V scales in [0, 2^126), int4 minimums of magnitude < 2^126 (finite), int8 codes in
/// [-127, 127]. The kernels rely on it (scales >= 0; int32 sums of |code| <= 127); load()
/// refuses a file with a page that does not.
bool valid_page(const CacheGeometry& g, const char* page);

/// The rows of a quantized block (quant_block), dequantized to the cache dtype into contiguous
/// rows: K [num_rows, head_dim] at k_out, V [num_rows, v_head_dim] at v_out.
void dequantize_block(const CacheGeometry& g, const KVBlock& kb, void* k_out, void* v_out);

/// The block view of rows [row_begin, row_end) of a quantized page (encoding g.kv_quant) whose
/// row 0 is position `first`.
KVBlock quant_block(const CacheGeometry& g, const char* page, int64_t first, int64_t row_begin, int64_t row_end);

}  // namespace quant
}  // namespace olep
