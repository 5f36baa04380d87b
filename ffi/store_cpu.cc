// CPU XLA FFI handler of the store (docs/format.md §5). The bytes are those of the jnp reference
// and the CUDA kernel (nvfp4_numerics.h); the speed comes from loops the compiler vectorises
// (quantize_blocks) and, for large stores, from XLA's intra-op thread pool.
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "store_ffi.h"
#include "handlers.h"

namespace nvfp4 {
namespace {

// Float32 subnormals flush to zero as inputs and results (nvfp4_numerics.h): set the CPU's
// flush-to-zero and denormals-are-zero modes for the duration of a call, whatever the caller
// (XLA sets them already; a standalone caller may not), and restore them after.
class FlushDenormalsScope {
 public:
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
  FlushDenormalsScope() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtz | kDaz); }
  ~FlushDenormalsScope() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtz = 0x8000, kDaz = 0x0040;
  unsigned saved_;
#elif defined(__aarch64__)
  FlushDenormalsScope() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    asm volatile("msr fpcr, %0" : : "r"(saved_ | kFz));
  }
  ~FlushDenormalsScope() { asm volatile("msr fpcr, %0" : : "r"(saved_)); }

 private:
  static constexpr uint64_t kFz = uint64_t(1) << 24;  // FZ flushes inputs and results
  uint64_t saved_;
#else
#error "jax_nvfp4: set flush-to-zero for this CPU architecture in FlushDenormalsScope"
#endif
};

// One (layer, token): both sides, every head, kMaxBatchBlocks blocks of a head vector at a time.
template <bool kIsF16, ScaleSearch kSearch>
void StoreToken(const StoreProblem& p, int64_t layer, int64_t token) {
  const int64_t slot = p.valid_slot(layer, token);
  if (slot < 0) return;
  const int64_t block = slot / p.page.block_size;
  const int32_t row = int32_t(slot % p.page.block_size);
  const int32_t blocks_per_head = int32_t(p.page.head_size / kBlockElems);
  for (int side = 0; side < 2; ++side) {
    const StoreFactor factor = p.factor(layer, side);
    const uint16_t* src = static_cast<const uint16_t*>(side == 0 ? p.key : p.value);
    for (int64_t head = 0; head < p.page.num_kv_heads; ++head) {
      for (int32_t first = 0; first < blocks_per_head; first += kMaxBatchBlocks) {
        const int n = blocks_per_head - first < kMaxBatchBlocks ? blocks_per_head - first
                                                                : kMaxBatchBlocks;
        const uint16_t* in = src + p.input_offset(layer, token, head, first);
        float x[kMaxBatchBlocks * kBlockElems];
        for (int i = 0; i < n * kBlockElems; ++i) x[i] = widen(in[i], kIsF16);
        uint8_t scales[kMaxBatchBlocks], packed[kMaxBatchBlocks * kBlockBytes];
        quantize_blocks<kSearch>(x, n, factor, scales, packed);
        // A head vector's packed codes are contiguous (docs/format.md §4); its scales are not
        // (V scales may be swizzled): each goes where place_block says.
        std::memcpy(p.kv_cache + place_block(p, layer, block, row, side, head, first).data, packed,
                    size_t(n) * kBlockBytes);
        for (int b = 0; b < n; ++b)
          p.kv_cache[place_block(p, layer, block, row, side, head, first + b).scale] = scales[b];
      }
    }
  }
}

// Tokens [begin, end) of the flattened (layer, token) axis. Distinct tokens write distinct
// bytes (duplicate slots are undefined), so ranges can run concurrently.
template <bool kIsF16, ScaleSearch kSearch>
void StoreTokens(const StoreProblem& p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i)
    StoreToken<kIsF16, kSearch>(p, i / p.num_tokens, i % p.num_tokens);
}

void StoreRange(const StoreProblem& p, int64_t begin, int64_t end) {
  const FlushDenormalsScope flush_denormals;  // per thread: the modes are thread state
  const bool four_over_six = p.scale_search == ScaleSearch::k4Over6;
  if (p.is_f16) {
    four_over_six ? StoreTokens<true, ScaleSearch::k4Over6>(p, begin, end)
                  : StoreTokens<true, ScaleSearch::kDefault>(p, begin, end);
  } else {
    four_over_six ? StoreTokens<false, ScaleSearch::k4Over6>(p, begin, end)
                  : StoreTokens<false, ScaleSearch::kDefault>(p, begin, end);
  }
}

// Below this many input values per piece a store is not split: starting a thread-pool task
// costs about as much as quantising this many values (a decode step stays on one thread).
constexpr int64_t kMinValuesPerPiece = int64_t(1) << 16;

// The pieces of a store shared by the calling thread and the pool's tasks. Tasks may start
// late, even after the call returned (XLA does not promise when, or in parallel), so this is
// reference-counted and a task that finds no piece left touches nothing else.
struct SharedStore {
  StoreProblem problem;
  int64_t num_pieces;
  int64_t tokens_per_piece;
  std::atomic<int64_t> next_piece{0};
  std::atomic<int64_t> pieces_done{0};
  std::mutex mutex;
  std::condition_variable all_done;

  void Work() {
    int64_t done = 0;
    const int64_t total = problem.num_layers * problem.num_tokens;
    for (int64_t piece; (piece = next_piece.fetch_add(1)) < num_pieces; ++done) {
      const int64_t begin = piece * tokens_per_piece, end = begin + tokens_per_piece;
      StoreRange(problem, begin, end < total ? end : total);
    }
    if (done && pieces_done.fetch_add(done) + done == num_pieces) {
      std::lock_guard<std::mutex> lock(mutex);
      all_done.notify_all();
    }
  }
};

void StoreAll(const StoreProblem& p, ffi::ThreadPool& pool) {
  const int64_t total = p.num_layers * p.num_tokens;
  const int64_t values_per_token = 2 * p.page.num_kv_heads * p.page.head_size;
  const int64_t threads = pool.num_threads();
  int64_t pieces = total * values_per_token / kMinValuesPerPiece;
  // As many pieces as the pool has threads (XLA:CPU runs the call itself on one of them; one
  // piece more left a third piece to run after the first two on a 2-core machine).
  pieces = pieces < threads ? pieces : threads;
  if (pieces <= 1) {
    StoreRange(p, 0, total);
    return;
  }
  auto shared = std::make_shared<SharedStore>();
  shared->problem = p;
  shared->tokens_per_piece = (total + pieces - 1) / pieces;
  shared->num_pieces = (total + shared->tokens_per_piece - 1) / shared->tokens_per_piece;
  for (int64_t i = 1; i < shared->num_pieces; ++i) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  // Pieces still running belong to tasks that started: waiting for them cannot deadlock.
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->all_done.wait(lock, [&] { return shared->pieces_done.load() == shared->num_pieces; });
}

ffi::Error StoreCpu(ffi::ThreadPool pool, ffi::AnyBuffer key, ffi::AnyBuffer value,
                    ffi::Buffer<ffi::U8> kv_cache, ffi::AnyBuffer slot_mapping,
                    ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                    ffi::Result<ffi::Buffer<ffi::U8>> kv_cache_out,
                    int32_t layout, int32_t scale_search, bool v_scale_swizzle) {
  StoreProblem p;
  ffi::Error error = MakeStoreProblem(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                      kv_cache_out, layout, scale_search, v_scale_swizzle, &p);
  if (error.failure()) return error;
  // XLA aliases the result to kv_cache; should it ever hand over two buffers, start from a copy.
  if (kv_cache.untyped_data() != kv_cache_out->untyped_data())
    std::memcpy(kv_cache_out->untyped_data(), kv_cache.untyped_data(), kv_cache.size_bytes());
  StoreAll(p, pool);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4StoreCpu, nvfp4::StoreCpu,
                              nvfp4::BindStore(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
