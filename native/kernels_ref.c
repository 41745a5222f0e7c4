/* The plain C reference kernel (obviously correct, byte at a time) and the SIMD kernels' tails. */
#include "gf256.h"
#include "kernels.h"

void rs_kernel_ref(const rs_job *job, size_t off, size_t len)
{
    if (job->pqd) {
        rs_tail_pqd(job, off, off + len);
        return;
    }
    for (int j = 0; j < job->rows; j++) {
        const uint8_t *row = job->coef + (size_t)j * job->cols;
        uint8_t *out = job->out[j];
        for (size_t b = off; b < off + len; b++) {
            uint8_t acc = 0;
            for (int i = 0; i < job->cols; i++)
                acc ^= gf_mul(row[i], job->in[i][b]);
            out[b] = acc;
        }
    }
}

void rs_tail(const rs_job *job, int j0, int n, size_t p, size_t end)
{
    for (int j = j0; j < j0 + n; j++) {
        const uint8_t *t = job->tables + (size_t)j * job->cols * 32;
        for (size_t b = p; b < end; b++) {
            uint8_t acc = 0;
            for (int i = 0; i < job->cols; i++) {
                uint8_t x = job->in[i][b];
                acc ^= t[i * 32 + (x & 15)] ^ t[i * 32 + 16 + (x >> 4)];
            }
            job->out[j][b] = acc;
        }
    }
}

static uint8_t mul2(uint8_t x) { return (uint8_t)((x << 1) ^ ((x & 0x80) ? 0x1d : 0)); }

void rs_tail_pq(const rs_job *job, size_t p, size_t end)
{
    int k = job->cols;
    for (size_t b = p; b < end; b++) {
        uint8_t pp = job->in[k - 1][b], q = pp;
        for (int i = k - 2; i >= 0; i--) {
            uint8_t x = job->in[i][b];
            pp ^= x;
            q = mul2(q) ^ x;
        }
        job->out[0][b] = pp;
        job->out[1][b] = q;
    }
}

static uint8_t table_mul(const uint8_t *t, uint8_t x) { return t[x & 15] ^ t[16 + (x >> 4)]; }

void rs_tail_pqd(const rs_job *job, size_t p, size_t end)
{
    int k = job->cols;
    for (size_t b = p; b < end; b++) {
        uint8_t sp = job->in[k][b], q = 0;
        for (int i = k - 1; i >= 0; i--) {
            q = mul2(q);
            if (job->in[i]) {
                q ^= job->in[i][b];
                sp ^= job->in[i][b];
            }
        }
        uint8_t sq = q ^ job->in[k + 1][b];
        uint8_t da = table_mul(job->pqd_tables, sq) ^ table_mul(job->pqd_tables + 32, sp);
        job->out[0][b] = da;
        job->out[1][b] = da ^ sp;
    }
}
