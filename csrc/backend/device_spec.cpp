#include "backend/device_spec.h"

#include <cctype>
#include <cmath>
#include <cstdlib>

#include "error.h"

namespace stowlm {

namespace {

std::string trim(const std::string& s) {
    size_t b = 0, e = s.size();
    while (b < e && std::isspace((unsigned char)s[b])) b++;
    while (e > b && std::isspace((unsigned char)s[e - 1])) e--;
    return s.substr(b, e - b);
}

std::string lower(std::string s) {
    for (char& c : s) c = (char)std::tolower((unsigned char)c);
    return s;
}

bool all_digits(const std::string& s) {
    if (s.empty()) return false;
    for (char c : s)
        if (!std::isdigit((unsigned char)c)) return false;
    return true;
}

int to_int(const std::string& digits) { return (int)std::strtol(digits.c_str(), nullptr, 10); }

// Items of `text` split at commas outside [...], each trimmed; empty ones kept (callers decide).
std::vector<std::string> split_outside_brackets(const std::string& text) {
    std::vector<std::string> parts;
    std::string cur;
    int depth = 0;
    for (char c : text) {
        if (c == '[') depth++;
        if (c == ']') depth--;
        if (c == ',' && depth == 0) {
            parts.push_back(trim(cur));
            cur.clear();
        } else {
            cur += c;
        }
    }
    parts.push_back(trim(cur));
    return parts;
}

}  // namespace

size_t parse_bytes(const std::string& text) {
    const std::string t = trim(text);
    size_t i = 0;
    while (i < t.size() && (std::isdigit((unsigned char)t[i]) || t[i] == '.')) i++;
    const std::string number = t.substr(0, i), unit = lower(trim(t.substr(i)));
    static const std::pair<const char*, double> units[] = {
        {"", 1}, {"b", 1}, {"k", 1024.0}, {"kb", 1e3}, {"kib", 1024.0}, {"m", 1048576.0}, {"mb", 1e6},
        {"mib", 1048576.0}, {"g", 1073741824.0}, {"gb", 1e9}, {"gib", 1073741824.0},
        {"t", 1099511627776.0}, {"tb", 1e12}, {"tib", 1099511627776.0}};
    char* end = nullptr;
    const double v = number.empty() || number.find('.') != number.rfind('.') ? -1 : std::strtod(number.c_str(), &end);
    if (v >= 0 && end && *end == '\0' && std::isfinite(v))
        for (const auto& u : units)
            if (unit == u.first) return (size_t)(v * u.second);
    throw InvalidInput("cannot parse memory size '" + text + "' (use e.g. 512MiB, 2GiB)");
}

std::string format_bytes(size_t n) {
    static const std::pair<const char*, size_t> units[] = {{"GiB", 1ull << 30}, {"MiB", 1ull << 20}, {"KiB", 1ull << 10}};
    for (const auto& u : units)
        if (n >= u.second && n % u.second == 0) return std::to_string(n / u.second) + u.first;
    return std::to_string(n);
}

DeviceSpec parse_device_spec(const std::string& text) {
    const std::string t = trim(text), quoted = "device '" + text + "'";
    const auto bad = [&] {
        return InvalidInput("cannot parse device '" + text + "' (expected e.g. cpu, cpu:1, cpu:0[threads=2,mem=1GiB])");
    };
    // kind[:index][@rank][[options]]
    std::string head = t, options;
    bool has_options = false;
    if (const size_t br = t.find('['); br != std::string::npos) {
        if (t.back() != ']' || t.find('[', br + 1) != std::string::npos) throw bad();
        head = trim(t.substr(0, br)), options = t.substr(br + 1, t.size() - br - 2), has_options = true;
    }
    std::string kind = head, index, rank;
    if (const size_t at = kind.find('@'); at != std::string::npos) rank = kind.substr(at + 1), kind = kind.substr(0, at);
    if (const size_t colon = kind.find(':'); colon != std::string::npos) index = kind.substr(colon + 1), kind = kind.substr(0, colon);
    bool letters = !kind.empty();
    for (char c : kind) letters = letters && std::isalpha((unsigned char)c);
    if (!letters || (head.find(':') != std::string::npos && !all_digits(index)) ||
        (head.find('@') != std::string::npos && !all_digits(rank)))
        throw bad();
    DeviceSpec d;
    d.kind = lower(kind);
    if (d.kind != "cpu" && d.kind != "cuda") throw InvalidInput(quoted + ": unknown kind '" + d.kind + "' (known: cpu, cuda)");
    d.index = index.empty() ? 0 : to_int(index);
    d.rank = rank.empty() ? -1 : to_int(rank);
    if (has_options && !trim(options).empty()) {
        for (const std::string& item : split_outside_brackets(options)) {
            const size_t eq = item.find('=');
            if (eq == std::string::npos) throw InvalidInput(quoted + ": option '" + item + "' is not key=value");
            const std::string key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
            if (key == "threads") {
                if (!all_digits(value) || to_int(value) < 1)
                    throw InvalidInput(quoted + ": threads must be a positive integer, got '" + value + "'");
                d.threads = to_int(value);
            } else if (key == "mem") {
                d.mem_bytes = parse_bytes(value);
                if (d.mem_bytes == 0) throw InvalidInput(quoted + ": mem must be positive");
            } else if (key == "speed") {
                char* end = nullptr;
                const double v = value.empty() ? -1 : std::strtod(value.c_str(), &end);
                if (!(end && *end == '\0' && v > 0 && std::isfinite(v)))
                    throw InvalidInput(quoted + ": speed must be a positive number, got '" + value + "'");
                d.speed = v;
            } else if (key == "rank") {
                if (!all_digits(value) || (d.rank >= 0 && to_int(value) != d.rank))
                    throw InvalidInput(quoted + ": rank must be a non-negative integer (and agree with @RANK)");
                d.rank = to_int(value);
            } else {
                throw InvalidInput(quoted + ": unknown option '" + key + "' (known: threads, mem, speed, rank)");
            }
        }
    }
    if (d.kind == "cuda" && d.threads)
        throw InvalidInput(quoted + ": threads applies to CPU devices only (a CUDA device takes mem)");
    return d;
}

std::vector<DeviceSpec> parse_device_list(const std::string& text) {
    std::vector<DeviceSpec> out;
    for (const std::string& item : split_outside_brackets(text))
        if (!item.empty()) out.push_back(parse_device_spec(item));
    if (out.empty()) throw InvalidInput("devices: empty device list");
    for (size_t i = 0; i < out.size(); i++)
        for (size_t j = 0; j < i; j++)
            if (out[i].name() == out[j].name()) throw InvalidInput("devices: " + out[i].name() + " appears more than once");
    return out;
}

}  // namespace stowlm
