// How a graph node's parameter slots (tensor.h: iparams/fparams of ROPE and FLASH_ATTN) map to
// the kernels' parameter structs: one place for every backend.
#pragma once
#include "cpu/ops.h"
#include "graph/tensor.h"

namespace stowlm {

inline cpu::RopeParams rope_params(const Tensor& n) {
    cpu::RopeParams p;
    p.n_rot = n.iparams[0];
    p.neox = n.iparams[1] != 0;
    p.freq_base = n.fparams[0];
    p.freq_scale = n.fparams[1];
    return p;
}

inline cpu::AttnParams attn_params(const Tensor& n) {
    cpu::AttnParams p;
    p.scale = n.fparams[0];
    p.softcap = n.fparams[1];
    p.window = n.iparams[0];
    p.causal = true;
    return p;
}

}  // namespace stowlm
