// What both emulated-CUDA harnesses (cuda_engine_emulated.cpp, cuda_tp_emulated.cpp) do with a
// loaded model and its context: check the plan, take the prompt's logits at every position, then
// n_decode greedy steps (tokens from `forced` when it has them, so every layout decodes the same
// sequence), and check that every device allocated exactly what the planner projected. A failed
// check prints FAIL and counts in `failures`.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include "engine/context.h"

namespace emulated {

inline std::vector<float> prompt_then_greedy(stowlm::Model& m, stowlm::Context& c, const std::vector<int32_t>& prompt,
                                             int n_decode, std::vector<int32_t>* forced, int& failures) {
    const std::string why = c.check_plan_sound();
    if (!why.empty()) printf("FAIL plan: %s\n", why.c_str()), failures++;
    std::vector<float> all = c.eval(prompt, {}, true);
    const int64_t nv = m.hp().n_vocab;
    std::vector<float> last(all.end() - nv, all.end());
    for (int i = 0; i < n_decode; i++) {
        if ((int)forced->size() <= i) {
            int64_t best = 0;
            for (int64_t j = 0; j < nv; j++)
                if (last[j] > last[best]) best = j;
            forced->push_back((int32_t)best);
        }
        last = c.eval({(*forced)[i]}, {}, false);
        all.insert(all.end(), last.begin(), last.end());
    }
    const auto rep = c.memory_report();
    for (size_t i = 0; i < rep.size(); i++)
        if (m.backends()[i]->memory_used() != rep[i].total) {
            printf("FAIL accounting on %s: allocated %zu, planned %zu\n", rep[i].name.c_str(),
                   m.backends()[i]->memory_used(), rep[i].total);
            failures++;
        }
    return all;
}

}  // namespace emulated
