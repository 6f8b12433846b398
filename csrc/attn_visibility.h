// Which KV cells a query sees, by the positions the cells hold: shared by the attention
// kernels on every device so masks agree. Same rules as cpu::flash_attn (cpu/ops.h).
#pragma once
#include <cstdint>

#include "common.h"

namespace stowlm {

// kv_pos == -1 marks an empty cell. causal: only cells at or before the query; window > 0:
// only the last `window` positions (q_pos - kv_pos < window).
HOST_DEVICE bool kv_visible(int32_t q_pos, int32_t kv_pos, bool causal, int32_t window) {
    if (kv_pos < 0) return false;
    if (causal && kv_pos > q_pos) return false;
    if (window > 0 && (int64_t)q_pos - (int64_t)kv_pos >= (int64_t)window) return false;
    return true;
}

}  // namespace stowlm
