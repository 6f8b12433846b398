// Dumps llama.cpp's logits for prompts of token ids, in a chosen mode, so that stowlm's figures
// can be set beside llama.cpp's own run-to-run variation (bench/moe_sensitivity.py --peer).
// Links against a llama.cpp build (see bench/README.md); not part of the stowlm build.
//
//   llama_logits MODEL.gguf PROMPTS.txt REPACK(0|1) BATCH(0|1) OUT.bin
//
// PROMPTS.txt: one prompt per line, token ids separated by spaces. REPACK 1 lets llama.cpp
// repack weights for its CPU kernels (its default); BATCH 1 evaluates each prompt in one batch
// with logits at every position (how the fixtures were made), 0 one token at a time.
// OUT.bin: float32 [positions, n_vocab] for every prompt, concatenated.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPTS.txt REPACK(0|1) BATCH(0|1) OUT.bin\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
    llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = atoi(argv[3]) != 0;
    const bool batch = atoi(argv[4]) != 0;
    llama_model* model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE* out = fopen(argv[5], "wb");
    std::ifstream in(argv[2]);
    if (!out || !in) { fprintf(stderr, "cannot open %s or %s\n", argv[2], argv[5]); return 1; }
    std::string line;
    while (std::getline(in, line)) {
        std::vector<llama_token> ids;
        std::istringstream ss(line);
        for (int t; ss >> t;) ids.push_back(t);
        const int n = (int)ids.size();
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = 512; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_threads = 2; cp.n_threads_batch = 2;
        llama_context* ctx = llama_init_from_model(model, cp);
        if (batch) {
            llama_batch b = llama_batch_init(n, 0, 1);
            for (int i = 0; i < n; i++) {
                b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1;
            }
            b.n_tokens = n;
            if (llama_decode(ctx, b) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
            for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out);
            llama_batch_free(b);
        } else {
            for (int i = 0; i < n; i++) {
                if (llama_decode(ctx, llama_batch_get_one(&ids[i], 1)) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
                fwrite(llama_get_logits_ith(ctx, -1), sizeof(float), n_vocab, out);
            }
        }
        llama_free(ctx);
    }
    fclose(out);
    llama_model_free(model);
    return 0;
}
