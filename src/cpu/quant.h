/*
 * quant.h: number formats of the reference, bit-exact: bf16 and e4m3 conversions and the block
 * quantizers of include/mok.h ("Quantizers"), plus the quantize-dequantize helpers the reference
 * layer uses at its documented rounding points. Plain C, host only.
 */
#ifndef MOK_CPU_QUANT_H
#define MOK_CPU_QUANT_H

#include <stdint.h>

#include "mok.h"

/* bf16: round to nearest even from fp32; NaN stays NaN (quiet, sign kept); infinities kept. */
uint16_t mok_bf16_from_float(float f);
float mok_bf16_to_float(uint16_t b);
/* The bf16 value nearest to v (RNE, via fp32 first: v is rounded to fp32, then to bf16). */
double mok_round_bf16(double v);

/* e4m3 ("fn"), as documented in mok.h: RNE, saturating to +-448, NaN -> 0x7F, -0 -> 0x80. */
uint8_t mok_e4m3_from_float(float f);
float mok_e4m3_to_float(uint8_t q);

/* The scale of one block from its amax (amax = max |v|; pass NaN if the block holds a NaN or an
 * infinity). Returns the fp32 scale; *e8m0 receives the E8M0 byte for POW2/E8M0 (0xFF for NaN). */
float mok_block_scale(float amax, mok_quant_scale_t kind, uint8_t *e8m0);

/* Quantize-dequantize a row-major [rows, cols] matrix of doubles in place (each value is first
 * rounded to fp32), with the blocks and scale kind given: v <- e4m3(fp32(v) / s) * s. This is
 * exactly mok_quantize_host followed by mok_dequantize_host. */
void mok_qdq_matrix(double *m, int64_t rows, int64_t cols, int block_rows, int block_cols,
                    mok_quant_scale_t kind);

#endif /* MOK_CPU_QUANT_H */
