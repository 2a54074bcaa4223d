// The host block cache (infinity/store/host_cache.py): torch's CPU allocator, with freed blocks of at
// least `min_bytes` kept for reuse, up to `cap_bytes` of them, instead of unmapped.
//
// Blocks at or above the threshold are mapped whole (mmap) and sized by class: steps of 1 MiB, or an
// eighth of the size's power of two where that is more, so a request wastes at most 1/8 and the
// blocks a step makes again and again (the same shapes every layer) meet the same class. A freed block
// goes to its class's free list; where that would pass the cap, the blocks freed longest ago are
// unmapped to make room (a block larger than the cap is unmapped itself).
// Smaller requests go to the allocator this one replaced, untouched.
//
// A data pointer is its own context (a "simple" data pointer, as torch's own CPU allocator makes), so
// the deleter finds the block's class in a map; a pointer not there came from the replaced allocator's
// raw path and goes back to its raw deleter.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

struct HostCache final : c10::Allocator {
  c10::Allocator* base = nullptr;
  c10::DeleterFnPtr base_raw = nullptr;
  std::atomic<size_t> min_bytes{0}, cap_bytes{0};
  std::mutex mu;
  std::unordered_map<void*, size_t> in_use;    // our blocks handed out -> their class's size
  // cached blocks: by class (most recently freed last), and all of them by when they were freed
  std::unordered_map<size_t, std::vector<std::pair<void*, unsigned long long>>> free;
  std::map<unsigned long long, std::pair<void*, size_t>> by_age;
  unsigned long long clock = 0;
  size_t cached = 0, in_use_bytes = 0, peak_cached = 0;
  long long hits = 0, misses = 0, dropped = 0;

  static size_t size_class(size_t n) {
    size_t step = size_t(1) << 20;
    size_t pow2 = size_t(1) << (63 - __builtin_clzll(n));
    if (pow2 / 8 > step) step = pow2 / 8;
    return (n + step - 1) / step * step;
  }

  c10::DataPtr allocate(size_t n) override {
    size_t cap = cap_bytes.load(std::memory_order_relaxed);
    if (cap == 0 || n == 0 || n < min_bytes.load(std::memory_order_relaxed)) return base->allocate(n);
    size_t sz = size_class(n);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = free.find(sz);
      if (it != free.end() && !it->second.empty()) {
        p = it->second.back().first;
        by_age.erase(it->second.back().second);
        it->second.pop_back();
        cached -= sz;
        hits++;
      } else {
        misses++;
      }
    }
    if (p == nullptr) {
      p = mmap(nullptr, sz, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return base->allocate(n);   // its own out-of-memory error, if any
    }
    {
      std::lock_guard<std::mutex> g(mu);
      in_use[p] = sz;
      in_use_bytes += sz;
    }
    return {p, p, &HostCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* p);

  // Under the lock: take the least recently freed cached blocks out until at most `keep` bytes stay
  // cached, into `out` (unmapped by the caller, outside the lock).
  void take_oldest(size_t keep, std::vector<std::pair<void*, size_t>>& out) {
    while (cached > keep && !by_age.empty()) {
      auto oldest = by_age.begin();
      void* p = oldest->second.first;
      size_t sz = oldest->second.second;
      auto& blocks = free[sz];
      for (auto b = blocks.begin(); b != blocks.end(); ++b) {
        if (b->first == p) {
          blocks.erase(b);
          break;
        }
      }
      by_age.erase(oldest);
      cached -= sz;
      out.emplace_back(p, sz);
    }
  }

  // Unmap cached blocks, least recently freed first, until at most `keep` bytes stay cached; the bytes
  // unmapped.
  size_t trim(size_t keep) {
    std::vector<std::pair<void*, size_t>> out;
    {
      std::lock_guard<std::mutex> g(mu);
      take_oldest(keep, out);
    }
    return unmap(out);
  }

  static size_t unmap(const std::vector<std::pair<void*, size_t>>& blocks) {
    size_t n = 0;
    for (auto& b : blocks) {
      munmap(b.first, b.second);
      n += b.second;
    }
    return n;
  }
};

HostCache* g_cache = nullptr;   // never deleted: blocks it handed out may outlive everything else

void HostCache::release(void* p) {
  HostCache* c = g_cache;
  size_t sz = 0;
  bool keep = false;
  std::vector<std::pair<void*, size_t>> evicted;
  {
    std::lock_guard<std::mutex> g(c->mu);
    auto it = c->in_use.find(p);
    if (it != c->in_use.end()) {
      sz = it->second;
      c->in_use.erase(it);
      c->in_use_bytes -= sz;
      size_t cap = c->cap_bytes.load(std::memory_order_relaxed);
      keep = sz <= cap;
      if (keep) {   // the blocks freed longest ago make room: the shapes just used come back soonest
        c->take_oldest(cap - sz, evicted);
        c->free[sz].emplace_back(p, ++c->clock);
        c->by_age[c->clock] = {p, sz};
        c->cached += sz;
        if (c->cached > c->peak_cached) c->peak_cached = c->cached;
      }
      c->dropped += (long long)evicted.size() + (keep ? 0 : 1);
    }
  }
  if (sz == 0) {
    if (p != nullptr && c->base_raw != nullptr) c->base_raw(p);
    return;
  }
  HostCache::unmap(evicted);
  if (!keep) munmap(p, sz);
}

}  // namespace

extern "C" {

// Make the cache torch's CPU allocator (once per process) and set its threshold and cap; a lower cap
// unmaps the excess at once. Returns 1 when torch's CPU allocator is the cache, else 0.
int infinity_host_cache_set(long long min_bytes, long long cap_bytes) {
  if (g_cache == nullptr) {
    auto* c = new HostCache();
    c->base = c10::GetCPUAllocator();
    c->base_raw = c->base->raw_deleter();
    g_cache = c;
    // a fork (a DataLoader's workers) while another thread holds the lock must not leave the child's
    // copy locked for good: the forking thread takes it first and both sides let it go after
    pthread_atfork([] { g_cache->mu.lock(); }, [] { g_cache->mu.unlock(); }, [] { g_cache->mu.unlock(); });
    c10::SetCPUAllocator(c, /*priority=*/100);
  }
  g_cache->min_bytes.store(size_t(min_bytes));
  g_cache->cap_bytes.store(size_t(cap_bytes));
  g_cache->trim(size_t(cap_bytes));
  return c10::GetCPUAllocator() == g_cache ? 1 : 0;
}

long long infinity_host_cache_trim(long long keep_bytes) {
  return g_cache == nullptr ? 0 : (long long)g_cache->trim(size_t(keep_bytes));
}

// The most bytes cached at once since the last call (or since the start); the next window starts now.
long long infinity_host_cache_take_peak() {
  if (g_cache == nullptr) return 0;
  std::lock_guard<std::mutex> g(g_cache->mu);
  long long peak = (long long)g_cache->peak_cached;
  g_cache->peak_cached = g_cache->cached;
  return peak;
}

// cached bytes, bytes handed out and not yet freed, hits, misses, blocks unmapped to keep the cap, peak cached in this window
void infinity_host_cache_stats(long long* out) {
  for (int i = 0; i < 6; i++) out[i] = 0;
  if (g_cache == nullptr) return;
  std::lock_guard<std::mutex> g(g_cache->mu);
  out[0] = (long long)g_cache->cached;
  out[1] = (long long)g_cache->in_use_bytes;
  out[2] = g_cache->hits;
  out[3] = g_cache->misses;
  out[4] = g_cache->dropped;
  out[5] = (long long)g_cache->peak_cached;
}

}  // extern "C"
