#include "provider/node_util.h"

namespace olep {
namespace provider {

namespace {
void release(OrtStatus* st) {
  if (st) api().ReleaseStatus(st);
}

// The attribute `name` of n, or nullptr when absent.
const OrtOpAttr* find_attr(const OrtNode* n, const char* name) {
  const OrtOpAttr* a = nullptr;
  OrtStatus* st = api().Node_GetAttributeByName(n, name, &a);
  if (st) {
    release(st);
    return nullptr;
  }
  return a;
}

// A scalar attribute of `type` into *v; false when absent or of another type.
template <class T>
bool read_scalar_attr(const OrtNode* n, const char* name, OrtOpAttrType type, T* v) {
  const OrtOpAttr* a = find_attr(n, name);
  if (a == nullptr) return false;
  size_t out = 0;
  OrtStatus* st = api().ReadOpAttr(a, type, v, sizeof(*v), &out);
  const bool ok = st == nullptr;
  release(st);
  return ok;
}

}  // namespace

bool node_attr_int(const OrtNode* n, const char* name, int64_t* v) {
  return read_scalar_attr(n, name, ORT_OP_ATTR_INT, v);
}

bool node_attr_float(const OrtNode* n, const char* name, float* v) {
  return read_scalar_attr(n, name, ORT_OP_ATTR_FLOAT, v);
}

bool node_attr_string(const OrtNode* n, const char* name, std::string* v) {
  const OrtOpAttr* a = find_attr(n, name);
  if (a == nullptr) return false;
  size_t size = 0;
  OrtStatus* st = api().ReadOpAttr(a, ORT_OP_ATTR_STRING, nullptr, 0, &size);
  release(st);  // fails with the size needed
  std::string buf(size, '\0');
  st = api().ReadOpAttr(a, ORT_OP_ATTR_STRING, size ? &buf[0] : nullptr, size, &size);
  if (st) {
    release(st);
    return false;
  }
  buf.resize(size);
  while (!buf.empty() && buf.back() == '\0') buf.pop_back();
  *v = buf;
  return true;
}

// Names of the attributes a node carries.
std::vector<std::string> attribute_names(const OrtNode* n) {
  size_t count = 0;
  check(api().Node_GetNumAttributes(n, &count));
  std::vector<const OrtOpAttr*> attrs(count, nullptr);
  if (count) check(api().Node_GetAttributes(n, attrs.data(), count));
  std::vector<std::string> names;
  for (const OrtOpAttr* a : attrs) {
    const char* name = nullptr;
    if (a) check(api().OpAttr_GetName(a, &name));
    if (name) names.push_back(name);
  }
  return names;
}

// Names of a node's inputs or outputs ("" for an omitted optional one).
std::vector<std::string> value_names(const OrtNode* n, bool inputs) {
  size_t count = 0;
  check(inputs ? api().Node_GetNumInputs(n, &count) : api().Node_GetNumOutputs(n, &count));
  std::vector<const OrtValueInfo*> vi(count, nullptr);
  if (count) check(inputs ? api().Node_GetInputs(n, vi.data(), count) : api().Node_GetOutputs(n, vi.data(), count));
  std::vector<std::string> names;
  for (const OrtValueInfo* v : vi) {
    const char* name = nullptr;
    if (v) check(api().GetValueInfoName(v, &name));
    names.push_back(name ? name : "");
  }
  return names;
}

ONNXTensorElementDataType input_type(const OrtNode* n, size_t index) {
  size_t count = 0;
  check(api().Node_GetNumInputs(n, &count));
  if (index >= count) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<const OrtValueInfo*> vi(count, nullptr);
  check(api().Node_GetInputs(n, vi.data(), count));
  if (!vi[index]) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  const OrtTypeInfo* ti = nullptr;
  check(api().GetValueInfoTypeInfo(vi[index], &ti));
  const OrtTensorTypeAndShapeInfo* tsi = nullptr;
  check(api().CastTypeInfoToTensorInfo(ti, &tsi));
  if (!tsi) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  ONNXTensorElementDataType t;
  check(api().GetTensorElementType(tsi, &t));
  return t;
}

std::string node_domain(const OrtNode* n) {
  const char* d = nullptr;
  check(api().Node_GetDomain(n, &d));
  return d ? d : "";
}

std::string node_op_type(const OrtNode* n) {
  const char* t = nullptr;
  check(api().Node_GetOperatorType(n, &t));
  return t ? t : "";
}

std::string node_name(const OrtNode* n) {
  const char* s = nullptr;
  check(api().Node_GetName(n, &s));
  return s ? s : "";
}

}  // namespace provider
}  // namespace olep
