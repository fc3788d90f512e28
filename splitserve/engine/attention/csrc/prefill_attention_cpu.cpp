// Paged prefill attention on the CPU: every prefill chunk of a step attends causally over its
// context where it lies in the pool (its own new K/V, already written, and any cached prefix).
//
// torch's CPU flash attention ran SmolLM2's 1,024-token prefill at ~96 GF/s on 2 AVX-512 cores,
// half of the prefill's time. Here each work item is a tile of query rows (tokens x the GQA
// heads of one KV head) and the keys go by in slices of 16 (one float32 vector): scores are a
// rows x 16 GEMM tile whose accumulators stay in registers, the online softmax works 16 keys at a
// time, and P.V is a rows x 16-column tile the same way. K slices are transposed (and widened to
// float32) once per layer into a scratch buffer that every tile of the chunk then reads.
//
// Inputs are the runner's step layout: rows of chunk b are query_start_loc[b]..[b+1], its context
// is seq_lens[b] tokens (the chunk's are the last ones), block_tables[b] its pages. Chunks from
// `first_chunk` on are prefills (decodes come first and are the other kernel's).
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;  // keys per slice: one v16f
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// Query rows of a tile: as many accumulators as the vector registers hold (32 on AVX-512,
// 16 ymm pairs otherwise), and at least a whole GQA group (16 at most).
#if defined(__AVX512F__)
constexpr int kRows = 24;
#else
constexpr int kRows = 16;
#endif

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }
inline v16f splat16(float x) { return v16f{} + x; }

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

// Horizontal max and sum in four halving steps (a scalar loop over the lanes compiled to a chain
// of 15 dependent scalar operations).
inline v16f fold16(v16f v, bool is_max) {
  v16f h = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = is_max ? (v > h ? v : h) : v + h;
  h = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = is_max ? (v > h ? v : h) : v + h;
  h = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = is_max ? (v > h ? v : h) : v + h;
  h = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return is_max ? (v > h ? v : h) : v + h;
}
inline float hmax16(v16f v) { return fold16(v, true)[0]; }
inline float hsum16(v16f v) { return fold16(v, false)[0]; }

// exp(x) for x <= 0, as the decode kernel's exp_nonpositive (2^(x log2 e): integer part into the
// exponent bits, the fraction through a degree-6 polynomial), 16 lanes; inputs below -87 give
// exp(-87) ~ 1.6e-38, not a denormal (which costs a microcode assist per operation on some CPUs).
// With AVX-512 the floor and the power of two are one instruction each (vrndscaleps, vscalefps:
// 11 operations, not 17).
inline v16f exp_nonpositive16(v16f x) {
  x = x > splat16(-87.0f) ? x : splat16(-87.0f);
#if defined(__AVX512F__)
  const v16f t = x * 1.44269504088896341f;
  const v16f fi = reinterpret_cast<v16f>(_mm512_roundscale_ps(reinterpret_cast<__m512>(t), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#else
  const v16f t = x * 1.44269504088896341f;
  v16f fi = __builtin_convertvector(__builtin_convertvector(t, v16i), v16f);
  fi = fi > t ? fi - 1.0f : fi;  // floor
#endif
  const v16f f = t - fi;
  v16f p = splat16(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
#if defined(__AVX512F__)
  return reinterpret_cast<v16f>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(fi)));
#else
  const v16i exponent = (__builtin_convertvector(fi, v16i) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return p * scale;
#endif
}

// cap * tanh(x / cap), as the decode kernel's softcap8: an odd polynomial below |x / cap| = 1/4,
// (1 - e) / (1 + e) with e = exp(-2|x / cap|) above.
inline v16f softcap16(v16f x, float cap) {
  const v16f y = x * (1.0f / cap);
  const v16f a = y < 0.0f ? -y : y;
  const v16f y2 = y * y;
  const v16f poly = y * (1.0f + y2 * (-1.0f / 3 + y2 * (2.0f / 15 + y2 * (-17.0f / 315 + y2 * (62.0f / 2835)))));
  const v16f e = exp_nonpositive16(-2.0f * a);
  const v16f t = (1.0f - e) / (1.0f + e);
  return (a < 0.25f ? poly : (y < 0.0f ? -t : t)) * cap;
}

// What a layer does beyond causal attention (the engine's AttentionVariant): a row at position p
// sees keys p - window + 1 .. p (window 0: 0 .. p); scores are soft-capped (softcap 0: not); each
// query head's softmax starts from its sink (sinks: float32 per query head, or null).
struct Variant {
  int window;
  float softcap;
  const float* sinks;
};

// bf16 pages and queries on a CPU with AVX512-BF16: scores by vdpbf16ps on bf16 K slices staged
// as pairs of dimensions ([D/2][16] pairs), the query pair broadcast, so each instruction does 16
// keys x 2 dimensions from unwidened values (bf16 products are exact in float32; sums are float32);
// P.V likewise on V staged as pairs of keys, the softmax weights rounded to bf16 for it, as
// FlashAttention does on GPUs (the running sums and softmax stay float32). Against float32
// attention, one 1,024-token bf16 prompt: mean error 3.2e-4 (2.6e-4 with float32 weights), max
// 8.3e-3 (7.7e-3); the bf16 output's own rounding is ~4e-3 at 1.
template <typename cache_t, typename q_t>
constexpr bool kBf16Dot =
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    std::is_same_v<cache_t, c10::BFloat16> && std::is_same_v<q_t, c10::BFloat16>;
#else
    false;
#endif

struct Chunk {
  int64_t q_start;   // first query row
  int q_len;         // query rows
  int ctx;           // context tokens, the chunk's own included
  int64_t seq;       // its row of block_tables / seq_lens
  int64_t slice0;    // its first K/V slice in the scratch buffers
};

// Slice j of (chunk, KV head): K rows 16j..16j+15 transposed to [D][16] float32 and V rows as
// [16][D] float32, zeros past the context; with kDot, bf16 pairs instead: K as [D/2][16] pairs of
// dimensions, V as [8][D] pairs of keys (32-bit words, the lower key or dimension in the low half).
template <bool kDot, typename cache_t>
void stage_slice(const cache_t* k_base, const cache_t* v_base, int64_t k_block, int64_t k_token, int64_t v_block,
                 int64_t v_token, const int32_t* table, int block_size, int ctx, int j, int D, float* kt, float* vf) {
  uint32_t* kt_pairs = reinterpret_cast<uint32_t*>(kt);
  uint16_t* v_pairs = reinterpret_cast<uint16_t*>(vf);  // kDot: [key pair][D][2] bf16
  for (int t = 0; t < kLanes; ++t) {
    const int key = j * kLanes + t;
    if (key >= ctx) {
      if constexpr (kDot) {
        for (int i = 0; i < D / 2; ++i) kt_pairs[i * kLanes + t] = 0;
      } else {
        for (int d = 0; d < D; ++d) kt[d * kLanes + t] = 0.0f;
      }
      if constexpr (kDot) {
        for (int d = 0; d < D; ++d) v_pairs[(t / 2) * 2 * D + 2 * d + t % 2] = 0;
      } else {
        std::memset(vf + t * D, 0, sizeof(float) * D);
      }
      continue;
    }
    const int64_t blk = table[key / block_size], off = key % block_size;
    const cache_t* k = k_base + blk * k_block + off * k_token;
    const cache_t* v = v_base + blk * v_block + off * v_token;
    if constexpr (kDot) {
      for (int i = 0; i < D / 2; ++i) std::memcpy(kt_pairs + i * kLanes + t, k + 2 * i, sizeof(uint32_t));
    } else {
      for (int d = 0; d < D; ++d) kt[d * kLanes + t] = widen(k[d]);
    }
    if constexpr (kDot) {
      const uint16_t* raw = reinterpret_cast<const uint16_t*>(v);
      for (int d = 0; d < D; ++d) v_pairs[(t / 2) * 2 * D + 2 * d + t % 2] = raw[d];
    } else {
      for (int d = 0; d < D; ++d) vf[t * D + d] = widen(v[d]);
    }
  }
}

// Slices scored before each online-softmax update: the update's horizontal max and sum, and the
// rescale of the accumulators, are paid once per 64 keys instead of once per 16.
constexpr int kBlockSlices = 4;

// One tile: R query rows (tile tokens x group heads, token-major), positions pos[r] (-1: a padding
// row), attending keys 0..pos[r] over `num_slices` staged slices. acc: [R][D] scratch. `q` holds
// the rows as float32 already scaled, or with kDot as raw bf16 (`scale` then applies to the scores).
// The loops over the R rows must unroll for their accumulators to live in registers: left to
// itself gcc kept them in a stack array, a load and a store around every multiply-add (the
// kernel ran 1.4x slower).
// kD: the head size when known at compile time (0: `head_size` at run time). A constant one lets
// the compiler address every row of the tile from one base register; at run time it needs a
// register a row, more than x86 has, and spills them inside the score loop.
// `sink` holds each row's sink logit (with var.sinks). With a window, slices before the earliest
// row's window are skipped and the others masked per row; a block all of whose keys a row cannot
// see weighs at most exp(-87) ~ 1e-38 in that row's sums once it sees a key, as masked keys do.
template <int R, bool kDot, int kD>
void attend_tile(const float* __restrict q, float scale, const int* pos, int head_size, const float* __restrict kt,
                 const float* __restrict vf, int num_slices, float* __restrict acc, float* __restrict out,
                 const Variant& var, const float* sink) {
  const int D = kD ? kD : head_size;
  constexpr int kBlockKeys = kBlockSlices * kLanes;
  float m[R], l[R];
  alignas(64) float p[R][kBlockKeys];
  int pos_min = 1 << 30, pos_max = -1;
  for (int r = 0; r < R; ++r) {
    m[r] = var.sinks ? sink[r] : -1e30f;
    l[r] = var.sinks ? 1.0f : 0.0f;
    if (pos[r] >= 0) pos_min = std::min(pos_min, pos[r]), pos_max = std::max(pos_max, pos[r]);
  }
  std::memset(acc, 0, sizeof(float) * R * D);
  const v16i lane = v16i{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  // Keys a row at position p cannot see for its window: those at or below p - window.
  const int first_slice = var.window > 0 ? std::max(0, pos_min - var.window + 1) / kLanes : 0;
  for (int j0 = first_slice; j0 < num_slices; j0 += kBlockSlices) {
    const int block_slices = std::min(kBlockSlices, num_slices - j0);
    // Scores of the block's slices: an R x 16 tile each, accumulators in registers.
    for (int jj = 0; jj < block_slices; ++jj) {
      const int j = j0 + jj;
      const float* ktj = kt + static_cast<int64_t>(j) * D * kLanes;
      v16f s[R];
      for (int r = 0; r < R; ++r) s[r] = v16f{};
      if constexpr (kDot) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q);
        for (int i = 0; i < D / 2; ++i) {
          const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(ktj + i * kLanes));
#pragma GCC unroll 32
          for (int r = 0; r < R; ++r)
            s[r] = _mm512_dpbf16_ps(s[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(q_pairs[r * D / 2 + i])), k);
        }
        for (int r = 0; r < R; ++r) s[r] *= scale;
#endif
      } else {
        for (int d = 0; d < D; ++d) {
          const v16f k = load16(ktj + d * kLanes);
#pragma GCC unroll 32
          for (int r = 0; r < R; ++r) s[r] += q[r * D + d] * k;
        }
      }
      if (var.softcap > 0.0f) {
        for (int r = 0; r < R; ++r) s[r] = softcap16(s[r], var.softcap);
      }
      if (j * kLanes + kLanes - 1 > pos_min) {  // keys past some row's position: mask them
        for (int r = 0; r < R; ++r) s[r] = (lane + j * kLanes) <= pos[r] ? s[r] : splat16(-1e30f);
      }
      if (var.window > 0 && j * kLanes <= pos_max - var.window) {  // keys before some row's window
        for (int r = 0; r < R; ++r) s[r] = (lane + j * kLanes) > pos[r] - var.window ? s[r] : splat16(-1e30f);
      }
      for (int r = 0; r < R; ++r) store16(p[r] + jj * kLanes, s[r]);
    }
    // Online softmax over the block, per row.
    float alpha[R];
    for (int r = 0; r < R; ++r) {
      v16f vmax = load16(p[r]);
      for (int jj = 1; jj < block_slices; ++jj) {
        const v16f x = load16(p[r] + jj * kLanes);
        vmax = x > vmax ? x : vmax;
      }
      const float mx = std::max(m[r], hmax16(vmax));
      alpha[r] = exp_nonpositive16(splat16(m[r] - mx))[0];
      v16f sum = v16f{};
      for (int jj = 0; jj < block_slices; ++jj) {
        const v16f x = load16(p[r] + jj * kLanes);
        // Masked keys (-1e30) weigh at most exp(-87) ~ 1e-38 here: nothing beside the row's
        // largest weight, 1, in float32 sums (and padding rows are not written out).
        const v16f e = exp_nonpositive16(x - mx);
        store16(p[r] + jj * kLanes, e);
        sum += e;
      }
      l[r] = l[r] * alpha[r] + hsum16(sum);
      m[r] = mx;
    }
    // P.V: an R x 16-column tile per pass over the block's keys.
    const float* vfb = vf + static_cast<int64_t>(j0) * kLanes * D;
    const int block_keys = block_slices * kLanes;
    if constexpr (kDot) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      // Weights rounded to bf16, in key pairs against V staged as key pairs: 16 columns x 2 keys
      // an instruction.
      alignas(64) uint32_t p_pairs[R][kBlockKeys / 2];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < block_keys; t += 2 * kLanes)
          _mm512_store_si512(p_pairs[r] + t / 2, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                                      load16(p[r] + t + kLanes), load16(p[r] + t))));
      // Each slice's slot holds 16 x D words, of which its 8 key pairs fill the first 8 x D.
      const uint32_t* v_pairs = reinterpret_cast<const uint32_t*>(vfb);
      for (int c = 0; c < D; c += kLanes) {
        v16f a[R];
        for (int r = 0; r < R; ++r) a[r] = load16(acc + r * D + c) * alpha[r];
        for (int u = 0; u < block_keys / 2; ++u) {
          const uint32_t* pair_row = v_pairs + (u / (kLanes / 2)) * kLanes * D + (u % (kLanes / 2)) * D;
          const __m512bh v = reinterpret_cast<__m512bh>(_mm512_loadu_si512(pair_row + c));
#pragma GCC unroll 32
          for (int r = 0; r < R; ++r)
            a[r] = _mm512_dpbf16_ps(a[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(p_pairs[r][u])), v);
        }
        for (int r = 0; r < R; ++r) store16(acc + r * D + c, a[r]);
      }
#endif
    } else {
      for (int c = 0; c < D; c += kLanes) {
        v16f a[R];
        for (int r = 0; r < R; ++r) a[r] = load16(acc + r * D + c) * alpha[r];
        for (int t = 0; t < block_keys; ++t) {
          const v16f v = load16(vfb + t * D + c);
#pragma GCC unroll 32
          for (int r = 0; r < R; ++r) a[r] += p[r][t] * v;
        }
        for (int r = 0; r < R; ++r) store16(acc + r * D + c, a[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int c = 0; c < D; c += kLanes) store16(out + r * D + c, load16(acc + r * D + c) * inv);
  }
}

template <typename cache_t, typename q_t>
void prefill_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const std::vector<Chunk>& chunks, int64_t total_slices,
                  double scale, const Variant& var) {
  const int num_q_heads = query.size(1), D = query.size(2);
  const int num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const int group = num_q_heads / num_kv_heads;
  const int tile_tokens = std::max(1, kRows / group);
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  const q_t* q_ptr = query.data_ptr<q_t>();
  q_t* o_ptr = out.data_ptr<q_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_row = block_tables.stride(0);
  const int64_t slice_floats = static_cast<int64_t>(D) * kLanes;

  // Staged K (transposed) and V: [KV head][slice][D x 16] each.
  at::Tensor staged = at::empty({2, num_kv_heads, total_slices, slice_floats}, query.options().dtype(at::kFloat));
  float* kt_all = staged.data_ptr<float>();
  float* vf_all = kt_all + num_kv_heads * total_slices * slice_floats;
  std::vector<std::pair<int, int>> slices;  // (chunk, slice within it)
  for (int c = 0; c < static_cast<int>(chunks.size()); ++c)
    for (int j = 0; j < (chunks[c].ctx + kLanes - 1) / kLanes; ++j) slices.emplace_back(c, j);
  at::parallel_for(0, static_cast<int64_t>(slices.size()) * num_kv_heads, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int h = i % num_kv_heads;
      const auto [c, j] = slices[i / num_kv_heads];
      const Chunk& ch = chunks[c];
      const int64_t at_slice = (h * total_slices + ch.slice0 + j) * slice_floats;
      stage_slice<kBf16Dot<cache_t, q_t>>(k_ptr + h * k_cache.stride(2), v_ptr + h * v_cache.stride(2), k_cache.stride(0), k_cache.stride(1),
                  v_cache.stride(0), v_cache.stride(1), bt + ch.seq * bt_row, block_size, ch.ctx, j, D,
                  kt_all + at_slice, vf_all + at_slice);
    }
  });

  // Tiles, costliest (most slices) first, each taken by whichever thread is free next.
  struct Tile { int chunk, head, token0, slices; };
  std::vector<Tile> tiles;
  for (int c = 0; c < static_cast<int>(chunks.size()); ++c) {
    const Chunk& ch = chunks[c];
    for (int t0 = 0; t0 < ch.q_len; t0 += tile_tokens) {
      const int last = ch.ctx - ch.q_len + std::min(t0 + tile_tokens, ch.q_len) - 1;
      for (int h = 0; h < num_kv_heads; ++h) tiles.push_back({c, h, t0, last / kLanes + 1});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.slices > b.slices; });
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t num_tiles = tiles.size();
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tiles), 1, [&](int64_t, int64_t) {
    std::vector<float> q(kRows * D), acc(kRows * D), o(kRows * D);
    int pos[kRows];
    float sink[kRows];
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_tiles;) {
      const Tile& tile = tiles[i];
      const Chunk& ch = chunks[tile.chunk];
      for (int r = 0; r < kRows; ++r) {
        const int t = tile.token0 + r / group, g = r % group;
        const bool valid = r < tile_tokens * group && t < ch.q_len;
        pos[r] = valid ? ch.ctx - ch.q_len + t : -1;
        sink[r] = var.sinks ? var.sinks[tile.head * group + g] : 0.0f;
        const q_t* src = q_ptr + (ch.q_start + t) * query.stride(0) + (tile.head * group + g) * query.stride(1);
        if constexpr (kBf16Dot<cache_t, q_t>) {  // raw bf16 rows, D/2 32-bit pairs each
          uint32_t* pairs = reinterpret_cast<uint32_t*>(q.data()) + r * D / 2;
          if (valid) std::memcpy(pairs, src, sizeof(q_t) * D);
          else std::memset(pairs, 0, sizeof(q_t) * D);
        } else {
          for (int d = 0; d < D; ++d) q[r * D + d] = valid ? widen(src[d]) * fscale : 0.0f;
        }
      }
      const int64_t at_slice = (tile.head * total_slices + ch.slice0) * slice_floats;
      constexpr bool kDot = kBf16Dot<cache_t, q_t>;
      const float* kt = kt_all + at_slice;
      const float* vf = vf_all + at_slice;
      if (D == 64) attend_tile<kRows, kDot, 64>(q.data(), fscale, pos, D, kt, vf, tile.slices, acc.data(), o.data(), var, sink);
      else if (D == 128) attend_tile<kRows, kDot, 128>(q.data(), fscale, pos, D, kt, vf, tile.slices, acc.data(), o.data(), var, sink);
      else attend_tile<kRows, kDot, 0>(q.data(), fscale, pos, D, kt, vf, tile.slices, acc.data(), o.data(), var, sink);
      for (int r = 0; r < kRows; ++r) {
        if (pos[r] < 0) continue;
        const int t = tile.token0 + r / group, g = r % group;
        q_t* dst = o_ptr + (ch.q_start + t) * out.stride(0) + (tile.head * group + g) * out.stride(1);
        for (int d = 0; d < D; ++d) dst[d] = static_cast<q_t>(o[r * D + d]);
      }
    }
  });
}

// out[rows of chunk b] = causal attention of those rows over chunk b's context, for every chunk b
// from first_chunk on. out, query: [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] float32,
// bf16 or fp16 with any strides (D contiguous); block_tables [B, max_blocks], query_start_loc
// [B + 1], seq_lens [B], all int32.
void paged_prefill(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                   int64_t first_chunk, double scale, int64_t window, double softcap,
                   const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "query/out must be [T, H, D] alike");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim of query/out must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be 4-D alike");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches' head_dim must be contiguous");
  TORCH_CHECK(k_cache.size(3) == query.size(2) && query.size(2) % kLanes == 0,
              "head_dim must be the caches' and a multiple of 16");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(1) / k_cache.size(2) <= 16,
              "query heads must be a multiple of KV heads, at most 16 a KV head");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
              seq_lens.scalar_type() == at::kInt, "block_tables, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
              query_start_loc.numel() == seq_lens.numel() + 1 && block_tables.size(0) >= seq_lens.numel(),
              "a query_start_loc pair, a seq_len and a block table row per sequence");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == query.size(1)),
              "sinks must be float32, contiguous, one per query head");
  const Variant var{static_cast<int>(window), static_cast<float>(softcap),
                    sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
  const int32_t* qs = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<Chunk> chunks;
  int64_t total_slices = 0;
  for (int64_t b = first_chunk; b < seq_lens.numel(); ++b) {
    const int q_len = qs[b + 1] - qs[b], ctx = lens[b];
    TORCH_CHECK(q_len >= 0 && q_len <= ctx && qs[b + 1] <= query.size(0), "chunk ", b, " has bad rows or length");
    TORCH_CHECK((ctx + k_cache.size(1) - 1) / k_cache.size(1) <= block_tables.size(1), "chunk ", b,
                "'s context outruns its block table");
    if (q_len == 0) continue;
    chunks.push_back({qs[b], q_len, ctx, b, total_slices});
    total_slices += (ctx + kLanes - 1) / kLanes;
  }
  if (chunks.empty()) return;
#define PREFILL_Q(cache_t)                                                                                 \
  switch (query.scalar_type()) {                                                                          \
    case at::kFloat: return prefill_impl<cache_t, float>(out, query, k_cache, v_cache, block_tables, chunks, \
                                                         total_slices, scale, var);                            \
    case at::kBFloat16: return prefill_impl<cache_t, c10::BFloat16>(out, query, k_cache, v_cache, block_tables, \
                                                                    chunks, total_slices, scale, var);         \
    case at::kHalf: return prefill_impl<cache_t, c10::Half>(out, query, k_cache, v_cache, block_tables, chunks, \
                                                            total_slices, scale, var);                         \
    default: TORCH_CHECK(false, "paged_prefill: unsupported query dtype ", query.scalar_type());           \
  }
  switch (k_cache.scalar_type()) {
    case at::kFloat: PREFILL_Q(float)
    case at::kBFloat16: PREFILL_Q(c10::BFloat16)
    case at::kHalf: PREFILL_Q(c10::Half)
    default: TORCH_CHECK(false, "paged_prefill: cache dtype ", k_cache.scalar_type(), " (float pages only)");
  }
#undef PREFILL_Q
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("paged_prefill(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, int first_chunk, float scale, int window=0, float softcap=0.0, "
        "Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
