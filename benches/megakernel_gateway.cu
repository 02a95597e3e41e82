// Does a stage handoff get cheaper when the SMs that stream the weights never talk to L2 for it?
//
// In the decode megakernel (templates/decode/megakernel.cu.tera) every block streams its next
// tasks' weights into shared memory by the copy engine and, at every stage, polls a counter in
// global memory and then reads its input row from L2. Those round trips come back behind the
// bytes the SM already has in flight: a poll waits about as long as its SM's outstanding copy
// takes at its share of the copy bandwidth (benches/RESULTS.md, "Tasks packed into the ring by
// their bytes"). Here, in clusters of CL CTAs, rank 0 is a *gateway* that streams nothing: it
// polls the counter, reads the input row and pushes it into its cluster's other CTAs' shared
// memory (a bulk copy over the SM-to-SM network, completing on their mbarriers); they send
// their output slices back the same way (st.async), and the gateway writes them to global
// memory and releases the next stage's counter. The other CTAs stream their weights and never
// touch global memory on the critical path.
//
// Both chains run STAGES dependent stages of a vector of N floats (each compute CTA writes 8 of
// the next stage's N, every compute CTA reads all N and sums them, as a layernorm or a
// matrix-vector task reads its input row), beside a weight stream of W bytes a stage over the
// whole GPU (each CTA's next slot issued before its wait, two slots, as the megakernel does):
//   classic:  every CTA streams W / grid, polls the counter, reads the row from L2, writes its
//             slice, and releases the counter (the megakernel's way);
//   gateway:  the compute CTAs stream W / compute CTAs; the gateways carry the handoff.
// Each also without a stream (W = 0). Not a Rust bench (the kernel is fixed, no spec): build and
// run by hand with the CUDA toolkit:
//   nvcc -O3 -arch=sm_90a -std=c++17 -o megakernel_gateway benches/megakernel_gateway.cu && ./megakernel_gateway
// H100 SXM (driver 580, CUDA 13.0), two runs alike within 0.02; 30 clusters of four fit at once,
// so the classic chain runs on the same 120 SMs. µs a stage:
//   W = 0:      classic 1.88, gateway CL=2 2.24, CL=4 2.34
//   W = 3 MB:   classic 2.41, gateway CL=2 2.73, CL=4 2.83
//   W = 8 MB:   classic 3.64, gateway CL=4 4.37 (CL=2: 127 KB a CTA, more than a slot)
//   W = 12 MB:  classic 4.75 (2.65 TB/s)
// The gateway loses everywhere. Its chain has two more hops (the push of the row, the slices
// sent back), and the stream still slows its handoff by as much as the classic one's (+0.5 µs
// at 3 MB), though the gateways themselves stream nothing. So what delays a handoff beside a
// stream is not only the polling SM's own bytes in flight.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "megakernel_sync.cuh"

constexpr int THREADS = 512;
constexpr int STAGES = 60;
constexpr int SLICE = 8;                // floats of the next stage's vector each compute CTA writes
constexpr int SLOT_MAX = 104 * 1024;    // one weight slot (two a CTA)
constexpr int N_MAX = 132 * SLICE;

__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// The same shared-memory address in CTA `rank` of the cluster.
__device__ __forceinline__ unsigned in_rank(const void* p, unsigned rank) {
    unsigned a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem(p)), "r"(rank));
    return a;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ float block_sum(float v, float* sh) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) sh[threadIdx.x / 32] = v;
    __syncthreads();
    v = threadIdx.x % 32 < THREADS / 32 ? sh[threadIdx.x % 32] : 0.f;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
    return v;
}
// Fresh bytes for stage s of this CTA's stream: never in L2 from an earlier stage.
__device__ __forceinline__ const char* stream_source(const char* w, long long wsize, int wbytes, unsigned epoch, int s, int cta, int ctas) {
    return w + ((((long long)(epoch * STAGES + s) * ctas + cta) * wbytes) % (wsize - wbytes) & ~15ll);
}
extern __shared__ __align__(128) unsigned char dyn[];

// The megakernel's handoff: every CTA streams, polls, reads its input from L2 and releases.
__global__ void __launch_bounds__(THREADS, 1) classic(float* bufs, unsigned* counters, int N, unsigned epoch,
                                                      const char* w, long long wsize, int wbytes, float* out) {
    __shared__ float sh[32];
    __shared__ __align__(8) unsigned long long full[2];
    char* slot[2] = {reinterpret_cast<char*>(dyn), reinterpret_cast<char*>(dyn) + SLOT_MAX};
    if (threadIdx.x == 0) { mbar_init(&full[0]); mbar_init(&full[1]); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0 && wbytes) {
        mbar_expect(&full[0], wbytes);
        bulk_copy(slot[0], stream_source(w, wsize, wbytes, epoch, 0, blockIdx.x, gridDim.x), wbytes, &full[0], evict_first_policy());
    }
    for (int s = 0; s < STAGES; ++s) {
        const int b = s % 2;
        if (threadIdx.x == 0 && wbytes && s + 1 < STAGES) {  // the next stage's slot, before the wait
            mbar_expect(&full[1 - b], wbytes);
            bulk_copy(slot[1 - b], stream_source(w, wsize, wbytes, epoch, s + 1, blockIdx.x, gridDim.x), wbytes, &full[1 - b], evict_first_policy());
        }
        if (s > 0 && threadIdx.x == THREADS - 32) { while (ld_acquire(&counters[s]) < gridDim.x * (epoch + 1)) {} }
        __syncthreads();
        float acc = 0.f;
        for (int i = threadIdx.x; i < N; i += THREADS) acc += __ldcg(bufs + (long long)s * N + i);
        if (wbytes) { mbar_wait(&full[b], (s / 2) & 1); acc += reinterpret_cast<const float*>(slot[b])[threadIdx.x] * 0.f; }
        const float total = block_sum(acc, sh);
        if (threadIdx.x < SLICE) {
            const int n = blockIdx.x * SLICE + threadIdx.x;
            bufs[(long long)(s + 1) * N + n] = total / N + n * 1e-4f;
        }
        __syncthreads();
        if (threadIdx.x == 0) red_release(&counters[s + 1], 1);
        if (s == STAGES - 1 && threadIdx.x == 0) out[blockIdx.x] = total;
    }
}

// The gateway's way (see the top of the file). CL CTAs a cluster; rank 0 the gateway.
template <int CL>
__global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(THREADS, 1)
gateway(float* bufs, unsigned* counters, int N, unsigned epoch, const char* w, long long wsize, int wbytes, float* out) {
    __shared__ float sh[32];
    __shared__ __align__(8) unsigned long long full[2], in_bar[2], out_bar;
    __shared__ __align__(16) float in_buf[2][N_MAX];      // compute CTAs: the stage's input row
    __shared__ __align__(16) float staged[N_MAX];         // gateway: the row it pushes
    __shared__ __align__(16) float slices[CL * SLICE];    // gateway: its compute CTAs' outputs
    char* slot[2] = {reinterpret_cast<char*>(dyn), reinterpret_cast<char*>(dyn) + SLOT_MAX};
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int cluster = blockIdx.x / CL, gateways = gridDim.x / CL, computes = gateways * (CL - 1);
    if (threadIdx.x == 0) { mbar_init(&full[0]); mbar_init(&full[1]); mbar_init(&in_bar[0]); mbar_init(&in_bar[1]); mbar_init(&out_bar); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    cluster_sync();  // every CTA's barriers exist before a peer copies into them
    if (rank == 0) {
        for (int s = 0; s < STAGES; ++s) {
            if (s > 0 && threadIdx.x == 0) { while (ld_acquire(&counters[s]) < gateways * (epoch + 1)) {} }
            if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // `staged` is free
            __syncthreads();
            for (int i = threadIdx.x; i < N; i += THREADS) staged[i] = __ldcg(bufs + (long long)s * N + i);
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, before the copy engine reads them
            __syncthreads();
            if (threadIdx.x == 0) {
                for (unsigned r = 1; r < CL; ++r)
                    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                                 :: "r"(in_rank(in_buf[s % 2], r)), "r"(smem(staged)), "r"(N * 4), "r"(in_rank(&in_bar[s % 2], r)) : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                mbar_expect(&out_bar, (CL - 1) * SLICE * 4);
            }
            mbar_wait(&out_bar, s & 1);  // every compute CTA's slice of the next row is here
            const int first = cluster * (CL - 1) * SLICE;
            if (threadIdx.x < (CL - 1) * SLICE) bufs[(long long)(s + 1) * N + first + threadIdx.x] = slices[threadIdx.x];
            __syncthreads();
            if (threadIdx.x == 0) red_release(&counters[s + 1], 1);
        }
    } else {
        const int me = cluster * (CL - 1) + rank - 1;
        if (threadIdx.x == 0 && wbytes) {
            mbar_expect(&full[0], wbytes);
            bulk_copy(slot[0], stream_source(w, wsize, wbytes, epoch, 0, me, computes), wbytes, &full[0], evict_first_policy());
        }
        float total = 0.f;
        for (int s = 0; s < STAGES; ++s) {
            const int b = s % 2;
            if (threadIdx.x == 0) {
                if (wbytes && s + 1 < STAGES) {
                    mbar_expect(&full[1 - b], wbytes);
                    bulk_copy(slot[1 - b], stream_source(w, wsize, wbytes, epoch, s + 1, me, computes), wbytes, &full[1 - b], evict_first_policy());
                }
                mbar_expect(&in_bar[b], N * 4);
            }
            mbar_wait(&in_bar[b], (s / 2) & 1);  // the gateway's copy of the row has landed
            float acc = 0.f;
            for (int i = threadIdx.x; i < N; i += THREADS) acc += in_buf[b][i];
            if (wbytes) { mbar_wait(&full[b], (s / 2) & 1); acc += reinterpret_cast<const float*>(slot[b])[threadIdx.x] * 0.f; }
            total = block_sum(acc, sh);
            if (threadIdx.x == 0) {  // this CTA's slice of the next row, into the gateway's `slices`
                const unsigned dst = in_rank(slices + (rank - 1) * SLICE, 0), bar = in_rank(&out_bar, 0);
                for (int q = 0; q < SLICE; q += 4) {
                    float v[4];
                    for (int j = 0; j < 4; ++j) v[j] = total / N + (me * SLICE + q + j) * 1e-4f;
                    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                                 :: "r"(dst + q * 4), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(bar) : "memory");
                }
            }
        }
        if (threadIdx.x == 0) out[me] = total;
    }
    cluster_sync();  // no CTA leaves while a peer may still write into its shared memory
}

// µs a stage: the median of 50 chains after 10 to warm up.
template <typename Launch>
float time_chain(Launch launch, unsigned* counters) {
    CK(cudaMemset(counters, 0, (STAGES + 2) * 4));
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> times;
    for (unsigned epoch = 0; epoch < 60; ++epoch) {
        cudaEventRecord(a);
        launch(epoch);
        cudaEventRecord(b);
        CK(cudaEventSynchronize(b));
        CK(cudaGetLastError());
        float ms; cudaEventElapsedTime(&ms, a, b);
        if (epoch >= 10) times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2] * 1000.f / STAGES;
}

template <int CL>
float run_gateway(int clusters, long long wtotal, float* bufs, unsigned* counters, const char* w, long long wsize, float* out) {
    const int computes = clusters * (CL - 1), N = computes * SLICE, wbytes = (int)(wtotal / computes) & ~127;
    if (wbytes > SLOT_MAX) return -1.f;
    const int smem_bytes = 2 * SLOT_MAX;
    CK(cudaFuncSetAttribute(gateway<CL>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    return time_chain([&](unsigned epoch) {
        gateway<CL><<<clusters * CL, THREADS, smem_bytes>>>(bufs, counters, N, epoch, w, wsize, wbytes, out);
    }, counters);
}

int main() {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    float *bufs, *out; unsigned* counters; char* w;
    const long long wsize = 1ll << 30;
    CK(cudaMalloc(&bufs, (size_t)(STAGES + 1) * N_MAX * 4)); CK(cudaMalloc(&counters, (STAGES + 2) * 4));
    CK(cudaMalloc(&w, wsize)); CK(cudaMemset(w, 0, wsize)); CK(cudaMalloc(&out, 132 * 4));
    std::vector<float> row(N_MAX);
    for (int i = 0; i < N_MAX; ++i) row[i] = 1.0f + i * 1e-4f;
    CK(cudaMemcpy(bufs, row.data(), N_MAX * 4, cudaMemcpyHostToDevice));  // stage 0's input
    // How many clusters of 2 and 4 can be resident at once (the chains spin: all must be).
    int fit2 = 0, fit4 = 0;
    {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = 2 * SLOT_MAX;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        CK(cudaFuncSetAttribute(gateway<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * SLOT_MAX));
        CK(cudaFuncSetAttribute(gateway<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * SLOT_MAX));
        attr.val.clusterDim = {2, 1, 1}; cfg.gridDim = dim3(132);
        CK(cudaOccupancyMaxActiveClusters(&fit2, gateway<2>, &cfg));
        attr.val.clusterDim = {4, 1, 1}; cfg.gridDim = dim3(128);
        CK(cudaOccupancyMaxActiveClusters(&fit4, gateway<4>, &cfg));
    }
    const int clusters2 = std::min(fit2, 66), clusters4 = std::min(fit4, 33);
    printf("resident at once: %d clusters of 2, %d of 4 (using %d and %d)\n", fit2, fit4, clusters2, clusters4);
    const int grid = clusters4 * 4;  // the classic chain on as many SMs as the clusters of four take
    CK(cudaFuncSetAttribute(classic, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * SLOT_MAX));
    printf("us a stage (stream rate), W = the weight bytes a stage over the GPU\n");
    for (long long wtotal : {0ll, 3ll << 20, 8ll << 20, 12ll << 20}) {
        const int wclassic = (int)(wtotal / grid) & ~127;
        const float c = time_chain([&](unsigned epoch) {
            classic<<<grid, THREADS, 2 * SLOT_MAX>>>(bufs, counters, grid * SLICE, epoch, w, wsize, wclassic, out);
        }, counters);
        const float g2 = run_gateway<2>(clusters2, wtotal, bufs, counters, w, wsize, out);
        const float g4 = run_gateway<4>(clusters4, wtotal, bufs, counters, w, wsize, out);
        auto rate = [&](float us) { return us > 0 ? wtotal / (us * 1e3) : 0.0; };
        printf("W = %5.1f MB: classic (%d CTAs) %.2f (%.0f GB/s)  gateway CL=2 (%d streaming) %.2f (%.0f GB/s)  gateway CL=4 (%d streaming) %.2f (%.0f GB/s)\n",
               wtotal / 1048576.0, grid, c, rate(c), clusters2, g2, rate(g2), clusters4 * 3, g4, rate(g4));
    }
    float host[132];
    CK(cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost));
    printf("(a check that the chains ran: out[0] = %g)\n", host[0]);
    return 0;
}
