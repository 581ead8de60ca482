// The host activation pager: round trips, slot reuse across steps, size classes, statistics.
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "check.hpp"
#include "trainstream/activation_pager.hpp"
#include "trainstream/errors.hpp"

using namespace trainstream;

namespace {
std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
}  // namespace

TEST_CASE("round trip restores every byte") {
  HostActivationPager pager;
  std::vector<std::uint8_t> src(3 * 1000 * 1000 + 7), dst(src.size(), 0);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 131 + 7);
  auto paged = pager.page_out(addr(src.data()), src.size(), 0);
  std::memset(src.data(), 0, 16);  // the host copy was taken at page_out
  pager.page_in(*paged, addr(dst.data()), 0);
  pager.order_after_page_in(*paged, 0);
  CHECK(dst[0] == 7);
  CHECK(std::memcmp(dst.data() + 16, src.data() + 16, src.size() - 16) == 0);
  const auto s = pager.stats();
  CHECK(s.paged_out_bytes == src.size());
  CHECK(s.paged_in_bytes == src.size());
  CHECK(s.slots == 1);
  CHECK(s.in_use_bytes >= src.size());
}

TEST_CASE("slots are reused step after step") {
  HostActivationPager pager;
  std::vector<float> a(1 << 20), b(300000);
  std::size_t slots_after_first = 0, reserved_after_first = 0;
  for (int step = 0; step < 10; ++step) {
    std::vector<std::shared_ptr<PagedActivation>> saved;
    for (int block = 0; block < 4; ++block) {
      saved.push_back(pager.page_out(addr(a.data()), a.size() * 4, 0));
      saved.push_back(pager.page_out(addr(b.data()), b.size() * 4, 0));
    }
    if (step == 0) {
      slots_after_first = pager.stats().slots;
      reserved_after_first = pager.stats().reserved_bytes;
    }
    saved.clear();  // backward done: every slot back in the pool
    CHECK(pager.stats().in_use_bytes == 0);
  }
  CHECK(slots_after_first == 8);
  CHECK(pager.stats().slots == slots_after_first);
  CHECK(pager.stats().reserved_bytes == reserved_after_first);
}

TEST_CASE("trim gives back the slots a plan no longer uses, and keeps the ones it does") {
  HostActivationPager pager;
  std::vector<float> big(64 << 20);  // 256 MiB: a slab of its own
  std::vector<float> small(1 << 20);
  {
    std::vector<std::shared_ptr<PagedActivation>> saved;  // a profiled step pages both
    saved.push_back(pager.page_out(addr(big.data()), big.size() * 4, 0));
    saved.push_back(pager.page_out(addr(small.data()), small.size() * 4, 0));
  }
  const std::size_t profiled = pager.stats().reserved_bytes;
  CHECK(pager.trim() == 0);  // nothing marked yet: nothing is given back
  pager.mark();              // the plan starts: it pages the small one only
  pager.page_out(addr(small.data()), small.size() * 4, 0).reset();
  const std::size_t freed = pager.trim();
  CHECK(freed >= big.size() * 4);
  CHECK(pager.stats().reserved_bytes == profiled - freed);
  CHECK(pager.stats().slots == 1);
  std::vector<float> back(small.size());  // the kept slot still pages exactly
  small[12345] = 7.5f;
  auto paged = pager.page_out(addr(small.data()), small.size() * 4, 0);
  pager.page_in(*paged, addr(back.data()), 0);
  CHECK(back[12345] == 7.5f);
  CHECK(pager.stats().slots == 1);
  pager.mark();  // a plan that pages nothing: the live slot stays, the rest goes
  CHECK(pager.trim() == 0);
  paged.reset();
  pager.mark();
  pager.trim();
  CHECK(pager.stats().slots == 0);
  CHECK(pager.stats().reserved_bytes == 0);
}

TEST_CASE("size classes round up and never shrink a request") {
  CHECK(SlotPool::size_class(1) == (64u << 10));
  CHECK(SlotPool::size_class(64u << 10) == (64u << 10));
  CHECK(SlotPool::size_class((1u << 20) + 1) == (2u << 20));
  for (std::size_t n : {std::size_t(1), std::size_t(65537), std::size_t(5) << 20, std::size_t(123456789)}) {
    CHECK(SlotPool::size_class(n) >= n);
  }
}

TEST_CASE("bad input is refused") {
  HostActivationPager pager;
  std::vector<char> buf(16);
  CHECK_THROWS_AS(pager.page_out(0, 16, 0), std::invalid_argument);
  CHECK_THROWS_AS(pager.page_out(addr(buf.data()), 0, 0), std::invalid_argument);
}

TS_TEST_MAIN
