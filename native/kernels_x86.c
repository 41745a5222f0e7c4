/* SSSE3 and AVX2 split-nibble (pshufb) kernels, compiled per function with target attributes. */
#include "kernels.h"

#if defined(MEMSNAP_X86)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2"), always_inline)) static inline
#define SSSE3 __attribute__((target("ssse3"), always_inline)) static inline
#define MAXG 4 /* outputs computed together while an input block sits in registers */
#ifndef NT_MIN_LEN
#define NT_MIN_LEN (512 * 1024) /* shorter outputs are likely read again soon: keep them cached */
#endif

/* ---- AVX2 --------------------------------------------------------------------------------- */

/* Rows j0..j0+M-1 over [p, end) in blocks of 32*U bytes; row j0 is XOR when X. Returns where it
 * stopped (the tail, shorter than one block). */
AVX2 void avx2_store(uint8_t *dst, __m256i v, const int NT)
{
    if (NT)
        _mm256_stream_si256((__m256i *)dst, v);
    else
        _mm256_storeu_si256((__m256i *)dst, v);
}

AVX2 size_t avx2_dot(const rs_job *jb, int j0, const int M, const int X, const int U, const int NT,
                     size_t p, size_t end)
{
    const int k = jb->cols;
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (; p + 32 * U <= end; p += 32 * U) {
        __m256i acc[MAXG][2];
        for (int j = 0; j < M; j++)
            for (int u = 0; u < U; u++)
                acc[j][u] = _mm256_setzero_si256();
        for (int i = 0; i < k; i++) {
            const uint8_t *s = jb->in[i] + p;
            __m256i lo[2], hi[2];
            for (int u = 0; u < U; u++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(s + 32 * u));
                if (X)
                    acc[0][u] = _mm256_xor_si256(acc[0][u], x);
                lo[u] = _mm256_and_si256(x, mask);
                hi[u] = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
            }
            for (int j = X; j < M; j++) {
                const uint8_t *t = jb->tables + ((size_t)(j0 + j) * k + i) * 32;
                __m256i tl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
                __m256i th = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 16)));
                for (int u = 0; u < U; u++)
                    acc[j][u] = _mm256_xor_si256(acc[j][u],
                        _mm256_xor_si256(_mm256_shuffle_epi8(tl, lo[u]), _mm256_shuffle_epi8(th, hi[u])));
            }
        }
        for (int j = 0; j < M; j++)
            for (int u = 0; u < U; u++)
                avx2_store(jb->out[j0 + j] + p + 32 * u, acc[j][u], NT);
    }
    return p;
}

/* RAID-6 P+Q: P = xor of the inputs, Q by Horner's rule with a multiply by 2 per input. */
AVX2 size_t avx2_pq(const rs_job *jb, const int NT, size_t p, size_t end)
{
    const int k = jb->cols;
    const __m256i poly = _mm256_set1_epi8(0x1d), zero = _mm256_setzero_si256();
    for (; p + 64 <= end; p += 64) {
        const uint8_t *s = jb->in[k - 1] + p;
        __m256i p0 = _mm256_loadu_si256((const __m256i *)s);
        __m256i p1 = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i q0 = p0, q1 = p1;
        for (int i = k - 2; i >= 0; i--) {
            s = jb->in[i] + p;
            __m256i x0 = _mm256_loadu_si256((const __m256i *)s);
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(s + 32));
            __m256i c0 = _mm256_and_si256(_mm256_cmpgt_epi8(zero, q0), poly);
            __m256i c1 = _mm256_and_si256(_mm256_cmpgt_epi8(zero, q1), poly);
            q0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_add_epi8(q0, q0), c0), x0);
            q1 = _mm256_xor_si256(_mm256_xor_si256(_mm256_add_epi8(q1, q1), c1), x1);
            p0 = _mm256_xor_si256(p0, x0);
            p1 = _mm256_xor_si256(p1, x1);
        }
        avx2_store(jb->out[0] + p, p0, NT);
        avx2_store(jb->out[0] + p + 32, p1, NT);
        avx2_store(jb->out[1] + p, q0, NT);
        avx2_store(jb->out[1] + p + 32, q1, NT);
    }
    return p;
}

/* RAID-6 double data loss (see kernels.h): syndromes by XOR and a Horner chain, then two
 * table multiplies per block. */
AVX2 size_t avx2_pqd(const rs_job *jb, const int NT, size_t p, size_t end)
{
    const int k = jb->cols;
    const __m256i poly = _mm256_set1_epi8(0x1d), zero = _mm256_setzero_si256();
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const uint8_t *t = jb->pqd_tables;
    const __m256i c1l = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
    const __m256i c1h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 16)));
    const __m256i c2l = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 32)));
    const __m256i c2h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(t + 48)));
    for (; p + 64 <= end; p += 64) {
        __m256i sp[2], q[2] = {zero, zero};
        for (int u = 0; u < 2; u++)
            sp[u] = _mm256_loadu_si256((const __m256i *)(jb->in[k] + p + 32 * u));
        for (int i = k - 1; i >= 0; i--) {
            const uint8_t *s = jb->in[i];
            for (int u = 0; u < 2; u++) {
                __m256i c = _mm256_and_si256(_mm256_cmpgt_epi8(zero, q[u]), poly);
                q[u] = _mm256_xor_si256(_mm256_add_epi8(q[u], q[u]), c);
            }
            if (!s)
                continue;
            for (int u = 0; u < 2; u++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(s + p + 32 * u));
                q[u] = _mm256_xor_si256(q[u], x);
                sp[u] = _mm256_xor_si256(sp[u], x);
            }
        }
        for (int u = 0; u < 2; u++) {
            __m256i sq = _mm256_xor_si256(q[u], _mm256_loadu_si256((const __m256i *)(jb->in[k + 1] + p + 32 * u)));
            __m256i ql = _mm256_and_si256(sq, mask), qh = _mm256_and_si256(_mm256_srli_epi16(sq, 4), mask);
            __m256i pl = _mm256_and_si256(sp[u], mask), ph = _mm256_and_si256(_mm256_srli_epi16(sp[u], 4), mask);
            __m256i da = _mm256_xor_si256(
                _mm256_xor_si256(_mm256_shuffle_epi8(c1l, ql), _mm256_shuffle_epi8(c1h, qh)),
                _mm256_xor_si256(_mm256_shuffle_epi8(c2l, pl), _mm256_shuffle_epi8(c2h, ph)));
            avx2_store(jb->out[0] + p + 32 * u, da, NT);
            avx2_store(jb->out[1] + p + 32 * u, _mm256_xor_si256(da, sp[u]), NT);
        }
    }
    return p;
}

#define AVX2_GROUPS(NT)                                                                          \
    switch (n * 2 + x) {                                                                         \
    case 2: return avx2_dot(jb, j0, 1, 0, 2, NT, p, end);                                        \
    case 3: return avx2_dot(jb, j0, 1, 1, 2, NT, p, end);                                        \
    case 4: return avx2_dot(jb, j0, 2, 0, 2, NT, p, end);                                        \
    case 5: return avx2_dot(jb, j0, 2, 1, 2, NT, p, end);                                        \
    case 6: return avx2_dot(jb, j0, 3, 0, 1, NT, p, end);                                        \
    case 7: return avx2_dot(jb, j0, 3, 1, 2, NT, p, end);                                        \
    case 8: return avx2_dot(jb, j0, 4, 0, 1, NT, p, end);                                        \
    default: return avx2_dot(jb, j0, 4, 1, 1, NT, p, end);                                       \
    }

__attribute__((target("avx2"))) static size_t avx2_group(const rs_job *jb, int j0, int n, int x,
                                                         int nt, size_t p, size_t end)
{
    if (nt)
        AVX2_GROUPS(1)
    AVX2_GROUPS(0)
}

/* Streaming (non-temporal) stores skip the read-for-ownership of outputs that will not fit in
 * cache anyway; they need every output 32-byte aligned at the same offset. Returns the number of
 * head bytes to do with ordinary code first, or -1 when streaming does not apply. */
static long stream_head(const rs_job *jb, size_t off, size_t len)
{
    if (len < NT_MIN_LEN || jb->rows > 2) /* more outputs: 32-byte blocks, partial lines hurt */
        return -1;
    uintptr_t mis = (uintptr_t)(jb->out[0] + off) & 31;
    for (int j = 1; j < jb->rows; j++)
        if (((uintptr_t)(jb->out[j] + off) & 31) != mis)
            return -1;
    return mis ? (long)(32 - mis) : 0;
}

__attribute__((target("avx2"))) void rs_kernel_avx2(const rs_job *jb, size_t off, size_t len)
{
    size_t end = off + len;
    long head = stream_head(jb, off, len);
    int nt = head >= 0;
    if (nt && head > 0) {
        rs_kernel_avx2(jb, off, (size_t)head);
        off += (size_t)head;
    }
    if (jb->pqd) {
        rs_tail_pqd(jb, nt ? avx2_pqd(jb, 1, off, end) : avx2_pqd(jb, 0, off, end), end);
    } else if (jb->pq) {
        rs_tail_pq(jb, nt ? avx2_pq(jb, 1, off, end) : avx2_pq(jb, 0, off, end), end);
    } else {
        for (int j0 = 0; j0 < jb->rows; j0 += MAXG) {
            int n = jb->rows - j0 < MAXG ? jb->rows - j0 : MAXG;
            int x = j0 == 0 && jb->xor_row0;
            rs_tail(jb, j0, n, avx2_group(jb, j0, n, x, nt, off, end), end);
        }
    }
    if (nt)
        _mm_sfence();
}

/* ---- SSSE3 -------------------------------------------------------------------------------- */

SSSE3 size_t ssse3_dot(const rs_job *jb, int j0, const int M, const int X, const int U, size_t p,
                       size_t end)
{
    const int k = jb->cols;
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (; p + 16 * U <= end; p += 16 * U) {
        __m128i acc[MAXG][2];
        for (int j = 0; j < M; j++)
            for (int u = 0; u < U; u++)
                acc[j][u] = _mm_setzero_si128();
        for (int i = 0; i < k; i++) {
            const uint8_t *s = jb->in[i] + p;
            __m128i lo[2], hi[2];
            for (int u = 0; u < U; u++) {
                __m128i x = _mm_loadu_si128((const __m128i *)(s + 16 * u));
                if (X)
                    acc[0][u] = _mm_xor_si128(acc[0][u], x);
                lo[u] = _mm_and_si128(x, mask);
                hi[u] = _mm_and_si128(_mm_srli_epi16(x, 4), mask);
            }
            for (int j = X; j < M; j++) {
                const uint8_t *t = jb->tables + ((size_t)(j0 + j) * k + i) * 32;
                __m128i tl = _mm_loadu_si128((const __m128i *)t);
                __m128i th = _mm_loadu_si128((const __m128i *)(t + 16));
                for (int u = 0; u < U; u++)
                    acc[j][u] = _mm_xor_si128(acc[j][u],
                        _mm_xor_si128(_mm_shuffle_epi8(tl, lo[u]), _mm_shuffle_epi8(th, hi[u])));
            }
        }
        for (int j = 0; j < M; j++)
            for (int u = 0; u < U; u++)
                _mm_storeu_si128((__m128i *)(jb->out[j0 + j] + p + 16 * u), acc[j][u]);
    }
    return p;
}

SSSE3 size_t ssse3_pq(const rs_job *jb, size_t p, size_t end)
{
    const int k = jb->cols;
    const __m128i poly = _mm_set1_epi8(0x1d), zero = _mm_setzero_si128();
    for (; p + 32 <= end; p += 32) {
        const uint8_t *s = jb->in[k - 1] + p;
        __m128i p0 = _mm_loadu_si128((const __m128i *)s);
        __m128i p1 = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i q0 = p0, q1 = p1;
        for (int i = k - 2; i >= 0; i--) {
            s = jb->in[i] + p;
            __m128i x0 = _mm_loadu_si128((const __m128i *)s);
            __m128i x1 = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c0 = _mm_and_si128(_mm_cmpgt_epi8(zero, q0), poly);
            __m128i c1 = _mm_and_si128(_mm_cmpgt_epi8(zero, q1), poly);
            q0 = _mm_xor_si128(_mm_xor_si128(_mm_add_epi8(q0, q0), c0), x0);
            q1 = _mm_xor_si128(_mm_xor_si128(_mm_add_epi8(q1, q1), c1), x1);
            p0 = _mm_xor_si128(p0, x0);
            p1 = _mm_xor_si128(p1, x1);
        }
        _mm_storeu_si128((__m128i *)(jb->out[0] + p), p0);
        _mm_storeu_si128((__m128i *)(jb->out[0] + p + 16), p1);
        _mm_storeu_si128((__m128i *)(jb->out[1] + p), q0);
        _mm_storeu_si128((__m128i *)(jb->out[1] + p + 16), q1);
    }
    return p;
}

__attribute__((target("ssse3"))) static size_t ssse3_group(const rs_job *jb, int j0, int n, int x,
                                                           size_t p, size_t end)
{
    switch (n * 2 + x) {
    case 2: return ssse3_dot(jb, j0, 1, 0, 2, p, end);
    case 3: return ssse3_dot(jb, j0, 1, 1, 2, p, end);
    case 4: return ssse3_dot(jb, j0, 2, 0, 2, p, end);
    case 5: return ssse3_dot(jb, j0, 2, 1, 2, p, end);
    case 6: return ssse3_dot(jb, j0, 3, 0, 1, p, end);
    case 7: return ssse3_dot(jb, j0, 3, 1, 2, p, end);
    case 8: return ssse3_dot(jb, j0, 4, 0, 1, p, end);
    default: return ssse3_dot(jb, j0, 4, 1, 1, p, end);
    }
}

__attribute__((target("ssse3"))) void rs_kernel_ssse3(const rs_job *jb, size_t off, size_t len)
{
    size_t end = off + len;
    if (jb->pqd) { /* rare on machines without AVX2: the plain code is enough */
        rs_tail_pqd(jb, off, end);
        return;
    }
    if (jb->pq) {
        rs_tail_pq(jb, ssse3_pq(jb, off, end), end);
        return;
    }
    for (int j0 = 0; j0 < jb->rows; j0 += MAXG) {
        int n = jb->rows - j0 < MAXG ? jb->rows - j0 : MAXG;
        int x = j0 == 0 && jb->xor_row0;
        rs_tail(jb, j0, n, ssse3_group(jb, j0, n, x, off, end), end);
    }
}

#endif /* MEMSNAP_X86 */
