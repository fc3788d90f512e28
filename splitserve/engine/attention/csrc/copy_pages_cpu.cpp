// Copies KV pages between two CPU pools (the shm KV transport): one pass per page, no temporary.
//
// A fragmented page table (arbitrary source and destination page ids) is what a gather into a
// temporary plus a scatter out of it moves twice; torch has no single op that both gathers and
// scatters, so this is the loop over pages. Each page is written with non-temporal (streaming)
// stores, as glibc's memcpy does for large copies: the destination is the decode worker's pool,
// read later by another process, so pulling it into this core's cache (a read for ownership of
// every line) only halves the bandwidth. Measured on a 2-core VM, SmolLM2 pages (6 KiB), 256
// pages x 30 layers: plain memcpy per page 0.5-0.7 of one 94 MB torch copy, streaming 0.83-0.95.
// One thread: it runs on the prefill worker's copier thread beside the model's compute, and a
// parallel region per layer measured several times slower on a loaded 2-core machine.
#include <torch/library.h>
#include <ATen/core/Tensor.h>

#if defined(__AVX__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace {

inline void copy_page(char* __restrict dst, const char* __restrict src, int64_t n) {
#if defined(__AVX__)
  if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0 && (n & 31) == 0) {
    for (int64_t o = 0; o < n; o += 32) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + o),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o)));
    }
    return;
  }
#elif defined(__SSE2__)
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0 && (n & 15) == 0) {
    for (int64_t o = 0; o < n; o += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + o), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + o)));
    }
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// dst[kv, dst_blocks[i]] = src[kv, src_blocks[i]] for kv in 0..1 and every i.
//   src, dst: [2, num_blocks, ...page dims] of one dtype, each page contiguous (any strides on the
//   first two dims, so one layer of a [layers, 2, blocks, ...] pool is taken as it is).
//   src_blocks, dst_blocks: [n] int64 page ids, checked against the pools.
void copy_pages(const at::Tensor& src, at::Tensor dst, const at::Tensor& src_blocks, const at::Tensor& dst_blocks) {
  TORCH_CHECK(src.device().is_cpu() && dst.device().is_cpu(), "copy_pages is the CPU kernel");
  TORCH_CHECK(src.dim() >= 3 && dst.dim() == src.dim() && src.size(0) == 2 && dst.size(0) == 2,
              "copy_pages: pools must be [2, blocks, ...page dims]");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "copy_pages: source and destination dtypes differ");
  TORCH_CHECK(src.sizes().slice(2) == dst.sizes().slice(2), "copy_pages: page shapes differ");
  TORCH_CHECK(src[0][0].is_contiguous() && dst[0][0].is_contiguous(), "copy_pages: pages must be contiguous");
  TORCH_CHECK(src_blocks.scalar_type() == at::kLong && dst_blocks.scalar_type() == at::kLong &&
              src_blocks.is_contiguous() && dst_blocks.is_contiguous() && src_blocks.dim() == 1 &&
              src_blocks.numel() == dst_blocks.numel(), "copy_pages: page ids must be two int64 [n] tensors");
  const int64_t n = src_blocks.numel();
  const int64_t* s_ids = src_blocks.data_ptr<int64_t>();
  const int64_t* d_ids = dst_blocks.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s_ids[i] >= 0 && s_ids[i] < src.size(1) && d_ids[i] >= 0 && d_ids[i] < dst.size(1),
                "copy_pages: page ", s_ids[i], " -> ", d_ids[i], " is outside the pools");
  }
  const int64_t item = src.element_size();
  const int64_t page_bytes = src[0][0].numel() * item;
  const char* s_base = static_cast<const char*>(src.data_ptr());
  char* d_base = static_cast<char*>(dst.data_ptr());
  const int64_t s_kv = src.stride(0) * item, s_blk = src.stride(1) * item;
  const int64_t d_kv = dst.stride(0) * item, d_blk = dst.stride(1) * item;
  for (int64_t kv = 0; kv < 2; ++kv) {
    for (int64_t i = 0; i < n; ++i) {
      copy_page(d_base + kv * d_kv + d_ids[i] * d_blk, s_base + kv * s_kv + s_ids[i] * s_blk, page_bytes);
    }
  }
#if defined(__AVX__) || defined(__SSE2__)
  _mm_sfence();  // streaming stores are weakly ordered: visible to other cores before we return
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("copy_pages(Tensor src, Tensor(a!) dst, Tensor src_blocks, Tensor dst_blocks) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("copy_pages", &copy_pages); }
