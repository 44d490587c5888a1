// The lanes path (simd_lanes.h: groups of >= one vector of query rows per KV head, no mask
// tensor) at the edges of its register blocks, against a double-precision reference, at every
// ISA level: rows not a multiple of the score (2 row vectors) or P.V (8 / 4 rows) blocks, key
// ranges that start and end inside a 32-key tile, pages that split tiles, head_dim 128 and 64
// (compile-time kernels), 48 and 40 (run-time; 40 falls back to the scalar level at AVX-512),
// v_head_dim != head_dim, prefill rows with causal frontiers and windows inside a tile, softcap,
// NaN / -inf keys reaching only the rows that see them, split key ranges merged, fp16 / bf16.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "kernels/attention.h"

using namespace olep;
using namespace olep::kernels;

namespace {

struct Lanes {
  int64_t G = 32, S = 1, P = 100, D = 128, Dv = 128;
  int64_t page = 0;      // > 0: blocks of this many rows
  int64_t window = -1;
  float softcap = 0.0f;
  DType dtype = DType::kFloat32;
  int64_t split = -1;    // >= 0: attend [0, split) and [split, T) separately, then merge
  int64_t begin = 0;     // keys [begin, T) only (a piece of a split range, finalized alone)
  int64_t valid = -1;    // >= 0: num_valid_rows (rows past it are padding: zero output)
};

uint16_t enc(DType t, float f) { return t == DType::kFloat16 ? float_to_half(f) : float_to_bf16(f); }
float dec(DType t, uint16_t b) { return t == DType::kFloat16 ? half_to_float(b) : bf16_to_float(b); }

void run(const Lanes& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int64_t T = c.P + c.S, R = c.G * c.S;
  std::vector<float> q(static_cast<size_t>(R * c.D)), k(static_cast<size_t>(T * c.D)), v(static_cast<size_t>(T * c.Dv));
  for (auto* x : {&q, &k, &v})
    for (float& e : *x) {
      e = nd(rng);
      if (c.dtype != DType::kFloat32) e = dec(c.dtype, enc(c.dtype, e));
    }
  const size_t es = dtype_size(c.dtype);
  auto pack = [&](const std::vector<float>& src) {
    std::vector<uint8_t> out(src.size() * es);
    for (size_t i = 0; i < src.size(); ++i) {
      if (c.dtype == DType::kFloat32) std::memcpy(&out[i * 4], &src[i], 4);
      else {
        const uint16_t b = enc(c.dtype, src[i]);
        std::memcpy(&out[i * 2], &b, 2);
      }
    }
    return out;
  };
  std::vector<uint8_t> qb = pack(q), kb = pack(k), vb = pack(v), ob(static_cast<size_t>(R * c.Dv) * es);
  std::vector<KVBlock> blocks;
  const int64_t per = c.page > 0 ? c.page : T;
  for (int64_t s = 0; s < T; s += per)
    blocks.push_back(KVBlock{kb.data() + static_cast<size_t>(s * c.D) * es, vb.data() + static_cast<size_t>(s * c.Dv) * es,
                             s, std::min(per, T - s)});
  AttentionGroup a;
  a.dtype = c.dtype;
  a.q = qb.data(); a.q_head_stride = c.S * c.D; a.q_row_stride = c.D;
  a.out = ob.data(); a.out_head_stride = c.S * c.Dv; a.out_row_stride = c.Dv;
  a.group_size = c.G; a.num_rows = c.S; a.num_valid_rows = c.valid >= 0 ? c.valid : c.S; a.q_offset = c.P;
  a.num_keys = T;
  a.blocks = blocks.data(); a.num_blocks = static_cast<int64_t>(blocks.size());
  a.head_dim = c.D; a.v_head_dim = c.Dv; a.scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  a.softcap = c.softcap; a.is_causal = true; a.local_window_size = c.window;
  std::vector<float> s1(static_cast<size_t>(state_floats(a))), s2(s1.size()), scratch(static_cast<size_t>(scratch_floats(a)));
  AttentionState st, st2;
  init_state(a, s1.data(), &st);
  if (c.split >= 0) {
    attend_range(a, c.begin, c.split, &st, scratch.data());
    init_state(a, s2.data(), &st2);
    attend_range(a, c.split, T, &st2, scratch.data());
    merge_states(a, &st, st2);
  } else {
    attend_range(a, c.begin, T, &st, scratch.data());
  }
  finalize(a, st);
  const double tol = c.dtype == DType::kFloat32 ? 2e-5 : c.dtype == DType::kFloat16 ? 2e-3 : 1.6e-2;
  for (int64_t h = 0; h < c.G; ++h)
    for (int64_t i = 0; i < c.S; ++i) {
      const int64_t pos = c.P + i, r = h * c.S + i;
      std::vector<double> s(static_cast<size_t>(T), -INFINITY);
      double m = -INFINITY;
      for (int64_t j = c.begin; j <= pos && i < a.num_valid_rows; ++j) {
        if (c.window > 0 && j <= pos - c.window) continue;
        double dot = 0;
        for (int64_t d = 0; d < c.D; ++d) dot += double(q[static_cast<size_t>(r * c.D + d)]) * k[static_cast<size_t>(j * c.D + d)];
        dot *= a.scale;
        if (c.softcap > 0) dot = c.softcap * std::tanh(dot / c.softcap);
        s[static_cast<size_t>(j)] = dot;
        m = std::max(m, dot);
      }
      std::vector<double> want(static_cast<size_t>(c.Dv), 0.0);
      double den = 0;
      for (int64_t j = 0; j < T && std::isfinite(m); ++j) {
        const double e = std::exp(s[static_cast<size_t>(j)] - m);
        den += e;
        for (int64_t d = 0; d < c.Dv; ++d) want[static_cast<size_t>(d)] += e * v[static_cast<size_t>(j * c.Dv + d)];
      }
      for (int64_t d = 0; d < c.Dv; ++d) {
        const size_t o = static_cast<size_t>(r * c.Dv + d);
        float got;
        if (c.dtype == DType::kFloat32) std::memcpy(&got, &ob[o * 4], 4);
        else {
          uint16_t b;
          std::memcpy(&b, &ob[o * 2], 2);
          got = dec(c.dtype, b);
        }
        CHECK_NEAR(got, den > 0 ? want[static_cast<size_t>(d)] / den : 0.0, tol);
      }
    }
}

void register_block_edges() {
  uint32_t seed = 1;
  // Rows per KV head around the score (2 x W) and P.V (8 / 4 rows) blocks, decode.
  for (int64_t G : {16, 17, 23, 24, 31, 33, 40, 47}) {
    Lanes c;
    c.G = G;
    run(c, seed++);
  }
  // head_dim / v_head_dim: compile-time 128 and 64, run-time 48 and 40 (a partial 32-element
  // block at the end), v_head_dim of 1.5 and 3 vectors.
  for (int64_t D : {64, 48, 40})
    for (int64_t Dv : {D, int64_t{24}, int64_t{48}}) {
      Lanes c;
      c.G = 19; c.D = D; c.Dv = Dv;
      run(c, seed++);
    }
  // Tiles split by pages (48 rows: page ends inside a 32-key tile) and a partial last tile.
  for (int64_t page : {32, 48, 80}) {
    Lanes c;
    c.G = 20; c.P = 203; c.page = page;
    run(c, seed++);
  }
  // Key ranges that start and end inside a tile, merged; and a range piece alone.
  for (int64_t split : {1, 45, 96, 170}) {
    Lanes c;
    c.G = 24; c.P = 180; c.page = 64; c.split = split;
    run(c, seed++);
  }
  Lanes piece;
  piece.G = 18; piece.P = 150; piece.begin = 37;
  run(piece, seed++);
  // Prefill blocks: causal frontiers and windows inside a tile, rows of several heads (a row
  // block then holds rows of two heads, far apart in position), padding rows past the valid ones.
  for (int64_t S : {13, 40, 77}) {
    Lanes c;
    c.G = 1; c.S = S; c.P = 29;
    run(c, seed++);
    c.G = 3; c.window = 21;
    run(c, seed++);
    c.valid = S * 2 / 3; c.window = -1;
    run(c, seed++);
    c.G = 1; c.window = 7; c.P = 0;
    run(c, seed++);
  }
  // Row blocks that see every key of most tiles (the fast softmax path and whole-block P.V on
  // causal rows) and tiles on each block's frontier: 64 rows from position 0 and from 300.
  for (int64_t P : {0, 300})
    for (int64_t G : {1, 4}) {
      Lanes c;
      c.G = G; c.S = 64 / G; c.P = P; c.page = 96;
      run(c, seed++);
    }
  Lanes cap;
  cap.G = 33; cap.softcap = 2.5f; cap.P = 70;
  run(cap, seed++);
  for (DType t : {DType::kFloat16, DType::kBFloat16})
    for (int64_t G : {16, 25}) {
      Lanes c;
      c.G = G; c.dtype = t; c.P = 90; c.page = 48;
      run(c, seed++);
      c.S = 9; c.G = 3;
      run(c, seed++);
    }
  // 16-bit prefill rows: q transposed W rows at a time in registers, the rows left one by one
  // (40 and 77 rows: 2 / 5 full 16-row blocks, 8 / 13 rows left), causal frontiers in 16-key
  // tiles across page ends (48-row pages).
  for (DType t : {DType::kFloat16, DType::kBFloat16})
    for (int64_t S : {40, 77}) {
      Lanes c;
      c.G = 1; c.S = S; c.dtype = t; c.P = 29; c.page = 48;
      run(c, seed++);
    }
}

// A NaN in one K row reaches only the rows that see it (prefill: rows before it do not),
// a -inf score (huge K against q) none; in tiles every row sees and tiles split by the frontier.
void nonfinite_keys() {
  const int64_t G = 2, S = 24, D = 64, P = 40, T = P + S, R = G * S;
  std::vector<float> q(static_cast<size_t>(R * D), 0.05f), k(static_cast<size_t>(T * D), 0.1f), v(k.size(), 1.0f), o(q.size());
  const int64_t bad = P + 10;  // seen by rows i >= 10
  k[static_cast<size_t>(bad * D + 3)] = NAN;
  KVBlock b{k.data(), v.data(), 0, T};
  AttentionGroup a;
  a.q = q.data(); a.q_head_stride = S * D; a.q_row_stride = D; a.out = o.data(); a.out_head_stride = S * D;
  a.out_row_stride = D; a.group_size = G; a.num_rows = S; a.num_valid_rows = S; a.q_offset = P; a.num_keys = T;
  a.blocks = &b; a.num_blocks = 1; a.head_dim = D; a.v_head_dim = D; a.scale = 0.125f; a.is_causal = true;
  std::vector<float> buf(static_cast<size_t>(attend_group_floats(a)));
  attend_group(a, buf.data());
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < S; ++i)
      for (int64_t d = 0; d < D; ++d) {
        const float x = o[static_cast<size_t>((h * S + i) * D + d)];
        if (i >= 10) CHECK(std::isnan(x));
        else CHECK_NEAR(x, 1.0f, 1e-6);
      }
}

}  // namespace

int main() {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (static_cast<int>(isa) > static_cast<int>(detected_isa())) {
      std::printf("ISA %s: not supported by this CPU, not run\n", isa_name(isa));
      continue;
    }
    set_isa(isa);
    const int before = failures();
    register_block_edges();
    nonfinite_keys();
    std::printf("ISA %s: %s\n", isa_name(isa), failures() == before ? "ok" : "FAILED");
  }
  TEST_MAIN_END();
}
