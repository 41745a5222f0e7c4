/* GF(2^8) arithmetic (polynomial 0x11d, generator 2) and the small matrix algebra of the code. */
#include "gf256.h"

#include <stdlib.h>
#include <string.h>

static uint8_t gf_exp[512];
static uint8_t gf_log[256];

void gf_init(void)
{
    unsigned x = 1;
    for (int i = 0; i < 255; i++) {
        gf_exp[i] = (uint8_t)x;
        gf_log[x] = (uint8_t)i;
        x <<= 1;
        if (x & 0x100)
            x ^= 0x11d;
    }
    for (int i = 255; i < 512; i++)
        gf_exp[i] = gf_exp[i - 255];
}

uint8_t gf_mul(uint8_t a, uint8_t b)
{
    if (a == 0 || b == 0)
        return 0;
    return gf_exp[gf_log[a] + gf_log[b]];
}

uint8_t gf_inv(uint8_t a) { return gf_exp[255 - gf_log[a]]; }

uint8_t gf_pow2(int e) { return gf_exp[e % 255]; }

/* m == 2: RAID-6 rows P = 1,1,...,1 and Q = 1,2,4,...,2^(k-1) (MDS for k <= 255), so that
 * encoding can run as XOR plus a multiply-by-2 Horner chain.  Otherwise a Cauchy matrix
 * 1/(x_j + y_i) with x_j = k + j, y_i = i, scaled per column so that row 0 is all ones (an XOR
 * row) and per row so that column 0 is all ones (k == 1 becomes replication).  Scaling rows
 * and columns by non-zero factors keeps every square submatrix non-singular, so [I; G] stays MDS. */
void gf_generator(int k, int m, uint8_t *g)
{
    if (m == 2) {
        for (int i = 0; i < k; i++) {
            g[i] = 1;
            g[k + i] = gf_pow2(i);
        }
        return;
    }
    for (int j = 0; j < m; j++)
        for (int i = 0; i < k; i++)
            g[j * k + i] = gf_inv((uint8_t)((k + j) ^ i));
    for (int i = 0; i < k; i++) {
        uint8_t s = gf_inv(g[i]);
        for (int j = 0; j < m; j++)
            g[j * k + i] = gf_mul(g[j * k + i], s);
    }
    for (int j = 0; j < m; j++) {
        uint8_t s = gf_inv(g[j * k]);
        for (int i = 0; i < k; i++)
            g[j * k + i] = gf_mul(g[j * k + i], s);
    }
}

static void swap_rows(uint8_t *a, uint8_t *b, int n)
{
    for (int c = 0; c < n; c++) {
        uint8_t t = a[c];
        a[c] = b[c];
        b[c] = t;
    }
}

int gf_invert(uint8_t *a, int n)
{
    uint8_t *inv = calloc((size_t)n * n, 1);
    if (!inv)
        return -1;
    for (int i = 0; i < n; i++)
        inv[i * n + i] = 1;
    for (int c = 0; c < n; c++) {
        int p = c;
        while (p < n && a[p * n + c] == 0)
            p++;
        if (p == n) {
            free(inv);
            return -1;
        }
        if (p != c) {
            swap_rows(a + p * n, a + c * n, n);
            swap_rows(inv + p * n, inv + c * n, n);
        }
        uint8_t s = gf_inv(a[c * n + c]);
        for (int x = 0; x < n; x++) {
            a[c * n + x] = gf_mul(a[c * n + x], s);
            inv[c * n + x] = gf_mul(inv[c * n + x], s);
        }
        for (int r = 0; r < n; r++) {
            uint8_t f = a[r * n + c];
            if (r == c || f == 0)
                continue;
            for (int x = 0; x < n; x++) {
                a[r * n + x] ^= gf_mul(f, a[c * n + x]);
                inv[r * n + x] ^= gf_mul(f, inv[c * n + x]);
            }
        }
    }
    memcpy(a, inv, (size_t)n * n);
    free(inv);
    return 0;
}

void gf_tables(const uint8_t *coef, size_t count, uint8_t *tables)
{
    for (size_t c = 0; c < count; c++, tables += 32)
        for (int n = 0; n < 16; n++) {
            tables[n] = gf_mul(coef[c], (uint8_t)n);
            tables[16 + n] = gf_mul(coef[c], (uint8_t)(n << 4));
        }
}
