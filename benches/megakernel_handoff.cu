// What one stage handoff costs in a persistent decode kernel (templates/decode/megakernel.cu.tera),
// measured alone: a chain of STAGES dependent stages in one cooperative launch; in each, P
// producer blocks write a slice of a vector of N floats and every block of the next stage reads
// the whole vector and reduces it (as a layernorm or a matrix-vector task reads its input row).
// Ways to hand a stage over:
//   0 counter: red.release by each producer; relaxed polls, then fence.acq_rel once reached
//   1 counter: red.release by each producer; an acquire load per poll (the megakernel's way)
//   2 a flag per producer block (st.release), polled in parallel by P threads with acquire loads
//   3 a flag inside every 8-byte word of the data (no counter; the consumer polls the data)
//   4 no synchronisation at all (wrong results; the floor of the stage's own work)
//   5 counter, polled by POLLERS threads (lane 0 of the last POLLERS warps, which do nothing
//     else) with acquire loads, staggered in time so that a poll lands every RTT / POLLERS; the
//     first to see the count releases the other warps through an mbarrier (variant 1 waits a
//     whole round trip when the count lands just after its poll left)
//   6 as 5 with one poller (the dedicated warps alone)
// Optionally each block also copies a 27 KB weight tile per stage (cp.async, issued before the
// wait, waited on after it), so that the handoff runs on a busy memory system.
// Not a Rust bench (the kernel is fixed, no spec): build and run by hand with the CUDA toolkit:
//   nvcc -O3 -arch=sm_90 -o megakernel_handoff benches/megakernel_handoff.cu && ./megakernel_handoff
// H100 SXM (driver 580, CUDA 13.0), µs a stage, N = 768, no weight tiles: 2.28 (0), 1.89 (1),
// 3.14 (2), 1.52 (3), 0.87 (4); with the weight tiles: 2.90, 2.56, 4.03, 2.31, 1.98. A later run
// with 5 and 6 (same kind of H100), no weight tiles: 2.01 (0), 1.73 (1), 3.14 (2), 1.48 (3),
// 0.86 (4), 1.91 (5), 1.74 (6); with them: 2.77, 2.53, 3.99, 2.33, 2.00, 2.77, 2.65. Staggered
// pollers lose: a poll's round trip is not what the wait is made of (nor is a warp that does
// nothing but wait faster), and four threads polling one counter load the memory system more.
// The stream table (stream_chain, below: the megakernel's bulk-copy weight stream, whole or paced
// by a loader warp), same kind of H100, µs a stage with the handoff / with none: 27 KB a block
// and stage whole 2.48 / 1.53, paced 8 KB x 2 2.94 / 2.36, 16 KB x 2 3.02 / 1.64, 4 KB x all
// 3.45 / 3.44; 96 KB whole 4.72 / 4.51 (2,749 GB/s), 16 KB x 2 4.57 / 4.88, 8 KB x 2 6.39 / 6.53.
// Pacing does not shorten the handoff: each piece costs its issue and its wait.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "megakernel_sync.cuh"

constexpr int THREADS = 512;
constexpr int STAGES = 60;
constexpr int P = 128;  // producer blocks per stage

__device__ __forceinline__ void st_ll(uint4* p, uint4 v) { asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory"); }
__device__ __forceinline__ uint4 ld_ll(const uint4* p) { uint4 v; asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) { asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src)); }

constexpr int POLLERS = 4;
constexpr int COMPUTE = THREADS - 32 * POLLERS;  // threads of variants 5 and 6 that read and write

// The sum over the first N threads of the block (all of them, or the COMPUTE threads of variants
// 5 and 6, which meet at named barrier 1 without the polling warps).
template <int N>
__device__ __forceinline__ void sync_first() {
    if (N == THREADS) __syncthreads();
    else asm volatile("bar.sync 1, %0;" :: "n"(N) : "memory");
}
template <int N = THREADS>
__device__ float block_sum(float v, float* sh) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
    sync_first<N>();
    if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
    sync_first<N>();
    v = threadIdx.x % 32 < N / 32 ? sh[threadIdx.x % 32] : 0.f;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
    return v;
}

extern __shared__ __align__(16) unsigned char wsmem[];

// This block's weight tile for stage s, copied by the first N threads before the wait (as the
// real kernel does), and the wait for it after.
template <int N>
__device__ __forceinline__ void copy_weight_tile(const char* weights, long long wsize, int wbytes, unsigned epoch, int s) {
    if (!wbytes) return;
    const unsigned wdst = (unsigned)__cvta_generic_to_shared(wsmem);
    const long long off = (((long long)(epoch * STAGES + s) * gridDim.x + blockIdx.x) * wbytes) % (wsize - wbytes);
    for (int b = threadIdx.x * 16; b < wbytes; b += N * 16) cp_async16(wdst + b, weights + (off & ~15ll) + b);
    asm volatile("cp.async.commit_group;");
}
__device__ __forceinline__ float wait_weight_tile(int wbytes) {  // 0, read from the tile
    if (!wbytes) return 0.f;
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    return reinterpret_cast<float*>(wsmem)[threadIdx.x] * 0.f;
}

// The first N threads' share of the sum of the stage's input vector (read through L2).
template <int N>
__device__ __forceinline__ float sum_input(const float* in, int n) {
    float acc = 0.f;
    for (int i = threadIdx.x * 4; i < n; i += N * 4) {
        float4 v = __ldcg(reinterpret_cast<const float4*>(in + i));
        acc += v.x + v.y + v.z + v.w;
    }
    return acc;
}

// A producer block's slice of the next stage's vector, written by the first N threads.
template <int N>
__device__ __forceinline__ void write_slice(float* next, int n, float total) {
    const int per = n / P;
    for (int j = threadIdx.x; j < per; j += N) next[blockIdx.x * per + j] = total / n + (blockIdx.x * per + j) * 1e-4f;
}

template <int VARIANT>
__global__ void __launch_bounds__(THREADS, 1) chain(float* bufs /*[STAGES+1][N]*/, uint4* ll /*[STAGES+1][N/2]*/,
                                                      unsigned* counters, unsigned* flags, int N, unsigned epoch,
                                                      const char* weights, long long wsize, int wbytes, float* out) {
    __shared__ float sh[32];
    const unsigned tag = epoch * (STAGES + 1);
    // stage 0 input: block 0 writes it
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < N; i += THREADS) bufs[i] = 1.0f + i * 1e-4f;
        for (int i = threadIdx.x; i < N / 2; i += THREADS)
            st_ll(ll + i, make_uint4(__float_as_uint(1.0f + 2 * i * 1e-4f), tag + 1, __float_as_uint(1.0f + (2 * i + 1) * 1e-4f), tag + 1));
        __syncthreads();
        if (threadIdx.x == 0) {
            if (VARIANT <= 1 || VARIANT >= 5) red_release(&counters[0], P);
            if (VARIANT == 2) for (int p = 0; p < P; ++p) st_release(&flags[p], epoch + 1);
        }
    }
    if constexpr (VARIANT >= 5) {
        __shared__ unsigned long long ready;  // completes a phase per stage: its input is there
        __shared__ int seen;                  // the newest stage a poller saw complete
        __shared__ int consumed;              // stages whose phase every compute thread has waited for
        if (threadIdx.x == 0) { mbar_init(&ready); seen = -1; consumed = 0; }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        __syncthreads();
        const int pollers = VARIANT == 5 ? POLLERS : 1;
        if (threadIdx.x >= COMPUTE) {  // the polling warps
            const int j = (threadIdx.x - COMPUTE) / 32;
            if (threadIdx.x % 32 != 0 || j >= pollers) return;
            for (int s = 0; s < STAGES; ++s) {
                // Not before every compute thread has waited for the previous phase: a phase
                // that completes twice under a waiter's feet reads as not completed at all.
                while (*(volatile int*)&consumed < s) {}
                __nanosleep(j * 150);  // staggered: a poll lands every ~150 ns
                while (*(volatile int*)&seen < s) {
                    if (ld_acquire(&counters[s]) >= P * (epoch + 1)) {
                        if (atomicMax(&seen, s) < s) mbar_arrive(&ready);
                        break;
                    }
                }
            }
            return;
        }
        for (int s = 0; s < STAGES; ++s) {
            copy_weight_tile<COMPUTE>(weights, wsize, wbytes, epoch, s);
            mbar_wait(&ready, s & 1);
            float acc = sum_input<COMPUTE>(bufs + (long long)s * N, N);
            acc += wait_weight_tile(wbytes);
            const float total = block_sum<COMPUTE>(acc, sh);  // its barriers: every compute thread is past the wait
            if (threadIdx.x == 0) *(volatile int*)&consumed = s + 1;
            if (blockIdx.x < P) {
                write_slice<COMPUTE>(bufs + (long long)(s + 1) * N, N, total);
                sync_first<COMPUTE>();
                if (threadIdx.x == 0) red_release(&counters[s + 1], 1);
            }
            if (s == STAGES - 1 && threadIdx.x == 0) out[blockIdx.x] = total;
        }
    } else {
        for (int s = 0; s < STAGES; ++s) {
            copy_weight_tile<THREADS>(weights, wsize, wbytes, epoch, s);
            float acc = 0.f;
            if (VARIANT == 0 || VARIANT == 1 || VARIANT == 2 || VARIANT == 4) {
                if (VARIANT == 0 && threadIdx.x == THREADS - 32) {
                    while (ld_relaxed(&counters[s]) < P * (epoch + 1)) {}
                    asm volatile("fence.acq_rel.gpu;" ::: "memory");
                }
                if (VARIANT == 1 && threadIdx.x == THREADS - 32) { while (ld_acquire(&counters[s]) < P * (epoch + 1)) {} }
                if (VARIANT == 2 && threadIdx.x < P) { while (ld_acquire(&flags[s * P + threadIdx.x]) != epoch + 1) {} }
                __syncthreads();
                acc = sum_input<THREADS>(bufs + (long long)s * N, N);
            } else {  // LL
                const uint4* lin = ll + (long long)s * (N / 2);
                const unsigned want = tag + s + 1;
                for (int i = threadIdx.x; i < N / 2; i += THREADS) {
                    uint4 v;
                    do { v = ld_ll(lin + i); } while (v.y != want || v.w != want);
                    acc += __uint_as_float(v.x) + __uint_as_float(v.z);
                }
            }
            acc += wait_weight_tile(wbytes);
            const float total = block_sum(acc, sh);
            if (blockIdx.x < P) {
                if (VARIANT == 3) {
                    const int per = N / P;  // slice of the next vector
                    uint4* lo = ll + (long long)(s + 1) * (N / 2);
                    const unsigned tg = tag + s + 2;
                    for (int j = threadIdx.x; j < per / 2; j += THREADS) {
                        const int n = blockIdx.x * per + 2 * j;
                        st_ll(lo + n / 2, make_uint4(__float_as_uint(total / N + n * 1e-4f), tg, __float_as_uint(total / N + (n + 1) * 1e-4f), tg));
                    }
                } else {
                    write_slice<THREADS>(bufs + (long long)(s + 1) * N, N, total);
                    __syncthreads();
                    if (threadIdx.x == THREADS - 32) {
                        if (VARIANT <= 1) red_release(&counters[s + 1], 1);
                        if (VARIANT == 2) st_release(&flags[(s + 1) * P + blockIdx.x], epoch + 1);
                    }
                }
            }
            if (s == STAGES - 1 && threadIdx.x == 0) out[blockIdx.x] = total;
        }
    }
}

// ---- the weight stream beside the handoff --------------------------------------------------
// The megakernel streams every block's next task's weights into a ring of two slots by the copy
// engine (cp.async.bulk, L2 evict-first), the copy issued before the wait for the task's input:
// up to 2 x 96 KB a block, 25 MB over the GPU, in flight at once. `stream_chain` runs the
// counter-acquire handoff (variant 1; SYNC = false: no handoff at all, the stage's own reads
// and writes) beside such a stream, `wbytes` a block and stage, so that the handoff's cost can be
// read against how the stream is issued:
//   inflight == 0: as the megakernel does, thread 0 issues the next stage's whole slot before
//                  the wait (one barrier a slot);
//   inflight >  0: a loader warp (the last; it does nothing else) issues the slots in pieces of
//                  `chunk` bytes, at most `inflight` pieces of this block in flight: the GPU then
//                  has at most 132 x inflight x chunk bytes requested, about what its bandwidth
//                  times a DRAM round trip needs (3 TB/s x ~1.5 us = ~4.5 MB), instead of 25 MB
//                  queued before every poll and every read of the activations.
constexpr int SLOT_MAX = 96 * 1024;
constexpr int PIECES_MAX = 48;   // pieces a slot (chunk >= 2 KB)

template <bool PACED, bool SYNC>
__global__ void __launch_bounds__(THREADS, 1) stream_chain(float* bufs, unsigned* counters, int N, unsigned epoch,
                                                           const char* weights, long long wsize, int wbytes,
                                                           int chunk, int inflight, float* out) {
    __shared__ float sh[32];
    __shared__ unsigned long long full[2][PIECES_MAX], empty[2];
    constexpr int WORKERS = PACED ? THREADS - 32 : THREADS;   // the threads that poll, read and write
    const int pieces = PACED ? (wbytes + chunk - 1) / chunk : 1;   // the last may be shorter
    char* slot[2] = {reinterpret_cast<char*>(wsmem), reinterpret_cast<char*>(wsmem) + SLOT_MAX};
    auto source = [&](int s) {   // stage s's weights for this block: fresh bytes, never in L2
        return weights + ((((long long)(epoch * STAGES + s) * gridDim.x + blockIdx.x) * wbytes) % (wsize - wbytes) & ~15ll);
    };
    const unsigned long long policy = evict_first_policy();
    if (threadIdx.x == 0) {
        for (int b = 0; b < 2; ++b) {
            for (int c = 0; c < pieces; ++c) mbar_init(&full[b][c]);
            mbar_init(&empty[b]);
        }
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < N; i += THREADS) bufs[i] = 1.0f + i * 1e-4f;
    }
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) red_release(&counters[0], P);
    if (PACED && threadIdx.x >= WORKERS) {   // the loader warp's lane 0
        if (threadIdx.x != WORKERS) return;
        // The barriers of the last `inflight` pieces. A piece of stage s - 2 or earlier needs no
        // wait (the workers have released its slot), and must not get one: its barrier may
        // already be armed again, and a wait on a reused phase can wait forever.
        unsigned long long* pending[64];
        unsigned parity[64];
        int pending_stage[64];
        int issued = 0;
        for (int s = 0; s < STAGES; ++s) {
            const int b = s % 2;
            if (s >= 2) mbar_wait<true>(&empty[b], (s / 2 - 1) & 1);   // the workers are done with stage s - 2
            for (int c = 0; c < pieces; ++c, ++issued) {
                const int k = issued % inflight;
                if (issued >= inflight && pending_stage[k] >= s - 1) mbar_wait<true>(pending[k], parity[k]);
                const int bytes = min(chunk, wbytes - c * chunk);
                mbar_expect(&full[b][c], bytes);
                bulk_copy(slot[b] + c * chunk, source(s) + c * chunk, bytes, &full[b][c], policy);
                pending[k] = &full[b][c];
                parity[k] = (s / 2) & 1;
                pending_stage[k] = s;
            }
        }
        return;
    }
    if (!PACED && threadIdx.x == 0) {   // stage 0's slot, before the loop
        mbar_expect(&full[0][0], wbytes);
        bulk_copy(slot[0], source(0), wbytes, &full[0][0], policy);
    }
    for (int s = 0; s < STAGES; ++s) {
        const int b = s % 2;
        if (!PACED && threadIdx.x == 0 && s + 1 < STAGES) {   // the next stage's slot, before the wait
            mbar_expect(&full[1 - b][0], wbytes);
            bulk_copy(slot[1 - b], source(s + 1), wbytes, &full[1 - b][0], policy);
        }
        if (SYNC && threadIdx.x == WORKERS - 32) { while (ld_acquire(&counters[s]) < P * (epoch + 1)) {} }
        sync_first<WORKERS>();
        float acc = sum_input<WORKERS>(bufs + (long long)s * N, N);
        for (int c = 0; c < pieces; ++c) mbar_wait(&full[b][c], (s / 2) & 1);
        acc += reinterpret_cast<const float*>(slot[b])[threadIdx.x] * 0.f;
        const float total = block_sum<WORKERS>(acc, sh);   // its barriers: every worker has read the slot
        if (PACED && threadIdx.x == 0) mbar_arrive(&empty[b]);
        if (blockIdx.x < P) {
            write_slice<WORKERS>(bufs + (long long)(s + 1) * N, N, total);
            sync_first<WORKERS>();
            if (SYNC && threadIdx.x == 0) red_release(&counters[s + 1], 1);
        }
        if (s == STAGES - 1 && threadIdx.x == 0) out[blockIdx.x] = total;
    }
}

template <bool PACED, bool SYNC>
float run_stream(int N, int wbytes, int chunk, int inflight, float* bufs, unsigned* counters, const char* w,
                 long long wsize, float* out, int grid) {
    const int smem = 2 * SLOT_MAX;
    CK(cudaFuncSetAttribute(stream_chain<PACED, SYNC>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaMemset(counters, 0, (STAGES + 2) * 4));
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> times;
    for (unsigned epoch = 0; epoch < 60; ++epoch) {
        void* args[] = {&bufs, &counters, &N, &epoch, &w, &wsize, &wbytes, &chunk, &inflight, &out};
        cudaEventRecord(a);
        CK(cudaLaunchCooperativeKernel((void*)stream_chain<PACED, SYNC>, grid, THREADS, args, smem));
        cudaEventRecord(b);
        CK(cudaEventSynchronize(b));
        float ms; cudaEventElapsedTime(&ms, a, b);
        if (epoch >= 10) times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2] * 1000.f / STAGES;
}

template <int V>
float run(int N, int wbytes, float* bufs, uint4* ll, unsigned* counters, unsigned* flags, const char* w, long long wsize, float* out, int grid) {
    CK(cudaFuncSetAttribute(chain<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
    CK(cudaMemset(counters, 0, (STAGES + 2) * 4));
    CK(cudaMemset(flags, 0, (STAGES + 2) * P * 4));
    CK(cudaMemset(ll, 0, (size_t)(STAGES + 1) * N * 8));
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> times;
    for (unsigned epoch = 0; epoch < 60; ++epoch) {
        void* args[] = {&bufs, &ll, &counters, &flags, &N, &epoch, &w, &wsize, &wbytes, &out};
        cudaEventRecord(a);
        CK(cudaLaunchCooperativeKernel((void*)chain<V>, grid, THREADS, args, 64 * 1024));
        cudaEventRecord(b);
        CK(cudaEventSynchronize(b));
        float ms; cudaEventElapsedTime(&ms, a, b);
        if (epoch >= 10) times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    float host[1]; CK(cudaMemcpy(host, out, 4, cudaMemcpyDeviceToHost));
    return times[times.size() / 2] * 1000.f / STAGES;  // µs per stage
}

int main() {
    setvbuf(stdout, nullptr, _IOLBF, 0);   // each table row as soon as it is measured
    int grid = 132;
    float *bufs, *out; uint4* ll; unsigned *counters, *flags; char* w;
    const long long wsize = 1ll << 30;
    CK(cudaMalloc(&bufs, (STAGES + 1) * 4096 * 4)); CK(cudaMalloc(&ll, (size_t)(STAGES + 1) * 4096 * 8));
    CK(cudaMalloc(&counters, (STAGES + 2) * 4)); CK(cudaMalloc(&flags, (STAGES + 2) * P * 4));
    CK(cudaMalloc(&w, wsize)); CK(cudaMemset(w, 0, wsize)); CK(cudaMalloc(&out, grid * 4));
    const char* names[] = {"counter+fence", "counter acquire", "flags/producer", "LL in data", "no sync",
                           "staggered pollers", "one dedicated poller"};
    for (int wbytes : {0, 27648}) for (int N : {768, 3072}) {
        printf("N=%4d weights/task=%5d B:", N, wbytes);
        float t[7];
        t[0] = run<0>(N, wbytes, bufs, ll, counters, flags, w, wsize, out, grid);
        t[1] = run<1>(N, wbytes, bufs, ll, counters, flags, w, wsize, out, grid);
        t[2] = run<2>(N, wbytes, bufs, ll, counters, flags, w, wsize, out, grid);
        t[3] = run<3>(N, wbytes, bufs, ll, counters, flags, w, wsize, out, grid);
        t[4] = run<4>(N, wbytes, bufs, ll, counters, flags, w, wsize, out, grid);
        t[5] = run<5>(N, wbytes, bufs, ll, counters, flags, w, wsize, out, grid);
        t[6] = run<6>(N, wbytes, bufs, ll, counters, flags, w, wsize, out, grid);
        for (int v = 0; v < 7; ++v) printf("  %s %.2f", names[v], t[v]);
        printf("  (us/stage)\n");
    }
    // The stream beside the handoff: µs a stage, and the stream's rate (bytes of every block's
    // slots over the chain's time); with the handoff (acquire) and without any (the stage's own
    // reads and writes beside the stream).
    for (int wbytes : {27648, 98304}) {
        auto report = [&](const char* name, float sync_us, float free_us) {
            printf("  %s %.2f / %.2f (%.0f GB/s)", name, sync_us, free_us, (double)wbytes * grid / (sync_us * 1e3));
        };
        printf("N= 768 stream %5d B a block and stage, handoff / none:", wbytes);
        report("whole before the wait", run_stream<false, true>(768, wbytes, wbytes, 0, bufs, counters, w, wsize, out, grid),
               run_stream<false, false>(768, wbytes, wbytes, 0, bufs, counters, w, wsize, out, grid));
        for (int chunk : {4096, 8192, 16384})
            for (int inflight : {1, 2, 4, 64}) {   // 64: the loader warp, not paced
                char name[64];
                snprintf(name, sizeof name, "loader %dK x %d", chunk / 1024, inflight);
                report(name, run_stream<true, true>(768, wbytes, chunk, inflight, bufs, counters, w, wsize, out, grid),
                       run_stream<true, false>(768, wbytes, chunk, inflight, bufs, counters, w, wsize, out, grid));
            }
        printf("  (us/stage)\n");
    }
    return 0;
}
