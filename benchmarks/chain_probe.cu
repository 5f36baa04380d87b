// Probe of the shortest dependent chain a paged split-KV decode launch can have on this GPU, at
// issue 18's 1 x 4096 point (8 kv heads, pages of 16 positions, 144 bytes a position and kv
// head: K and V codes and scales at head size 128; 16 splits of 256 positions, one CTA of 128
// threads each, as the decode kernel's plan), against that issue's target of 6 µs a call.
//
// Why (benchmarks/NOTES.md, "Where it stands (end of the forty-third session)"): the decode
// kernel takes 13-14 µs there, and its per-CTA timeline puts ~2 µs before the first page bytes,
// ~3 µs in the chunks and ~4 µs in the merges. This measures what the steps that no design of a
// paged split-KV read can leave out cost by themselves, each kernel one step more than the one
// before, with no arithmetic beyond a sum that keeps the loads:
//   empty:   every CTA starts and ends;
//   table:   + each CTA's 16 block-table entries and the sequence's length (one round trip);
//   pages:   + the 36 KB of page bytes those entries name (a second, dependent round trip),
//            summed over the CTA, one float a CTA written to a workspace;
//   merge:   + the split-KV merge: each CTA counts itself done on its kv head's counter (an
//            acq_rel atomic, as the decode kernel's v17 did), and the last of the 16 reads the
//            16 partials and writes the kv head's output (a third round trip, through the L2).
// Each launch records its first CTA's start and its last CTA's end (the global timer; its step
// is 32 ns on Hopper), so the span is the device's own time for the grid without the host's
// launch. Each stage runs twice: "flushed", each launch reading its own random pages of a pool
// larger than the L2 with a 256 MB memset between launches, and "warm", every launch reading
// the same pages (as a benchmark calling the reader on one cache again and again: 4.7 MB of
// pages stay in the L2). Prints the median and the 10th / 90th percentile span a stage over
// the launches, and the median time between CUDA events recorded around each launch (the
// stream's view: the span plus the grid's launch and drain on the device). Then each stage
// chained, as a benchmark times a reader (attention_bench.py's difference of chains): launches
// back to back with nothing between them, a call's time = (time of 200 launches - time of 100)
// / 100, the median of 5; each launch on its own pages (none in the L2, no flush needed: 200
// launches read 944 MB) and all on the same pages; once launched one by one from the host (its
// launch rate shows in the empty stage) and once as a CUDA graph of the chain (the device's own
// gap between kernels: what a chain of calls costs where launches are not the limit).
//
// Build and run on a Hopper GPU, from the repository root:
//   nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o chain_probe benchmarks/chain_probe.cu
//   ./chain_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <vector>

#include "cuda_check.h"

constexpr int kKvHeads = 8;
constexpr int kSplits = 16;
constexpr int kPagesPerSplit = 16;         // 256 positions a CTA at pages of 16
constexpr int kHeadPageBytes = 16 * 144;   // one kv head's part of a page
constexpr int kHeadPageWords = kHeadPageBytes / 16;            // uint4 words: 144
constexpr int kCtaWords = kPagesPerSplit * kHeadPageWords;     // 2304 a CTA
constexpr int kThreads = 128;
static_assert(kCtaWords % kThreads == 0, "whole words a thread");
constexpr int kWordsPerThread = kCtaWords / kThreads;          // 18
constexpr int kSeqPages = kSplits * kPagesPerSplit;            // 256 pages: 4096 positions
constexpr int kPoolPages = 32768;  // 32768 x 8 x 2304 bytes = 604 MB: past any L2
constexpr int kLaunches = 200;

enum Stage { kEmpty = 0, kTable = 1, kPages = 2, kMerge = 3 };
const char* const kStageNames[] = {"empty", "table", "pages", "merge"};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <int kStage>
__global__ void __launch_bounds__(kThreads) chain(const int* seq_len, const int* table,
                                                  const uint4* pool, float* partial,
                                                  unsigned* counters, float* out,
                                                  unsigned long long* first_start,
                                                  unsigned long long* last_end) {
  const unsigned long long start = global_ns();
  const int head = blockIdx.x / kSplits, split = blockIdx.x % kSplits;
  __shared__ int pages[kPagesPerSplit];
  __shared__ float warp_sum[kThreads / 32];
  __shared__ bool last;
  float sum = 0.f;
  if (kStage >= kTable) {
    // The length and the split's entries in one round trip (the decode kernel's v6 order).
    const int len = __ldg(seq_len);
    if (threadIdx.x < kPagesPerSplit)
      pages[threadIdx.x] = __ldg(table + split * kPagesPerSplit + threadIdx.x);
    __syncthreads();
    if (split * kPagesPerSplit * 16 >= len) return;  // (never: the split is inside)
    if (kStage == kTable) sum = float(pages[threadIdx.x % kPagesPerSplit]);
  }
  if (kStage >= kPages) {
    uint4 w[kWordsPerThread];
#pragma unroll
    for (int j = 0; j < kWordsPerThread; ++j) {
      const int k = threadIdx.x + kThreads * j;
      const int64_t page = pages[k / kHeadPageWords];
      w[j] = __ldg(pool + (page * kKvHeads + head) * kHeadPageWords + k % kHeadPageWords);
    }
#pragma unroll
    for (int j = 0; j < kWordsPerThread; ++j) sum += float(w[j].x ^ w[j].y ^ w[j].z ^ w[j].w);
  }
  if (kStage >= kTable) {
#pragma unroll
    for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, d);
    if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      const float cta = warp_sum[0] + warp_sum[1] + warp_sum[2] + warp_sum[3];
      if (kStage < kMerge) {
        out[blockIdx.x] = cta;
      } else {
        partial[blockIdx.x] = cta;
        // (the release that publishes the partial, and the acquire of the others' for the last)
        unsigned before;
        asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;"
                     : "=r"(before) : "l"(counters + head) : "memory");
        last = before == kSplits - 1;
      }
    }
    if (kStage >= kMerge) {
      __syncthreads();
      if (last && threadIdx.x < kSplits) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // thread 0's acquire, for the CTA
        float v = __ldcg(partial + head * kSplits + threadIdx.x);
#pragma unroll
        for (int d = 8; d > 0; d /= 2) v += __shfl_xor_sync(0x0000FFFFu, v, d);
        if (threadIdx.x == 0) out[head] = v;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMin(first_start, start);
    atomicMax(last_end, global_ns());
  }
}

// The device buffers every launch reads and writes, and launch i of a stage (its own table,
// partials, counters and span slots) on `stream`.
struct Buffers {
  const int* seq_len;
  const int* tables;
  const uint4* pool;
  float* partial;
  unsigned* counters;
  float* out;
  unsigned long long* starts;
  unsigned long long* ends;
};

template <int kStage>
void launch(const Buffers& b, int i, cudaStream_t stream = 0) {
  chain<kStage><<<kKvHeads * kSplits, kThreads, 0, stream>>>(
      b.seq_len, b.tables + i * kSeqPages, b.pool, b.partial + i * kKvHeads * kSplits,
      b.counters + i * kKvHeads, b.out, b.starts + i, b.ends + i);
}

template <int kStage>
void run(const Buffers& b, uint8_t* flush, size_t flush_bytes, bool flushed) {
  std::vector<cudaEvent_t> before(kLaunches), after(kLaunches);
  for (int i = 0; i < kLaunches; ++i) {
    CHECK(cudaEventCreate(&before[i]));
    CHECK(cudaEventCreate(&after[i]));
  }
  for (int i = 0; i < kLaunches; ++i) {
    if (flushed) CHECK(cudaMemsetAsync(flush, i & 0xFF, flush_bytes));
    CHECK(cudaEventRecord(before[i]));
    launch<kStage>(b, i);
    CHECK(cudaEventRecord(after[i]));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<unsigned long long> s(kLaunches), ends_ns(kLaunches);
  CHECK(cudaMemcpy(s.data(), b.starts, kLaunches * 8, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ends_ns.data(), b.ends, kLaunches * 8, cudaMemcpyDeviceToHost));
  std::vector<double> span;
  for (int i = 10; i < kLaunches; ++i) span.push_back((ends_ns[i] - s[i]) * 1e-3);  // 10 warm-ups
  std::vector<double> events;  // the stream's time for the launch (its events' difference)
  for (int i = 10; i < kLaunches; ++i) {
    float ms;
    CHECK(cudaEventElapsedTime(&ms, before[i], after[i]));
    events.push_back(ms * 1e3);
  }
  for (int i = 0; i < kLaunches; ++i) {
    CHECK(cudaEventDestroy(before[i]));
    CHECK(cudaEventDestroy(after[i]));
  }
  std::sort(span.begin(), span.end());
  std::sort(events.begin(), events.end());
  const auto at = [](const std::vector<double>& v, double q) { return v[size_t(q * (v.size() - 1))]; };
  printf("| %s | %s | %.2f | %.2f | %.2f | %.2f |\n", kStageNames[kStage],
         flushed ? "flushed" : "warm", at(span, 0.5), at(span, 0.1), at(span, 0.9),
         at(events, 0.5));
}

// A stage's launches back to back: the time a call adds to a chain of calls (no events or
// memsets between them), the median of 5 differences of a 200- and a 100-launch chain.
// With `graph`, each chain is one CUDA graph of its launches, built before the timing.
template <int kStage>
double chained(const Buffers& b, bool graph) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t begin, end;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));
  const auto launches = [&](int n) {
    for (int i = 0; i < n; ++i) launch<kStage>(b, i, stream);
  };
  cudaGraphExec_t execs[2] = {};  // the chains of kLaunches / 2 and kLaunches launches
  if (graph) {
    for (int h = 0; h < 2; ++h) {
      cudaGraph_t g;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      launches(h ? kLaunches : kLaunches / 2);
      CHECK(cudaStreamEndCapture(stream, &g));
      CHECK(cudaGraphInstantiate(&execs[h], g, 0));
      CHECK(cudaGraphDestroy(g));
    }
  }
  const auto chain_ms = [&](int n) {
    CHECK(cudaMemsetAsync(b.counters, 0, kLaunches * kKvHeads * 4, stream));  // fresh counters
    CHECK(cudaEventRecord(begin, stream));
    if (graph) CHECK(cudaGraphLaunch(execs[n == kLaunches], stream));
    else launches(n);
    CHECK(cudaEventRecord(end, stream));
    CHECK(cudaEventSynchronize(end));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, begin, end));
    return double(ms);
  };
  chain_ms(kLaunches);  // warm-up
  std::vector<double> per_call;
  for (int r = 0; r < 5; ++r) {
    const double half = chain_ms(kLaunches / 2), full = chain_ms(kLaunches);
    per_call.push_back((full - half) * 1e3 / (kLaunches - kLaunches / 2));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(begin));
  CHECK(cudaEventDestroy(end));
  for (cudaGraphExec_t exec : execs)
    if (exec) CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaStreamDestroy(stream));
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs, L2 %d MB; %d CTAs of %d threads, %d KB of pages a CTA, %d launches\n",
         prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, kKvHeads * kSplits,
         kThreads, kCtaWords * 16 / 1024, kLaunches);
  // A random page for every (launch, logical page), so that no launch reads another's lines.
  std::vector<int> tables(size_t(kLaunches) * kSeqPages);
  uint32_t x = 12345u;
  for (auto& t : tables) x = x * 1664525u + 1013904223u, t = int((x >> 8) % kPoolPages);
  const int len = kSeqPages * 16;
  int *d_len, *d_tables;
  uint4* pool;
  float *partial, *out;
  unsigned* counters;
  unsigned long long *starts, *ends;
  uint8_t* flush;
  const size_t pool_bytes = size_t(kPoolPages) * kKvHeads * kHeadPageBytes;
  const size_t flush_bytes = size_t(256) << 20;
  CHECK(cudaMalloc(&d_len, 4));
  CHECK(cudaMalloc(&d_tables, tables.size() * 4));
  CHECK(cudaMalloc(&pool, pool_bytes));
  CHECK(cudaMalloc(&partial, size_t(kLaunches) * kKvHeads * kSplits * 4));
  CHECK(cudaMalloc(&out, kKvHeads * kSplits * 4));
  CHECK(cudaMalloc(&counters, kLaunches * kKvHeads * 4));
  CHECK(cudaMalloc(&starts, kLaunches * 8));
  CHECK(cudaMalloc(&ends, kLaunches * 8));
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMemcpy(d_len, &len, 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_tables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(pool, 0x5A, pool_bytes));
  printf("| stage | L2 | median span µs | 10th | 90th | events µs (median) |\n"
         "| --- | --- | ---: | ---: | ---: | ---: |\n");
  const Buffers buffers{d_len, d_tables, pool, partial, counters, out, starts, ends};
  std::vector<double> chained_us[2][2];  // [same pages][graph][stage]
  for (bool flushed : {true, false}) {
    // warm: each launch reads the same pages, which the launches before left in the L2 (as a
    // benchmark that calls the reader again and again on one cache does)
    if (!flushed) {
      for (int i = 1; i < kLaunches; ++i)
        std::copy(tables.begin(), tables.begin() + kSeqPages, tables.begin() + i * kSeqPages);
      CHECK(cudaMemcpy(d_tables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
    }
    const auto stage = [&](auto kind) {  // one stage's launches, from fresh counters and spans
      CHECK(cudaMemset(counters, 0, kLaunches * kKvHeads * 4));
      CHECK(cudaMemset(starts, 0xFF, kLaunches * 8));
      CHECK(cudaMemset(ends, 0, kLaunches * 8));
      run<decltype(kind)::value>(buffers, flush, flush_bytes, flushed);
      for (int graph = 0; graph < 2; ++graph)
        chained_us[!flushed][graph].push_back(
            chained<decltype(kind)::value>(buffers, graph));
    };
    stage(std::integral_constant<int, kEmpty>{});
    stage(std::integral_constant<int, kTable>{});
    stage(std::integral_constant<int, kPages>{});
    stage(std::integral_constant<int, kMerge>{});
  }
  printf("\nChained (launches back to back; µs a call, the median of 5 chain differences):\n\n"
         "| stage | own pages, host launches | same pages, host launches | own pages, graph | "
         "same pages, graph |\n| --- | ---: | ---: | ---: | ---: |\n");
  for (int k = 0; k < 4; ++k)
    printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", kStageNames[k], chained_us[0][0][k],
           chained_us[1][0][k], chained_us[0][1][k], chained_us[1][1][k]);
  return 0;
}
