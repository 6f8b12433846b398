// GGUF reader: mmap, zero copy, strict validation. A malformed or truncated file throws
// InvalidInput whose message names the file and the field (or tensor) at fault; nothing is
// ever read outside the mapping. Split files (NAME-00001-of-0000N.gguf) open as one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "quant/types.h"

namespace stowlm {

// The path given (or a split part it implies) does not exist: Python FileNotFoundError.
struct GGUFFileNotFound : InvalidInput {
    using InvalidInput::InvalidInput;
};

enum class GGUFType : uint32_t {
    UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
    BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

const char* gguf_type_name(GGUFType t);  // "UINT8", ..., "?" for ids outside the enum

// One metadata value. Scalars are decoded; numeric arrays stay in the mapping (zero copy).
struct GGUFValue {
    GGUFType type = GGUFType::UINT8;
    GGUFType elem_type = GGUFType::UINT8;  // element type when type == ARRAY
    uint64_t count = 0;                    // element count when type == ARRAY
    int64_t i = 0;                         // any integer scalar or BOOL, widened
    uint64_t u = 0;                        // UINT64 scalar exactly (i wraps above INT64_MAX)
    double f = 0;                          // FLOAT32 / FLOAT64 scalar
    std::string s;                         // STRING scalar
    const uint8_t* data = nullptr;         // numeric array elements, little endian, in the mapping
    std::vector<std::string> strings;      // STRING array elements
};

struct GGUFTensor {
    std::string name;
    QType type = QType::F32;
    int n_dims = 0;
    int64_t ne[4] = {1, 1, 1, 1};  // ne[0] is the row length (GGUF order)
    size_t nbytes = 0;
    const uint8_t* data = nullptr; // inside the mapping of file `split`
    int split = 0;
    size_t file_offset = 0;        // absolute offset of the data in its file

    int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
    int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
};

class GGUFFile {
public:
    // Opens `path` (for a split model, any part's path or the first part's). Throws InvalidInput.
    static std::unique_ptr<GGUFFile> open(const std::string& path);
    // The same, shared with whoever holds this file's parse already (same path, device, inode,
    // size and modification time): loading a model opens it for fit, the native model and the
    // tokenizer, and each gets the one parse and mapping while any of them holds it.
    static std::shared_ptr<const GGUFFile> open_shared(const std::string& path);
    static int64_t parse_count();  // parses made by open() in this process (tests)
    ~GGUFFile();
    GGUFFile(const GGUFFile&) = delete;
    GGUFFile& operator=(const GGUFFile&) = delete;

    const std::string& path() const { return path_; }
    uint32_t version() const { return version_; }
    size_t n_splits() const { return maps_.size(); }
    size_t total_file_bytes() const;
    bool maps(const void* p, size_t bytes) const;  // [p, p + bytes) lies inside one split's mapping
    const std::string& split_path(size_t split) const { return maps_.at(split).path; }
    uint32_t alignment(size_t split = 0) const { return alignments_.at(split); }  // general.alignment

    // Metadata of the first split (the one that carries the model's keys).
    const std::map<std::string, GGUFValue>& metadata() const { return kv_; }
    const GGUFValue* find(const std::string& key) const;
    bool has(const std::string& key) const { return find(key) != nullptr; }

    // Typed getters: throw InvalidInput naming the key when missing or of the wrong kind;
    // the overloads with a default return it when the key is missing.
    std::string get_str(const std::string& key) const;
    std::string get_str(const std::string& key, const std::string& dflt) const;
    int64_t get_int(const std::string& key) const;  // any integer type or bool
    int64_t get_int(const std::string& key, int64_t dflt) const;
    double get_float(const std::string& key) const; // float or integer types
    double get_float(const std::string& key, double dflt) const;
    bool get_bool(const std::string& key, bool dflt) const;
    std::vector<int64_t> get_int_array(const std::string& key) const;
    std::vector<float> get_float_array(const std::string& key) const;
    const std::vector<std::string>& get_str_array(const std::string& key) const;

    // Tensors of all splits, in file order.
    const std::vector<GGUFTensor>& tensors() const { return tensors_; }
    const GGUFTensor* find_tensor(const std::string& name) const;
    const GGUFTensor& tensor(const std::string& name) const;  // throws InvalidInput naming it

private:
    GGUFFile() = default;
    struct Map {
        std::string path;
        const uint8_t* base = nullptr;
        size_t size = 0;
        int fd = -1;
    };
    void parse_split(size_t index, bool first);
    void map_file(const std::string& path, const std::string& why);

    std::vector<uint32_t> alignments_;  // general.alignment of each split
    int n_splits_expected_ = 1;         // split.count of the first part

    std::string path_;
    uint32_t version_ = 0;
    std::vector<Map> maps_;
    std::map<std::string, GGUFValue> kv_;
    std::vector<GGUFTensor> tensors_;
    std::map<std::string, size_t> tensor_index_;
};

}  // namespace stowlm
