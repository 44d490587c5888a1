// KVCache::save / KVCache::load: a versioned file with the geometry, the
// lengths and the valid rows of every (layer, sequence, kv head).
//
// Layout (little-endian, as this library only runs on x86-64):
//   bytes 0..7    magic "OLKVCACH"
//   u32           format version (3)
//   u32           header size in bytes (from the start of the file)
//   i64 x 12      num_layers, batch_size, kv_num_heads, head_dim, v_head_dim,
//                 max_sequence_length, dtype (0 f32, 1 f16, 2 bf16), page_tokens,
//                 rollback_tokens, kv_quant (0 none, 1 int8, 2 int4), recent_tokens, sink_tokens
//   i64 x L       sliding_window per layer (0 = none)
//   i64 x B       seq_lens
//   i64 x L*B     first position held per (layer, sequence) (> 0 after eviction)
//   i64 x L*B     first block cold-page quantization has not considered, per (layer, sequence)
//   block map     u8 per (layer, sequence, block held, head): 0 native, 1 int8, 2 int4 (KVEncoding)
//   payload       for layer, sequence, head, block held: a native block's valid K rows then its
//                 V rows; a quantized block (always full) as its page stores it: codes, then
//                 scales (and int4 minimums) (quantize.h), so values survive exactly
//   u64           checksum of every byte before it (64-bit FNV-1a over 8-byte words)
// save() writes to "<path>.tmp" and renames it over `path`, so a reader never sees a partial
// file. load() checks magic, version, every geometry field, the exact file size and the
// checksum, and that each quantized page holds only what its codec writes (quant::valid_page); on
// any mismatch it throws std::invalid_argument naming what is wrong and creates
// nothing (the pool is left as it was; the file is only read).
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache.h"
#include "kvcache/quantize.h"

namespace olep {
namespace {

constexpr char kMagic[8] = {'O', 'L', 'K', 'V', 'C', 'A', 'C', 'H'};
constexpr uint32_t kVersion = 3;  // 3: int8 V codes in row pairs, int4 pages (kernels/kv_block.h)
constexpr int kFixedFields = 12;

std::string str(int64_t v) { return std::to_string(v); }

struct Checksum {
  uint64_t h = 1469598103934665603ULL;
  void add(const void* data, size_t n) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      h = (h ^ w) * 1099511628211ULL;
    }
    for (; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  }
};

struct File {
  std::FILE* f = nullptr;
  explicit File(std::FILE* fp) : f(fp) {}
  ~File() {
    if (f) std::fclose(f);
  }
};

class Writer {
 public:
  Writer(std::FILE* f, const std::string& path) : f_(f), path_(path) {}
  void put(const void* data, size_t n) {
    if (n && std::fwrite(data, 1, n, f_) != n) throw std::runtime_error("could not write " + path_);
    sum_.add(data, n);
  }
  void put_i64(int64_t v) { put(&v, sizeof(v)); }
  uint64_t checksum() const { return sum_.h; }

 private:
  std::FILE* f_;
  std::string path_;
  Checksum sum_;
};

class Reader {
 public:
  Reader(std::FILE* f, const std::string& path) : f_(f), path_(path) {}
  void get(void* data, size_t n, const char* what) {
    if (n && std::fread(data, 1, n, f_) != n)
      throw std::invalid_argument(path_ + ": the file is truncated (while reading " + what + ")");
    sum_.add(data, n);
  }
  int64_t get_i64(const char* what) {
    int64_t v;
    get(&v, sizeof(v), what);
    return v;
  }
  uint64_t checksum() const { return sum_.h; }

 private:
  std::FILE* f_;
  std::string path_;
  Checksum sum_;
};

}  // namespace

void KVCache::save(const std::string& path) const {
  std::lock_guard<std::mutex> lk(mu_);
  drop_stale_step_locked();
  const int64_t L = g_.num_layers, B = g_.batch_size, H = g_.kv_num_heads, P = g_.page_tokens;
  const std::string tmp = path + ".tmp";
  File file(std::fopen(tmp.c_str(), "wb"));
  if (!file.f) throw std::runtime_error("could not open " + tmp + " for writing");
  try {
    Writer w(file.f, tmp);
    w.put(kMagic, sizeof(kMagic));
    const uint32_t version = kVersion;
    const int64_t header_bytes = 16 + 8 * (kFixedFields + L + B + 2 * L * B);
    if (header_bytes > static_cast<int64_t>(UINT32_MAX))
      throw std::runtime_error("could not save: the header of " + str(header_bytes) + " bytes exceeds the format's 4 GiB");
    const uint32_t header = static_cast<uint32_t>(header_bytes);
    w.put(&version, sizeof(version));
    w.put(&header, sizeof(header));
    for (int64_t v : {g_.num_layers, g_.batch_size, g_.kv_num_heads, g_.head_dim, g_.v_head_dim,
                      g_.max_sequence_length, static_cast<int64_t>(g_.dtype), g_.page_tokens, g_.rollback_tokens,
                      static_cast<int64_t>(g_.kv_quant), g_.recent_tokens, g_.sink_tokens})
      w.put_i64(v);
    for (int64_t l = 0; l < L; ++l) w.put_i64(g_.window(l));
    for (int64_t b = 0; b < B; ++b) w.put_i64(content_.lens[static_cast<size_t>(b)]);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t b = 0; b < B; ++b) w.put_i64(content_.table(l, b, B).first_block * P);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t b = 0; b < B; ++b) w.put_i64(content_.table(l, b, B).quant_next);
    std::vector<uint8_t> block_map;  // one put: the checksum runs over 8-byte words of each put
    for (int64_t l = 0; l < L; ++l)
      for (int64_t b = 0; b < B; ++b)
        for (const Page* pg : content_.table(l, b, B).pages) block_map.push_back(pg->encoding);
    w.put(block_map.data(), block_map.size());
    const size_t es = g_.elem_bytes();
    const size_t krow = static_cast<size_t>(g_.head_dim) * es, vrow = static_cast<size_t>(g_.v_head_dim) * es;
    const size_t qbytes = static_cast<size_t>(g_.quant_scale_offset() + g_.quant_meta_bytes());
    std::vector<KVBlock> blocks;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t b = 0; b < B; ++b) {
        const PageTable& t = content_.table(l, b, B);
        for (int64_t h = 0; h < H; ++h) {
          blocks.clear();
          append_blocks(g_, t.first_block, 0, content_.lens[static_cast<size_t>(b)],
                        [&](int64_t blk) { return t.at(blk, h, H); }, &blocks);
          for (const KVBlock& kb : blocks) {
            if (kb.encoding != KVEncoding::kNative) {
              w.put(t.at(kb.first_position / P, h, H)->data, qbytes);
            } else {
              w.put(kb.key, static_cast<size_t>(kb.num_rows) * krow);
              w.put(kb.value, static_cast<size_t>(kb.num_rows) * vrow);
            }
          }
        }
      }
    const uint64_t sum = w.checksum();
    if (std::fwrite(&sum, 1, sizeof(sum), file.f) != sizeof(sum) || std::fflush(file.f) != 0)
      throw std::runtime_error("could not write " + tmp);
  } catch (...) {
    std::fclose(file.f);
    file.f = nullptr;
    std::remove(tmp.c_str());
    throw;
  }
  std::fclose(file.f);
  file.f = nullptr;
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("could not move " + tmp + " to " + path);
  }
}

std::unique_ptr<KVCache> KVCache::load(const std::string& path, std::shared_ptr<PagePool> pool) {
  File file(std::fopen(path.c_str(), "rb"));
  if (!file.f) throw std::invalid_argument(path + ": cannot open the file for reading");
  std::fseek(file.f, 0, SEEK_END);
  const long file_size = std::ftell(file.f);
  std::fseek(file.f, 0, SEEK_SET);
  Reader r(file.f, path);
  char magic[8];
  r.get(magic, sizeof(magic), "the magic");
  if (std::memcmp(magic, kMagic, sizeof(magic)) != 0)
    throw std::invalid_argument(path + ": not a KVCache file (wrong magic; expected \"OLKVCACH\")");
  uint32_t version = 0, header = 0;
  r.get(&version, sizeof(version), "the version");
  if (version != kVersion)
    throw std::invalid_argument(path + ": format version " + str(version) + "; this library reads version " +
                                str(kVersion));
  r.get(&header, sizeof(header), "the header size");
  CacheGeometry g;
  g.num_layers = r.get_i64("num_layers");
  g.batch_size = r.get_i64("batch_size");
  g.kv_num_heads = r.get_i64("kv_num_heads");
  g.head_dim = r.get_i64("head_dim");
  g.v_head_dim = r.get_i64("v_head_dim");
  g.max_sequence_length = r.get_i64("max_sequence_length");
  const int64_t dtype = r.get_i64("dtype");
  g.page_tokens = r.get_i64("page_tokens");
  g.rollback_tokens = r.get_i64("rollback_tokens");
  const int64_t kv_quant = r.get_i64("kv_quant");
  g.recent_tokens = r.get_i64("recent_tokens");
  g.sink_tokens = r.get_i64("sink_tokens");
  if (dtype < 0 || dtype > 2) throw std::invalid_argument(path + ": bad dtype code " + str(dtype));
  if (kv_quant < 0 || kv_quant > 2) throw std::invalid_argument(path + ": bad kv_quant code " + str(kv_quant));
  g.dtype = static_cast<DType>(dtype);
  g.kv_quant = static_cast<KVQuant>(kv_quant);
  try {
    if (g.num_layers < 1 || g.num_layers > 4096 || g.batch_size < 1 || g.batch_size > 65536)
      throw std::invalid_argument("num_layers or batch_size out of range");
    g.sliding_window.resize(static_cast<size_t>(g.num_layers));
    for (auto& w : g.sliding_window) w = r.get_i64("sliding_window");
    bool any = false;
    for (int64_t w : g.sliding_window) any = any || w > 0;
    if (!any) g.sliding_window.clear();
    g.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(path + ": bad geometry in the header: " + e.what());
  }
  const int64_t L = g.num_layers, B = g.batch_size, H = g.kv_num_heads, P = g.page_tokens;
  // In 64 bits (L * B reaches 2^28: a 32-bit size wraps), and within the file, before the
  // per-(layer, sequence) arrays are allocated.
  const int64_t header_bytes = 16 + 8 * (kFixedFields + L + B + 2 * L * B);
  if (static_cast<int64_t>(header) != header_bytes)
    throw std::invalid_argument(path + ": header size " + str(header) + " does not match its geometry (" +
                                str(header_bytes) + " bytes)");
  if (header_bytes > file_size)
    throw std::invalid_argument(path + ": the header describes " + str(header_bytes) + " bytes of header; the file "
                                "has " + str(file_size) + " (truncated or not a complete KVCache file)");
  std::vector<int64_t> lens(static_cast<size_t>(B)), first(static_cast<size_t>(L * B)),
      qnext(static_cast<size_t>(L * B));
  for (auto& v : lens) v = r.get_i64("seq_lens");
  for (auto& v : first) v = r.get_i64("first positions");
  for (auto& v : qnext) v = r.get_i64("quantization marks");
  const size_t es = dtype_size(g.dtype);
  const size_t krow = static_cast<size_t>(g.head_dim) * es, vrow = static_cast<size_t>(g.v_head_dim) * es;
  const int64_t qbytes = g.quant_scale_offset() + g.quant_meta_bytes();
  int64_t blocks = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[static_cast<size_t>(b)];
    if (len < 0 || len > g.max_sequence_length)
      throw std::invalid_argument(path + ": seq_lens[" + str(b) + "] = " + str(len) + " is out of range");
    for (int64_t l = 0; l < L; ++l) {
      const int64_t f = first[static_cast<size_t>(l * B + b)], q = qnext[static_cast<size_t>(l * B + b)];
      if (f < 0 || f % P != 0 || f > len || (f > 0 && g.window(l) <= 0))
        throw std::invalid_argument(path + ": first position " + str(f) + " of layer " + str(l) + ", sequence " +
                                    str(b) + " is inconsistent with its length and window");
      if (q < 0 || q > (len + P - 1) / P)
        throw std::invalid_argument(path + ": quantization mark " + str(q) + " of layer " + str(l) + ", sequence " +
                                    str(b) + " is past its length");
      // Bounded: len <= 2^24 and H <= 4096 (validated): the sum fits.
      blocks += ((len + P - 1) / P - f / P) * H;
    }
  }
  if (blocks > file_size)
    throw std::invalid_argument(path + ": the header describes more blocks than the file's " + str(file_size) +
                                " bytes hold (truncated or not a complete KVCache file)");
  std::vector<uint8_t> enc(static_cast<size_t>(blocks));
  r.get(enc.data(), enc.size(), "the block map");
  int64_t payload = 0, natives = 0, quants = 0;
  size_t e = 0;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t f = first[static_cast<size_t>(l * B + b)], len = lens[static_cast<size_t>(b)];
      for (int64_t blk = f / P; blk < (len + P - 1) / P; ++blk)
        for (int64_t h = 0; h < H; ++h, ++e) {
          const int64_t rows = std::min(P, len - blk * P);
          if (enc[e] > 2 || (enc[e] != 0 && (static_cast<int64_t>(g.kv_quant) != enc[e] || rows != P)))
            throw std::invalid_argument(path + ": block map entry " + str(static_cast<int64_t>(enc[e])) +
                                        " of layer " + str(l) + ", sequence " + str(b) + ", block " + str(blk) +
                                        " is not valid for this cache (0 native; 1 int8 / 2 int4: full pages of a"
                                        " cache of that kv_quant)");
          if (enc[e] != 0) {
            payload += qbytes;
            ++quants;
          } else {
            payload += rows * static_cast<int64_t>(krow + vrow);
            ++natives;
          }
          if (payload > file_size)
            throw std::invalid_argument(path + ": the header describes more rows than the file's " +
                                        str(file_size) + " bytes hold (truncated or not a complete KVCache file)");
        }
    }
  const int64_t expect = static_cast<int64_t>(header) + blocks + payload + 8;
  if (file_size != expect)
    throw std::invalid_argument(path + ": the file has " + str(file_size) + " bytes; its header describes " +
                                str(expect) + " (truncated or not a complete KVCache file)");
  const int64_t need = natives * g.page_bytes() + quants * g.quant_page_bytes();
  if (g.memory_limit_bytes > 0 && need > g.memory_limit_bytes)
    throw MemoryLimitError("loading needs " + str(need) + " bytes of pages");
  auto cache = std::make_unique<KVCache>(g, std::move(pool));
  std::vector<Page*> got_native, got_quant;
  cache->pool_->allocate(g.page_bytes(), natives, &got_native);  // all or nothing, with the next one:
  try {
    cache->pool_->allocate(g.quant_page_bytes(), quants, &got_quant);
  } catch (...) {
    cache->pool_->release(got_native);
    throw;
  }
  CacheContent& c = cache->content_;
  c.lens = lens;
  size_t kn = 0, kq = 0;
  e = 0;
  // Thrown once every page is in a table (the cache's destructor then releases them all).
  std::string bad_page;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t b = 0; b < B; ++b) {
      PageTable& t = c.table(l, b, B);
      const int64_t f = first[static_cast<size_t>(l * B + b)], len = lens[static_cast<size_t>(b)];
      t.first_block = f / P;
      t.quant_next = qnext[static_cast<size_t>(l * B + b)];
      // head by head, as a step takes its pages (step.cc): one head's pages in a row
      const int64_t nblk = std::max<int64_t>(0, (len + P - 1) / P - t.first_block);
      t.pages.assign(static_cast<size_t>(nblk * H), nullptr);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < nblk; ++i) {
          const size_t at = static_cast<size_t>(i * H + h);
          Page* pg = enc[e + at] != 0 ? got_quant[kq++] : got_native[kn++];
          pg->encoding = enc[e + at];
          t.pages[at] = pg;
          c.holds.add(pg);
        }
      e += static_cast<size_t>(nblk * H);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t blk = t.first_block; blk < (len + P - 1) / P; ++blk) {
          Page* pg = t.at(blk, h, H);
          if (pg->encoding != 0) {
            r.get(pg->data, static_cast<size_t>(qbytes), "rows");
            if (bad_page.empty() && !quant::valid_page(g, pg->data))
              bad_page = "layer " + str(l) + ", sequence " + str(b) + ", head " + str(h) + ", block " + str(blk);
          } else {
            const size_t n = static_cast<size_t>(std::min(P, len - blk * P));
            r.get(pg->data, n * krow, "rows");
            r.get(pg->data + g.value_offset(), n * vrow, "rows");
          }
        }
    }
  const uint64_t sum = r.checksum();
  uint64_t stored = 0;
  if (std::fread(&stored, 1, sizeof(stored), file.f) != sizeof(stored) || stored != sum)
    throw std::invalid_argument(path + ": checksum mismatch (the file is corrupted)");
  if (!bad_page.empty())
    throw std::invalid_argument(path + ": the quantized page of " + bad_page +
                                " holds values its codec never writes (a NaN, infinite or negative scale, a"
                                " non-finite minimum or int8 code -128): the file is corrupted");
  cache->bytes_appended_ = 0;
  cache->quantize_cold_locked();  // as after a commit (a file written by an earlier policy run)
  return cache;
}

}  // namespace olep
