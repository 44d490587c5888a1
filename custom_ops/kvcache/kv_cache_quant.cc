// KVCache: cold-page quantization (see kv_cache.h, quantize.h).
#include <algorithm>
#include <unordered_map>
#include <vector>

#include "kvcache/kv_cache.h"
#include "kvcache/quantize.h"

namespace olep {

void KVCache::quantize_cold_locked() noexcept {
  if (g_.kv_quant == KVQuant::kNone) return;
  const int64_t B = g_.batch_size, H = g_.kv_num_heads, P = g_.page_tokens, R = g_.recent_tokens;
  const uint8_t enc = static_cast<uint8_t>(g_.kv_quant);  // the KVEncoding of its pages
  // A native page shared by several sequences of this cache (a fork with repeated indices, a
  // beam reorder) becomes one quantized page they all share; nullptr = left native (not finite).
  std::unordered_map<const Page*, Page*> done;
  try {
    for (int64_t l = 0; l < g_.num_layers; ++l)
      for (int64_t b = 0; b < B; ++b) {
        PageTable& t = content_.table(l, b, B);
        const int64_t len = content_.lens[static_cast<size_t>(b)];
        const int64_t end = std::min(len > R ? (len - R) / P : 0, t.end_block(H));  // wholly before len - R
        const int64_t begin = std::max({t.quant_next, t.first_block, g_.first_quant_block()});
        // Head by head, so that one head's quantized pages come from the pool one after another
        // (in address order on fresh slabs) and the kernel reads them as one stream, as a
        // step's native pages (step.cc). A refused page leaves quant_next at `begin`: the
        // pages already quantized are skipped by their encoding on the next commit.
        for (int64_t h = 0; h < H; ++h)
          for (int64_t blk = begin; blk < end; ++blk) {
            Page*& slot = t.at(blk, h, H);
            if (slot->encoding == enc) continue;
            Page* q = nullptr;
            auto it = done.find(slot);
            if (it != done.end()) {
              q = it->second;
              if (q) pool_->retain(&q, 1);
            } else {
              std::vector<Page*> one;
              pool_->allocate(g_.quant_page_bytes(), 1, &one);  // MemoryLimitError: stop here
              q = one[0];
              if (quant::quantize_page(g_, slot->data, q->data)) {
                q->encoding = enc;
              } else {
                pool_->release(one);
                q = nullptr;
              }
              done[slot] = q;
            }
            if (!q) continue;  // inf, NaN or huge values in the page: it stays native
            content_.holds.remove(slot);
            Page* old = slot;
            slot = q;
            content_.holds.add(q);
            // This table's reference goes at once (not at the end): under a pool budget the
            // native bytes it frees let the next int8 page be allocated. Other holders keep
            // theirs (another sequence of this cache gets the same int8 page from done[]).
            pool_->release(&old, 1);
          }
        t.quant_next = std::max(t.quant_next, end);
      }
  } catch (...) {
    // The pool's budget (or the OS) refused a page: what is quantized stays so, the rest stays
    // native until a later commit (quant_next was not advanced past the refused block).
  }
}

}  // namespace olep
