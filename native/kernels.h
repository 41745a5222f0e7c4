/* The kernel interface: one job multiplies k input shards by a rows x k matrix into rows outputs. */
#ifndef MEMSNAP_KERNELS_H
#define MEMSNAP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* x86-64 builds the SSSE3/AVX2 kernels too; elsewhere (or with -DMEMSNAP_NO_SIMD) only the
 * reference kernel exists. */
#if defined(__x86_64__) && !defined(MEMSNAP_NO_SIMD)
#define MEMSNAP_X86 1
#endif

typedef struct {
    int rows, cols;
    const uint8_t *coef;   /* rows x cols, row-major */
    const uint8_t *tables; /* 32 bytes per coefficient, see gf_tables */
    int xor_row0;          /* row 0 is all ones: plain XOR */
    int pq;                /* rows == 2, row 0 all ones, row 1 = 2^i: RAID-6 P+Q */
    /* RAID-6 double data loss: when pqd, in[0..cols-1] are the data shards (NULL at the lost
     * a and b), in[cols] = P, in[cols+1] = Q, and out[0], out[1] receive data shards a and b:
     * with syndromes Sp = P + sum d_i, Sq = Q + sum 2^i d_i over the survivors,
     * d_a = c1 Sq + c2 Sp and d_b = Sp + d_a.  pqd_tables holds the nibble tables of c1, c2. */
    int pqd;
    uint8_t pqd_tables[64];
    const uint8_t *const *in;
    uint8_t *const *out;
} rs_job;

/* Computes out[j][off:off+len] = sum_i coef[j][i] * in[i][off:off+len] for every row j. */
typedef void (*rs_kernel)(const rs_job *job, size_t off, size_t len);

void rs_kernel_ref(const rs_job *job, size_t off, size_t len);
/* Scalar nibble-table code for the bytes [p, end) of rows j0..j0+n-1 (the SIMD kernels' tails). */
void rs_tail(const rs_job *job, int j0, int n, size_t p, size_t end);
void rs_tail_pq(const rs_job *job, size_t p, size_t end);
void rs_tail_pqd(const rs_job *job, size_t p, size_t end);

#if defined(MEMSNAP_X86)
void rs_kernel_ssse3(const rs_job *job, size_t off, size_t len);
void rs_kernel_avx2(const rs_job *job, size_t off, size_t len);
#endif

#endif
