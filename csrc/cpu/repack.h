// Weights repacked at load into groups of 16 interleaved rows, for the CPU product of a few
// tokens (a speculative draft's verification, a small batch). In GGUF's layout a 32-block of one
// row fills part of a vector, so every (row, token) pair pays its own int -> float conversion and
// scale; here one vector holds 4 consecutive elements of 16 rows, one vpdpbusd takes them with
// a broadcast of 4 activations, and a block's conversion and scale serve all 16 rows (3x fewer
// instructions per weight byte and token, the route of ik_llama.cpp's _R4/_R8 types).
//
// A group of 16 rows keeps the bytes the 16 rows had (the same size, the same place in the
// tensor), so byte counts, row ranges at multiples of 16 and memory accounting are unchanged.
// Batches of kBatchMinTokens or more keep the GEMM / AMX tiles, whose panels unpack these rows
// back to GGUF bytes (unrepack_row16). Below that, every output is the same float sequence
// whatever the batch and the instruction set:
//   acc = 0; for each block b: acc = fma(float(idot_b), d_w[b] * d_a[b], acc)
//   (Q4_1/Q5_1 then acc = fma(m_w[b], s_a[b], acc), s_a = d_a * sum(a))
// with idot_b the exact integer dot of the block (offsets removed in integers), so a token's
// result does not depend on its batch, and the scalar path gives the AVX2 and AVX-512 paths' bits. The K
// formats sum their sub-block scales in integers too, per super-block:
//   Q2_K/Q4_K/Q5_K: acc = fma(float(sum_s sc_s idot_s), d d_a, acc); acc = fma(-float(sum_s m_s bsum_s), dmin d_a, acc)
//   Q3_K:           acc = fma(float(sum_s sc_s idot_s - 4 sum_s sc_s bsum_s), d d_a, acc)
//   Q6_K:           acc = fma(float(sum_s sc_s idot_s - 32 sum_s sc_s bsum_s), d d_a, acc)
//   IQ4_XS:         acc = fma(float(sum_s (ls_s - 32) idot_s), d d_a, acc)  (idot_s of the IQ4 levels)
#pragma once
#include <cstddef>
#include <cstdint>

#include "cpu/matmul_impl.h"
#include "quant/rows16.h"
#include "quant/types.h"

namespace stowlm::cpu {

// The offset the 32-element formats' unsigned values carry (removed as -OFF * sum(activations)).
int repack_offset(QType t);
// Whether a matrix of this type and shape can be repacked: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
// MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS.
// The rows after its last whole group of 16 keep the GGUF layout, and their products the same
// float sequence (matmul_r16_tail), so any slice of rows (a tensor-parallel shard) gives the
// bits of the whole matrix's rows.
bool repack_supported(QType t, int64_t rows, int64_t cols);
// dst (rows * row_bytes(t, cols) bytes, not overlapping src) = src repacked. Rows [r0, r1) only
// when given (multiples of 16), so that callers can split the work.
void repack_rows16(QType t, int64_t rows, int64_t cols, const void* src, void* dst, int64_t r0 = 0, int64_t r1 = -1);
// Row r of a repacked matrix in GGUF's layout again (row_bytes(t, cols) bytes at dst).
void unrepack_row16(QType t, int64_t rows, int64_t cols, const void* packed, int64_t r, void* dst);

// Bytes at the start of a 32-element format's matmul scratch for the sums of its quantized
// activation blocks (MatmulArgs::asum; reserved whether or not the weights are repacked, so
// that a projection of the scratch need not know).
inline size_t act_sum_bytes(int64_t cols, int64_t n_tok) { return ((size_t)(cols / QK) * 4 * (size_t)n_tok + 63) & ~(size_t)63; }
// sums[t * cols / 32 + b] = the sum of token t's quantized block b (A.act quantized).
void act_block_sums(const MatmulArgs& A, int32_t* sums);
// Groups [g0, g1) x every token (A.rows16 and A.asum set): the scalar reference, and the
// AVX-512 VNNI and AVX2 kernels (matmul_r16_avx512.cpp, matmul_r16_avx2.cpp), bit for bit the same.
void matmul_r16_scalar(const MatmulArgs& A, int64_t g0, int64_t g1);
void matmul_r16_avx512(const MatmulArgs& A, int64_t g0, int64_t g1);
void matmul_r16_avx2(const MatmulArgs& A, int64_t g0, int64_t g1);
// The rows after the last whole group x every token, from their GGUF blocks, with the groups'
// integers and FMAs (scalar: at most 15 rows).
void matmul_r16_tail(const MatmulArgs& A);

}  // namespace stowlm::cpu
