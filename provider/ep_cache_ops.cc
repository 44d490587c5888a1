#include "provider/ep_cache_ops.h"

#include <memory>
#include <set>
#include <stdexcept>

#include "ops/cache_attention.h"
#include "provider/cache_kernels.h"

namespace olep {
namespace provider {
namespace {

template <class Kernel>
struct CacheComputeInfo : NodeComputeInfo {
  Kernel kernel;
  OrtStatus* run(OrtKernelContext* ctx) noexcept { return kernel.compute(ctx); }
};

std::string quoted(const std::string& s) { return "'" + s + "'"; }

std::string input_name(const OrtNode* n, size_t i) {
  const std::vector<std::string> names = value_names(n, true);
  return i < names.size() ? names[i] : "";
}

int64_t int_attr(const OrtNode* n, const char* name, int64_t dflt) {
  int64_t v = dflt;
  node_attr_int(n, name, &v);
  return v;
}

}  // namespace

bool is_cache_node(const OrtNode* node) {
  if (node_domain(node) != kDomain) return false;
  const std::string op = node_op_type(node);
  return op == "CacheAttention" || op == "CacheExport" || op == "CacheCommit" || op == "CacheShape";
}

void check_cache_graph(const std::vector<const OrtNode*>& nodes, CacheGraphInfo* info) {
  struct PerCache {
    std::map<int64_t, std::string> layers;  // layer -> node name
    std::map<int64_t, std::string> shapes;  // CacheShape layer -> node name
    std::set<int64_t> commit_node;          // values of commit_node seen
    int commits = 0;
    std::string error;
  };
  std::map<std::string, PerCache> caches;
  int commit_nodes = 0;
  for (const OrtNode* n : nodes) {
    if (node_domain(n) != kDomain) continue;
    const std::string op = node_op_type(n), name = node_name(n);
    if (op == "CacheAttention") {
      PerCache& c = caches[input_name(n, 3)];
      const int64_t layer = int_attr(n, "layer", -1);
      c.commit_node.insert(int_attr(n, "commit_node", 0));
      auto it = c.layers.find(layer);
      if (it != c.layers.end() && c.error.empty())
        c.error = "CacheAttention nodes " + quoted(it->second) + " and " + quoted(name) + " both have layer=" +
                  std::to_string(layer) + " (every layer index must appear once per cache input)";
      c.layers.emplace(layer, name);
    } else if (op == "CacheShape") {
      caches[input_name(n, 0)].shapes.emplace(int_attr(n, "layer", -1), name);
    } else if (op == "CacheCommit") {
      ++commit_nodes;
      const int64_t k = int_attr(n, "num_caches", 1);
      for (int64_t i = 0; i < k; ++i) ++caches[input_name(n, static_cast<size_t>(i))].commits;
    }
  }
  if (commit_nodes > 1 && info->error.empty())
    info->error = "OnnxLightExecutionProvider: " + std::to_string(commit_nodes) + " CacheCommit nodes in one graph: "
                  "a run has one commit point, its last node (name every cache in one CacheCommit with "
                  "num_caches)";
  for (auto& kv : caches) {
    PerCache& c = kv.second;
    const std::string where = " on cache input " + quoted(kv.first);
    if (c.error.empty() && !c.layers.empty()) {
      int64_t expect = 0;
      for (const auto& l : c.layers) {
        if (l.first != expect) {
          c.error = "no CacheAttention node has layer=" + std::to_string(expect) + where +
                    " (layers must be 0..N-1; the nodes have layers " + std::to_string(c.layers.begin()->first) +
                    ".." + std::to_string(c.layers.rbegin()->first) + ")";
          break;
        }
        ++expect;
      }
    }
    for (const auto& s : c.shapes)
      if (c.error.empty() && !c.layers.empty() && !c.layers.count(s.first))
        c.error = "CacheShape " + quoted(s.second) + " has layer=" + std::to_string(s.first) + where +
                  " but no CacheAttention node has that layer (layers 0.." +
                  std::to_string(c.layers.rbegin()->first) + ")";
    if (c.error.empty() && c.commit_node.size() > 1)
      c.error = "the CacheAttention nodes" + where + " disagree on commit_node (some 0, some 1)";
    if (c.error.empty() && c.commits > 1)
      c.error = std::to_string(c.commits) + " CacheCommit nodes" + where + " (at most one per cache input)";
    if (c.error.empty() && c.commit_node.count(1) && c.commits == 0)
      c.error = "the CacheAttention nodes" + where + " have commit_node=1 but no CacheCommit node commits their step";
    if (c.error.empty() && c.commits == 1 && !c.commit_node.count(1))
      c.error = "CacheCommit" + where + " but its CacheAttention nodes commit at their last layer (commit_node=0)";
    if (!c.error.empty() && info->error.empty()) info->error = "OnnxLightExecutionProvider: " + c.error;
    const int64_t n = static_cast<int64_t>(c.layers.size());
    auto it = info->layers.find(kv.first);
    if (it == info->layers.end()) info->layers.emplace(kv.first, n);
    else if (it->second != n) it->second = 0;  // two graphs disagree: unknown
  }
}

NodeComputeInfo* compile_cache_node(const OrtNode* node, const OrtNode* fused_node, const CacheGraphInfo& info) {
  if (!info.error.empty()) throw std::invalid_argument(info.error);
  const std::string op = node_op_type(node), name = node_name(node);
  const std::vector<std::string> ins = value_names(node, true), outs = value_names(node, false);
  const std::vector<std::string> fins = value_names(fused_node, true), fouts = value_names(fused_node, false);
  if (op == "CacheAttention") {
    auto ci = std::make_unique<CacheComputeInfo<CacheAttentionKernel>>();
    ops::CacheAttentionAttrs& a = ci->kernel.attrs;
    if (!node_attr_int(node, "layer", &a.layer)) throw std::invalid_argument("CacheAttention: attribute 'layer' is required");
    node_attr_int(node, "q_num_heads", &a.q_num_heads);
    node_attr_int(node, "kv_num_heads", &a.kv_num_heads);
    node_attr_float(node, "scale", &a.scale);
    node_attr_int(node, "is_causal", &a.is_causal);
    node_attr_float(node, "softcap", &a.softcap);
    node_attr_int(node, "local_window_size", &a.local_window_size);
    node_attr_int(node, "commit_node", &a.commit_node);
    node_attr_int(node, "rotary_interleaved", &a.rotary_interleaved);
    ops::validate(a);
    auto it = info.layers.find(ins.size() > 3 ? ins[3] : "");
    a.graph_layers = it == info.layers.end() ? 0 : it->second;
    map_by_name(ins, fins, ci->kernel.in);
    int out[1];
    map_by_name(outs, fouts, out);
    ci->kernel.out = out[0];
    ci->kernel.node = name;
    ci->node = name;
    a.node_id = reinterpret_cast<uintptr_t>(ci.get());
    return NodeComputeInfo::init(ci.release());
  }
  if (op == "CacheShape") {
    auto ci = std::make_unique<CacheComputeInfo<CacheShapeKernel>>();
    if (!node_attr_int(node, "layer", &ci->kernel.layer) || ci->kernel.layer < 0)
      throw std::invalid_argument("CacheShape: attribute 'layer' is required and must be >= 0");
    int64_t value = 0;
    node_attr_int(node, "value", &value);
    if (value != 0 && value != 1)
      throw std::invalid_argument("CacheShape: attribute 'value' must be 0 (past key) or 1 (past value); got " +
                                  std::to_string(value));
    ci->kernel.value = value == 1;
    int in[1], out[1];
    map_by_name(ins, fins, in);
    map_by_name(outs, fouts, out);
    ci->kernel.cache_in = in[0];
    ci->kernel.out = out[0];
    ci->kernel.node = name;
    ci->node = name;
    return NodeComputeInfo::init(ci.release());
  }
  if (op == "CacheExport") {
    auto ci = std::make_unique<CacheComputeInfo<CacheExportKernel>>();
    if (!node_attr_int(node, "layer", &ci->kernel.layer) || ci->kernel.layer < 0)
      throw std::invalid_argument("CacheExport: attribute 'layer' is required and must be >= 0");
    int in[1];
    map_by_name(ins, fins, in);
    ci->kernel.cache_in = in[0];
    map_by_name(outs, fouts, ci->kernel.out);
    ci->kernel.node = name;
    ci->node = name;
    return NodeComputeInfo::init(ci.release());
  }
  auto ci = std::make_unique<CacheComputeInfo<CacheCommitKernel>>();
  int64_t num_caches = 1;
  node_attr_int(node, "num_caches", &num_caches);
  if (num_caches < 1 || static_cast<size_t>(num_caches) > ins.size())
    throw std::invalid_argument("CacheCommit: attribute 'num_caches' must be in [1, inputs=" +
                                std::to_string(ins.size()) + "]; got " + std::to_string(num_caches));
  ci->kernel.cache_in.clear();
  for (int64_t i = 0; i < num_caches; ++i) {
    int idx[1];
    map_by_name(std::vector<std::string>{ins[static_cast<size_t>(i)]}, fins, idx);
    ci->kernel.cache_in.push_back(idx[0]);
  }
  int out[1];
  map_by_name(outs, fouts, out);
  ci->kernel.out = out[0];
  ci->kernel.node = name;
  ci->node = name;
  return NodeComputeInfo::init(ci.release());
}

}  // namespace provider
}  // namespace olep
