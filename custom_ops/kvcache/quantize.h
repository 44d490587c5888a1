// Cold-page quantization: the page-level int8 codec of KVCache (docs/API.md, "Quantized
// pages"). Pure functions over page bytes; no locks, no pool.
//
// int8 page layout (CacheGeometry::quant_page_bytes): K int8 [page_tokens, head_dim], V int8
// in row pairs [page_tokens / 2, v_head_dim, 2] (int8_value_index, kernels/kv_block.h), K scales float32 [head_dim], V scales float32 [page_tokens].
// Scheme (symmetric, no zero point, scales from the page's own rows, no calibration):
//   K: scale[d] = max_r |k[r][d]| / 127 per channel d over the page's rows (channel outliers
//      stay within their own channel), q = round_half_even(k / scale[d]) in [-127, 127];
//   V: scale[r] = max_d |v[r][d]| / 127 per row r, q = round_half_even(v / scale[r]);
//   a zero scale (an all-zero channel or row) stores q = 0. Arithmetic in float32 (the
//   cache dtype converted exactly); dequantized value = q * scale in float32.
#pragma once

#include <cstdint>

#include "kernels/kv_block.h"
#include "kvcache/geometry.h"

namespace olep {
namespace quant {

/// Quantizes a full native page (`src`, g.page_bytes(), page_tokens valid rows) into `dst`
/// (g.quant_page_bytes()). Returns false, with dst unspecified, when any K or V element is not
/// finite or has magnitude >= 2^126 (the page then stays native: an int8 code cannot hold inf
/// or NaN, and 127 * scale could round up to inf).
bool quantize_page_int8(const CacheGeometry& g, const char* src, char* dst);

/// The rows of an int8 block (int8_block), dequantized to the cache dtype into contiguous
/// rows: K [num_rows, head_dim] at k_out, V [num_rows, v_head_dim] at v_out.
void dequantize_block(const CacheGeometry& g, const KVBlock& kb, void* k_out, void* v_out);

/// The block view of rows [row_begin, row_end) of an int8 page whose row 0 is position `first`.
KVBlock int8_block(const CacheGeometry& g, const char* page, int64_t first, int64_t row_begin, int64_t row_end);

}  // namespace quant
}  // namespace olep
