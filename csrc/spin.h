// Waiting for another thread that is microseconds away: pause between looks, and yield the core
// now and then, so a machine with more threads than cores runs the thread that ends the wait.
#pragma once
#include <chrono>
#include <cstdint>
#include <thread>

namespace stowlm {

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
}

constexpr uint32_t kSpinYieldEvery = 256;  // looks between yields

// Until done() holds.
template <class F>
void spin_until(F done) {
    for (uint32_t i = 1; !done(); i++) {
        if (i % kSpinYieldEvery == 0) std::this_thread::yield();
        else cpu_pause();
    }
}

// Until done() holds or `limit` has passed (checked at each yield); whether it held.
template <class F>
bool spin_until(F done, std::chrono::microseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    for (uint32_t i = 1;; i++) {
        if (done()) return true;
        if (i % kSpinYieldEvery == 0) {
            if (std::chrono::steady_clock::now() > until) return false;
            std::this_thread::yield();
        } else {
            cpu_pause();
        }
    }
}

}  // namespace stowlm
