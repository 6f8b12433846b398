#include "gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

namespace stowlm {

namespace {

constexpr uint32_t kDefaultAlignment = 32;
constexpr uint32_t kMaxAlignment = 1u << 30;
// GGML_MAX_NAME is 64 (63 characters and a NUL); other writers go a little further, so we
// accept longer names but not ones no real model would have.
constexpr uint64_t kMaxTensorName = 256;
constexpr uint64_t kMaxKeyLength = 65535;  // the GGUF spec's limit for keys
constexpr int kMaxDims = 4;                // GGML_MAX_DIMS
// Smallest encodings, used to bound counts by the bytes left: a count that cannot fit in the
// file is rejected before anything is allocated for it.
constexpr uint64_t kMinKVBytes = 8 + 1 + 4 + 1;           // key length, 1-char key, type, u8 value
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;  // name len, name, n_dims, ne, type, offset

[[noreturn]] void fail(const std::string& file, const std::string& field, const std::string& problem) {
    throw InvalidInput(file + ": " + field + ": " + problem);
}

size_t scalar_size(GGUFType t) {
    switch (t) {
        case GGUFType::UINT8: case GGUFType::INT8: case GGUFType::BOOL: return 1;
        case GGUFType::UINT16: case GGUFType::INT16: return 2;
        case GGUFType::UINT32: case GGUFType::INT32: case GGUFType::FLOAT32: return 4;
        case GGUFType::UINT64: case GGUFType::INT64: case GGUFType::FLOAT64: return 8;
        default: return 0;  // STRING, ARRAY: variable size
    }
}

bool known_type(uint32_t t) { return t <= (uint32_t)GGUFType::FLOAT64; }

bool is_integer(GGUFType t) {
    switch (t) {
        case GGUFType::UINT8: case GGUFType::INT8: case GGUFType::UINT16: case GGUFType::INT16:
        case GGUFType::UINT32: case GGUFType::INT32: case GGUFType::UINT64: case GGUFType::INT64:
            return true;
        default: return false;
    }
}
bool is_float(GGUFType t) { return t == GGUFType::FLOAT32 || t == GGUFType::FLOAT64; }

std::string hex(uint64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "0x%llx", (unsigned long long)v);
    return buf;
}

// Bounds-checked little-endian reader over one mapping. Every read names the field it is for,
// so a truncated or corrupt file says where it went wrong.
struct Cursor {
    const uint8_t* base;
    size_t size;
    size_t pos;
    const std::string& file;

    size_t left() const { return size - pos; }
    void need(uint64_t n, const std::string& field) const {
        if (n > left())
            fail(file, field, "truncated: needs " + std::to_string(n) + " bytes at offset " +
                                  std::to_string(pos) + " but the file has " + std::to_string(size));
    }
    template <typename T>
    T get(const std::string& field) {
        need(sizeof(T), field);
        T v;
        memcpy(&v, base + pos, sizeof(T));  // unaligned-safe; x86-64 and GGUF are little endian
        pos += sizeof(T);
        return v;
    }
    std::string str(const std::string& field, uint64_t max_len) {
        uint64_t n = get<uint64_t>(field + " length");
        if (n > left())
            fail(file, field, "string length " + std::to_string(n) + " at offset " + std::to_string(pos - 8) +
                                  " extends past end of file (size " + std::to_string(size) + ")");
        if (n > max_len)
            fail(file, field, "string length " + std::to_string(n) + " exceeds the limit " + std::to_string(max_len));
        std::string s((const char*)base + pos, (size_t)n);
        pos += (size_t)n;
        return s;
    }
};

// Reads one value of type `t` (not ARRAY) into v; `field` names it in errors.
void read_scalar(Cursor& c, GGUFType t, GGUFValue& v, const std::string& field) {
    v.type = t;
    switch (t) {
        case GGUFType::UINT8: v.i = c.get<uint8_t>(field); break;
        case GGUFType::INT8: v.i = c.get<int8_t>(field); break;
        case GGUFType::UINT16: v.i = c.get<uint16_t>(field); break;
        case GGUFType::INT16: v.i = c.get<int16_t>(field); break;
        case GGUFType::UINT32: v.i = c.get<uint32_t>(field); break;
        case GGUFType::INT32: v.i = c.get<int32_t>(field); break;
        case GGUFType::UINT64: v.u = c.get<uint64_t>(field); v.i = (int64_t)v.u; break;
        case GGUFType::INT64: v.i = c.get<int64_t>(field); break;
        case GGUFType::FLOAT32: v.f = c.get<float>(field); break;
        case GGUFType::FLOAT64: v.f = c.get<double>(field); break;
        case GGUFType::BOOL: {
            uint8_t b = c.get<uint8_t>(field);
            if (b > 1) fail(c.file, field, "bool value " + std::to_string(b) + " is neither 0 nor 1");
            v.i = b;
            break;
        }
        case GGUFType::STRING: v.s = c.str(field, std::numeric_limits<uint64_t>::max()); break;
        default: fail(c.file, field, "unexpected value type");
    }
}

void read_value(Cursor& c, uint32_t type_id, GGUFValue& v, const std::string& field) {
    if (!known_type(type_id)) fail(c.file, field, "unknown value type " + std::to_string(type_id));
    GGUFType t = (GGUFType)type_id;
    if (t != GGUFType::ARRAY) {
        read_scalar(c, t, v, field);
        return;
    }
    v.type = GGUFType::ARRAY;
    uint32_t et = c.get<uint32_t>(field + " array element type");
    if (!known_type(et)) fail(c.file, field, "unknown array element type " + std::to_string(et));
    // Real models never nest arrays and llama.cpp rejects them; so do we, which also bounds depth.
    if ((GGUFType)et == GGUFType::ARRAY) fail(c.file, field, "nested arrays are not supported");
    v.elem_type = (GGUFType)et;
    v.count = c.get<uint64_t>(field + " array count");
    if (v.elem_type == GGUFType::STRING) {
        if (v.count > c.left() / 8)
            fail(c.file, field, "array of " + std::to_string(v.count) +
                                    " strings cannot fit in the rest of the file (" + std::to_string(c.left()) +
                                    " bytes)");
        v.strings.reserve((size_t)std::min<uint64_t>(v.count, 1u << 20));
        const std::string ef = field + " element";
        for (uint64_t k = 0; k < v.count; k++) v.strings.push_back(c.str(ef, std::numeric_limits<uint64_t>::max()));
        return;
    }
    size_t es = scalar_size(v.elem_type);
    if (v.count > c.left() / es)
        fail(c.file, field, "array of " + std::to_string(v.count) + " " + gguf_type_name(v.elem_type) +
                                " extends past end of file (size " + std::to_string(c.size) + ")");
    v.data = c.base + c.pos;
    if (v.elem_type == GGUFType::BOOL) {
        for (uint64_t k = 0; k < v.count; k++)
            if (v.data[k] > 1) fail(c.file, field, "bool element " + std::to_string(k) + " is neither 0 nor 1");
    }
    c.pos += (size_t)(v.count * es);
}

// NAME-00001-of-00005.gguf, as llama.cpp's gguf-split names the parts.
struct SplitName {
    std::string prefix;
    int no = 0;
    int count = 0;
};

bool parse_split_name(const std::string& path, SplitName* out) {
    const std::string tail = "-00000-of-00000.gguf";
    if (path.size() < tail.size()) return false;
    size_t p = path.size() - tail.size();
    const char* s = path.c_str() + p;
    auto digits = [](const char* d, int* v) {
        *v = 0;
        for (int k = 0; k < 5; k++) {
            if (d[k] < '0' || d[k] > '9') return false;
            *v = *v * 10 + (d[k] - '0');
        }
        return true;
    };
    if (s[0] != '-' || memcmp(s + 6, "-of-", 4) != 0 || memcmp(s + 15, ".gguf", 5) != 0) return false;
    if (!digits(s + 1, &out->no) || !digits(s + 10, &out->count)) return false;
    if (out->count < 1 || out->no < 1 || out->no > out->count) return false;
    out->prefix = path.substr(0, p);
    return true;
}

std::string part_path(const std::string& prefix, int no, int count) {
    char buf[32];
    snprintf(buf, sizeof buf, "-%05d-of-%05d.gguf", no, count);
    return prefix + buf;
}


// Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF): tensor names are
// identifiers that callers look up by str, so a name that is not text is corruption.
bool valid_utf8(const std::string& s) {
    const auto* p = (const unsigned char*)s.data();
    size_t n = s.size(), i = 0;
    while (i < n) {
        unsigned c = p[i];
        size_t len;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
        else return false;
        if (i + len > n) return false;
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += len;
    }
    return true;
}

// A name as messages show it: quoted, control bytes and any bytes of invalid UTF-8 escaped,
// and cut short, so a corrupt name still makes a readable (and decodable) message.
std::string quote(const std::string& s) {
    const bool utf8 = valid_utf8(s);
    std::string out = "'";
    size_t cut = std::min<size_t>(s.size(), 120);
    while (utf8 && cut > 0 && cut < s.size() && ((unsigned char)s[cut] & 0xC0) == 0x80) cut--;  // whole characters
    for (size_t k = 0; k < cut; k++) {
        unsigned char c = (unsigned char)s[k];
        if (c < 0x20 || c == 0x7f || (c >= 0x80 && !utf8)) {
            char buf[8];
            snprintf(buf, sizeof buf, "\\x%02x", c);
            out += buf;
        } else {
            out += (char)c;
        }
    }
    if (cut < s.size()) out += "...";
    return out + "'";
}

}  // namespace

const char* gguf_type_name(GGUFType t) {
    static const char* const names[] = {"UINT8", "INT8",  "UINT16", "INT16", "UINT32", "INT32", "FLOAT32",
                                        "BOOL",  "STRING", "ARRAY", "UINT64", "INT64", "FLOAT64"};
    uint32_t id = (uint32_t)t;
    return id < sizeof(names) / sizeof(names[0]) ? names[id] : "?";
}

GGUFFile::~GGUFFile() {
    for (Map& m : maps_) {
        if (m.base) munmap((void*)m.base, m.size);
        if (m.fd >= 0) ::close(m.fd);
    }
}

size_t GGUFFile::total_file_bytes() const {
    size_t n = 0;
    for (const Map& m : maps_) n += m.size;
    return n;
}

bool GGUFFile::maps(const void* p, size_t bytes) const {
    const uint8_t* c = (const uint8_t*)p;
    for (const Map& m : maps_)
        if (c >= m.base && c <= m.base + m.size && bytes <= (size_t)(m.base + m.size - c)) return true;
    return false;
}

void GGUFFile::map_file(const std::string& path, const std::string& why) {
    Map m;
    m.path = path;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT) throw GGUFFileNotFound(path + ": no such file" + why);
        throw InvalidInput(path + ": cannot open: " + strerror(e) + why);
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        throw InvalidInput(path + ": not a regular file");
    }
    m.size = (size_t)st.st_size;
    if (m.size < 4) {
        ::close(fd);
        throw InvalidInput(path + ": not a GGUF file (magic missing: the file has only " + std::to_string(m.size) +
                           " bytes)");
    }
    // Read-only shared mapping: pages come from the page cache, are never copied, and several
    // processes loading one model share them.
    void* p = mmap(nullptr, m.size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) throw InvalidInput(path + ": mmap failed: " + strerror(errno));
    m.base = (const uint8_t*)p;
    maps_.push_back(m);
}

void GGUFFile::parse_split(size_t index, bool first) {
    const Map& m = maps_[index];
    const std::string& file = m.path;
    Cursor c{m.base, m.size, 0, file};

    if (memcmp(m.base, "GGUF", 4) != 0) {
        std::string shown;
        for (int k = 0; k < 4; k++) {
            char ch = (char)m.base[k];
            shown += (ch >= 32 && ch < 127) ? std::string(1, ch) : "\\x" + hex(m.base[k]).substr(2);
        }
        uint32_t magic;
        memcpy(&magic, m.base, 4);
        throw InvalidInput(file + ": not a GGUF file (magic " + hex(magic) + " '" + shown + "', expected 'GGUF')");
    }
    c.pos = 4;
    uint32_t version = c.get<uint32_t>("header version");
    if (version != 2 && version != 3) {
        uint32_t swapped = __builtin_bswap32(version);
        if (swapped >= 1 && swapped <= 3)
            fail(file, "header version", "big-endian GGUF (version reads " + hex(version) +
                                             ") is not supported; convert it to little endian");
        if (version == 1)
            fail(file, "header version", "GGUF version 1 is not supported (it uses 32-bit counts; "
                                         "versions 2 and 3 are read): re-convert the model");
        fail(file, "header version", "unsupported GGUF version " + std::to_string(version) + " (2 and 3 are read)");
    }
    if (first) version_ = version;
    uint64_t n_tensors = c.get<uint64_t>("header tensor count");
    uint64_t n_kv = c.get<uint64_t>("header metadata count");
    // Both tables must fit at their smallest encoding before anything is sized from the counts.
    if (n_kv > c.left() / kMinKVBytes)
        fail(file, "header metadata count", std::to_string(n_kv) + " entries cannot fit in the file (size " +
                                                std::to_string(m.size) + ")");
    if (n_tensors > c.left() / kMinTensorInfoBytes ||
        n_kv * kMinKVBytes + n_tensors * kMinTensorInfoBytes > c.left())
        fail(file, "header tensor count", std::to_string(n_tensors) + " tensors cannot fit in the file (size " +
                                              std::to_string(m.size) + ")");

    std::map<std::string, GGUFValue> local;
    std::map<std::string, GGUFValue>& kv = first ? kv_ : local;
    for (uint64_t k = 0; k < n_kv; k++) {
        std::string key = c.str("metadata entry #" + std::to_string(k) + " key", kMaxKeyLength);
        if (key.empty()) fail(file, "metadata entry #" + std::to_string(k) + " key", "empty key");
        const std::string field = "key " + quote(key);
        if (kv.count(key)) fail(file, field, "duplicate key");
        uint32_t type_id = c.get<uint32_t>(field + " type");
        GGUFValue v;
        read_value(c, type_id, v, field);
        kv.emplace(std::move(key), std::move(v));
    }

    uint32_t alignment = kDefaultAlignment;
    auto al = kv.find("general.alignment");
    if (al != kv.end()) {
        const GGUFValue& v = al->second;
        if (!is_integer(v.type)) fail(file, "key 'general.alignment'", std::string("has type ") + gguf_type_name(v.type) + ", expected an integer");
        if (v.i <= 0 || v.i > (int64_t)kMaxAlignment || (v.i & (v.i - 1)) != 0 || (v.type == GGUFType::UINT64 && v.u > kMaxAlignment))
            fail(file, "key 'general.alignment'", "value " + std::to_string(v.i) + " is not a power of two up to " +
                                                      std::to_string(kMaxAlignment));
        alignment = (uint32_t)v.i;
    }
    if (alignments_.size() <= index) alignments_.resize(index + 1);
    alignments_[index] = alignment;

    struct Info {
        GGUFTensor t;
        uint64_t rel;  // offset inside the data section
    };
    std::vector<Info> infos;
    infos.reserve((size_t)std::min<uint64_t>(n_tensors, 1u << 16));
    for (uint64_t k = 0; k < n_tensors; k++) {
        Info in;
        GGUFTensor& t = in.t;
        t.name = c.str("tensor info #" + std::to_string(k) + " name", kMaxTensorName);
        if (t.name.empty()) fail(file, "tensor info #" + std::to_string(k) + " name", "empty tensor name");
        if (!valid_utf8(t.name)) fail(file, "tensor info #" + std::to_string(k) + " name", "not valid UTF-8");
        const std::string field = "tensor " + quote(t.name);
        if (tensor_index_.count(t.name)) fail(file, field, "duplicate tensor name");
        tensor_index_[t.name] = (size_t)-1;  // placeholder until the tensor lands in tensors_
        uint32_t n_dims = c.get<uint32_t>(field + " n_dims");
        if (n_dims < 1 || n_dims > (uint32_t)kMaxDims)
            fail(file, field, "n_dims " + std::to_string(n_dims) + " is outside 1.." + std::to_string(kMaxDims));
        t.n_dims = (int)n_dims;
        uint64_t n_el = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            uint64_t ne = c.get<uint64_t>(field + " ne[" + std::to_string(d) + "]");
            if (ne < 1 || ne > (uint64_t)std::numeric_limits<int64_t>::max())
                fail(file, field, "ne[" + std::to_string(d) + "] = " + std::to_string((int64_t)ne) + " is not a positive size");
            if (__builtin_mul_overflow(n_el, ne, &n_el) || n_el > (uint64_t)std::numeric_limits<int64_t>::max())
                fail(file, field, "element count overflows 64 bits");
            t.ne[d] = (int64_t)ne;
        }
        uint32_t type_id = c.get<uint32_t>(field + " type");
        const QTypeInfo* qi;
        try {
            qi = &qtype_checked(type_id);
        } catch (const InvalidInput& e) {
            fail(file, field, e.what());
        }
        t.type = (QType)type_id;
        if (t.ne[0] % qi->block_elems != 0)
            fail(file, field, "row length ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the " + qi->name +
                                  " block size " + std::to_string(qi->block_elems));
        uint64_t nbytes = (uint64_t)(t.ne[0] / qi->block_elems) * (uint64_t)qi->block_bytes;  // ne[0] < 2^63, bytes < 2^9
        uint64_t rows = (uint64_t)t.ne[1] * (uint64_t)t.ne[2] * (uint64_t)t.ne[3];  // product bounded by n_el
        if (__builtin_mul_overflow(nbytes, rows, &nbytes)) fail(file, field, "byte size overflows 64 bits");
        t.nbytes = (size_t)nbytes;
        in.rel = c.get<uint64_t>(field + " offset");
        if (in.rel % alignment != 0)
            fail(file, field, "data offset " + std::to_string(in.rel) + " is not a multiple of general.alignment " +
                                  std::to_string(alignment));
        t.split = (int)index;
        infos.push_back(std::move(in));
    }

    // The data section starts at the next multiple of the alignment after the tensor table.
    const uint64_t data_start = ((uint64_t)c.pos + alignment - 1) / alignment * alignment;
    if (n_tensors > 0 && data_start > m.size)
        fail(file, "data section", "starts at " + std::to_string(data_start) + ", past end of file (size " +
                                       std::to_string(m.size) + ")");
    for (Info& in : infos) {
        GGUFTensor& t = in.t;
        const uint64_t room = m.size - data_start;
        if (in.rel > room || t.nbytes > room - in.rel) {
            uint64_t begin = data_start + in.rel, end = begin + t.nbytes;
            bool wrap = in.rel > std::numeric_limits<uint64_t>::max() - data_start || end < begin;
            fail(file, "tensor " + quote(t.name),
                 "data [" + std::to_string(begin) + ", " + (wrap ? std::string("overflow") : std::to_string(end)) +
                     ") extends past end of file (size " + std::to_string(m.size) + ")");
        }
        t.file_offset = (size_t)(data_start + in.rel);
        t.data = m.base + t.file_offset;
    }
    // Tensors must not share bytes: a writer bug or corruption would otherwise alias weights.
    std::vector<const Info*> order;
    order.reserve(infos.size());
    for (const Info& in : infos) order.push_back(&in);
    std::sort(order.begin(), order.end(), [](const Info* a, const Info* b) { return a->rel < b->rel; });
    for (size_t k = 1; k < order.size(); k++) {
        const Info* a = order[k - 1];
        const Info* b = order[k];
        if (a->rel + a->t.nbytes > b->rel)
            fail(file, "tensor " + quote(b->t.name),
                 "data [" + std::to_string(b->t.file_offset) + ", " + std::to_string(b->t.file_offset + b->t.nbytes) +
                     ") overlaps tensor " + quote(a->t.name) + " [" + std::to_string(a->t.file_offset) + ", " +
                     std::to_string(a->t.file_offset + a->t.nbytes) + ")");
    }
    for (Info& in : infos) {
        tensor_index_[in.t.name] = tensors_.size();
        tensors_.push_back(std::move(in.t));
    }

    if (!first) {
        // Later parts must say which part they are, so a part from another model is caught.
        auto no = local.find("split.no");
        if (no == local.end() || !is_integer(no->second.type))
            fail(file, "key 'split.no'", "missing or not an integer in a split part");
        if (no->second.i != (int64_t)index)
            fail(file, "key 'split.no'", "is " + std::to_string(no->second.i) + ", expected " + std::to_string(index));
        auto cnt = local.find("split.count");
        if (cnt != local.end() && (!is_integer(cnt->second.type) || cnt->second.i != (int64_t)n_splits_expected_))
            fail(file, "key 'split.count'", "does not match the first part's " + std::to_string(n_splits_expected_));
    }
}

namespace {
std::atomic<int64_t> g_parses{0};
}

int64_t GGUFFile::parse_count() { return g_parses.load(); }

std::shared_ptr<const GGUFFile> GGUFFile::open_shared(const std::string& path) {
    static std::mutex mu;
    static std::map<std::string, std::weak_ptr<const GGUFFile>> live;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return std::shared_ptr<const GGUFFile>(open(path));  // open() says why
    const std::string key = path + "\n" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" +
                            std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
                            std::to_string(st.st_mtim.tv_nsec);
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = live.begin(); it != live.end();) it = it->second.expired() ? live.erase(it) : std::next(it);
    if (auto held = live[key].lock()) return held;
    std::shared_ptr<const GGUFFile> f(open(path));
    live[key] = f;
    return f;
}

std::unique_ptr<GGUFFile> GGUFFile::open(const std::string& path) {
    g_parses++;
    std::unique_ptr<GGUFFile> f(new GGUFFile());
    f->path_ = path;
    SplitName sn;
    const bool named_split = parse_split_name(path, &sn);
    const std::string first = named_split ? part_path(sn.prefix, 1, sn.count) : path;
    f->map_file(first, first == path ? "" : " (first part of split model " + path + ")");
    f->n_splits_expected_ = 1;
    f->parse_split(0, true);

    int64_t count = 1;
    if (const GGUFValue* v = f->find("split.count")) {
        if (!is_integer(v->type)) fail(first, "key 'split.count'", std::string("has type ") + gguf_type_name(v->type) + ", expected an integer");
        if (v->i < 1 || v->i > 99999) fail(first, "key 'split.count'", "value " + std::to_string(v->i) + " is outside 1..99999");
        count = v->i;
        if (const GGUFValue* no = f->find("split.no")) {
            if (!is_integer(no->type) || no->i != 0)
                fail(first, "key 'split.no'", "the first part must have split.no 0");
        }
    }
    if (named_split && sn.count != count)
        fail(first, "key 'split.count'", "is " + std::to_string(count) + " but the file name says " +
                                             std::to_string(sn.count) + " parts");
    if (count > 1 && !named_split)
        fail(first, "key 'split.count'", "the model has " + std::to_string(count) +
                                             " parts but the file name does not follow NAME-00001-of-" +
                                             part_path("", count, count).substr(10));
    f->n_splits_expected_ = (int)count;
    for (int k = 1; k < count; k++) {
        f->map_file(part_path(sn.prefix, k + 1, (int)count),
                    " (part " + std::to_string(k + 1) + " of " + std::to_string(count) + " of split model " + path + ")");
        f->parse_split((size_t)k, false);
    }
    if (const GGUFValue* v = f->find("split.tensors.count")) {
        if (!is_integer(v->type) || v->i != (int64_t)f->tensors_.size())
            fail(first, "key 'split.tensors.count'", "is " + std::to_string(v->i) + " but the parts hold " +
                                                         std::to_string(f->tensors_.size()) + " tensors");
    }
    return f;
}

const GGUFValue* GGUFFile::find(const std::string& key) const {
    auto it = kv_.find(key);
    return it == kv_.end() ? nullptr : &it->second;
}

namespace {
const GGUFValue& need_key(const GGUFFile& f, const std::string& key) {
    const GGUFValue* v = f.find(key);
    if (!v) fail(f.path(), "key " + quote(key), "missing");
    return *v;
}
[[noreturn]] void wrong_kind(const GGUFFile& f, const std::string& key, const GGUFValue& v, const char* want) {
    std::string have = gguf_type_name(v.type);
    if (v.type == GGUFType::ARRAY) have += std::string(" of ") + gguf_type_name(v.elem_type);
    fail(f.path(), "key " + quote(key), "has type " + have + ", expected " + want);
}
int64_t int_of(const GGUFFile& f, const std::string& key, const GGUFValue& v) {
    if (v.type == GGUFType::UINT64 && v.u > (uint64_t)std::numeric_limits<int64_t>::max())
        fail(f.path(), "key " + quote(key), "value " + std::to_string(v.u) + " does not fit in int64");
    if (is_integer(v.type) || v.type == GGUFType::BOOL) return v.i;
    wrong_kind(f, key, v, "an integer");
}
double float_of(const GGUFFile& f, const std::string& key, const GGUFValue& v) {
    if (is_float(v.type)) return v.f;
    if (v.type == GGUFType::UINT64) return (double)v.u;
    if (is_integer(v.type)) return (double)v.i;
    wrong_kind(f, key, v, "a number");
}
// Element k of a numeric array, widened.
template <typename T>
T elem_at(const GGUFValue& v, uint64_t k) {
    const uint8_t* p = v.data + k * scalar_size(v.elem_type);
    switch (v.elem_type) {
#define STOWLM_ELEM(E, C) \
    case GGUFType::E: {   \
        C x;              \
        memcpy(&x, p, sizeof x); \
        return (T)x;      \
    }
        STOWLM_ELEM(UINT8, uint8_t) STOWLM_ELEM(INT8, int8_t) STOWLM_ELEM(UINT16, uint16_t)
        STOWLM_ELEM(INT16, int16_t) STOWLM_ELEM(UINT32, uint32_t) STOWLM_ELEM(INT32, int32_t)
        STOWLM_ELEM(UINT64, uint64_t) STOWLM_ELEM(INT64, int64_t) STOWLM_ELEM(FLOAT32, float)
        STOWLM_ELEM(FLOAT64, double) STOWLM_ELEM(BOOL, uint8_t)
#undef STOWLM_ELEM
        default: return T();
    }
}
}  // namespace

std::string GGUFFile::get_str(const std::string& key) const {
    const GGUFValue& v = need_key(*this, key);
    if (v.type != GGUFType::STRING) wrong_kind(*this, key, v, "STRING");
    return v.s;
}
std::string GGUFFile::get_str(const std::string& key, const std::string& dflt) const {
    return has(key) ? get_str(key) : dflt;
}
int64_t GGUFFile::get_int(const std::string& key) const { return int_of(*this, key, need_key(*this, key)); }
int64_t GGUFFile::get_int(const std::string& key, int64_t dflt) const { return has(key) ? get_int(key) : dflt; }
double GGUFFile::get_float(const std::string& key) const { return float_of(*this, key, need_key(*this, key)); }
double GGUFFile::get_float(const std::string& key, double dflt) const { return has(key) ? get_float(key) : dflt; }
bool GGUFFile::get_bool(const std::string& key, bool dflt) const {
    const GGUFValue* v = find(key);
    if (!v) return dflt;
    if (v->type != GGUFType::BOOL) wrong_kind(*this, key, *v, "BOOL");
    return v->i != 0;
}
std::vector<int64_t> GGUFFile::get_int_array(const std::string& key) const {
    const GGUFValue& v = need_key(*this, key);
    if (v.type != GGUFType::ARRAY || !(is_integer(v.elem_type) || v.elem_type == GGUFType::BOOL))
        wrong_kind(*this, key, v, "an ARRAY of integers");
    std::vector<int64_t> out((size_t)v.count);
    for (uint64_t k = 0; k < v.count; k++) {
        if (v.elem_type == GGUFType::UINT64 && elem_at<uint64_t>(v, k) > (uint64_t)std::numeric_limits<int64_t>::max())
            fail(path_, "key " + quote(key), "element " + std::to_string(k) + " does not fit in int64");
        out[k] = elem_at<int64_t>(v, k);
    }
    return out;
}
std::vector<float> GGUFFile::get_float_array(const std::string& key) const {
    const GGUFValue& v = need_key(*this, key);
    if (v.type != GGUFType::ARRAY || !(is_integer(v.elem_type) || is_float(v.elem_type)))
        wrong_kind(*this, key, v, "an ARRAY of numbers");
    std::vector<float> out((size_t)v.count);
    for (uint64_t k = 0; k < v.count; k++)
        out[k] = v.elem_type == GGUFType::FLOAT32 ? elem_at<float>(v, k) : (float)elem_at<double>(v, k);
    return out;
}
const std::vector<std::string>& GGUFFile::get_str_array(const std::string& key) const {
    const GGUFValue& v = need_key(*this, key);
    if (v.type != GGUFType::ARRAY || v.elem_type != GGUFType::STRING) wrong_kind(*this, key, v, "an ARRAY of STRING");
    return v.strings;
}

const GGUFTensor* GGUFFile::find_tensor(const std::string& name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}
const GGUFTensor& GGUFFile::tensor(const std::string& name) const {
    const GGUFTensor* t = find_tensor(name);
    if (!t) fail(path_, "tensor " + quote(name), "not in the model");
    return *t;
}

}  // namespace stowlm
