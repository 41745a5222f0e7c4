/* GF(2^8) arithmetic (polynomial 0x11d, generator 2) and the small matrix algebra of the code. */
#ifndef MEMSNAP_GF256_H
#define MEMSNAP_GF256_H

#include <stddef.h>
#include <stdint.h>

void gf_init(void);
uint8_t gf_mul(uint8_t a, uint8_t b);
uint8_t gf_inv(uint8_t a);              /* a != 0 */
uint8_t gf_pow2(int e);                 /* 2^e */

/* Generator rows (m x k, row-major) of the systematic code [I; G]: see gf256.c. */
void gf_generator(int k, int m, uint8_t *g);
/* In-place Gauss-Jordan inverse of an n x n matrix; returns 0, or -1 if it is singular. */
int gf_invert(uint8_t *a, int n);
/* 32 bytes per coefficient: products with the low nibbles 0..15, then the high nibbles. */
void gf_tables(const uint8_t *coef, size_t count, uint8_t *tables);

#endif
