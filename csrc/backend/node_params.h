// How a graph node's parameter slots (tensor.h: iparams/fparams of ROPE and FLASH_ATTN) map to
// the kernels' parameter structs: one place for every backend.
#pragma once
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "graph/tensor.h"

namespace stowlm {

inline cpu::RopeParams rope_params(const Tensor& n) {
    cpu::RopeParams p;
    p.n_rot = n.iparams[0];
    p.neox = n.iparams[1] != 0;
    p.n_ctx_orig = n.iparams[2];
    p.freq_base = n.fparams[0];
    p.freq_scale = n.fparams[1];
    p.ext_factor = n.fparams[2];
    p.attn_factor = n.fparams[3];
    p.beta_fast = n.fparams[4];
    p.beta_slow = n.fparams[5];
    return p;
}

// A MUL_MAT or FLASH_ATTN node of a pass that takes the batched kernels however few its tokens
// (GraphOptions::batched; MUL_MAT's iparams[0], FLASH_ATTN's iparams[3]).
inline bool batched_node(const Tensor& n) { return n.iparams[n.op == Op::FLASH_ATTN ? 3 : 0] != 0; }
inline void mark_batched(Tensor& n) { n.iparams[n.op == Op::FLASH_ATTN ? 3 : 0] = 1; }

// The fixed KV split of a FLASH_ATTN node: the graph's (several sequences), else a single
// sequence's, sized by its cache (iparams[4]); every backend takes the same, so a token's numbers
// follow neither its call's size nor the device.
inline int32_t split_cells_of(const Tensor& n) {
    if (n.iparams[1] > 0) return n.iparams[1];
    return n.iparams[4] > 0 ? cpu::single_sequence_split_cells(n.iparams[4]) : 0;
}

inline cpu::AttnParams attn_params(const Tensor& n) {
    cpu::AttnParams p;
    p.scale = n.fparams[0];
    p.softcap = n.fparams[1];
    p.window = n.iparams[0];
    p.causal = true;
    p.sinks = n.src[7] ? (const float*)n.src[7]->data : nullptr;
    p.q_seq = n.src[8] ? (const int32_t*)n.src[8]->data : nullptr;
    p.kv_seq = n.src[9] ? (const int32_t*)n.src[9]->data : nullptr;
    p.split_cells = split_cells_of(n);
    p.seq_cells = n.iparams[2];
    p.seq_end = n.src[10] ? (const int32_t*)n.src[10]->data : nullptr;
    p.batched = batched_node(n);
    return p;
}

inline cpu::TopKParams top_k_params(const Tensor& n) {
    cpu::TopKParams p;
    p.k = n.iparams[0];
    p.gating = (cpu::Gating)n.iparams[1];
    p.bias = n.src[1] ? (const float*)n.src[1]->data : nullptr;
    p.n_groups = n.iparams[2], p.n_group_used = n.iparams[3];
    return p;
}

// The K and V cache views of a FLASH_ATTN node as the kernels read them.
inline cpu::KvView kv_view(const Tensor& n) {
    const Tensor *q = n.src[0], *k = n.src[1], *v = n.src[2];
    cpu::KvView kv;
    kv.k = k->data, kv.v = v->data, kv.type = k->type;
    kv.hd_k = q->ne[0];
    kv.n_head_kv = k->ne[0] / kv.hd_k;
    kv.hd_v = v->ne[0] / kv.n_head_kv;
    kv.n_kv = k->ne[1];
    kv.k_cell_bytes = k->nb[1], kv.v_cell_bytes = v->nb[1];
    return kv;
}

}  // namespace stowlm
