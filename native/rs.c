/* Kernel selection by CPU features and the threaded driver that runs one job. */
#include "rs.h"

#include <pthread.h>
#include <string.h>

#include "gf256.h"

const char *const rs_isa_names[RS_ISA_COUNT] = {"scalar", "ssse3", "avx2"};

static const rs_kernel kernels[RS_ISA_COUNT] = {
    rs_kernel_ref,
#if defined(MEMSNAP_X86)
    rs_kernel_ssse3,
    rs_kernel_avx2,
#else
    0,
    0,
#endif
};

static int available[RS_ISA_COUNT];
static int current = RS_ISA_SCALAR;

void rs_init(void)
{
    gf_init();
    available[RS_ISA_SCALAR] = 1;
#if defined(MEMSNAP_X86)
    __builtin_cpu_init();
    available[RS_ISA_SSSE3] = __builtin_cpu_supports("ssse3");
    available[RS_ISA_AVX2] = __builtin_cpu_supports("avx2");
#endif
    for (int i = 0; i < RS_ISA_COUNT; i++)
        if (available[i])
            current = i;
}

int rs_isa_available(int isa) { return isa >= 0 && isa < RS_ISA_COUNT && available[isa]; }

int rs_isa(void) { return current; }

int rs_set_isa(int isa)
{
    if (!rs_isa_available(isa))
        return -1;
    current = isa;
    return 0;
}

void rs_job_classify(rs_job *job)
{
    int k = job->cols, ones = 1, pow2 = job->rows == 2;
    for (int i = 0; i < k; i++) {
        ones &= job->coef[i] == 1;
        if (pow2)
            pow2 &= job->coef[k + i] == gf_pow2(i);
    }
    job->xor_row0 = ones;
    job->pq = ones && pow2 && k >= 2;
}

typedef struct {
    const rs_job *job;
    rs_kernel kernel;
    size_t off, len;
} rs_slice;

static void *run_slice(void *arg)
{
    rs_slice *s = arg;
    s->kernel(s->job, s->off, s->len);
    return NULL;
}

#define MIN_BYTES_PER_THREAD (1024 * 1024) /* bytes read + written; below this a thread costs more than it saves */
#define MAX_THREADS 256

int rs_run(const rs_job *job, size_t len, int threads)
{
    rs_kernel kernel = kernels[current];
    size_t most = len * (size_t)(job->rows + job->cols) / MIN_BYTES_PER_THREAD;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if ((size_t)threads > most)
        threads = most ? (int)most : 1;
    if (threads <= 1) {
        kernel(job, 0, len);
        return 0;
    }
    rs_slice slices[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    size_t step = (len / threads + 63) & ~(size_t)63, off = 0;
    int started = 0;
    for (int t = 0; t < threads; t++) {
        size_t n = t == threads - 1 || off + step > len ? len - off : step;
        slices[t] = (rs_slice){job, kernel, off, n};
        off += n;
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, run_slice, &slices[t]) != 0)
            break;
        started = t;
    }
    for (int t = started + 1; t < threads; t++) /* threads that could not start run here */
        run_slice(&slices[t]);
    run_slice(&slices[0]);
    for (int t = 1; t <= started; t++)
        pthread_join(tids[t], NULL);
    return 0;
}
