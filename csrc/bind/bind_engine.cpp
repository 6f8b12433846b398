// Bindings of the inference engine: _core.engine.Model / Context / project. Thin: device specs
// come parsed from Python (stowlm/devices.py), results go back as numpy arrays and dicts.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "backend/device_spec.h"
#include "dist/context_link.h"
#include "engine/context.h"
#include "cpu/threadpool.h"
#include "error.h"

namespace nb = nanobind;
using namespace stowlm;

namespace {

using SpecTuple = std::tuple<std::string, int, int, size_t, int>;  // kind, index, threads, mem_bytes, MPI rank

std::vector<DeviceSpec> to_specs(const std::vector<SpecTuple>& in) {
    std::vector<DeviceSpec> out;
    for (const auto& t : in) {
        DeviceSpec s;
        s.kind = std::get<0>(t);
        s.index = std::get<1>(t);
        s.threads = std::get<2>(t);
        s.mem_bytes = std::get<3>(t);
        s.rank = std::get<4>(t);
        out.push_back(s);
    }
    return out;
}

using OverrideTuple = std::tuple<std::string, int, std::string>;  // pattern, device index, label

std::vector<TensorOverride> to_overrides(const std::vector<OverrideTuple>& in) {
    std::vector<TensorOverride> out;
    for (const auto& t : in) out.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t)});
    return out;
}

nb::list to_py(const std::vector<DeviceMemory>& r, const std::vector<Backend*>* backends) {
    nb::list out;
    for (size_t d = 0; d < r.size(); d++) {
        const DeviceMemory& m = r[d];
        nb::dict e;
        e["device"] = m.name;
        e["weights"] = m.weights;
        e["kv"] = m.kv;
        e["compute"] = m.compute;
        e["copies"] = m.copies;
        e["total"] = m.total;
        e["budget"] = m.budget;
        if (backends) e["allocated"] = (*backends)[d]->memory_used();
        out.append(e);
    }
    return out;
}

ContextParams params(int64_t n_ctx, int64_t n_ubatch, const std::string& kv_type, int64_t n_outputs, int n_copies,
                     int n_seq = 1, int64_t moe_offload_min = kMoeOffloadMin, bool embeddings = false) {
    ContextParams p;
    p.embeddings = embeddings;
    p.moe_offload_min = moe_offload_min;
    p.n_seq = n_seq;
    p.n_ctx = n_ctx;
    p.n_ubatch = n_ubatch;
    p.n_outputs = n_outputs;
    p.kv_type = parse_kv_type(kv_type);
    p.n_copies = n_copies;
    return p;
}

nb::dict pipeline_py(const PipelineMode& m) {
    nb::dict d;
    d["n_copies"] = m.n_copies;
    d["reason"] = m.reason;
    return d;
}

// {"devices": [per device ...], "pipeline": {"n_copies": N, "reason": why it is off or ""}}
nb::dict projection_py(const Projection& p) {
    nb::dict d;
    d["devices"] = to_py(p.devices, nullptr);
    d["pipeline"] = pipeline_py(p.pipeline);
    return d;
}

struct BoundModel {
    std::unique_ptr<Model> m;
};

struct BoundContext {
    std::unique_ptr<Context> c;
};

// One model file opened once, for fit: what each weight costs, what the KV of each layer
// costs, and exact projections of any placement (nothing allocated, no threads started).
struct BoundProjector {
    std::shared_ptr<const GGUFFile> file;
    std::unique_ptr<Model> shape;  // on one CPU device: hyperparameters and weights
};

}  // namespace

// Per shard: device and, per layer, its query heads, KV heads, FFN rows, experts and
// shared-expert rows; the LM head rows.
nb::list shards_py(const Model& m) {
    nb::list out;
    for (int sh = 0; sh < m.n_shards(); sh++) {
        nb::list layers;
        for (int il = 0; il < m.hp().n_layer; il++) {
            const ShardGeometry& g = m.shard_geometry(sh, il);
            layers.append(
                nb::make_tuple(g.q_heads, g.kv_heads, g.ff, g.experts, g.shexp_ff, g.experts * g.expert_ff, g.embd));
        }
        const Tensor* head = m.shard_output(sh);
        nb::dict d;
        d["device"] = m.shard_device(sh, 0);
        d["layers"] = layers;
        d["vocab"] = head ? head->ne[1] : 0;
        out.append(d);
    }
    return out;
}

STOWLM_BIND(engine) {
    nb::module_ e = stowlm::bind::submodule(m, "engine");

    nb::class_<BoundModel>(e, "Model")
        .def("__init__",
             [](BoundModel* self, const std::string& path, const std::vector<SpecTuple>& devices,
                const std::vector<int>& layer_split, const std::vector<OverrideTuple>& overrides,
                const std::vector<double>& tensor_split, int interleave, bool tensor_sum) {
                 std::unique_ptr<Model> model;
                 {
                     nb::gil_scoped_release nogil;
                     model = Model::load(path, to_specs(devices), layer_split, true, to_overrides(overrides),
                                         tensor_split, interleave, tensor_sum);
                 }
                 new (self) BoundModel{std::move(model)};
             },
             nb::arg("path"), nb::arg("devices"), nb::arg("layer_split"), nb::arg("overrides"),
             nb::arg("tensor_split") = std::vector<double>(), nb::arg("interleave") = 0, nb::arg("tensor_sum") = false)
        .def_prop_ro("interleave", [](const BoundModel& s) { return s.m->interleave(); })
        .def_prop_ro("shards", [](const BoundModel& s) { return shards_py(*s.m); })
        .def_prop_ro("arch", [](const BoundModel& s) { return s.m->hp().arch; })
        .def_prop_ro("n_layer", [](const BoundModel& s) { return s.m->hp().n_layer; })
        .def_prop_ro("n_vocab", [](const BoundModel& s) { return s.m->hp().n_vocab; })
        .def_prop_ro("n_expert", [](const BoundModel& s) { return s.m->hp().n_expert; })
        .def_prop_ro("batch_bounds", [](const BoundModel& s) { return s.m->batch_bounds(); })
        .def_prop_ro("n_embd", [](const BoundModel& s) { return s.m->hp().n_embd; })
        .def_prop_ro("n_ctx_train", [](const BoundModel& s) { return s.m->hp().n_ctx_train; })
        .def_prop_ro("weight_bytes_per_token", [](const BoundModel& s) { return s.m->weight_bytes_per_token(); })
        .def("attention_macs", [](const BoundModel& s, int64_t n_kv) { return s.m->attention_macs(n_kv); },
             nb::arg("n_kv"))
        .def_prop_ro("layer_devices", [](const BoundModel& s) { return s.m->layer_devices(); })
        .def("tensor_device",
             [](const BoundModel& s, const std::string& name) { return s.m->weight_device(name); })
        .def_prop_ro("repacked", [](const BoundModel& s) { return s.m->repacked_weights(); })
        .def_prop_ro("device_names",
                     [](const BoundModel& s) {
                         std::vector<std::string> n;
                         for (Backend* b : s.m->backends()) n.push_back(b->name());
                         return n;
                     })
        .def("device_used",
             [](const BoundModel& s) {
                 std::vector<size_t> n;
                 for (Backend* b : s.m->backends()) n.push_back(b->memory_used());
                 return n;
             })
        .def("plan",
             [](const BoundModel& s, int64_t n_ctx, int64_t n_ubatch, const std::string& kv_type, int64_t n_outputs,
                int n_copies, int n_seq, int64_t moe_offload_min, bool embeddings) {
                 return projection_py(project_memory(
                     *s.m, params(n_ctx, n_ubatch, kv_type, n_outputs, n_copies, n_seq, moe_offload_min, embeddings)));
             },
             nb::arg("n_ctx"), nb::arg("n_ubatch"), nb::arg("kv_type"), nb::arg("n_outputs"), nb::arg("n_copies"),
             nb::arg("n_seq") = 1, nb::arg("moe_offload_min") = kMoeOffloadMin, nb::arg("embeddings") = false);

    e.attr("DEFAULT_MOE_OFFLOAD_MIN") = kMoeOffloadMin;

    nb::class_<BoundContext>(e, "Context")
        .def("__init__",
             [](BoundContext* self, BoundModel& model, int64_t n_ctx, int64_t n_ubatch, const std::string& kv_type,
                int64_t n_outputs, int n_copies, int n_seq, int64_t moe_offload_min, bool embeddings) {
                 const ContextParams p =
                     params(n_ctx, n_ubatch, kv_type, n_outputs, n_copies, n_seq, moe_offload_min, embeddings);
                 std::unique_ptr<Context> c;
                 {
                     nb::gil_scoped_release nogil;
                     c = std::make_unique<Context>(*model.m, p);
                 }
                 new (self) BoundContext{std::move(c)};
             },
             nb::arg("model"), nb::arg("n_ctx"), nb::arg("n_ubatch"), nb::arg("kv_type"), nb::arg("n_outputs"),
             nb::arg("n_copies"), nb::arg("n_seq") = 1, nb::arg("moe_offload_min") = kMoeOffloadMin,
             nb::arg("embeddings") = false, nb::keep_alive<1, 2>())
        .def("eval",
             [](BoundContext& s, const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions, bool all) {
                 std::vector<float>* out = nullptr;
                 {
                     nb::gil_scoped_release nogil;
                     out = new std::vector<float>(s.c->eval(tokens, positions, all));
                 }
                 const size_t width = (size_t)s.c->row_width();
                 const size_t rows = out->size() / width;
                 nb::capsule owner(out, [](void* p) noexcept { delete (std::vector<float>*)p; });
                 return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out->data(), {rows, width}, owner);
             },
             nb::arg("tokens"), nb::arg("positions"), nb::arg("all_logits"))
        // Tokens of several sequences (seqs[i] is token i's); logits of the rows listed, in order.
        .def("eval_batch",
             [](BoundContext& s, const std::vector<int32_t>& tokens, const std::vector<int32_t>& seqs,
                const std::vector<int32_t>& positions, const std::vector<int32_t>& rows, bool batched) {
                 std::vector<float>* out = nullptr;
                 {
                     nb::gil_scoped_release nogil;
                     out = new std::vector<float>(s.c->eval_batch(tokens, seqs, positions, rows, batched));
                 }
                 const size_t width = (size_t)s.c->row_width();
                 nb::capsule owner(out, [](void* p) noexcept { delete (std::vector<float>*)p; });
                 return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out->data(), {out->size() / width, width}, owner);
             },
             nb::arg("tokens"), nb::arg("seqs"), nb::arg("positions"), nb::arg("rows"), nb::arg("batched") = false)
        .def_prop_ro("can_force_batched", [](const BoundContext& s) { return s.c->can_force_batched(); })
        .def("kv_truncate", [](BoundContext& s, int64_t n, int seq) { s.c->kv_truncate(n, seq); }, nb::arg("n"),
             nb::arg("seq") = 0)
        .def("clear", [](BoundContext& s, int seq) { s.c->clear(seq); }, nb::arg("seq") = -1)
        .def("kv_span", [](BoundContext& s, int seq, int n) { s.c->kv_span(seq, n); }, nb::arg("seq"), nb::arg("n"))
        .def("kv_span_of", [](const BoundContext& s, int seq) { return s.c->kv_span_of(seq); }, nb::arg("seq"))
        .def("kv_held_by", [](const BoundContext& s, int seq) { return s.c->kv_held_by(seq); }, nb::arg("seq"))
        .def("capacity", [](const BoundContext& s, int seq) { return s.c->capacity(seq); }, nb::arg("seq"))
        .def_prop_ro("n_past", [](const BoundContext& s) { return s.c->n_past(); })
        .def("n_past_of", [](const BoundContext& s, int seq) { return s.c->n_past(seq); }, nb::arg("seq"))
        .def_prop_ro("n_cells_used", [](const BoundContext& s) { return s.c->n_cells_used(); })
        .def_prop_ro("n_seq", [](const BoundContext& s) { return s.c->n_seq(); })
        .def_prop_ro("n_ctx", [](const BoundContext& s) { return s.c->n_ctx(); })
        .def_prop_ro("embeddings", [](const BoundContext& s) { return s.c->embeddings(); })
        .def_prop_ro("row_width", [](const BoundContext& s) { return s.c->row_width(); })
        .def_prop_ro("n_graphs", [](const BoundContext& s) { return s.c->n_graphs(); })
        .def("check_plan", [](const BoundContext& s) { return s.c->check_plan_sound(); })
        .def_prop_ro("n_inplace", [](const BoundContext& s) { return s.c->plan().n_inplace; })
        .def_prop_ro("pipeline", [](const BoundContext& s) { return pipeline_py(s.c->pipeline()); })
        .def("kv_bytes",
             [](const BoundContext& s, int il, bool v) {
                 const std::vector<uint8_t> b = s.c->kv_bytes(il, v);
                 return nb::bytes((const char*)b.data(), b.size());
             },
             nb::arg("layer"), nb::arg("v"))
        // The last eval run as a pipeline: wall seconds, busy seconds per device, micro-batches.
        .def_prop_ro("pipeline_stats",
                     [](const BoundContext& s) {
                         const PipelineStats& st = s.c->pipeline_stats();
                         nb::dict d;
                         d["wall_s"] = st.wall_s;
                         d["busy_s"] = st.busy_s;
                         d["micro_batches"] = st.micro_batches;
                         return d;
                     })
        .def("memory_report", [](const BoundContext& s, const BoundModel& model) {
            auto backends = model.m->backends();
            return to_py(s.c->memory_report(), &backends);
        });

    e.def("default_threads", &default_threads, "threads a CPU device gets when none are asked for");
    // The device grammar (backend/device_spec.h): a spec as (kind, index, threads, mem_bytes, rank, speed).
    auto spec_tuple = [](const DeviceSpec& d) { return std::make_tuple(d.kind, d.index, d.threads, d.mem_bytes, d.rank, d.speed); };
    e.def("parse_device", [spec_tuple](const std::string& text) { return spec_tuple(parse_device_spec(text)); }, nb::arg("text"));
    e.def("parse_devices", [spec_tuple](const std::string& text) {
        std::vector<std::tuple<std::string, int, int, size_t, int, double>> out;
        for (const DeviceSpec& d : parse_device_list(text)) out.push_back(spec_tuple(d));
        return out;
    }, nb::arg("text"));
    e.def("parse_bytes", [](const std::string& text) { return parse_bytes(text); }, nb::arg("text"));
    e.def("format_bytes", [](size_t n) { return format_bytes(n); }, nb::arg("n"));

    nb::class_<BoundProjector>(e, "Projector")
        .def("__init__",
             [](BoundProjector* self, const std::string& path) {
                 std::shared_ptr<const GGUFFile> f = GGUFFile::open_shared(path);
                 auto shape = Model::load(f, {DeviceSpec()}, {}, false, {});
                 new (self) BoundProjector{std::move(f), std::move(shape)};
             },
             nb::arg("path"))
        .def_prop_ro("arch", [](const BoundProjector& s) { return s.shape->hp().arch; })
        .def_prop_ro("n_layer", [](const BoundProjector& s) { return s.shape->hp().n_layer; })
        .def_prop_ro("n_ctx_train", [](const BoundProjector& s) { return s.shape->hp().n_ctx_train; })
        .def_prop_ro("n_expert", [](const BoundProjector& s) { return s.shape->hp().n_expert; })
        .def_prop_ro("n_expert_used", [](const BoundProjector& s) { return s.shape->hp().n_expert_used; })
        .def_prop_ro("n_vocab", [](const BoundProjector& s) { return s.shape->hp().n_vocab; })
        .def_prop_ro("tied_output", [](const BoundProjector& s) { return s.shape->output() == s.shape->tok_embd(); })
        // Every weight the model uses: (name, anchor, bytes, packed_bytes, index of the first
        // override matching it or -1, elements); anchor: its layer, -1 first device, -2 last device.
        .def("weights",
             [](const BoundProjector& s, const std::vector<OverrideTuple>& overrides) {
                 int n_dev = 1;
                 for (const auto& o : overrides) n_dev = std::max(n_dev, std::get<1>(o) + 1);
                 auto m = Model::load(s.file, std::vector<DeviceSpec>(n_dev), std::vector<int>(), false,
                                      to_overrides(overrides));
                 nb::list out;
                 for (const WeightInfo& w : m->weight_infos())
                     out.append(nb::make_tuple(w.name, w.anchor, w.bytes, w.packed_bytes, w.override_index,
                                               w.n_elements));
                 return out;
             },
             nb::arg("overrides"))
        .def("kv_layer_bytes",
             [](const BoundProjector& s, int64_t n_ctx, const std::string& kv_type) {
                 return kv_bytes_per_layer(context_kv_layout(*s.shape, params(n_ctx, 1, kv_type, 0, 1)));
             },
             nb::arg("n_ctx"), nb::arg("kv_type"))
        .def("shards",
             [](const BoundProjector& s, const std::vector<SpecTuple>& devices, const std::vector<double>& tensor_split,
                bool tensor_sum) {
                 auto model = Model::load(s.file, to_specs(devices), {}, false, {}, tensor_split, 0, tensor_sum);
                 return shards_py(*model);
             },
             nb::arg("devices"), nb::arg("tensor_split"), nb::arg("tensor_sum") = false)
        .def("project",
             [](const BoundProjector& s, const std::vector<SpecTuple>& devices, const std::vector<int>& layer_split,
                const std::vector<OverrideTuple>& overrides, int64_t n_ctx, int64_t n_ubatch,
                const std::string& kv_type, int64_t n_outputs, int n_copies, int n_seq,
                const std::vector<double>& tensor_split, int interleave, bool tensor_sum, int64_t moe_offload_min,
                bool embeddings) {
                 auto model = Model::load(s.file, to_specs(devices), layer_split, false, to_overrides(overrides),
                                          tensor_split, interleave, tensor_sum);
                 return projection_py(project_memory(
                     *model, params(n_ctx, n_ubatch, kv_type, n_outputs, n_copies, n_seq, moe_offload_min, embeddings)));
             },
             nb::arg("devices"), nb::arg("layer_split"), nb::arg("overrides"), nb::arg("n_ctx"), nb::arg("n_ubatch"),
             nb::arg("kv_type"), nb::arg("n_outputs"), nb::arg("n_copies"), nb::arg("n_seq") = 1,
             nb::arg("tensor_split") = std::vector<double>(), nb::arg("interleave") = 0, nb::arg("tensor_sum") = false,
             nb::arg("moe_offload_min") = kMoeOffloadMin, nb::arg("embeddings") = false);

    // MPI ranks other than 0 (stowlm.mpi): repeat rank 0's contexts over this model until rank 0
    // ends the job; returns the status it ends with. model None: this rank could not load its
    // share (load_error), which rank 0 is told when it opens a context.
    e.def(
        "serve_ranks",
        [](BoundModel* model, const std::string& load_error) {
            nb::gil_scoped_release nogil;
            return dist::serve(model ? model->m.get() : nullptr, load_error);
        },
        nb::arg("model").none(), nb::arg("load_error") = "");

    e.def(
        "project",
        [](const std::string& path, const std::vector<SpecTuple>& devices, const std::vector<int>& layer_split,
           const std::vector<OverrideTuple>& overrides, int64_t n_ctx, int64_t n_ubatch,
           const std::string& kv_type, int64_t n_outputs, int n_copies, const std::vector<double>& tensor_split,
           int interleave, bool tensor_sum) {
            auto model = Model::load(path, to_specs(devices), layer_split, false, to_overrides(overrides), tensor_split,
                                     interleave, tensor_sum);
            return projection_py(project_memory(*model, params(n_ctx, n_ubatch, kv_type, n_outputs, n_copies)));
        },
        nb::arg("path"), nb::arg("devices"), nb::arg("layer_split"), nb::arg("overrides"), nb::arg("n_ctx"), nb::arg("n_ubatch"),
        nb::arg("kv_type"), nb::arg("n_outputs"), nb::arg("n_copies"), nb::arg("tensor_split") = std::vector<double>(),
        nb::arg("interleave") = 0, nb::arg("tensor_sum") = false);

    // Which device each layer goes to, and the interleave that is (Model::load's rule).
    e.def(
        "layer_devices",
        [](const std::vector<int>& counts, int interleave, bool cpu_only) {
            const int v = effective_interleave(counts, interleave, cpu_only);
            return std::make_tuple(layer_devices(counts, v), v);
        },
        nb::arg("counts"), nb::arg("interleave") = 0, nb::arg("cpu_only") = true);
}
