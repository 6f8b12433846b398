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
// result does not depend on its batch, and the scalar path gives the AVX-512 path's bits. The K
// formats sum their sub-block scales in integers too, per super-block:
//   Q2_K/Q4_K/Q5_K: acc = fma(float(sum_s sc_s idot_s), d d_a, acc); acc = fma(-float(sum_s m_s bsum_s), dmin d_a, acc)
//   Q3_K:           acc = fma(float(sum_s sc_s idot_s - 4 sum_s sc_s bsum_s), d d_a, acc)
//   Q6_K:           acc = fma(float(sum_s sc_s idot_s - 32 sum_s sc_s bsum_s), d d_a, acc)
#pragma once
#include <cstddef>
#include <cstdint>

#include "cpu/matmul_impl.h"
#include "quant/types.h"

namespace stowlm::cpu {

constexpr int kRepackRows = 16;

// Block b of a group of 16 rows. qs: vector k holds, for row r, bytes 4r..4r+3 = elements
// 4k..4k+3 of that row's block b as unsigned values (Q8_0: q + 128; Q4_0/Q5_0: each byte has
// element 4k+i in its low nibble and 16+4k+i in its high one, k < 4). d: the rows' fp16 scales.
// Q5_0's fifth bits: qh[k] bit 4r+i belongs to element 4k+i of row r (k < 8). IQ4_NL keeps Q4_0's
// bytes (block_q4_0x16), its nibbles indexing the IQ4 levels (+ 128 in the products); MXFP4 the
// same with the doubled E2M1 levels, its rows' E8M0 exponents (a byte each) in place of d.
struct block_q8_0x16 { uint16_t d[16]; uint8_t qs[8][64]; };
struct block_q4_0x16 { uint16_t d[16]; uint8_t qs[4][64]; };
struct block_mxfp4x16 { uint8_t e[16]; uint8_t qs[4][64]; };
struct block_q5_0x16 { uint16_t d[16]; uint8_t qs[4][64]; uint64_t qh[8]; };
// Q4_1/Q5_1: the same with the rows' fp16 mins after d (w = d u + m; no offset).
struct block_q4_1x16 { uint16_t d[16]; uint16_t m[16]; uint8_t qs[4][64]; };
struct block_q5_1x16 { uint16_t d[16]; uint16_t m[16]; uint8_t qs[4][64]; uint64_t qh[8]; };
// The K formats keep each row's bytes, moved: Q4_K/Q5_K qs[j][c] holds for row r bytes
// 32j + 4c .. +3 of its qs (low nibbles elements 64j + 4c + i, high ones 32 further), scales[k][r]
// byte k of its 12 packed 6-bit scales and mins; Q5_K's fifth bits as qh[G] bit 4r + i for
// element 4G + i. Q6_K: ql[n][c] bytes 64n + 4c .. +3 of row r's ql (low nibbles elements
// 128n + 4c + i, high ones 64 further), qh[n][c] bytes 32n + 4c .. +3 of its qh (bits 2k, 2k+1:
// element 128n + 4c + i + 32k), scales[s][r] its 16-element scale s.
// Q2_K: qs[n][c] bytes 32n + 4c .. +3 of row r's qs (bits 2j, 2j+1: element 128n + 32j + 4c + i),
// scales[s][r] its byte s (scale and min of sub-block s). Q3_K: qs as Q2_K's, hmask[c] bytes
// 4c .. +3 of its hmask (bit 4n + j: the high bit of element 128n + 32j + 4c + i), scales[k][r]
// byte k of its 12 packed 6-bit scales; its values u = q + 4 (0..7).
struct block_q2_Kx16 { uint16_t d[16]; uint16_t dmin[16]; uint8_t scales[16][16]; uint8_t qs[2][8][64]; };
struct block_q3_Kx16 { uint16_t d[16]; uint8_t scales[12][16]; uint8_t hmask[8][64]; uint8_t qs[2][8][64]; };
struct block_q4_Kx16 { uint16_t d[16]; uint16_t dmin[16]; uint8_t scales[12][16]; uint8_t qs[4][8][64]; };
struct block_q5_Kx16 { uint16_t d[16]; uint16_t dmin[16]; uint8_t scales[12][16]; uint64_t qh[64]; uint8_t qs[4][8][64]; };
struct block_q6_Kx16 { uint8_t ql[2][16][64]; uint8_t qh[2][8][64]; int8_t scales[16][16]; uint16_t d[16]; };
static_assert(sizeof(block_q8_0x16) == 16 * 34, "16 rows of Q8_0 blocks");
static_assert(sizeof(block_q4_1x16) == 16 * 20, "16 rows of Q4_1 blocks");
static_assert(sizeof(block_q5_1x16) == 16 * 24, "16 rows of Q5_1 blocks");
static_assert(sizeof(block_q2_Kx16) == 16 * 84, "16 rows of Q2_K blocks");
static_assert(sizeof(block_q3_Kx16) == 16 * 110, "16 rows of Q3_K blocks");
static_assert(sizeof(block_q4_Kx16) == 16 * 144, "16 rows of Q4_K blocks");
static_assert(sizeof(block_q5_Kx16) == 16 * 176, "16 rows of Q5_K blocks");
static_assert(sizeof(block_q6_Kx16) == 16 * 210, "16 rows of Q6_K blocks");
static_assert(sizeof(block_q4_0x16) == 16 * 18, "16 rows of Q4_0 blocks");
static_assert(sizeof(block_q5_0x16) == 16 * 22, "16 rows of Q5_0 blocks");
static_assert(sizeof(block_mxfp4x16) == 16 * 17, "16 rows of MXFP4 blocks");

// The offset the 32-element formats' unsigned values carry (removed as -OFF * sum(activations)).
int repack_offset(QType t);
// Whether a matrix of this type and shape can be repacked: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
// MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
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
// AVX-512 VNNI kernels (matmul_r16_avx512.cpp), bit for bit the same.
void matmul_r16_scalar(const MatmulArgs& A, int64_t g0, int64_t g1);
void matmul_r16_avx512(const MatmulArgs& A, int64_t g0, int64_t g1);
// The rows after the last whole group x every token, from their GGUF blocks, with the groups'
// integers and FMAs (scalar: at most 15 rows).
void matmul_r16_tail(const MatmulArgs& A);

}  // namespace stowlm::cpu
