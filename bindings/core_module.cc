// onnx_light_ep._core: Python access to the KVCache arena that lives in
// libonnx_light.so (this module links it, so Python and ORT share one
// registry). Thin: validation lives in the arena, whose std::invalid_argument
// becomes ValueError and std::runtime_error (limits) becomes ValueError too,
// since both mean "this call cannot be done; nothing changed".
#include <dlfcn.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/stream_read.h"
#include "kvcache/kv_cache.h"

namespace py = pybind11;
using olep::CacheGeometry;
using olep::DType;
using olep::KVCache;
using olep::Registry;

namespace {

std::shared_ptr<KVCache> get(int64_t h, const char* what) { return Registry::instance().get(h, what); }

py::dtype numpy_dtype(DType t) {
  switch (t) {
    case DType::kFloat32: return py::dtype("float32");
    case DType::kFloat16: return py::dtype("float16");
    case DType::kBFloat16: return py::dtype("uint16");  // raw bits; Python views them as ml_dtypes.bfloat16
  }
  return py::dtype("float32");
}

std::vector<int64_t> to_vec(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& a) {
  if (a.ndim() != 1) throw std::invalid_argument("expected a 1-D integer array");
  return std::vector<int64_t>(a.data(), a.data() + a.size());
}

py::dict info(int64_t h) {
  auto c = get(h, "KVCache");
  const CacheGeometry& g = c->geometry();
  py::dict d;
  d["num_layers"] = g.num_layers;
  d["batch_size"] = g.batch_size;
  d["kv_num_heads"] = g.kv_num_heads;
  d["head_dim"] = g.head_dim;
  d["v_head_dim"] = g.v_head_dim;
  d["dtype"] = olep::dtype_name(g.dtype);
  d["max_sequence_length"] = g.max_sequence_length;
  d["memory_limit_bytes"] = g.memory_limit_bytes;
  return d;
}

py::dict stats(int64_t h) {
  const olep::CacheStats s = get(h, "KVCache.stats")->stats();
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["committed_bytes"] = s.committed_bytes;
  d["live_bytes"] = s.live_bytes;
  d["bytes_appended"] = s.bytes_appended;
  d["bytes_copied"] = s.bytes_copied;
  d["num_appends"] = s.num_appends;
  return d;
}

py::tuple export_layer(int64_t h, int64_t layer) {
  auto c = get(h, "KVCache.export");
  const CacheGeometry& g = c->geometry();
  py::array k, v;
  c->export_layer(layer, /*include_pending=*/false, [&](int64_t L) {
    k = py::array(numpy_dtype(g.dtype), std::vector<py::ssize_t>{g.batch_size, g.kv_num_heads, L, g.head_dim});
    v = py::array(numpy_dtype(g.dtype), std::vector<py::ssize_t>{g.batch_size, g.kv_num_heads, L, g.v_head_dim});
    std::memset(k.mutable_data(), 0, static_cast<size_t>(k.nbytes()));
    std::memset(v.mutable_data(), 0, static_cast<size_t>(v.nbytes()));
    return std::make_pair(k.mutable_data(), v.mutable_data());
  });
  return py::make_tuple(k, v);
}

void import_past(int64_t h, const py::list& keys, const py::list& values) {
  auto c = get(h, "KVCache.from_past");
  const CacheGeometry& g = c->geometry();
  const py::dtype want = numpy_dtype(g.dtype);
  std::vector<py::array> hold;  // keeps contiguous copies alive
  std::vector<const void*> kp, vp;
  int64_t length = -1;
  auto take = [&](const py::handle& obj, const char* name, size_t layer, int64_t d) {
    py::array a = py::array::ensure(obj, py::array::c_style);
    const std::string where = std::string("KVCache.from_past: ") + name + "[" + std::to_string(layer) + "]";
    if (!a) throw std::invalid_argument(where + " must be a numpy array");
    if (!a.dtype().is(want))
      throw std::invalid_argument(where + " must have dtype " + olep::dtype_name(g.dtype) + ", got " +
                                  std::string(py::str(a.dtype())));
    if (a.ndim() != 4 || a.shape(0) != g.batch_size || a.shape(1) != g.kv_num_heads || a.shape(3) != d)
      throw std::invalid_argument(where + " must have shape [batch_size=" + std::to_string(g.batch_size) +
                                  ", kv_num_heads=" + std::to_string(g.kv_num_heads) + ", L, " + std::to_string(d) + "]");
    if (length >= 0 && a.shape(2) != length)
      throw std::invalid_argument(where + " has length " + std::to_string(a.shape(2)) + ", other layers have " +
                                  std::to_string(length));
    length = a.shape(2);
    hold.push_back(a);
    return a.data();
  };
  if (static_cast<int64_t>(keys.size()) != g.num_layers || static_cast<int64_t>(values.size()) != g.num_layers)
    throw std::invalid_argument("KVCache.from_past: keys and values must hold num_layers=" +
                                std::to_string(g.num_layers) + " arrays");
  for (size_t l = 0; l < keys.size(); ++l) {
    kp.push_back(take(keys[l], "keys", l, g.head_dim));
    vp.push_back(take(values[l], "values", l, g.v_head_dim));
  }
  c->import_past(kp, vp, length < 0 ? 0 : length);
}

std::string library_path() {
  Dl_info dl;
  if (dladdr(reinterpret_cast<void*>(&Registry::instance), &dl) == 0 || dl.dli_fname == nullptr)
    throw std::runtime_error("could not locate libonnx_light.so with dladdr");
  char resolved[4096];
  if (realpath(dl.dli_fname, resolved) == nullptr) return dl.dli_fname;
  return resolved;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "KVCache arena of libonnx_light.so (see docs/API.md); use onnx_light_ep.KVCache.";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::runtime_error& e) {  // a limit reached: the call cannot be done, nothing changed
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def(
      "create",
      [](int64_t num_layers, int64_t batch_size, int64_t kv_num_heads, int64_t head_dim, int64_t v_head_dim,
         const std::string& dtype, int64_t max_sequence_length, int64_t memory_limit_bytes) {
        CacheGeometry g;
        g.num_layers = num_layers;
        g.batch_size = batch_size;
        g.kv_num_heads = kv_num_heads;
        g.head_dim = head_dim;
        g.v_head_dim = v_head_dim;
        g.dtype = olep::parse_dtype(dtype, "KVCache: dtype");
        g.max_sequence_length = max_sequence_length;
        g.memory_limit_bytes = memory_limit_bytes;
        return Registry::instance().add(std::make_unique<KVCache>(g));
      },
      py::arg("num_layers"), py::arg("batch_size"), py::arg("kv_num_heads"), py::arg("head_dim"),
      py::arg("v_head_dim"), py::arg("dtype"), py::arg("max_sequence_length"), py::arg("memory_limit_bytes"));
  m.def("release", [](int64_t h) { Registry::instance().release(h, "KVCache.close"); });
  m.def("is_live", [](int64_t h) { return Registry::instance().is_live(h); });
  m.def("num_live_caches", [] { return Registry::instance().num_live(); });
  m.def("info", &info);
  m.def("seq_lens", [](int64_t h) {
    const std::vector<int64_t> v = get(h, "KVCache.seq_lens")->seq_lens();
    return py::array_t<int64_t>(static_cast<py::ssize_t>(v.size()), v.data());
  });
  m.def("stats", &stats);
  m.def("reset", [](int64_t h) { get(h, "KVCache.reset")->reset(); });
  m.def("truncate", [](int64_t h, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& lengths) {
    get(h, "KVCache.truncate")->truncate(to_vec(lengths));
  });
  m.def("reorder", [](int64_t h, const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& indices) {
    get(h, "KVCache.reorder")->reorder(to_vec(indices));
  });
  m.def("fork", [](int64_t h) {
    auto c = get(h, "KVCache.fork");
    std::unique_ptr<KVCache> f;
    {
      py::gil_scoped_release nogil;
      f = c->fork();
    }
    return Registry::instance().add(std::move(f));
  });
  m.def("export", &export_layer);
  m.def("import_past", &import_past);
  m.def("library_path", &library_path);
  m.def(
      "stream_read",
      [](const py::array& arr) {
        if (!(arr.flags() & py::array::c_style))
          throw std::invalid_argument("stream_read: the array must be C-contiguous");
        const void* p = arr.data();
        const size_t bytes = static_cast<size_t>(arr.nbytes());
        py::gil_scoped_release nogil;
        return olep::kernels::stream_read(p, bytes);
      },
      "Reads every byte of a C-contiguous buffer once with the widest vector loads (the physical-limit probe of "
      "the benchmarks); returns a checksum.");
  m.def("isa", [] { return std::string(olep::kernels::isa_name(olep::kernels::active_isa())); },
        "Attention kernel ISA level in use: 'scalar', 'avx2', 'avx512' or 'avx512_bf16'.");
  m.def("detected_isa", [] { return std::string(olep::kernels::isa_name(olep::kernels::detected_isa())); },
        "Best ISA level this CPU supports.");
  m.def(
      "set_isa",
      [](const std::string& name) {
        olep::kernels::Isa isa;
        if (name == "scalar") isa = olep::kernels::Isa::kScalar;
        else if (name == "avx2") isa = olep::kernels::Isa::kAvx2;
        else if (name == "avx512") isa = olep::kernels::Isa::kAvx512;
        else if (name == "avx512_bf16") isa = olep::kernels::Isa::kAvx512Bf16;
        else throw std::invalid_argument("set_isa: expected 'scalar', 'avx2', 'avx512' or 'avx512_bf16', got '" + name + "'");
        olep::kernels::set_isa(isa);
      },
      "Forces the attention kernel ISA level for this process (tests, benchmarks); ValueError if the CPU lacks it.");
}
