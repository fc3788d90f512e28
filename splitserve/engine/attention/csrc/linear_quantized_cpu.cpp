// Linear layers with quantized weights on the CPU.
//
// linear_w8 (--quantization int8 | fp8): 8-bit codes with one scale per output channel (below).
// linear_wq (GGUF Q4_0/Q4_1/Q8_0, GPTQ, AWQ checkpoints): 4- or 8-bit codes in groups along the
// input dimension, each group with its own scale and offset (further down).
//
// linear_w8: out = x . (codes * scales)^T,
// the codes int8 or fp8 e4m3 (widened by moving its exponent and mantissa bits into float32's
// and rebiasing the exponent, with the subnormals fixed by one masked operation: a table gather
// per 16 codes was 10x slower).
//
// The weight stays 8-bit in memory and is widened to float32 in registers, 16 codes at a time,
// right before its multiply-adds; nothing else of it is ever written. A decode step reads its
// weights once per step, so it reads a quarter of fp32's bytes (half of bf16's). Each work item
// is a block of output channels; within it, tiles of kRows input rows x kCols channels keep
// kRows x kCols 16-lane accumulators in registers, and every 16 codes loaded serve kRows rows.
// The per-channel scale multiplies the finished dot product, so the sum is of x * code products,
// exact in float32 for bf16 activations and rounded once for float32 ones: the same arithmetic
// as a float GEMM over the de-quantized weight, up to the order of the additions.
//
// Activations are float32, bf16 or fp16 (widened once per call into a float32 copy), the output
// is in their dtype. float32 activations of any count run these tiles (for 4,096 x 4,096 on two
// AVX-512 Zen 5 cores: 14x an fp32 GEMM at one row, 3.9x at 16, 1.9x at 512). bf16/fp16 ones past
// kTileRowsMax rows, where the tiles lose to the CPU's bf16 GEMM (0.43x at 512 rows), de-quantize
// the weight into their dtype for the call and run that GEMM instead.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int8_t v16c __attribute__((vector_size(16)));

constexpr int kRows = 4;  // input rows a tile (each 16 codes loaded serve them all)
constexpr int kCols = 4;  // output channels a tile: kRows x kCols accumulators, 16 registers on AVX-512
constexpr int64_t kTileRowsMax = 16;  // half-precision rows above which a float GEMM is faster

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v16f codes16(const int8_t* p) {
#if defined(__AVX512F__)
  // vpmovsxbd + vcvtdq2ps: the generic conversion below compiled to a slower sequence.
  return reinterpret_cast<v16f>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#else
  v16c c;
  std::memcpy(&c, p, sizeof(c));
  return __builtin_convertvector(c, v16f);
#endif
}
const float* e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b)
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}
inline v16f codes16(const c10::Float8_e4m3fn* p) {
#if defined(__AVX512F__)
  // e4m3 (s eeee mmm, bias 7) -> float32: eeee mmm shifted into float32's exponent and mantissa
  // with the bias raised by 120 is exact for normal codes; a subnormal code (eeee = 0) then reads
  // 2^-7 (1 + m/8) where it means m 2^-9 = 2 (that) - 2^-6.
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  __m512 v = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
  const __mmask16 subnormal = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8));
  v = _mm512_mask_sub_ps(v, subnormal, _mm512_add_ps(v, v), _mm512_set1_ps(1.0f / 64));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return reinterpret_cast<v16f>(_mm512_or_si512(_mm512_castps_si512(v), sign));
#else
  const float* table = e4m3_table();
  const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = table[b[i]];
  return v;
#endif
}
inline float code_value(int8_t c) { return static_cast<float>(c); }
inline float code_value(c10::Float8_e4m3fn c) { return static_cast<float>(c); }

inline float hsum(v16f v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

// R rows x C channels of out (R <= kRows, C <= kCols), over the whole K.
template <typename code_t, int R, int C>
void tile(const float* x, int64_t K, const code_t* codes, const float* scales, float* out, int64_t ldo) {
  v16f acc[R][C] = {};
  const int64_t K16 = K & ~int64_t{15};
  for (int64_t k = 0; k < K16; k += 16) {
    v16f w[C];
    for (int c = 0; c < C; ++c) w[c] = codes16(codes + c * K + k);
    for (int r = 0; r < R; ++r) {
      const v16f xr = load16(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] += xr * w[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float sum = hsum(acc[r][c]);
      for (int64_t k = K16; k < K; ++k) sum += x[r * K + k] * code_value(codes[c * K + k]);
      out[r * ldo + c] = sum * scales[c];
    }
}

template <typename code_t, int R>
void tile_cols(int C, const float* x, int64_t K, const code_t* codes, const float* scales, float* out, int64_t ldo) {
  switch (C) {
    case 1: return tile<code_t, R, 1>(x, K, codes, scales, out, ldo);
    case 2: return tile<code_t, R, 2>(x, K, codes, scales, out, ldo);
    case 3: return tile<code_t, R, 3>(x, K, codes, scales, out, ldo);
    default: return tile<code_t, R, kCols>(x, K, codes, scales, out, ldo);
  }
}

template <typename code_t>
void any_tile(int R, int C, const float* x, int64_t K, const code_t* codes, const float* scales, float* out,
              int64_t ldo) {
  switch (R) {
    case 1: return tile_cols<code_t, 1>(C, x, K, codes, scales, out, ldo);
    case 2: return tile_cols<code_t, 2>(C, x, K, codes, scales, out, ldo);
    case 3: return tile_cols<code_t, 3>(C, x, K, codes, scales, out, ldo);
    default: return tile_cols<code_t, kRows>(C, x, K, codes, scales, out, ldo);
  }
}

// Calls tile(R, C, m, n) for every tile of an M x N output, R <= kRows rows by C <= kCols channels
// starting at row m and channel n. Work items are blocks of 64 channels: each thread reads its own
// codes, once per kRows rows.
template <typename Tile>
void for_each_tile(int64_t M, int64_t N, const Tile& tile) {
  constexpr int64_t kBlock = 64;
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlock, n1 = std::min(N, n0 + kBlock);
      for (int64_t m = 0; m < M; m += kRows) {
        const int R = static_cast<int>(std::min<int64_t>(kRows, M - m));
        for (int64_t n = n0; n < n1; n += kCols) tile(R, static_cast<int>(std::min<int64_t>(kCols, n1 - n)), m, n);
      }
    }
  });
}

// codes * scales as a [N, K] tensor of T, in one pass over the codes (each value rounded once).
template <typename T, typename code_t>
at::Tensor dequantized(const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t N = codes.size(0), K = codes.size(1);
  at::Tensor w = at::empty({N, K}, codes.options().dtype(c10::CppTypeToScalarType<T>::value));
  const code_t* cp = codes.data_ptr<code_t>();
  const float* sp = scales.data_ptr<float>();
  T* wp = w.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k) wp[n * K + k] = static_cast<T>(code_value(cp[n * K + k]) * sp[n]);
  });
  return w;
}

template <typename code_t>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  if (x.scalar_type() == at::kBFloat16 && M > kTileRowsMax)
    return at::linear(x, dequantized<c10::BFloat16, code_t>(codes, scales));
  if (x.scalar_type() == at::kHalf && M > kTileRowsMax) return at::linear(x, dequantized<c10::Half, code_t>(codes, scales));
  // The activations as float32, once (a copy of M x K: small beside the weight).
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out32 = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const code_t* cp = codes.data_ptr<code_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out32.data_ptr<float>();
  for_each_tile(M, N, [&](int R, int C, int64_t m, int64_t n) {
    any_tile<code_t>(R, C, xp + m * K, K, cp + n * K, sp + n, op + m * N + n, N);
  });
  return x.scalar_type() == at::kFloat ? out32 : out32.to(x.scalar_type());
}

// x [M, K] (any float dtype, rows contiguous), codes [N, K] int8 or fp8 e4m3, scales [N] float32 -> [M, N].
at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "linear_w8 is the CPU kernel");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1), "x [M, K] and codes [N, K]");
  TORCH_CHECK(codes.is_contiguous(), "codes must be contiguous");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == codes.size(0),
              "scales must be float32, one per output channel");
  switch (codes.scalar_type()) {
    case at::kChar: return linear_impl<int8_t>(x, codes, scales);
    case at::kFloat8_e4m3fn: return linear_impl<c10::Float8_e4m3fn>(x, codes, scales);
    default: TORCH_CHECK(false, "linear_w8: codes must be int8 or float8_e4m3fn, got ", codes.scalar_type());
  }
}

// ---------------------------------------------------------------------------------------------
// linear_wq: group-wise codes, w[n, k] = code[n, k] * scale[n, g] + offset[n, g] with g = k / group.
// One form for every format: GGUF Q4_0 (offset -8 d), Q4_1 (offset m), Q8_0 (no offset), GPTQ and
// AWQ (offset -zero * scale), FP8 checkpoints (e4m3 codes, a scale per tensor, channel or block). Each 32 codes are widened to float32 and turned into the exact float
// weight by one fused multiply-add (code * scale is exact in float32 for these formats' 4- and
// 8-bit codes and 16-bit scales, so the weight is rounded once, where the formats' own
// de-quantizers round it once too); the rows then multiply-add against it as against a float
// weight. 4-bit codes sit two to a byte, 32 codes per 16 bytes as GGUF lays them out: byte i
// holds code i in its low nibble and code i + 16 in its high nibble.

// 32 codes starting at element k of a row (k a multiple of 32), as two float vectors.
template <typename code_t>  // int8 or fp8 e4m3, one byte a code
struct Codes8 {
  static constexpr int64_t kBytesPer32 = 32;
  static inline void load32(const uint8_t* row, int64_t k, v16f& lo, v16f& hi) {
    const code_t* p = reinterpret_cast<const code_t*>(row) + k;
    lo = codes16(p);
    hi = codes16(p + 16);
  }
};
struct Codes4 {
  static constexpr int64_t kBytesPer32 = 16;
  static inline void load32(const uint8_t* row, int64_t k, v16f& lo, v16f& hi) {
    const uint8_t* p = row + k / 2;
#if defined(__AVX512F__)
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = reinterpret_cast<v16f>(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF))));
    hi = reinterpret_cast<v16f>(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
#else
    for (int i = 0; i < 16; ++i) {
      lo[i] = static_cast<float>(p[i] & 0xF);
      hi[i] = static_cast<float>(p[i] >> 4);
    }
#endif
  }
};

struct Groups {
  const float* scales;   // [N, K / group]
  const float* offsets;  // [N, K / group] or nullptr
  int64_t group;         // a multiple of 16
  int64_t per_row;       // K / group
};

// R rows x C channels of out, over the whole K, channels starting at n.
template <typename codes_t, int R, int C>
void group_tile(const float* x, int64_t K, const uint8_t* codes, int64_t row_bytes, const Groups& g, int64_t n,
                float* out, int64_t ldo) {
  v16f acc[R][C] = {};
  for (int64_t k = 0; k < K; k += 32) {
    // The groups of the chunk's two halves (the same one unless groups are 16 wide).
    const int64_t j0 = k / g.group, j1 = (k + 16) / g.group;
    v16f lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const float* scales = g.scales + (n + c) * g.per_row;
      const float* offsets = g.offsets ? g.offsets + (n + c) * g.per_row : nullptr;
      codes_t::load32(codes + (n + c) * row_bytes, k, lo[c], hi[c]);
      lo[c] = lo[c] * scales[j0] + (offsets ? offsets[j0] : 0.0f);
      hi[c] = hi[c] * scales[j1] + (offsets ? offsets[j1] : 0.0f);
    }
    for (int r = 0; r < R; ++r) {
      const v16f x0 = load16(x + r * K + k), x1 = load16(x + r * K + k + 16);
      for (int c = 0; c < C; ++c) acc[r][c] += x0 * lo[c] + x1 * hi[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + n + c] = hsum(acc[r][c]);
}

template <typename codes_t, int R>
void group_tile_cols(int C, const float* x, int64_t K, const uint8_t* codes, int64_t row_bytes, const Groups& g,
                     int64_t n, float* out, int64_t ldo) {
  switch (C) {
    case 1: return group_tile<codes_t, R, 1>(x, K, codes, row_bytes, g, n, out, ldo);
    case 2: return group_tile<codes_t, R, 2>(x, K, codes, row_bytes, g, n, out, ldo);
    case 3: return group_tile<codes_t, R, 3>(x, K, codes, row_bytes, g, n, out, ldo);
    default: return group_tile<codes_t, R, kCols>(x, K, codes, row_bytes, g, n, out, ldo);
  }
}

template <typename codes_t>
void any_group_tile(int R, int C, const float* x, int64_t K, const uint8_t* codes, int64_t row_bytes,
                    const Groups& g, int64_t n, float* out, int64_t ldo) {
  switch (R) {
    case 1: return group_tile_cols<codes_t, 1>(C, x, K, codes, row_bytes, g, n, out, ldo);
    case 2: return group_tile_cols<codes_t, 2>(C, x, K, codes, row_bytes, g, n, out, ldo);
    case 3: return group_tile_cols<codes_t, 3>(C, x, K, codes, row_bytes, g, n, out, ldo);
    default: return group_tile_cols<codes_t, kRows>(C, x, K, codes, row_bytes, g, n, out, ldo);
  }
}

// The de-quantized weight [N, K] in T (each value rounded once from the exact float32 weight).
template <typename T, typename codes_t>
at::Tensor group_dequantized(const uint8_t* codes, int64_t row_bytes, const Groups& g, int64_t N, int64_t K,
                             const at::TensorOptions& options) {
  at::Tensor w = at::empty({N, K}, options.dtype(c10::CppTypeToScalarType<T>::value));
  T* wp = w.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; k += 32) {
        const int64_t j0 = n * g.per_row + k / g.group, j1 = n * g.per_row + (k + 16) / g.group;
        v16f lo, hi;
        codes_t::load32(codes + n * row_bytes, k, lo, hi);
        lo = lo * g.scales[j0] + (g.offsets ? g.offsets[j0] : 0.0f);
        hi = hi * g.scales[j1] + (g.offsets ? g.offsets[j1] : 0.0f);
        for (int i = 0; i < 16; ++i) {
          wp[n * K + k + i] = static_cast<T>(lo[i]);
          wp[n * K + k + 16 + i] = static_cast<T>(hi[i]);
        }
      }
  });
  return w;
}

// Rows above which half-precision activations de-quantize the weight for the call and run the
// CPU's half-precision GEMM instead of these tiles (AVX-512 BF16 Zen 5, 2 threads: the tiles win
// to ~128 rows on a 4,096 x 4,096 weight and to ~16 on a 576 x 1,536 one). float32 activations
// always run the tiles: they matched or beat an MKL float32 GEMM at every count measured (1-512).
constexpr int64_t kGroupTileRowsMaxHalf = 64;

template <typename codes_t>
at::Tensor linear_wq_impl(const at::Tensor& x, const uint8_t* codes, int64_t N, const Groups& g) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t row_bytes = K / 32 * codes_t::kBytesPer32;
  if (M > kGroupTileRowsMaxHalf) {
    if (x.scalar_type() == at::kBFloat16)
      return at::linear(x, group_dequantized<c10::BFloat16, codes_t>(codes, row_bytes, g, N, K, x.options()));
    if (x.scalar_type() == at::kHalf)
      return at::linear(x, group_dequantized<c10::Half, codes_t>(codes, row_bytes, g, N, K, x.options()));
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out32 = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* op = out32.data_ptr<float>();
  for_each_tile(M, N, [&](int R, int C, int64_t m, int64_t n) {
    any_group_tile<codes_t>(R, C, xp + m * K, K, codes, row_bytes, g, n, op + m * N, N);
  });
  return x.scalar_type() == at::kFloat ? out32 : out32.to(x.scalar_type());
}

// x [M, K] (any float dtype), codes [N, K] int8 or fp8 e4m3 (bits 8) or [N, K / 2] uint8 (bits 4, GGUF's nibble
// order), scales and offsets [N, K / group_size] float32 (offsets may be absent) -> [M, N].
at::Tensor linear_wq(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& offsets, int64_t bits, int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "linear_wq is the CPU kernel");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.is_contiguous(), "x [M, K] and contiguous codes [N, ...]");
  const int64_t K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0 && K % 32 == 0,
              "linear_wq: the group size must be a multiple of 16 that divides K (a multiple of 32), got ",
              group_size, " for K ", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group_size,
              "linear_wq: scales must be float32 [N, K / group_size]");
  if (offsets) TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kFloat &&
                               offsets->is_contiguous(), "linear_wq: offsets must be like scales");
  const Groups g{scales.data_ptr<float>(), offsets ? offsets->data_ptr<float>() : nullptr, group_size, K / group_size};
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  if (bits == 8) {
    TORCH_CHECK(codes.size(1) == K, "linear_wq: 8-bit codes are [N, K]");
    if (codes.scalar_type() == at::kFloat8_e4m3fn) return linear_wq_impl<Codes8<c10::Float8_e4m3fn>>(x, cp, N, g);
    TORCH_CHECK(codes.scalar_type() == at::kChar, "linear_wq: 8-bit codes are int8 or float8_e4m3fn");
    return linear_wq_impl<Codes8<int8_t>>(x, cp, N, g);
  }
  TORCH_CHECK(bits == 4, "linear_wq: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(1) == K / 2, "linear_wq: 4-bit codes are uint8 [N, K / 2]");
  return linear_wq_impl<Codes4>(x, cp, N, g);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("linear_w8(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("linear_wq(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int bits, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("linear_w8", &linear_w8);
  m.impl("linear_wq", &linear_wq);
}
