// Paged decode attention on the CPU: every decoding sequence reads its K/V pages where they lie.
//
// One work item per (sequence, KV head): the GQA group of query heads that share that KV head
// walks the sequence's block table page by page with an online softmax, so no context is ever
// gathered or copied. Scores and accumulators are float32 whatever the cache dtype; bf16/fp16
// pages are widened on load. Work items are spread over torch's intra-op threads, the same
// threads the linear layers use.
//
// The caches are taken as a logical [num_blocks, block_size, num_kv_heads, head_dim] view with
// any strides (head_dim contiguous), so token-major and head-major pools are both read in place.
//
// Quantized caches (int8, fp8 e4m3 / e5m2; splitserve/engine/attention/kv_quant.py) hold rows of head_dim
// 8-bit codes followed by the 4 bytes of a float32 scale per (token, head): the row is
// [.., head_dim + 4] elements. K rows are dequantized as they are widened into the page buffer;
// V's scales are folded into the softmax weights, so the V loop is the same as for floats.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

namespace {

constexpr int kMaxBlockSize = 256;
constexpr int kMaxGroup = 16;

// Eight floats: one AVX2 register (two NEON ones); plain vector extensions so every target
// compiles, with AVX2 intrinsics where a generic spelling compiles badly.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8f bits_to_float(v8u32 x) {
  v8f v;
  std::memcpy(&v, &x, sizeof(v));
  return v;
}

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v8f load8(const c10::BFloat16* p) {
#if defined(__AVX2__)
  const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<v8f>(_mm256_castsi256_ps(wide));
#else
  v8u16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return bits_to_float(__builtin_convertvector(raw, v8u32) << 16);
#endif
}
inline v8f load8(const c10::Half* p) {
#if defined(__F16C__)
  return reinterpret_cast<v8f>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
inline v8f load8(const int8_t* p) {
#if defined(__AVX2__)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v8f>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
#else
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// fp8 codes -> float through a 256-entry table (1 KiB, stays in L1): one gather per 8 codes.
template <typename fp8_t>
const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(fp8_t(static_cast<uint8_t>(b), fp8_t::from_bits()));
    return t;
  }();
  return table.data();
}
template <typename fp8_t>
inline v8f load8_fp8(const fp8_t* p) {
  const float* table = fp8_table<fp8_t>();
#if defined(__AVX2__)
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v8f>(_mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(raw), 4));
#else
  const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
  v8f v;
  for (int i = 0; i < 8; ++i) v[i] = table[b[i]];
  return v;
#endif
}
inline v8f load8(const c10::Float8_e4m3fn* p) { return load8_fp8(p); }
inline v8f load8(const c10::Float8_e5m2* p) { return load8_fp8(p); }

// Which cache types are quantized rows, and the largest code each maps a row's amax onto.
template <typename T> struct KvQuant { static constexpr bool value = false; };
template <> struct KvQuant<int8_t> { static constexpr bool value = true; static constexpr float qmax = 127.0f; };
template <> struct KvQuant<c10::Float8_e4m3fn> { static constexpr bool value = true; static constexpr float qmax = 448.0f; };
template <> struct KvQuant<c10::Float8_e5m2> { static constexpr bool value = true; static constexpr float qmax = 57344.0f; };
constexpr int kScaleBytes = 4;

// The float32 scale after a quantized row's D codes (the row need not be 4-byte aligned).
template <typename cache_t>
inline float row_scale(const cache_t* row, int D) {
  float scale;
  std::memcpy(&scale, row + D, sizeof(scale));
  return scale;
}

inline bool is_quantized(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}
// Head size of a cache: its last dim, less a quantized row's scale.
inline int64_t cache_head_dim(const at::Tensor& cache) {
  return cache.size(3) - (is_quantized(cache.scalar_type()) ? kScaleBytes : 0);
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8f vmax(v8f a, v8f b) { return a > b ? a : b; }
// Horizontal max and sum in three halving steps (a scalar loop over the lanes compiled to a chain
// of seven dependent scalar operations).
inline float hmax(v8f v) {
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  return vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}
inline float hsum(v8f v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return (v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6))[0];
}

// What a layer does beyond causal attention over every earlier token (the engine's
// AttentionVariant): the scale, a sliding window (a decode at position ctx-1 sees positions
// ctx-window .. ctx-1; 0: all), soft-capping of the scores (cap * tanh(score / cap); 0: none) and
// attention sinks (a float32 logit per query head in every softmax's denominator; null: none).
struct Variant {
  float scale;
  int window;
  float softcap;
  const float* sinks;
  int first_visible(int ctx) const { return window > 0 ? std::max(0, ctx - window) : 0; }
};

// exp(x) for x <= 0 as 2^(x log2 e): the integer part goes into the exponent bits, the
// fraction through a degree-6 polynomial (relative error ~2e-7, below the float32 rounding
// of the sums it feeds). Inputs below -87 give ~0 instead of a denormal. With AVX-512 (VL) the
// floor and the power of two are one instruction each (vrndscaleps, vscalefps).
inline v8f exp_nonpositive(v8f x) {
  x = vmax(x, splat(-87.0f));
#if defined(__AVX512F__) && defined(__AVX512VL__)
  const v8f t = x * splat(1.44269504088896341f);
  const v8f fi = reinterpret_cast<v8f>(_mm256_roundscale_ps(reinterpret_cast<__m256>(t), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#else
  const v8f t = x * splat(1.44269504088896341f);
  v8f fi = __builtin_convertvector(__builtin_convertvector(t, v8i), v8f);
  fi = fi > t ? fi - splat(1.0f) : fi;  // floor
#endif
  const v8f f = t - fi;
  v8f p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.0f);
#if defined(__AVX512F__) && defined(__AVX512VL__)
  return reinterpret_cast<v8f>(_mm256_scalef_ps(reinterpret_cast<__m256>(p), reinterpret_cast<__m256>(fi)));
#else
  const v8i exponent = (__builtin_convertvector(fi, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return p * scale;
#endif
}

// cap * tanh(x / cap): an odd polynomial below |x / cap| = 1/4 (its first omitted term is ~1e-9
// relative there), (1 - e) / (1 + e) with e = exp(-2|x / cap|) above (no cancellation left).
inline v8f softcap8(v8f x, float cap) {
  const v8f y = x * splat(1.0f / cap);
  const v8f a = y < splat(0.0f) ? -y : y;
  const v8f y2 = y * y;
  const v8f poly = y * (splat(1.0f) + y2 * (splat(-1.0f / 3) + y2 * (splat(2.0f / 15) + y2 * (splat(-17.0f / 315) +
                                                                                     y2 * splat(62.0f / 2835)))));
  const v8f e = exp_nonpositive(splat(-2.0f) * a);
  const v8f t = (splat(1.0f) - e) / (splat(1.0f) + e);
  const v8f big = y < splat(0.0f) ? -t : t;
  return (a < splat(0.25f) ? poly : big) * splat(cap);
}

// The variant's part of one span of scores s[0..n) at context positions pos0..: soft-capped,
// and positions before `first` (outside the window) masked. Slots n.. up to the next multiple of
// 8 hold masked scores (-1e30), capped along in the last vector: they are masked again.
inline void apply_variant(float* s, int n, int pos0, int first, const Variant& var) {
  if (var.softcap > 0.0f) {
    for (int t = 0; t < n; t += 8) store8(s + t, softcap8(load8(s + t), var.softcap));
    for (int t = n; t < ((n + 7) & ~7); ++t) s[t] = -1e30f;
  }
  for (int t = 0; t < std::min(n, first - pos0); ++t) s[t] = -1e30f;
}

// Eight dot-product accumulators -> one vector of their eight sums.
inline v8f reduce8(const v8f d[8]) {
#if defined(__AVX__)
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  // a = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high halves of each row), b likewise for rows 4-7.
  const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(a, b, 0x31);
  return reinterpret_cast<v8f>(_mm256_add_ps(lo, hi));
#else
  v8f out;
  for (int j = 0; j < 8; ++j) {
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) sum += d[j][i];
    out[j] = sum;
  }
  return out;
#endif
}

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void store_row(T* __restrict dst, const float* __restrict src, int n) {
  for (int d = 0; d < n; ++d) dst[d] = static_cast<T>(src[d]);
}

struct CacheView {
  int64_t block, token, head;  // strides in elements
};

// Online softmax of one head over one page (the bf16 kernel: a span of pages): its `n8` scores
// (a multiple of 8; the tail past its tokens holds -1e30) become their weights exp(score - new
// max), and what came before (running sum `l`, accumulator `acc` of D floats, in any order) is
// rescaled by exp(old max - new max).
template <int D>
inline void online_softmax(float* __restrict s, int n8, float& m, float& l, float* __restrict acc) {
  v8f page_max = splat(m);
  for (int t0 = 0; t0 < n8; t0 += 8) page_max = vmax(page_max, load8(s + t0));
  const float mx = hmax(page_max);
  const float alpha = exp_nonpositive(splat(m - mx))[0];
  v8f sum = v8f{};
  for (int t0 = 0; t0 < n8; t0 += 8) {
    const v8f e = exp_nonpositive(load8(s + t0) - splat(mx));
    store8(s + t0, e);
    sum += e;
  }
  l = l * alpha + hsum(sum);
  m = mx;
  for (int c = 0; c < D / 8; ++c) store8(acc + c * 8, load8(acc + c * 8) * splat(alpha));
}

// Register columns of V accumulated per pass: G x CC accumulators (at most 12 of AVX2's 16
// registers, leaving room for the V row and the weight), CC dividing the row's C columns.
constexpr int v_columns(int group, int columns) {
  int cc = 12 / group > 0 ? 12 / group : 1;
  while (columns % cc != 0) --cc;
  return cc;
}

// Query heads of one KV head attended in one walk of the pages: the loops over them unroll
// (a runtime count kept every accumulator in memory); larger GQA groups take several walks,
// the later ones reading the pages from cache.
constexpr int kWalkGroup = 4;

// G query heads (G <= kWalkGroup) sharing one KV head of one sequence: `q` holds their G rows of
// `D` floats, already scaled. Per page: score the page's tokens for all G heads with each K row
// loaded once, update the online softmax, then accumulate V with each V row loaded once. Float
// pages are read in place; other dtypes are widened (and dequantized) into an L1 buffer first.
template <typename cache_t, int D, int G>
void attend_group(const float* __restrict q, const cache_t* __restrict k_base, const cache_t* __restrict v_base,
                  CacheView kv, CacheView vv, const int32_t* __restrict table, int ctx, int block_size,
                  float* __restrict out, const Variant& var, int head0) {
  constexpr int C = D / 8;                  // register columns of a row
  constexpr int T = G * 2 <= 8 ? 8 / G : 1;  // tokens scored per pass: G x T <= 8 dot products
  constexpr int CC = v_columns(G, C);
  constexpr bool kInPlace = std::is_same_v<cache_t, float>;
  float m[G], l[G];
  alignas(64) float acc[G][D];
  alignas(64) float s[G][kMaxBlockSize + 8];
  alignas(64) float kf[kInPlace ? 1 : kMaxBlockSize + 8][D];
  alignas(64) float vscale[kMaxBlockSize + 8];  // quantized V: each token's scale
  alignas(64) static const float zero_row[D] = {};
  for (int g = 0; g < G; ++g) {  // a sink starts the softmax as a score whose value is zero
    m[g] = var.sinks ? var.sinks[head0 + g] : -1e30f;
    l[g] = var.sinks ? 1.0f : 0.0f;
    for (int c = 0; c < C; ++c) store8(acc[g] + c * 8, v8f{});
  }
  const int num_pages = (ctx + block_size - 1) / block_size;
  const int first = var.first_visible(ctx);
  for (int p = first / block_size; p < num_pages; ++p) {
    const int64_t blk = table[p];
    const int n = std::min(block_size, ctx - p * block_size);
    const int n8 = (n + 7) & ~7;
    const cache_t* kp = k_base + blk * kv.block;
    const cache_t* vp = v_base + blk * vv.block;
    if constexpr (!kInPlace) {
      for (int t = 0; t < n; ++t) {
        if constexpr (KvQuant<cache_t>::value) {
          const v8f ks = splat(row_scale(kp + t * kv.token, D));
          for (int c = 0; c < C; ++c) store8(kf[t] + c * 8, load8(kp + t * kv.token + c * 8) * ks);
          vscale[t] = row_scale(vp + t * vv.token, D);
        } else {
          for (int c = 0; c < C; ++c) store8(kf[t] + c * 8, load8(kp + t * kv.token + c * 8));
        }
      }
    }
    auto krow = [&](int t) -> const float* {
      if (t >= n) return zero_row;
      if constexpr (kInPlace) return kp + t * kv.token;
      else return kf[t];
    };
    // Scores: T tokens x G heads per pass, each K row loaded once per register column.
    for (int t0 = 0; t0 < n8; t0 += T) {
      v8f d[8] = {};
      for (int c = 0; c < C; ++c) {
        v8f k[T];
        for (int j = 0; j < T; ++j) k[j] = load8(krow(t0 + j) + c * 8);
        for (int g = 0; g < G; ++g) {
          const v8f qg = load8(q + g * D + c * 8);
          for (int j = 0; j < T; ++j) d[g * T + j] += qg * k[j];
        }
      }
      const v8f r = reduce8(d);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < T; ++j) s[g][t0 + j] = t0 + j < n ? r[g * T + j] : -1e30f;
    }
    for (int g = 0; g < G; ++g) {
      if (var.softcap > 0.0f || first > p * block_size) apply_variant(s[g], n, p * block_size, first, var);
      online_softmax<D>(s[g], n8, m[g], l[g], acc[g]);
      if constexpr (KvQuant<cache_t>::value) {  // weight x V scale: the V loop below reads raw codes
        for (int t = 0; t < n; ++t) s[g][t] *= vscale[t];
      }
    }
    // V: CC register columns of all G heads at a time, each V row's columns loaded once.
    for (int c0 = 0; c0 < C; c0 += CC) {
      v8f a[G][CC];
      for (int g = 0; g < G; ++g)
        for (int cc = 0; cc < CC; ++cc) a[g][cc] = load8(acc[g] + (c0 + cc) * 8);
      for (int t = 0; t < n; ++t) {
        const cache_t* vrow = vp + t * vv.token + c0 * 8;
        v8f v[CC];
        for (int cc = 0; cc < CC; ++cc) v[cc] = load8(vrow + cc * 8);
        for (int g = 0; g < G; ++g) {
          const v8f w = splat(s[g][t]);
          for (int cc = 0; cc < CC; ++cc) a[g][cc] += w * v[cc];
        }
      }
      for (int g = 0; g < G; ++g)
        for (int cc = 0; cc < CC; ++cc) store8(acc[g] + (c0 + cc) * 8, a[g][cc]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int c = 0; c < C; ++c) store8(out + g * D + c * 8, load8(acc[g] + c * 8) * splat(inv));
  }
}

// All `group` query heads of one KV head, in walks of up to kWalkGroup heads.
template <typename cache_t, int D>
void attend_one(const float* q, int group, const cache_t* k_base, const cache_t* v_base, CacheView kv,
                CacheView vv, const int32_t* table, int ctx, int block_size, float* out, const Variant& var,
                int head0) {
  for (int g0 = 0; g0 < group; g0 += kWalkGroup) {
    const float* qg = q + g0 * D;
    float* og = out + g0 * D;
    switch (std::min(kWalkGroup, group - g0)) {
      case 1: attend_group<cache_t, D, 1>(qg, k_base, v_base, kv, vv, table, ctx, block_size, og, var, head0 + g0); break;
      case 2: attend_group<cache_t, D, 2>(qg, k_base, v_base, kv, vv, table, ctx, block_size, og, var, head0 + g0); break;
      case 3: attend_group<cache_t, D, 3>(qg, k_base, v_base, kv, vv, table, ctx, block_size, og, var, head0 + g0); break;
      default: attend_group<cache_t, D, 4>(qg, k_base, v_base, kv, vv, table, ctx, block_size, og, var, head0 + g0); break;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 pages and bf16 queries on a CPU with AVX512-BF16 (Zen 4/5, Sapphire Rapids): scores by
// vdpbf16ps straight from the pages, 32 bf16 products a register, no widening of K (bf16 x bf16
// products are exact in float32, sums float32, as above); P.V in float32 on 16-lane registers.
// Where this is compiled, bf16 decode on the generic path above spent most of its time widening K
// and in 8-lane horizontal sums.
constexpr bool kBf16DotKernel = true;

// Sixteen dot-product accumulators -> one register of their sixteen sums, lane j = sum of d[j]:
// pairs are interleaved and added within 128-bit lanes, then 128-bit lanes across registers.
inline __m512 reduce16(const __m512 d[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // lanes [j j+1 j j+1] of tokens j = 2i: partial sums
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lanes [4i 4i+1 4i+2 4i+3] in each 128-bit lane
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

// Tokens scored and weighed together by the bf16 kernel: whole pages up to this many (one page
// when pages are larger), so the online softmax's bookkeeping is paid once a span, not a page.
constexpr int kSpanTokens = 64;

// attend_group for bf16 pages and queries: `q` holds G raw bf16 rows (`scale` applies to the
// scores). Per span: scores 16 tokens at a time across its pages (rows past the span read a zero
// row and are masked), the shared online softmax, then V. V rows are widened by interleaving
// with zeros, which leaves each 32-value block's floats in the order [0-3 8-11 16-19 24-27 |
// 4-7 12-15 20-23 28-31]: `acc` keeps that order and the end puts it back.
template <int D, int G>
void attend_group_bf16(const c10::BFloat16* __restrict q, const c10::BFloat16* __restrict k_base,
                       const c10::BFloat16* __restrict v_base, CacheView kv, CacheView vv,
                       const int32_t* __restrict table, int ctx, int block_size, float* __restrict out,
                       const Variant& var, int head0) {
  constexpr int VP = D / 32;  // bf16 registers of a row
  constexpr int PP = [] {     // bf16 V registers per pass: G x 2PP float accumulators in at most 24 registers
    int pp = 12 / G > 0 ? 12 / G : 1;
    while (VP % pp != 0) --pp;
    return pp;
  }();
  constexpr int kMaxSpan = kMaxBlockSize > kSpanTokens ? kMaxBlockSize : kSpanTokens;
  float m[G], l[G];
  alignas(64) float acc[G][D];
  alignas(64) float s[G][kMaxSpan + 16];
  alignas(64) static const c10::BFloat16 zero_row[D] = {};
  const c10::BFloat16* krow[kMaxSpan + 16];
  const c10::BFloat16* vrow[kMaxSpan];
  __m512bh qv[G][VP];
  for (int g = 0; g < G; ++g) {
    m[g] = var.sinks ? var.sinks[head0 + g] : -1e30f;
    l[g] = var.sinks ? 1.0f : 0.0f;
    for (int c = 0; c < D / 16; ++c) _mm512_store_ps(acc[g] + c * 16, _mm512_setzero_ps());
    for (int c = 0; c < VP; ++c) qv[g][c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + g * D + c * 32));
  }
  const __m512 vscale = _mm512_set1_ps(var.scale);
  const __m512 masked = _mm512_set1_ps(-1e30f);
  const __m512i zero = _mm512_setzero_si512();
  const int first = var.first_visible(ctx);
  for (int pos = first - first % block_size; pos < ctx;) {  // `pos` is always at a page boundary
    int n = 0;
    do {
      const int64_t blk = table[(pos + n) / block_size];
      const int rows = std::min(block_size, ctx - (pos + n));
      for (int t = 0; t < rows; ++t) {
        krow[n + t] = k_base + blk * kv.block + t * kv.token;
        vrow[n + t] = v_base + blk * vv.block + t * vv.token;
      }
      n += rows;
    } while (pos + n < ctx && n + block_size <= kSpanTokens);
    const int n16 = (n + 15) & ~15;
    for (int t = n; t < n16; ++t) krow[t] = zero_row;
    for (int t0 = 0; t0 < n16; t0 += 16) {
      const int rows = std::min(16, n - t0);
      const __mmask16 valid = static_cast<__mmask16>(rows >= 16 ? 0xFFFFu : (1u << rows) - 1u);
      for (int g = 0; g < G; ++g) {
        __m512 d[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          d[j] = _mm512_setzero_ps();
          for (int c = 0; c < VP; ++c)
            d[j] = _mm512_dpbf16_ps(d[j], qv[g][c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(krow[t0 + j] + c * 32)));
        }
        _mm512_store_ps(s[g] + t0, _mm512_mask_blend_ps(valid, masked, _mm512_mul_ps(reduce16(d), vscale)));
      }
    }
    const int n8 = (n + 7) & ~7;
    for (int g = 0; g < G; ++g) {
      if (var.softcap > 0.0f || first > pos) apply_variant(s[g], n, pos, first, var);
      online_softmax<D>(s[g], n8, m[g], l[g], acc[g]);
    }
    for (int c0 = 0; c0 < VP; c0 += PP) {
      __m512 a[G][2 * PP];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 2 * PP; ++i) a[g][i] = _mm512_load_ps(acc[g] + c0 * 32 + i * 16);
      for (int t = 0; t < n; ++t) {
        __m512 v[2 * PP];
        for (int pp = 0; pp < PP; ++pp) {
          const __m512i x = _mm512_loadu_si512(vrow[t] + (c0 + pp) * 32);
          v[2 * pp] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x));
          v[2 * pp + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x));
        }
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(s[g][t]);
          for (int i = 0; i < 2 * PP; ++i) a[g][i] = _mm512_fmadd_ps(w, v[i], a[g][i]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 2 * PP; ++i) _mm512_store_ps(acc[g] + c0 * 32 + i * 16, a[g][i]);
    }
    pos += n;
  }
  for (int g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int c = 0; c < VP; ++c) {
      const float* lo = acc[g] + c * 32;
      float* o = out + g * D + c * 32;
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 4; ++i) {
          o[8 * k + i] = lo[4 * k + i] * inv;
          o[8 * k + 4 + i] = lo[16 + 4 * k + i] * inv;
        }
    }
  }
}

template <int D>
void attend_one_bf16(const c10::BFloat16* q, int group, const c10::BFloat16* k_base,
                     const c10::BFloat16* v_base, CacheView kv, CacheView vv, const int32_t* table, int ctx,
                     int block_size, float* out, const Variant& var, int head0) {
  for (int g0 = 0; g0 < group; g0 += kWalkGroup) {
    const c10::BFloat16* qg = q + g0 * D;
    float* og = out + g0 * D;
    switch (std::min(kWalkGroup, group - g0)) {
      case 1: attend_group_bf16<D, 1>(qg, k_base, v_base, kv, vv, table, ctx, block_size, og, var, head0 + g0); break;
      case 2: attend_group_bf16<D, 2>(qg, k_base, v_base, kv, vv, table, ctx, block_size, og, var, head0 + g0); break;
      case 3: attend_group_bf16<D, 3>(qg, k_base, v_base, kv, vv, table, ctx, block_size, og, var, head0 + g0); break;
      default: attend_group_bf16<D, 4>(qg, k_base, v_base, kv, vv, table, ctx, block_size, og, var, head0 + g0); break;
    }
  }
}
#else
constexpr bool kBf16DotKernel = false;
#endif

template <typename cache_t, typename q_t, int D>
void decode_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const Variant& var, int64_t num_seqs) {
  const int num_q_heads = query.size(1);
  const int num_kv_heads = k_cache.size(2);
  const int block_size = k_cache.size(1);
  const int group = num_q_heads / num_kv_heads;
  const CacheView kv{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  const CacheView vv{v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  const q_t* q_ptr = query.data_ptr<q_t>();
  q_t* o_ptr = out.data_ptr<q_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t bt_row = block_tables.stride(0);
  const float fscale = var.scale;

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float q[kMaxGroup * D];
    alignas(64) float o[kMaxGroup * D];
    alignas(64) q_t q_raw[kMaxGroup * D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads;
      const int h = item % num_kv_heads;
      const int ctx = lens[b];
      constexpr bool bf16_dot = kBf16DotKernel && std::is_same_v<cache_t, c10::BFloat16> &&
                                std::is_same_v<q_t, c10::BFloat16> && D % 32 == 0;
      if constexpr (bf16_dot) {
        for (int g = 0; g < group; ++g)
          std::memcpy(q_raw + g * D, q_ptr + b * q_row + (h * group + g) * q_head, D * sizeof(q_t));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        attend_one_bf16<D>(q_raw, group, k_ptr + h * kv.head, v_ptr + h * vv.head, kv, vv, bt + b * bt_row, ctx,
                           block_size, o, var, h * group);
#endif
      } else {
        for (int g = 0; g < group; ++g) {
          const q_t* src = q_ptr + b * q_row + (h * group + g) * q_head;
          for (int d = 0; d < D; ++d) q[g * D + d] = widen(src[d]) * fscale;
        }
        attend_one<cache_t, D>(q, group, k_ptr + h * kv.head, v_ptr + h * vv.head, kv, vv, bt + b * bt_row, ctx,
                               block_size, o, var, h * group);
      }
      for (int g = 0; g < group; ++g) store_row(o_ptr + b * o_row + (h * group + g) * o_head, o + g * D, D);
    }
  });
}

template <typename cache_t, typename q_t>
void dispatch_head_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const Variant& var, int64_t num_seqs) {
  switch (query.size(2)) {
    case 16: return decode_impl<cache_t, q_t, 16>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case 32: return decode_impl<cache_t, q_t, 32>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case 48: return decode_impl<cache_t, q_t, 48>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case 64: return decode_impl<cache_t, q_t, 64>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case 80: return decode_impl<cache_t, q_t, 80>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case 96: return decode_impl<cache_t, q_t, 96>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case 128: return decode_impl<cache_t, q_t, 128>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case 256: return decode_impl<cache_t, q_t, 256>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    default: TORCH_CHECK(false, "paged_decode: head_dim ", query.size(2), " is not one of 16, 32, 48, 64, 80, 96, 128, 256");
  }
}

template <typename cache_t>
void dispatch_query(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const Variant& var, int64_t num_seqs) {
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_head_dim<cache_t, float>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case at::kBFloat16:
      return dispatch_head_dim<cache_t, c10::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, var,
                                                       num_seqs);
    case at::kHalf:
      return dispatch_head_dim<cache_t, c10::Half>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    default: TORCH_CHECK(false, "paged_decode: unsupported query dtype ", query.scalar_type());
  }
}

void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.device().is_cpu(), "splitserve_cpu ops are the CPU kernels");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be 4-D alike");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches' head_dim must be contiguous");
  TORCH_CHECK(k_cache.size(1) <= kMaxBlockSize, "block_size above ", kMaxBlockSize);
}

// Decode attention of the first `num_seqs` rows (one new token each).
void decode_rows(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const Variant& var, int64_t num_seqs) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, H, D] alike");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim of query/out must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out and query differ in dtype");
  TORCH_CHECK(cache_head_dim(k_cache) == query.size(2), "query and cache head_dim differ");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(1) / k_cache.size(2) <= kMaxGroup, "GQA group above ", kMaxGroup);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(num_seqs >= 0 && num_seqs <= query.size(0), "more decodes than query rows");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) >= num_seqs,
              "block_tables must be [B, max_blocks] with contiguous rows, a row per decode");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.numel() >= num_seqs, "seq_lens must hold a length per decode");
  if (num_seqs == 0) return;
  switch (k_cache.scalar_type()) {
    case at::kFloat: return dispatch_query<float>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case at::kBFloat16:
      return dispatch_query<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case at::kHalf: return dispatch_query<c10::Half>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case at::kChar: return dispatch_query<int8_t>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case at::kFloat8_e4m3fn:
      return dispatch_query<c10::Float8_e4m3fn>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    case at::kFloat8_e5m2:
      return dispatch_query<c10::Float8_e5m2>(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_seqs);
    default: TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
  }
}

// One (token, head) row as codes + float32 scale, the same arithmetic as kv_quant.quantize:
// scale = amax / qmax, code = x * (1 / scale) (rounded to nearest-even for int8).
template <typename cache_t, typename in_t>
inline void quantize_row(const in_t* __restrict src, cache_t* __restrict dst, int64_t n) {
  constexpr float qmax = KvQuant<cache_t>::qmax;
  float amax = 0.0f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(widen(src[d])));
  const float scale = amax / qmax;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t d = 0; d < n; ++d) {
    const float x = std::min(std::max(widen(src[d]) * inv, -qmax), qmax);
    if constexpr (std::is_same_v<cache_t, int8_t>) {
      dst[d] = static_cast<int8_t>(std::nearbyint(x));
    } else {
      dst[d] = static_cast<cache_t>(x);
    }
  }
  std::memcpy(dst + n, &scale, sizeof(scale));
}

template <typename cache_t, typename in_t>
void write_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                const int64_t* slots) {
  const int64_t num_tokens = key.size(0), num_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = k_cache.size(1);
  const in_t* k_in = key.data_ptr<in_t>();
  const in_t* v_in = value.data_ptr<in_t>();
  cache_t* kc = k_cache.data_ptr<cache_t>();
  cache_t* vc = v_cache.data_ptr<cache_t>();
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding
      const int64_t blk = slot / block_size, off = slot % block_size;
      for (int64_t h = 0; h < num_heads; ++h) {
        const in_t* ks = k_in + t * key.stride(0) + h * key.stride(1);
        const in_t* vs = v_in + t * value.stride(0) + h * value.stride(1);
        cache_t* kd = kc + blk * k_cache.stride(0) + off * k_cache.stride(1) + h * k_cache.stride(2);
        cache_t* vd = vc + blk * v_cache.stride(0) + off * v_cache.stride(1) + h * v_cache.stride(2);
        if constexpr (KvQuant<cache_t>::value) {
          quantize_row(ks, kd, head_dim);
          quantize_row(vs, vd, head_dim);
        } else {
          for (int64_t d = 0; d < head_dim; ++d) {
            kd[d] = static_cast<cache_t>(widen(ks[d]));
            vd[d] = static_cast<cache_t>(widen(vs[d]));
          }
        }
      }
    }
  });
}

template <typename cache_t>
void write_dispatch(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const int64_t* slots) {
  switch (key.scalar_type()) {
    case at::kFloat: return write_impl<cache_t, float>(key, value, k_cache, v_cache, slots);
    case at::kBFloat16: return write_impl<cache_t, c10::BFloat16>(key, value, k_cache, v_cache, slots);
    case at::kHalf: return write_impl<cache_t, c10::Half>(key, value, k_cache, v_cache, slots);
    default: TORCH_CHECK(false, "unsupported key dtype ", key.scalar_type());
  }
}

// Token t's key/value into slot slot_mapping[t] of the caches (negative slots are skipped).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [T, H_kv, D] alike");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value differ in dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "head_dim of key/value must be contiguous");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == cache_head_dim(k_cache),
              "key heads/head_dim differ from the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() >= key.size(0), "slot_mapping must be int64 with a slot per token");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  switch (k_cache.scalar_type()) {
    case at::kFloat: return write_dispatch<float>(key, value, k_cache, v_cache, slots);
    case at::kBFloat16: return write_dispatch<c10::BFloat16>(key, value, k_cache, v_cache, slots);
    case at::kHalf: return write_dispatch<c10::Half>(key, value, k_cache, v_cache, slots);
    case at::kChar: return write_dispatch<int8_t>(key, value, k_cache, v_cache, slots);
    case at::kFloat8_e4m3fn: return write_dispatch<c10::Float8_e4m3fn>(key, value, k_cache, v_cache, slots);
    case at::kFloat8_e5m2: return write_dispatch<c10::Float8_e5m2>(key, value, k_cache, v_cache, slots);
    default: TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type());
  }
}

// The Variant of the ops' arguments (window 0, softcap 0, no sinks: plain causal attention).
Variant variant_of(const at::Tensor& query, double scale, int64_t window, double softcap,
                   const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: none)");
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == query.size(1),
                "sinks must be float32, contiguous, one per query head");
  }
  return Variant{static_cast<float>(scale), static_cast<int>(window), static_cast<float>(softcap),
                 sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
}

// out[b] = softmax(query[b] . K[b]^T * scale) V[b] over positions 0..seq_lens[b]-1 of sequence b
// (with a window, the last `window` of them; see Variant).
//   out, query: [B, num_q_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
//   (any strides, head_dim contiguous); block_tables [B, max_blocks] int32; seq_lens [B] int32.
void paged_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  double softcap, const std::optional<at::Tensor>& sinks) {
  check_caches(k_cache, v_cache);
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.numel() == query.size(0),
              "paged_decode: a block table row and a length per query row");
  decode_rows(out, query, k_cache, v_cache, block_tables, seq_lens, variant_of(query, scale, window, softcap, sinks),
              query.size(0));
}

// One layer's step on the CPU in one call: every new token's K/V into its slot, then decode
// attention for the first `num_decodes` rows (the runner orders decodes first). Prefill rows
// of `out` are left for the caller.
void write_and_decode(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_decodes, double scale,
                      int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  check_caches(k_cache, v_cache);
  const Variant var = variant_of(query, scale, window, softcap, sinks);
  write_kv(key, value, k_cache, v_cache, slot_mapping);
  decode_rows(out, query, k_cache, v_cache, block_tables, seq_lens, var, num_decodes);
}

// Whether bf16 decode runs on the AVX512-BF16 kernel in this build (it needs -march on such a CPU).
bool decode_uses_bf16_dot() { return kBf16DotKernel; }

}  // namespace

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("decode_uses_bf16_dot() -> bool", &decode_uses_bf16_dot);  // no tensors: no dispatch key
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> ()");
  m.def("write_and_decode(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_decodes, "
        "float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("write_and_decode", &write_and_decode);
}
