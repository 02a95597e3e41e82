// Ceiling of WMMA TF32 m16n16k8 (mma.sync class) on this GPU: independent MMAs on registers
// only, no memory traffic. It bounds what `matmul_wmma` can reach; cuBLAS uses Hopper's wgmma
// (warp-group MMA from shared memory) and is not bound by it. Not a Rust bench (the kernel is
// fixed, no spec): build and run by hand on a machine with the CUDA toolkit:
//   nvcc -O3 -arch=sm_90 -o wmma_tf32_peak benches/wmma_tf32_peak.cu && ./wmma_tf32_peak
// H100 SXM (driver 580, CUDA 13.0): ~241 TFLOP/s at 4, 8 or 16 warps per block, against ~405
// TFLOP/s for cuBLAS TF32 on an 8192^3 GEMM in the same session.
#include <cstdio>
#include <mma.h>
using namespace nvcuda;
constexpr int CHAINS = 8;
__global__ void mma_peak(float* out, int iters) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> c[CHAINS];
    for (int e = 0; e < a.num_elements; ++e) a.x[e] = wmma::__float_to_tf32(threadIdx.x * 1e-3f + e);
    for (int e = 0; e < b.num_elements; ++e) b.x[e] = wmma::__float_to_tf32(threadIdx.x * 2e-3f - e);
    for (int i = 0; i < CHAINS; ++i) wmma::fill_fragment(c[i], 0.0f);
    for (int it = 0; it < iters; ++it)
#pragma unroll
        for (int i = 0; i < CHAINS; ++i) wmma::mma_sync(c[i], a, b, c[i]);
    float s = 0;
    for (int i = 0; i < CHAINS; ++i)
        for (int e = 0; e < c[i].num_elements; ++e) s += c[i].x[e];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
int main() {
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const int iters = 4096;
    for (int warps : {4, 8, 16}) {
        const int blocks = sms * 2, threads = warps * 32;
        float* out; cudaMalloc(&out, blocks * threads * sizeof(float));
        cudaEvent_t t0, t1; cudaEventCreate(&t0); cudaEventCreate(&t1);
        mma_peak<<<blocks, threads>>>(out, iters);
        cudaEventRecord(t0);
        for (int r = 0; r < 5; ++r) mma_peak<<<blocks, threads>>>(out, iters);
        cudaEventRecord(t1); cudaEventSynchronize(t1);
        float ms; cudaEventElapsedTime(&ms, t0, t1);
        double flops = 5.0 * blocks * warps * (double)iters * CHAINS * 2.0 * 16 * 16 * 8;
        printf("wmma tf32 m16n16k8 register-only: %d blocks x %d warps: %.1f TFLOP/s (%s)\n", blocks, warps,
               flops / (ms * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
        cudaFree(out);
    }
}
