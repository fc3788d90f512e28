// A step's LoRA updates on the CPU: each token through its own adapter's A and B only.
//
//   out[t] = (x[t] . A[s]^T) . B[s]     s = slot[t], the token's adapter slot; 0 where s < 0
//
// lora_a is [slots * R, in] (slot s's A in rows s*R ..), lora_b [slots * R, out] (its B,
// transposed and scaled), both zero past an adapter's own rank. A step's tokens of one request are
// consecutive, so they come in runs of one slot ("segments"): a prefill chunk is one long run, a
// decode batch runs of one token each.
//
// The masked stack this replaces multiplied every token by every slot's matrices (max_loras x the
// work, in plain GEMMs at a fraction of the packed base linears' speed). Here a token costs 2 * R *
// (in + out) multiply-adds and reads only its slot's A and B, which stay in cache while a run
// lasts. Runs go through the loops below, in parallel over tokens (a GEMM call per 1-token decode
// segment costs more than its work, and a rank-8 GEMM is slow even over a long one); only long
// runs of higher ranks through two GEMMs of the segment (kGemmWork).
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

typedef float v16f __attribute__((vector_size(64)));

// A segment whose length x rank reaches this runs as two GEMMs. Measured on two AVX-512 Zen 5
// cores in fp32 (us a token, loops vs GEMMs; projections 576->1536 to 4096->14336), the loops win
// for decode runs and short prefill chunks at every rank (R 8, run 64: 0.46 vs 1.10 for 576->1536),
// the GEMMs from about 1,024 tokens at rank 8, 512 at 16, 256 at 32 (R 32, run 1,024, 4096->4096:
// 12.3 vs 5.3), the rank-8 GEMM being too thin for the CPU's GEMM to be efficient.
constexpr int64_t kGemmWork = 8192;
constexpr int64_t kMaxRank = 256;  // the loops keep a token's R shrunk values on the stack

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v16f load16(const c10::BFloat16* p) {
  typedef uint16_t v16h __attribute__((vector_size(32)));
  typedef uint32_t v16u __attribute__((vector_size(64)));
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  v16u wide = __builtin_convertvector(h, v16u) << 16;  // bf16 is float32's upper half
  v16f v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}
inline v16f load16(const c10::Half* p) {
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// One token: shrunk[r] = x . a[r] (R rows of `in`), then out = sum_r shrunk[r] * b[r] (R rows of `n`).
template <typename T>
void token_update(const T* x, const T* a, const T* b, int64_t rank, int64_t in, int64_t n, T* out) {
  float shrunk[kMaxRank];
  const int64_t in16 = in - in % 16;
  int64_t r = 0;
  for (; r + 4 <= rank; r += 4) {  // four rows of A a pass: each 16 of x loaded serve them all
    const T *a0 = a + r * in, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;
    v16f s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int64_t i = 0; i < in16; i += 16) {
      const v16f xv = load16(x + i);
      s0 += xv * load16(a0 + i), s1 += xv * load16(a1 + i), s2 += xv * load16(a2 + i), s3 += xv * load16(a3 + i);
    }
    float t0 = hsum(s0), t1 = hsum(s1), t2 = hsum(s2), t3 = hsum(s3);
    for (int64_t i = in16; i < in; ++i) {
      const float xi = static_cast<float>(x[i]);
      t0 += xi * static_cast<float>(a0[i]), t1 += xi * static_cast<float>(a1[i]);
      t2 += xi * static_cast<float>(a2[i]), t3 += xi * static_cast<float>(a3[i]);
    }
    shrunk[r] = t0, shrunk[r + 1] = t1, shrunk[r + 2] = t2, shrunk[r + 3] = t3;
  }
  for (; r < rank; ++r) {
    const T* ar = a + r * in;
    v16f s = {};
    for (int64_t i = 0; i < in16; i += 16) s += load16(x + i) * load16(ar + i);
    float t = hsum(s);
    for (int64_t i = in16; i < in; ++i) t += static_cast<float>(x[i]) * static_cast<float>(ar[i]);
    shrunk[r] = t;
  }
  const int64_t n16 = n - n % 16;
  for (int64_t o = 0; o < n16; o += 16) {
    v16f acc = {};
    for (int64_t q = 0; q < rank; ++q) acc += shrunk[q] * load16(b + q * n + o);
    for (int k = 0; k < 16; ++k) out[o + k] = static_cast<T>(acc[k]);
  }
  for (int64_t o = n16; o < n; ++o) {
    float acc = 0.f;
    for (int64_t q = 0; q < rank; ++q) acc += shrunk[q] * static_cast<float>(b[q * n + o]);
    out[o] = static_cast<T>(acc);
  }
}

at::Tensor lora_update(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                       const at::Tensor& token_slot, int64_t rank) {
  TORCH_CHECK(x.dim() == 2 && lora_a.dim() == 2 && lora_b.dim() == 2, "lora_update: 2-d x, lora_a, lora_b");
  TORCH_CHECK(x.scalar_type() == lora_a.scalar_type() && x.scalar_type() == lora_b.scalar_type(),
              "lora_update: x and the adapters' matrices must share a dtype");
  TORCH_CHECK(token_slot.scalar_type() == at::kInt && token_slot.is_contiguous(), "lora_update: int32 token_slot");
  TORCH_CHECK(rank > 0 && rank <= kMaxRank, "lora_update: rank must be in 1..", kMaxRank);
  const int64_t tokens = x.size(0), in = x.size(1), n = lora_b.size(1);
  TORCH_CHECK(token_slot.numel() >= tokens, "lora_update: token_slot has fewer entries than x has rows");
  TORCH_CHECK(lora_a.size(1) == in && lora_a.size(0) == lora_b.size(0) && lora_a.size(0) % rank == 0,
              "lora_update: lora_a [slots*R, in] and lora_b [slots*R, out] do not match x or each other");
  const int64_t slots = lora_a.size(0) / rank;
  const at::Tensor xc = x.contiguous(), a = lora_a.contiguous(), b = lora_b.contiguous();
  at::Tensor out = at::zeros({tokens, n}, x.options());
  const int32_t* slot = token_slot.data_ptr<int32_t>();

  // Runs of one slot: long ones as GEMMs here, the tokens of short ones for the loops below.
  std::vector<int64_t> short_tokens;
  for (int64_t start = 0; start < tokens;) {
    const int32_t s = slot[start];
    int64_t end = start + 1;
    while (end < tokens && slot[end] == s) ++end;
    if (s >= 0) {
      TORCH_CHECK(s < slots, "lora_update: token ", start, " names slot ", s, " of ", slots);
      if ((end - start) * rank >= kGemmWork) {
        const at::Tensor shrunk = at::mm(xc.narrow(0, start, end - start), a.narrow(0, s * rank, rank).t());
        at::Tensor rows = out.narrow(0, start, end - start);
        at::mm_out(rows, shrunk, b.narrow(0, s * rank, rank));
      } else {
        for (int64_t t = start; t < end; ++t) short_tokens.push_back(t);
      }
    }
    start = end;
  }
  if (short_tokens.empty()) return out;
  const auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *xp = xc.data_ptr<T>(), *ap = a.data_ptr<T>(), *bp = b.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, static_cast<int64_t>(short_tokens.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = short_tokens[i], s = slot[t];
        token_update<T>(xp + t * in, ap + s * rank * in, bp + s * rank * n, rank, in, n, op + t * n);
      }
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "lora_update: float32, bfloat16 or float16 only, not ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("lora_update(Tensor x, Tensor lora_a, Tensor lora_b, Tensor token_slot, int rank) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("lora_update", &lora_update); }
