// onnx_light_ep._core: Python access to the KVCache arena that lives in
// libonnx_light.so (this module links it, so Python and ORT share one
// registry). Thin: validation lives in the arena; this file converts
// arguments, releases the GIL around arena calls (they may wait for a cache
// lock held by a run), puts "KVCache.<method>: " in front of error messages
// and raises the Python class of each error kind:
//   std::invalid_argument -> ValueError
//   MemoryLimitError      -> onnx_light_ep.errors.KVCacheMemoryError
//   BusyError             -> onnx_light_ep.errors.KVCacheBusyError
#include <dlfcn.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "fma_peak.h"
#include "kernels/attention.h"
#include "kernels/stream_read.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache.h"
#include "kvcache/registry.h"
#include "kvcache/run_scope.h"

namespace py = pybind11;
using olep::CacheGeometry;
using olep::DType;
using olep::KVCache;
using olep::Registry;

namespace {

using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Runs f() with the GIL released; arena errors get "<what>: " in front, keeping their kind.
template <class F>
auto call(const char* what, F&& f) -> decltype(f()) {
  py::gil_scoped_release nogil;
  try {
    return f();
  } catch (...) {
    olep::rethrow_with_prefix(std::string(what) + ": ");
  }
}

std::shared_ptr<KVCache> cache(int64_t h, const char* what) {
  return call(what, [&] { return Registry::instance().cache(h); });
}

py::dtype numpy_dtype(DType t) {
  switch (t) {
    case DType::kFloat32: return py::dtype("float32");
    case DType::kFloat16: return py::dtype("float16");
    case DType::kBFloat16: return py::dtype("uint16");  // raw bits; Python views them as ml_dtypes.bfloat16
  }
  return py::dtype("float32");
}

std::vector<int64_t> to_vec(const IntArray& a, const char* what) {
  if (a.ndim() != 1) throw std::invalid_argument(std::string(what) + ": expected a 1-D integer array");
  return std::vector<int64_t>(a.data(), a.data() + a.size());
}

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
  return py::array_t<int64_t>(static_cast<py::ssize_t>(v.size()), v.data());
}

py::dict info(int64_t h) {
  auto c = cache(h, "KVCache");
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
  d["page_tokens"] = g.page_tokens;
  d["sliding_window"] = g.sliding_window;
  d["rollback_tokens"] = g.rollback_tokens;
  d["kv_quant"] = olep::kv_quant_name(g.kv_quant);
  d["recent_tokens"] = g.recent_tokens;
  d["sink_tokens"] = g.sink_tokens;
  return d;
}

py::dict stats(int64_t h) {
  auto c = cache(h, "KVCache.stats");
  const olep::CacheStats s = call("KVCache.stats", [&] { return c->stats(); });
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["committed_bytes"] = s.committed_bytes;
  d["live_bytes"] = s.live_bytes;
  d["shared_bytes"] = s.shared_bytes;
  d["checkpoint_bytes"] = s.checkpoint_bytes;
  d["num_pages"] = s.num_pages;
  d["page_table_bytes"] = s.page_table_bytes;
  d["fragmentation_bytes"] = s.fragmentation_bytes;
  d["bytes_appended"] = s.bytes_appended;
  d["bytes_copied"] = s.bytes_copied;
  d["num_appends"] = s.num_appends;
  d["quantized_bytes"] = s.quantized_bytes;
  d["native_bytes"] = s.native_bytes;
  d["scale_bytes"] = s.scale_bytes;
  return d;
}

py::dict pool_stats_dict(const olep::PoolStats& s) {
  py::dict d;
  d["memory_limit_bytes"] = s.memory_limit_bytes;
  d["committed_bytes"] = s.committed_bytes;
  d["live_bytes"] = s.live_bytes;
  d["shared_bytes"] = s.shared_bytes;
  d["free_bytes"] = s.free_bytes;
  d["overhead_bytes"] = s.overhead_bytes;
  d["num_pages"] = s.num_pages;
  d["num_free_pages"] = s.num_free_pages;
  d["num_slabs"] = s.num_slabs;
  d["num_caches"] = s.num_caches;
  d["num_checkpoints"] = s.num_checkpoints;
  d["keep_free_bytes"] = s.keep_free_bytes;
  d["empty_slab_bytes"] = s.empty_slab_bytes;
  return d;
}

py::dict pool_stats(int64_t h) {
  auto p = call("KVPool.stats", [&] { return Registry::instance().pool(h); });
  return pool_stats_dict(p->stats());
}

py::tuple export_layer(int64_t h, int64_t layer) {
  auto c = cache(h, "KVCache.export");
  const CacheGeometry& g = c->geometry();
  // Copied without the GIL into buffers, then into the numpy arrays made under it.
  int64_t L = 0;
  std::vector<char> kbuf, vbuf;
  call("KVCache.export", [&] {
    c->export_layer(layer, /*include_pending=*/false, [&](int64_t len) {
      L = len;
      const size_t es = olep::dtype_size(g.dtype);
      kbuf.assign(static_cast<size_t>(g.batch_size * g.kv_num_heads * len * g.head_dim) * es, 0);
      vbuf.assign(static_cast<size_t>(g.batch_size * g.kv_num_heads * len * g.v_head_dim) * es, 0);
      return std::make_pair<void*, void*>(kbuf.data(), vbuf.data());
    });
    return 0;
  });
  py::array k(numpy_dtype(g.dtype), std::vector<py::ssize_t>{g.batch_size, g.kv_num_heads, L, g.head_dim});
  py::array v(numpy_dtype(g.dtype), std::vector<py::ssize_t>{g.batch_size, g.kv_num_heads, L, g.v_head_dim});
  if (!kbuf.empty()) std::memcpy(k.mutable_data(), kbuf.data(), kbuf.size());
  if (!vbuf.empty()) std::memcpy(v.mutable_data(), vbuf.data(), vbuf.size());
  return py::make_tuple(k, v);
}

void import_past(int64_t h, const py::list& keys, const py::list& values) {
  auto c = cache(h, "KVCache.from_past");
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
  call("KVCache.from_past", [&] {
    c->import_past(kp, vp, length < 0 ? 0 : length);
    return 0;
  });
}

std::string library_path() {
  Dl_info dl;
  if (dladdr(reinterpret_cast<void*>(&Registry::instance), &dl) == 0 || dl.dli_fname == nullptr)
    throw std::runtime_error("could not locate libonnx_light.so with dladdr");
  char resolved[4096];
  if (realpath(dl.dli_fname, resolved) == nullptr) return dl.dli_fname;
  return resolved;
}

void raise_kind(const char* cls, const char* msg) {
  py::object type = py::module_::import("onnx_light_ep.errors").attr(cls);
  PyErr_SetString(type.ptr(), msg);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "KVCache arena of libonnx_light.so (see docs/API.md); use onnx_light_ep.KVCache and KVPool.";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const olep::MemoryLimitError& e) {
      raise_kind("KVCacheMemoryError", e.what());
    } catch (const olep::BusyError& e) {
      raise_kind("KVCacheBusyError", e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  // ---- caches ----
  m.def(
      "create",
      [](int64_t num_layers, int64_t batch_size, int64_t kv_num_heads, int64_t head_dim, int64_t v_head_dim,
         const std::string& dtype, int64_t max_sequence_length, int64_t memory_limit_bytes, int64_t page_tokens,
         int64_t pool, const std::vector<int64_t>& sliding_window, int64_t rollback_tokens,
         const std::string& kv_quant, int64_t recent_tokens, int64_t sink_tokens) {
        CacheGeometry g;
        g.num_layers = num_layers;
        g.batch_size = batch_size;
        g.kv_num_heads = kv_num_heads;
        g.head_dim = head_dim;
        g.v_head_dim = v_head_dim;
        g.dtype = olep::parse_dtype(dtype, "KVCache: dtype");
        g.max_sequence_length = max_sequence_length;
        g.memory_limit_bytes = memory_limit_bytes;
        g.page_tokens = page_tokens > 0 ? page_tokens : olep::default_page_tokens(head_dim, v_head_dim, g.dtype);
        g.sliding_window = sliding_window;
        g.rollback_tokens = rollback_tokens;
        g.kv_quant = olep::parse_kv_quant(kv_quant);
        g.recent_tokens = recent_tokens;
        g.sink_tokens = sink_tokens;
        return call("KVCache", [&] {
          std::shared_ptr<olep::PagePool> p = pool ? Registry::instance().pool(pool) : nullptr;
          return Registry::instance().add_cache(std::make_shared<KVCache>(g, p));
        });
      },
      py::arg("num_layers"), py::arg("batch_size"), py::arg("kv_num_heads"), py::arg("head_dim"),
      py::arg("v_head_dim"), py::arg("dtype"), py::arg("max_sequence_length"), py::arg("memory_limit_bytes"),
      py::arg("page_tokens"), py::arg("pool"), py::arg("sliding_window"), py::arg("rollback_tokens"),
      py::arg("kv_quant") = "none", py::arg("recent_tokens") = 0, py::arg("sink_tokens") = 0);
  m.def(
      "default_page_tokens",
      [](int64_t head_dim, int64_t v_head_dim, const std::string& dtype) {
        return call("default_page_tokens", [&] {
          return olep::default_page_tokens(head_dim, v_head_dim, olep::parse_dtype(dtype, "default_page_tokens: dtype"));
        });
      },
      py::arg("head_dim"), py::arg("v_head_dim"), py::arg("dtype"),
      "page_tokens a cache gets when none is given (at least 128 KiB of K and V per page).");
  m.def("release", [](int64_t h) { call("KVCache.close", [&] { Registry::instance().release_cache(h); return 0; }); });
  m.def("is_live", [](int64_t h) { return Registry::instance().is_live(h); });
  m.def("num_live_caches", [] { return Registry::instance().num_live_caches(); });
  m.def("info", &info);
  m.def("seq_lens", [](int64_t h) { auto c = cache(h, "KVCache.seq_lens"); return to_array(call("KVCache.seq_lens", [&] { return c->seq_lens(); })); });
  m.def("first_positions", [](int64_t h) {
    auto c = cache(h, "KVCache.first_positions");
    return to_array(call("KVCache.first_positions", [&] { return c->first_positions(); }));
  });
  m.def("stats", &stats);
  m.def("reset", [](int64_t h) { auto c = cache(h, "KVCache.reset"); call("KVCache.reset", [&] { c->reset(); return 0; }); });
  m.def("truncate", [](int64_t h, const IntArray& lengths) {
    auto c = cache(h, "KVCache.truncate");
    const auto v = to_vec(lengths, "KVCache.truncate: lengths");
    call("KVCache.truncate", [&] { c->truncate(v); return 0; });
  });
  m.def("rollback", [](int64_t h, const IntArray& num_tokens) {
    auto c = cache(h, "KVCache.rollback");
    const auto v = to_vec(num_tokens, "KVCache.rollback: num_tokens");
    call("KVCache.rollback", [&] { c->rollback(v); return 0; });
  });
  m.def("reorder", [](int64_t h, const IntArray& indices) {
    auto c = cache(h, "KVCache.reorder");
    const auto v = to_vec(indices, "KVCache.reorder: indices");
    call("KVCache.reorder", [&] { c->reorder(v); return 0; });
  });
  m.def("fork", [](int64_t h, const IntArray& indices) {
    auto c = cache(h, "KVCache.fork");
    const auto v = to_vec(indices, "KVCache.fork: indices");
    return call("KVCache.fork", [&] { return Registry::instance().add_cache(std::shared_ptr<KVCache>(c->fork(v))); });
  });
  m.def("export", &export_layer);
  m.def("import_past", &import_past);
  m.def("save", [](int64_t h, const std::string& path) {
    auto c = cache(h, "KVCache.save");
    call("KVCache.save", [&] { c->save(path); return 0; });
  });
  m.def("load", [](const std::string& path, int64_t pool) {
    return call("KVCache.load", [&] {
      std::shared_ptr<olep::PagePool> p = pool ? Registry::instance().pool(pool) : nullptr;
      return Registry::instance().add_cache(std::shared_ptr<KVCache>(KVCache::load(path, p)));
    });
  });
  m.def("page_ids", [](int64_t h, int64_t layer, int64_t b, int64_t head) {
    auto c = cache(h, "KVCache.page_ids");
    return call("KVCache.page_ids", [&] { return c->page_ids(layer, b, head); });
  }, "Page ids of (layer, sequence, head), block by block (tests, debugging).");

  // ---- checkpoints ----
  m.def("checkpoint", [](int64_t h) {
    auto c = cache(h, "KVCache.checkpoint");
    return call("KVCache.checkpoint", [&] { return Registry::instance().add_checkpoint(c->checkpoint()); });
  });
  m.def("restore", [](int64_t h, int64_t cp) {
    auto c = cache(h, "KVCache.restore");
    call("KVCache.restore", [&] { c->restore(*Registry::instance().checkpoint(cp)); return 0; });
  });
  m.def("release_checkpoint", [](int64_t cp) {
    call("KVCheckpoint.close", [&] { Registry::instance().release_checkpoint(cp); return 0; });
  });
  m.def("checkpoint_info", [](int64_t cp) {
    auto c = call("KVCheckpoint", [&] { return Registry::instance().checkpoint(cp); });
    py::dict d;
    d["seq_lens"] = to_array(c->content().lens);
    d["num_pages"] = c->num_pages();
    d["batch_size"] = c->geometry().batch_size;
    d["num_layers"] = c->geometry().num_layers;
    std::vector<uint32_t> ids;  // one entry per table reference (tests: the pool invariant)
    for (const olep::PageTable& t : c->content().tables)
      for (const olep::Page* p : t.pages) ids.push_back(p->id);
    d["page_ids"] = ids;
    return d;
  });

  // ---- pools ----
  m.attr("DEFAULT_KEEP_FREE_BYTES") = olep::kDefaultKeepFreeBytes;
  m.def("pool_create", [](int64_t memory_limit_bytes, int64_t keep_free_bytes) {
    return call("KVPool", [&] {
      return Registry::instance().add_pool(std::make_shared<olep::PagePool>(memory_limit_bytes, keep_free_bytes));
    });
  }, py::arg("memory_limit_bytes"), py::arg("keep_free_bytes") = olep::kDefaultKeepFreeBytes);
  m.def("pool_trim", [](int64_t h) {
    auto p = call("KVPool.trim", [&] { return Registry::instance().pool(h); });
    py::gil_scoped_release nogil;
    return p->trim();
  }, "Unmaps the pool's empty slabs; returns the bytes unmapped.");
  m.def("pool_release", [](int64_t h) { call("KVPool.close", [&] { Registry::instance().release_pool(h); return 0; }); });
  m.def("pool_stats", &pool_stats);
  m.def("pool_page_refs", [](int64_t h) {
    auto p = call("KVPool", [&] { return Registry::instance().pool(h); });
    return p->page_refs();
  }, "Every mapped page of the pool as (id, refs); refs 0 = free (tests, debugging).");
  m.def("cache_pool_stats", [](int64_t h) {
    auto c = cache(h, "KVCache.pool_stats");
    return pool_stats_dict(c->pool()->stats());
  }, "stats of the pool a cache uses (its private pool included).");
  m.def("cache_pool_page_refs", [](int64_t h) {
    auto c = cache(h, "KVCache");
    return c->pool()->page_refs();
  }, "page_refs of the pool a cache uses (its private pool included).");
  m.def("process_committed_bytes", [] { return olep::PagePool::process_committed_bytes(); },
        "Slab bytes mapped by every page pool of the process.");
  m.def("set_huge_pages", [](bool on) { olep::PagePool::set_huge_pages(on); },
        "Whether slabs mapped from now on use huge pages (default True; benchmarks compare both).");
  m.def("huge_pages", [] { return olep::PagePool::huge_pages(); });

  // ---- run boundaries (onnx_light_ep.InferenceSession) ----
  m.def("run_begin", [](bool deferred) { olep::run_scope::begin(deferred); },
        "Begins a run on this thread; deferred: its cache steps commit only at run_end(True).");
  m.def("run_end", [](bool ok) {
    std::vector<std::string> d;
    {
      py::gil_scoped_release nogil;
      d = olep::run_scope::end(ok);
    }
    return d;
  }, "Ends the run: commits (ok) or rolls back its steps; returns diagnoses of a successful run.");

  // ---- misc ----
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
  m.def(
      "fma_peak",
      [](const std::string& level, double ms, int trials) -> py::object {
        double g;
        {
          py::gil_scoped_release nogil;
          g = olep::bench::fma_peak(level, ms, trials);
        }
        return g < 0 ? py::object(py::none()) : py::object(py::float_(g));
      },
      py::arg("level"), py::arg("ms") = 50.0, py::arg("trials") = 5,
      "Peak multiply-add throughput of one core at one ISA level, in GFMA/s (1e9 multiply-adds per second of "
      "the calling thread's CPU time): the best of `trials` trials of ~`ms` ms each; None where the CPU lacks "
      "the level. Levels: fma_peak_levels(). ValueError for an unknown level, ms outside (0, 10000] or "
      "trials outside 1..1000. Releases the GIL; takes about trials x ms of CPU time.");
  m.def(
      "fma_peak_levels",
      [] {
        py::list out;
        for (const auto& l : olep::bench::fma_levels()) {
          py::dict d;
          d["name"] = l.name;
          d["what"] = l.what;
          d["chains"] = l.chains;
          d["supported"] = l.supported;
          out.append(d);
        }
        return out;
      },
      "The levels fma_peak measures: [{name, what, chains, supported}] (supported: this CPU has them).");
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
