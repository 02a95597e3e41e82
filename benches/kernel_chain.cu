// What one dependent step of a decode step costs when it is a kernel of its own, against a stage
// of one persistent kernel: the bound of the graph engine's design at batch 64-256.
//
// A batched decode step is ~64 kernels in a chain (five a layer, then the LM head and the
// chooser), replayed as one CUDA graph whose edges are programmatic (every kernel begins with
// `griddepcontrol.wait`, then `griddepcontrol.launch_dependents`: templates/common/launch.cu.tera).
// At batch 64 the GEMMs of such a step take ~5-8 µs each alone for 0.1-1 µs of bytes and FLOPs
// (RESULTS, twelfth pass). How much of a step is the chain itself? Here STAGES dependent stages
// of a tiny workload, the same for every way of running them: G CTAs of 256 threads; at each
// stage every CTA reads the whole vector of N = 8 G floats the stage before wrote and sums it
// (as a layernorm or a GEMM tile reads the rows it needs) and writes its 8 floats of the next
// (as a tile writes its part of the output). Four ways:
//   plain graph:        one kernel a stage, a CUDA graph with plain edges;
//   programmatic graph: the same kernels with programmatic edges, waiting as kernelforge's do
//                       (captured from launches with programmatic stream serialization);
//   programmatic + prologue: as above, each CTA's prologue (barrier init, 64 KB of "weights"
//                       asked into shared memory by one bulk copy) before its wait, as a GEMM's
//                       would be if it loaded its weight tiles before the wait;
//   persistent:         one kernel of G CTAs; a stage waits on a counter in global memory (thread
//                       0 polls with acquire loads, then a block barrier), and after its writes
//                       every CTA adds 1 to the next stage's counter with release semantics
//                       (the decode megakernel's handoff, templates/decode/megakernel.cu.tera).
// Times: CUDA events around 20 replays of the whole chain, median of 7; µs a stage.
// Not a Rust bench (fixed kernels, no spec): built and run by hand on the GPU machine:
//   nvcc -O3 -arch=sm_90a -std=c++17 -o kernel_chain benches/kernel_chain.cu && ./kernel_chain
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int THREADS = 256;
constexpr int STAGES = 64;
constexpr int PER_CTA = 8;                 // floats each CTA writes a stage
constexpr unsigned WEIGHT_BYTES = 64 << 10;  // the prologue variant's bulk copy

__device__ __forceinline__ void wait_for_previous_kernel() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Reads all of `in` (N floats), writes this CTA's PER_CTA floats of `out`.
__device__ __forceinline__ void stage_work(const float* in, float* out, int n, int stage) {
    __shared__ float partial[THREADS / 32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += THREADS) s += __ldcg(in + i);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x < PER_CTA) {
        float t = 0.0f;
        for (int w = 0; w < THREADS / 32; ++w) t += partial[w];
        out[blockIdx.x * PER_CTA + threadIdx.x] = 0.5f * t / (float)n + (float)stage;
    }
}

__global__ void __launch_bounds__(THREADS) stage_kernel(const float* in, float* out, int n, int stage) {
    wait_for_previous_kernel();
    stage_work(in, out, n, stage);
}

__global__ void __launch_bounds__(THREADS) stage_kernel_prologue(const float* in, float* out, int n, int stage,
                                                                 const char* weights) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar;
    const unsigned bar_s = (unsigned)__cvta_generic_to_shared(&bar);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(bar_s) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(bar_s), "r"(WEIGHT_BYTES) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(weights + (size_t)(blockIdx.x % 64) * WEIGHT_BYTES),
                        "r"(WEIGHT_BYTES), "r"(bar_s) : "memory");
    }
    __syncthreads();
    wait_for_previous_kernel();
    stage_work(in, out, n, stage);
    // The copy must land before the CTA exits.
    if (threadIdx.x == 0) {
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar_s) : "memory");
    }
    __syncthreads();
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// counters[s] counts the CTAs done with stage s - 1; a memset node zeroes them before every replay.
__global__ void __launch_bounds__(THREADS) persistent_chain(float* buf0, float* buf1, int n, unsigned* counters) {
    for (int s = 0; s < STAGES; ++s) {
        if (s > 0) {
            if (threadIdx.x == 0)
                while (ld_acquire(counters + s) < gridDim.x) {
                }
            __syncthreads();
        }
        stage_work(s % 2 ? buf1 : buf0, s % 2 ? buf0 : buf1, n, s);
        __syncthreads();
        if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counters + s + 1) : "memory");
    }
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// µs a stage of the graph, replayed `reps` times between two events, median of 7.
static float time_graph(cudaGraphExec_t exec, cudaStream_t stream, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(exec, stream));
    std::vector<float> times;
    for (int t = 0; t < 7; ++t) {
        CK(cudaEventRecord(a, stream));
        for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(exec, stream));
        CK(cudaEventRecord(b, stream));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        times.push_back(ms * 1000.0f / reps / STAGES);
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return median(times);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CK(cudaFuncSetAttribute(stage_kernel_prologue, cudaFuncAttributeMaxDynamicSharedMemorySize, WEIGHT_BYTES));
    const int reps = 20;
    printf("%s, %d SMs; %d dependent stages; us a stage (median of 7, each over %d replays)\n", prop.name,
           prop.multiProcessorCount, STAGES, reps);
    printf("%-6s %-12s %-18s %-28s %-12s\n", "CTAs", "plain graph", "programmatic graph", "programmatic + prologue", "persistent");
    for (int grid : {prop.multiProcessorCount / 2, prop.multiProcessorCount}) {
        const int n = grid * PER_CTA;
        float *buf0, *buf1;
        char* weights;
        unsigned* counters;
        CK(cudaMalloc(&buf0, n * sizeof(float)));
        CK(cudaMalloc(&buf1, n * sizeof(float)));
        CK(cudaMalloc(&weights, 64 * (size_t)WEIGHT_BYTES));
        CK(cudaMalloc(&counters, (STAGES + 1) * sizeof(unsigned)));
        CK(cudaMemset(buf0, 0, n * sizeof(float)));
        CK(cudaMemset(buf1, 0, n * sizeof(float)));
        CK(cudaMemset(weights, 1, 64 * (size_t)WEIGHT_BYTES));
        float result[4];
        double worst[4] = {0, 0, 0, 0};
        for (int mode = 0; mode < 4; ++mode) {
            cudaGraph_t graph;
            CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
            if (mode == 3) {
                CK(cudaMemsetAsync(counters, 0, (STAGES + 1) * sizeof(unsigned), stream));
                persistent_chain<<<grid, THREADS, 0, stream>>>(buf0, buf1, n, counters);
                CK(cudaGetLastError());
            } else {
                for (int s = 0; s < STAGES; ++s) {
                    const float* in = s % 2 ? buf1 : buf0;
                    float* out = s % 2 ? buf0 : buf1;
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(grid);
                    cfg.blockDim = dim3(THREADS);
                    cfg.stream = stream;
                    cudaLaunchAttribute attr[1];
                    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    attr[0].val.programmaticStreamSerializationAllowed = 1;
                    cfg.attrs = attr;
                    cfg.numAttrs = mode == 0 || s == 0 ? 0 : 1;
                    if (mode == 2) {
                        cfg.dynamicSmemBytes = WEIGHT_BYTES;
                        CK(cudaLaunchKernelEx(&cfg, stage_kernel_prologue, in, out, n, s, (const char*)weights));
                    } else {
                        CK(cudaLaunchKernelEx(&cfg, stage_kernel, in, out, n, s));
                    }
                }
            }
            CK(cudaStreamEndCapture(stream, &graph));
            cudaGraphExec_t exec;
            CK(cudaGraphInstantiate(&exec, graph, 0));
            result[mode] = time_graph(exec, stream, reps);
            // Once more from zeros: every stage's values are equal, v_s = v_(s-1) / 2 + s, so the
            // last stage's are known; a stage that read its input early shows as a wrong value.
            CK(cudaMemset(buf0, 0, n * sizeof(float)));
            CK(cudaMemset(buf1, 0, n * sizeof(float)));
            CK(cudaGraphLaunch(exec, stream));
            CK(cudaStreamSynchronize(stream));
            std::vector<float> last(n);
            CK(cudaMemcpy(last.data(), STAGES % 2 ? buf1 : buf0, n * sizeof(float), cudaMemcpyDeviceToHost));
            double expected = 0.0;
            for (int s = 0; s < STAGES; ++s) expected = expected / 2 + s;
            for (float v : last) worst[mode] = std::max(worst[mode], std::abs(v - expected) / expected);
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(graph));
        }
        printf("%-6d %-12.2f %-18.2f %-28.2f %-12.2f\n", grid, result[0], result[1], result[2], result[3]);
        printf("       largest relative error of the last stage's values: %.1e %.1e %.1e %.1e\n", worst[0], worst[1],
               worst[2], worst[3]);
        CK(cudaFree(buf0));
        CK(cudaFree(buf1));
        CK(cudaFree(weights));
        CK(cudaFree(counters));
    }
    return 0;
}
