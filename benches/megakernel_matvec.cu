// What one matrix-vector task of the decode megakernel costs, measured alone.
//
// Appended to a rendered megakernel source (it uses that source's matvec_task, prefetch_slot and
// mbarrier helpers unchanged) and built with nvcc; benches/megakernel_matvec.sh does all of it
// for GPT-2's task shapes, or by hand:
//
//   kernelforge inspect decode_megakernel --dtype bf16 --param max_rows=1 ... > mk.cu
//   cat mk.cu benches/megakernel_matvec.cu > bench.cu
//   nvcc -arch=sm_90a -O3 -std=c++17 -o bench bench.cu && ./bench K COLS
//
// Every resident block (one per SM, THREADS threads) walks tasks of COLS weight rows of length
// K through a ring of SLOTS slots, as the megakernel does: the copy engine fills the next task's
// slot while the block computes the current one. Two modes:
//   stream:   a 256 MB weight matrix streamed once (what a decode step's weights do);
//   resident: every task reads the same slot, copied once (the arithmetic alone).
// It prints, per task, the cycles from the slot's data being there to the last output stored
// (what `bench --timeline` calls compute) and from the task's start to its slot's data (the
// wait), the stream's bandwidth, and the outputs' largest error against a double-precision
// reference on the host. The task is the source's matvec_task with one row and the bias
// epilogue; -DMATVEC_TASK=name runs another function of the same signature instead (the
// tensor-core matvec_task_mma, matvec_task_kslice of a source rendered at kslice = 1, or a
// probe: a copy with steps taken out), and a probe that
// counts its phases' cycles into a __device__ array named by -DMATVEC_PHASES=array
// ([block][4], summed) gets them printed too.
//
// -DMLP_TASK (with a source rendered at fuse_mlp = 1) runs a fused MLP task instead: fc rows with
// bias and GELU into `tile`, then as many rows of a transposed projection (K outputs each, in
// the slot's second half) times them, summed over the block's tasks in shared memory and added
// into an f32 residual row by atomics after the block's last task, or after every task with
// the third argument 1 (how the template added them before); it prints the cycles of both
// halves (no reference check: tests/gpu_megakernel.rs checks the fused MLP's values).
//
// What it showed (H100, bf16, 512 threads, two columns a warp): a task of GPT-2 small's qkv
// (18 rows of 768) took 2,305 cycles, of which the dot products' loop was under half; the
// epilogue and stores alone 779. After the changes that followed, 1,843. See benches/RESULTS.md,
// "What a task's arithmetic costs".
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <cmath>

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

// stats[block] = {tasks, compute cycles, wait cycles, MLP projection cycles}; clk[0..1] = block
// 0's cycles and ns over its whole run (the SM clock it ran at). `weight2` and `acc` are the MLP
// task's transposed projection and residual row (MLP_TASK only).
#define STATS 4
extern "C" __global__ void __launch_bounds__(THREADS, 1)
bench_matvec(const storage_t* weight, const storage_t* bias, const storage_t* input, storage_t* out, int n, int k,
             int cols, int tasks, int resident, const storage_t* weight2, float* acc, int atomics_every_task,
             unsigned long long* stats, unsigned long long* clk) {
    const unsigned long long c_start = clock64(), ns_start = global_time();
    storage_t* xs = reinterpret_cast<storage_t*>(dynamic_smem + SLOTS * SLOT_BYTES);
    __shared__ float tile[MAX_ROWS * MAX_TASK_COLS];
    __shared__ float bias_s[MAX_TASK_COLS];
    __shared__ float partial_s[WARPS * HEAD_DIM > 4096 ? WARPS * HEAD_DIM : 4096];
    __shared__ __align__(16) Stage st;
    __shared__ __align__(8) unsigned long long slot_bar[SLOTS];
    if (threadIdx.x == 0) {
        memset(&st, 0, sizeof(st));
        st.kind = STAGE_MATVEC;
        st.n = n;
        st.k = k;
        st.cols = cols;
        st.epilogue = EPI_BIAS;
        st.weight = weight;
        st.bias = bias;
        st.out = out;
#ifdef MLP_TASK
        st.flags = FLAG_MLP;
        st.epilogue = EPI_BIAS_GELU;
        st.n2 = k;
        st.weight2 = weight2;
        st.acc = acc;
#endif
        for (int j = 0; j < SLOTS; ++j) mbar_init(smem_address(&slot_bar[j]), 1);
        mbar_init_fence();
    }
    for (int i = threadIdx.x * VEC; i < k; i += THREADS * VEC)
        *reinterpret_cast<uint4*>(xs + i) = *reinterpret_cast<const uint4*>(input + i);
    __syncthreads();
    unsigned phases = 0;
    unsigned long long compute = 0, wait = 0, count = 0, project = 0;
    const int grid = gridDim.x;
    auto task_of = [&](int i) { return resident ? blockIdx.x : blockIdx.x + i * grid; };
    auto prefetch = [&](int i) {
        if (task_of(i) < tasks && (!resident || i < SLOTS))
            prefetch_slot(st, task_of(i), 0, 0, reinterpret_cast<storage_t*>(dynamic_smem + (i % SLOTS) * SLOT_BYTES),
                          slot_bar + i % SLOTS);
    };
    for (int i = 0; i < SLOTS - 1; ++i) prefetch(i);
    const int rounds = resident ? 64 : (tasks - blockIdx.x + grid - 1) / grid;
    for (int i = 0; i < rounds; ++i) {
        prefetch(i + SLOTS - 1);
        const int task = task_of(i);
        if (threadIdx.x < min(cols, n - task * cols)) bias_s[threadIdx.x] = to_float(bias[task * cols + threadIdx.x]);
        __syncthreads();
        const unsigned long long t0 = clock64();
        if (!resident || i < SLOTS) {
            mbar_wait(smem_address(&slot_bar[i % SLOTS]), (phases >> (i % SLOTS)) & 1);
            phases ^= 1u << (i % SLOTS);
        }
        __syncthreads();
        const unsigned long long t1 = clock64();
        const unsigned slot = dynamic_smem_address() + (resident ? 0 : (i % SLOTS) * SLOT_BYTES);
#ifdef MATVEC_TASK
        MATVEC_TASK(st, task, 1, slot, dynamic_smem_address() + SLOTS * SLOT_BYTES, bias_s, tile, partial_s, 0, 0, 0);
#else
        matvec_task(st, task, 1, slot, dynamic_smem_address() + SLOTS * SLOT_BYTES, bias_s, tile, partial_s, 0, 0, 0);
#endif
        __syncthreads();
        const unsigned long long t2 = clock64();
        unsigned long long t3 = t2;
#ifdef MLP_TASK
        mlp_project(st, task, 1, slot + SLOT_BYTES / 2, tile, mlp_sums(xs, k), i == 0 || atomics_every_task,
                    i == rounds - 1 || atomics_every_task);
        __syncthreads();
        t3 = clock64();
#endif
        if (i > 0) {  // the first task pays for the start
            compute += t3 - t1;
            project += t3 - t2;
            wait += t1 - t0;
            ++count;
        }
    }
    if (threadIdx.x == 0) {
        stats[STATS * blockIdx.x] = count;
        stats[STATS * blockIdx.x + 1] = compute;
        stats[STATS * blockIdx.x + 2] = wait;
        stats[STATS * blockIdx.x + 3] = project;
        if (blockIdx.x == 0) {
            clk[0] = clock64() - c_start;
            clk[1] = global_time() - ns_start;
        }
    }
}

// host-side conversions (the rendered source's to_float/from_float are device functions)
static float bf(storage_t v) { return static_cast<float>(v); }
static storage_t st_of(float v) { return storage_t(v); }

int main(int argc, char** argv) {
    const int k = argc > 1 ? atoi(argv[1]) : 1600;
    const int cols = argc > 2 ? atoi(argv[2]) : 25;
    const int atomics_every_task = argc > 3 ? atoi(argv[3]) : 0;  // MLP_TASK: the old way
    const long long bytes = 256ll << 20;
    const int n = (int)(bytes / (k * STORAGE_BYTES)) / cols * cols;
    const int tasks = n / cols;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::vector<storage_t> w((size_t)n * k), b(n), x(k);
    srand(1);
    for (auto& v : w) v = st_of((rand() % 2001 - 1000) / 1000.0f);
    for (auto& v : b) v = st_of((rand() % 2001 - 1000) / 1000.0f);
    for (auto& v : x) v = st_of((rand() % 2001 - 1000) / 1000.0f);
    storage_t *dw, *db, *dx, *dout;
    unsigned long long *dstats, *dclock;
    CHECK(cudaMalloc(&dw, w.size() * STORAGE_BYTES));
    CHECK(cudaMalloc(&db, n * STORAGE_BYTES));
    CHECK(cudaMalloc(&dx, k * STORAGE_BYTES));
    CHECK(cudaMalloc(&dout, n * STORAGE_BYTES));
    CHECK(cudaMalloc(&dstats, STATS * sms * sizeof(unsigned long long)));
    // the MLP task's transposed projection (the same random values as fc's rows: only the time
    // is measured) and its f32 residual row, ACC_SPREAD floats a group of 4
    storage_t* dw2 = nullptr;
    float* dacc = nullptr;
#ifdef MLP_TASK
    CHECK(cudaMalloc(&dw2, w.size() * STORAGE_BYTES));
    CHECK(cudaMalloc(&dacc, (size_t)k / 4 * ACC_SPREAD * sizeof(float)));
    CHECK(cudaMemset(dacc, 0, (size_t)k / 4 * ACC_SPREAD * sizeof(float)));
    const int task_bytes = 2 * cols * k * STORAGE_BYTES, sums_bytes = k * 4;
#else
    const int task_bytes = cols * k * STORAGE_BYTES, sums_bytes = 0;
#endif
    CHECK(cudaMalloc(&dclock, 2 * sizeof(unsigned long long)));
    CHECK(cudaMemcpy(dw, w.data(), w.size() * STORAGE_BYTES, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, b.data(), n * STORAGE_BYTES, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dx, x.data(), k * STORAGE_BYTES, cudaMemcpyHostToDevice));
    if (dw2) CHECK(cudaMemcpy(dw2, w.data(), w.size() * STORAGE_BYTES, cudaMemcpyHostToDevice));
    if (task_bytes > SLOT_BYTES) {
        fprintf(stderr, "a task of %d x %d does not fit a slot of %d bytes\n", cols, k, SLOT_BYTES);
        return 1;
    }
    const int smem = SLOTS * SLOT_BYTES + k * STORAGE_BYTES + ROW_PAD + sums_bytes;
    int smem_max = 0;
    cudaFuncAttributes kernel;
    CHECK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    CHECK(cudaFuncGetAttributes(&kernel, bench_matvec));
    if (smem + (int)kernel.sharedSizeBytes > smem_max) {
        fprintf(stderr, "the ring, a staged row of %d and the kernel's own %d bytes need more shared memory than the %d a block may have\n",
                k, (int)kernel.sharedSizeBytes, smem_max);
        return 1;
    }
    CHECK(cudaFuncSetAttribute(bench_matvec, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    for (int resident = 0; resident < 2; ++resident) {
        float best = 1e30f;
        std::vector<unsigned long long> stats(STATS * sms), clk(2);
        for (int rep = 0; rep < 5; ++rep) {
            CHECK(cudaMemset(dout, 0xff, n * STORAGE_BYTES));
            CHECK(cudaEventRecord(e0));
            bench_matvec<<<sms, THREADS, smem>>>(dw, db, dx, dout, n, k, cols, tasks, resident, dw2, dacc,
                                                 atomics_every_task, dstats, dclock);
            CHECK(cudaEventRecord(e1));
            CHECK(cudaEventSynchronize(e1));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (ms < best) {
                best = ms;
                CHECK(cudaMemcpy(stats.data(), dstats, stats.size() * 8, cudaMemcpyDeviceToHost));
                CHECK(cudaMemcpy(clk.data(), dclock, 16, cudaMemcpyDeviceToHost));
            }
        }
        double count = 0, compute = 0, wait = 0, project = 0;
        for (int i = 0; i < sms; ++i) {
            count += stats[STATS * i];
            compute += stats[STATS * i + 1];
            wait += stats[STATS * i + 2];
            project += stats[STATS * i + 3];
        }
        // check the outputs of the tasks that ran (stream: all; resident: each block's own)
        std::vector<storage_t> o(n);
        CHECK(cudaMemcpy(o.data(), dout, n * STORAGE_BYTES, cudaMemcpyDeviceToHost));
        double worst = 0;
        for (int t = 0; !dw2 && t < (resident ? sms : tasks); t += resident ? 1 : 97)
            for (int c = t * cols; c < (t + 1) * cols && c < n; ++c) {
                double ref = bf(b[c]);
                for (int i = 0; i < k; ++i) ref += (double)bf(w[(size_t)c * k + i]) * bf(x[i]);
                worst = fmax(worst, fabs(ref - bf(o[c])) / (1.0 + fabs(ref)));
            }
        const double mhz = 1000.0 * clk[0] / clk[1];
#ifdef MATVEC_PHASES
        // an instrumented task (MATVEC_TASK) left its phases' cycles, summed over every run of
        // the block's tasks (all 5 repetitions), in MATVEC_PHASES[block][4]
        {
            std::vector<unsigned long long> phases(4 * sms);
            CHECK(cudaMemcpyFromSymbol(phases.data(), MATVEC_PHASES, phases.size() * 8));
            double sum[4] = {0, 0, 0, 0}, runs = 0;
            for (int i = 0; i < sms; ++i) {
                for (int j = 0; j < 4; ++j) sum[j] += phases[4 * i + j];
                runs += 5.0 * (resident ? 64 : (tasks - i + sms - 1) / sms);
            }
            printf("  phases (cycles a task): inputs %.0f, sums %.0f, exchange %.0f, finish %.0f\n", sum[0] / runs,
                   sum[1] / runs, sum[2] / runs, sum[3] / runs);
            std::vector<unsigned long long> zero(4 * sms, 0);
            CHECK(cudaMemcpyToSymbol(MATVEC_PHASES, zero.data(), zero.size() * 8));
        }
#endif
        const long long streamed = dw2 ? 2 * bytes : bytes;
        char check[32];  // the fused MLP's outputs are checked by tests/gpu_megakernel.rs, not here
        if (dw2)
            snprintf(check, sizeof check, "outputs not checked");
        else
            snprintf(check, sizeof check, "max rel err %.1e", worst);
        printf("%-8s k=%d cols=%d (%d B a task): compute %.0f cycles (%.2f us at %.0f MHz), wait %.0f cycles, "
               "kernel %.3f ms%s, %s\n",
               resident ? "resident" : "stream", k, cols, task_bytes, compute / count,
               compute / count / mhz, mhz, wait / count, best,
               resident ? "" : (" = " + std::to_string((int)(streamed / best / 1e6)) + " GB/s").c_str(),
               check);
        if (dw2)
            printf("  of which the MLP projection (%s) %.0f cycles\n",
                   atomics_every_task ? "atomics every task" : "summed, atomics after the block's last task",
                   project / count);
    }
    return 0;
}
