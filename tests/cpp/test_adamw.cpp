// Host AdamW engine: every vector kernel against the scalar reference (bit for bit), the
// threaded engine against one kernel call, bf16 rounding, and argument validation.
//
// AVX-512 cases run only on CPUs that have it; elsewhere they print a SKIP line saying why.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "check.hpp"
#include "../../cpp/src/adamw/adamw8bit_kernels.hpp"  // both AVX-512 decodes, side by side
#include "trainstream/adamw.hpp"
#include "trainstream/adamw8bit.hpp"
#include "trainstream/errors.hpp"

using namespace trainstream;

namespace {

const std::size_t kSizes[] = {1, 15, 16, 17, 31, 4099, 100003};
const Isa kVectorIsas[] = {Isa::avx2, Isa::avx512};

void skip(const std::string& what, const std::string& why) {
  std::printf("  [SKIP] %s: %s\n", what.c_str(), why.c_str());
}

// SplitMix64: deterministic, and different for every (seed, index).
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1).
float unit(std::uint64_t seed, std::size_t i) {
  return static_cast<float>(mix(seed * 0x100000001b3ull + i) >> 40) / 8388608.0f - 1.0f;
}

std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

float from_bits(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// One parameter's buffers, owned, filled with deterministic non-zero data. Gradients span six
// orders of magnitude and include exact zeros, so that tiny, huge and unchanged moments occur.
struct State {
  std::vector<float> param, exp_avg, exp_avg_sq, grad32;
  std::vector<std::uint16_t> grad16, out16;

  State(std::size_t n, std::uint64_t seed)
      : param(n), exp_avg(n), exp_avg_sq(n), grad32(n), grad16(n), out16(n, 0xdead) {
    const float scales[] = {1e-4f, 1e-2f, 1.0f, 30.0f};
    for (std::size_t i = 0; i < n; ++i) {
      param[i] = 2.0f * unit(seed, 4 * i);
      exp_avg[i] = 0.1f * unit(seed, 4 * i + 1);
      const float s = unit(seed, 4 * i + 2);
      exp_avg_sq[i] = 1e-3f * s * s;
      const std::uint64_t r = mix(seed ^ (i * 31 + 7));
      grad32[i] = (r % 97 == 0) ? 0.0f : unit(seed, 4 * i + 3) * scales[r % 4];
      grad16[i] = float_to_bf16(grad32[i]);
    }
  }

  AdamWBuffers buffers(DType grad_dtype, bool bf16_out) {
    AdamWBuffers b;
    b.param = param.data();
    b.grad_dtype = grad_dtype;
    b.grad = grad_dtype == DType::bfloat16 ? static_cast<const void*>(grad16.data())
                                           : static_cast<const void*>(grad32.data());
    b.exp_avg = exp_avg.data();
    b.exp_avg_sq = exp_avg_sq.data();
    b.param_bf16 = bf16_out ? out16.data() : nullptr;
    b.numel = param.size();
    return b;
  }
};

template <typename T>
bool same_bits(const std::vector<T>& got, const std::vector<T>& want, const char* what,
               const std::string& context) {
  if (got.size() != want.size()) {
    std::fprintf(stderr, "  %s [%s]: sizes %zu vs %zu\n", what, context.c_str(), got.size(), want.size());
    return false;
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if constexpr (std::is_same_v<T, float>) {
        std::fprintf(stderr, "  %s [%s]: first difference at %zu: %.9g (0x%08x) vs %.9g (0x%08x)\n",
                     what, context.c_str(), i, got[i], bits_of(got[i]), want[i], bits_of(want[i]));
      } else {
        std::fprintf(stderr, "  %s [%s]: first difference at %zu: 0x%04x vs 0x%04x\n", what,
                     context.c_str(), i, unsigned(got[i]), unsigned(want[i]));
      }
      return false;
    }
  }
  return true;
}

// Every state buffer, bit for bit (the bf16 gradient too: it may double as the output).
bool same_state(const State& got, const State& want, const std::string& context) {
  bool ok = same_bits(got.param, want.param, "param", context);
  ok = same_bits(got.exp_avg, want.exp_avg, "exp_avg", context) && ok;
  ok = same_bits(got.exp_avg_sq, want.exp_avg_sq, "exp_avg_sq", context) && ok;
  ok = same_bits(got.grad16, want.grad16, "grad16/param_bf16", context) && ok;
  ok = same_bits(got.out16, want.out16, "param_bf16", context) && ok;
  return ok;
}

struct Variant {
  double weight_decay;
  double beta1;
  double grad_scale;
  bool maximize;
};

// Weight decay on/off, both lerp branches (1 - beta1 below and above 0.5), a gradient scale,
// maximize: every combination.
std::vector<Variant> variants() {
  std::vector<Variant> out;
  for (double wd : {0.0, 0.1})
    for (double beta1 : {0.9, 0.3})
      for (double scale : {1.0, 0.37})
        for (bool maximize : {false, true}) out.push_back({wd, beta1, scale, maximize});
  return out;
}

AdamWHyper hyper_for(const Variant& v, std::int64_t step) {
  AdamWHyper h;
  h.lr = 3e-3;
  h.beta1 = v.beta1;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weight_decay = v.weight_decay;
  h.step = step;
  h.grad_scale = v.grad_scale;
  h.maximize = v.maximize;
  return h;
}

enum class Output { none, separate, into_grad };

const char* output_name(Output o) {
  return o == Output::none ? "no bf16 out" : o == Output::separate ? "bf16 out" : "bf16 out = grad";
}

AdamWBuffers buffers_for(State& s, DType dtype, Output out) {
  AdamWBuffers b = s.buffers(dtype, out == Output::separate);
  if (out == Output::into_grad) b.param_bf16 = s.grad16.data();
  return b;
}

std::string describe(Isa isa, std::size_t n, DType dtype, const Variant& v, Output out) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s n=%zu grad=%s wd=%g beta1=%g scale=%g maximize=%d %s",
                isa_name(isa), n, dtype == DType::bfloat16 ? "bf16" : "fp32", v.weight_decay,
                v.beta1, v.grad_scale, int(v.maximize), output_name(out));
  return buf;
}

// Two consecutive updates (steps 5 and 6) with `kernel` over the whole buffer. With the bf16
// output written into the gradient, the second step reads the bf16 weights as its gradient:
// odd, but deterministic, so still comparable.
void two_steps(AdamWKernel kernel, State& s, DType dtype, Output out, const Variant& v) {
  for (std::int64_t step : {5, 6}) {
    const AdamWBuffers b = buffers_for(s, dtype, out);
    validate_buffers(b);
    kernel(b, adamw_coeffs(hyper_for(v, step)), 0, b.numel);
  }
}

bool accepted(const AdamWBuffers& b) {
  try {
    validate_buffers(b);
    return true;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "  unexpectedly rejected: %s\n", e.what());
    return false;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Vector kernels vs the scalar reference

TEST_CASE("8-bit codes are the nearest value of the map, ties up, and blocks must be whole") {
  float qmap[256];
  for (int i = 0; i < 256; ++i) qmap[i] = static_cast<float>(i) / 255.0f;  // ascending, 0 to 1
  CHECK(quantize_with_qmap(0.0f, qmap) == 0);
  CHECK(quantize_with_qmap(1.0f, qmap) == 255);
  CHECK(quantize_with_qmap(2.0f, qmap) == 255);  // past the map's end: its last code
  CHECK(quantize_with_qmap(qmap[7] + 0.4f * (qmap[8] - qmap[7]), qmap) == 7);
  CHECK(quantize_with_qmap(qmap[7] + 0.6f * (qmap[8] - qmap[7]), qmap) == 8);
  CHECK(quantize_with_qmap(0.5f * (qmap[100] + qmap[101]), qmap) == 101);
  ThreadPool pool(1);
  std::vector<float> param(300), grad(300), scale(2);
  std::vector<std::uint8_t> codes(300);
  AdamW8bitBuffers b;
  b.param = param.data();
  b.grad = grad.data();
  b.exp_avg = b.exp_avg_sq = {codes.data(), scale.data()};
  b.signed_qmap = b.unsigned_qmap = qmap;
  b.numel = 300;
  CHECK_THROWS_AS(adamw8bit_step(pool, b, AdamW8bitHyper{}, Isa::scalar), std::invalid_argument);
}

TEST_CASE("every 8-bit kernel encodes as the scalar search does, on maps of any spacing") {
  // With beta1 = beta2 = 0 the new moments are the gradient and its square; each block holds a
  // 1.0 (its scale), the map's values, midpoints and the floats either side, and noise.
  std::uint32_t seed = 7;
  const auto noise = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>(seed >> 8) / 8388608.0f - 1.0f;
  };
  // evenly spaced, ever denser near 0, and (power 0) all in [0.5, 1]: several values a table cell
  for (float power : {1.0f, 3.0f, 6.0f, 0.0f}) {
    std::vector<float> map(256), unsigned_map(256);
    for (int i = 0; i < 256; ++i) {
      const float u = -1.0f + 2.0f * static_cast<float>(i) / 255.0f, w = static_cast<float>(i) / 255.0f;
      map[i] = power == 0.0f ? 0.5f + 0.5f * w : std::copysign(std::pow(std::fabs(u), power), u);
      unsigned_map[i] = power == 0.0f ? 0.5f + 0.5f * w : std::pow(w, power);
    }
    std::vector<float> grad;
    for (int i = 0; i < 256; ++i) {
      for (float x : {map[i], i < 255 ? 0.5f * (map[i] + map[i + 1]) : map[i]}) {
        grad.insert(grad.end(), {x, std::nextafter(x, 2.0f), std::nextafter(x, -2.0f)});
      }
    }
    while (grad.size() % 255 != 0) grad.push_back(noise());
    std::vector<float> g;
    for (std::size_t i = 0; i < grad.size(); i += 255) {
      g.push_back(1.0f);
      g.insert(g.end(), grad.begin() + i, grad.begin() + i + 255);
    }
    for (int i = 0; i < 4 * 256; ++i) g.push_back(i < 256 ? 0.0f : 1e-3f * noise());
    const std::size_t n = g.size(), blocks = n / kQuantBlock;
    const auto run = [&](Isa isa) {
      std::vector<float> param(n, 0.5f), scales(2 * blocks, 1.0f);
      std::vector<std::uint8_t> codes(2 * n, 128);
      AdamW8bitBuffers b;
      b.param = param.data();
      b.grad = g.data();
      b.exp_avg = {codes.data(), scales.data()};
      b.exp_avg_sq = {codes.data() + n, scales.data() + blocks};
      b.signed_qmap = map.data();
      b.unsigned_qmap = unsigned_map.data();
      b.numel = n;
      AdamW8bitHyper h;
      h.beta1 = h.beta2 = 0.0;
      ThreadPool pool(2);
      adamw8bit_step(pool, b, h, isa);
      return std::make_pair(codes, param);
    };
    const auto want = run(Isa::scalar);
    for (Isa isa : kVectorIsas) {
      if (!isa_supported(isa)) {
        skip(std::string(isa_name(isa)) + " 8-bit vs scalar", "this CPU lacks it");
        continue;
      }
      const auto got = run(isa);
      CHECK(got.first == want.first);
      CHECK(std::memcmp(got.second.data(), want.second.data(), 4 * n) == 0);
    }
  }
}

TEST_CASE("the AVX-512 8-bit update decodes by byte permutes (VBMI) to the bits it decodes by float permutes") {
  if (!detect_cpu_features().avx512_vbmi) {
    skip("AVX-512 VBMI decode", "this CPU lacks it");
    return;
  }
  std::vector<float> map(256), unsigned_map(256);
  for (int i = 0; i < 256; ++i) {  // every byte of the values differing from code to code
    const float u = -1.0f + 2.0f * static_cast<float>(i) / 255.0f;
    map[i] = std::copysign(std::pow(std::fabs(u), 2.7f), u) * (1.0f - 1e-7f * static_cast<float>(i % 7));
    unsigned_map[i] = std::pow(static_cast<float>(i) / 255.0f, 4.1f);
  }
  map[0] = -1.0f;
  map[255] = unsigned_map[255] = 1.0f;
  std::uint32_t seed = 11;
  const auto next = [&seed] { return seed = seed * 1664525u + 1013904223u; };
  const std::size_t n = 7 * kQuantBlock, blocks = n / kQuantBlock;
  std::vector<float> g(n);
  std::vector<std::uint8_t> codes(2 * n);
  std::vector<float> scales(2 * blocks);
  for (std::size_t i = 0; i < n; ++i) g[i] = static_cast<float>(static_cast<std::int32_t>(next())) * 1e-10f;
  for (std::size_t i = 0; i < 2 * n; ++i) codes[i] = static_cast<std::uint8_t>(i < 512 ? i % 256 : next() >> 24);
  for (std::size_t i = 0; i < 2 * blocks; ++i) scales[i] = 0.01f * static_cast<float>(1 + i);
  for (bool stochastic : {false, true}) {
    const auto run = [&](auto kernel) {
      std::vector<float> param(n, 0.25f), s = scales;
      std::vector<std::uint16_t> param16(n, 0x3e80);
      std::vector<std::uint8_t> c = codes;
      AdamW8bitBuffers b;
      if (stochastic) {
        b.param16 = b.param16_out = param16.data();
      } else {
        b.param = b.param_out = param.data();
      }
      b.grad = g.data();
      b.exp_avg = b.exp_avg_out = {c.data(), s.data()};
      b.exp_avg_sq = b.exp_avg_sq_out = {c.data() + n, s.data() + blocks};
      b.signed_qmap = map.data();
      b.unsigned_qmap = unsigned_map.data();
      b.numel = n;
      AdamW8bitHyper h;
      h.step = 3;
      h.stochastic_round = stochastic;
      kernel(b, adamw8bit_coeffs(h), eight_bit::quant_table(map.data()), eight_bit::quant_table(unsigned_map.data()),
             0, blocks);
      return std::make_tuple(c, s, param, param16);
    };
    CHECK(run(eight_bit::blocks_avx512_vbmi) == run(eight_bit::blocks_avx512));
  }
}

TEST_CASE("8-bit updates out of place write the in-place results and leave what they read untouched") {
  std::vector<float> map(256), unsigned_map(256);
  for (int i = 0; i < 256; ++i) {
    const float u = -1.0f + 2.0f * static_cast<float>(i) / 255.0f;
    map[i] = std::copysign(u * u * u, u);
    unsigned_map[i] = std::pow(static_cast<float>(i) / 255.0f, 3.0f);
  }
  const std::size_t n = 5 * kQuantBlock, blocks = n / kQuantBlock;
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = std::sin(0.7f * static_cast<float>(i)) * (1.0f + i % 17);
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) {
      skip(std::string(isa_name(isa)) + " 8-bit out of place", "this CPU lacks it");
      continue;
    }
    std::vector<float> p_in(n, 0.5f), p_out(n, 0.0f), s_in(2 * blocks, 0.25f), s_out(2 * blocks, 0.0f);
    std::vector<std::uint8_t> c_in(2 * n, 140), c_out(2 * n, 0);
    std::vector<float> p_ref = p_in, s_ref = s_in;
    std::vector<std::uint8_t> c_ref = c_in;
    const auto buffers = [&](float* p, float* s, std::uint8_t* c) {
      AdamW8bitBuffers b;
      b.param = p;
      b.grad = g.data();
      b.exp_avg = {c, s};
      b.exp_avg_sq = {c + n, s + blocks};
      b.signed_qmap = map.data();
      b.unsigned_qmap = unsigned_map.data();
      b.numel = n;
      return b;
    };
    ThreadPool pool(2);
    AdamW8bitHyper h;
    h.step = 3;
    adamw8bit_step(pool, buffers(p_ref.data(), s_ref.data(), c_ref.data()), h, isa);
    AdamW8bitBuffers b = buffers(p_in.data(), s_in.data(), c_in.data());
    b.param_out = p_out.data();
    b.exp_avg_out = {c_out.data(), s_out.data()};
    b.exp_avg_sq_out = {c_out.data() + n, s_out.data() + blocks};
    adamw8bit_step(pool, b, h, isa);
    CHECK(p_out == p_ref && s_out == s_ref && c_out == c_ref);
    CHECK(p_in == std::vector<float>(n, 0.5f) && c_in == std::vector<std::uint8_t>(2 * n, 140));
    AdamW8bitBuffers half = buffers(p_in.data(), s_in.data(), c_in.data());
    half.param_out = p_out.data();  // the weights out of place, the moments in place: refused
    CHECK_THROWS_AS(adamw8bit_step(pool, half, h, isa), std::invalid_argument);
  }
}

TEST_CASE("bf16 stochastic rounding: the same bits from every kernel, unbiased, reproducible from the seed") {
  std::vector<float> map(256), unsigned_map(256);
  for (int i = 0; i < 256; ++i) {
    const float u = -1.0f + 2.0f * static_cast<float>(i) / 255.0f;
    map[i] = std::copysign(u * u * u, u);
    unsigned_map[i] = std::pow(static_cast<float>(i) / 255.0f, 3.0f);
  }
  const std::size_t n = 64 * kQuantBlock, blocks = n / kQuantBlock;
  std::vector<std::uint16_t> g(n), w0(n);
  for (std::size_t i = 0; i < n; ++i) {
    g[i] = float_to_bf16(unit(3, i) * (i % 5 == 0 ? 1e-4f : 1.0f));
    w0[i] = float_to_bf16(unit(4, i));
  }
  w0[5] = 0x7fc0;  // a NaN weight stays NaN
  w0[6] = 0x7f80;  // +inf: decayed as p - lr * wd * p, NaN
  struct Out {
    std::vector<std::uint16_t> w, copy;
    std::vector<std::uint8_t> codes;
    std::vector<float> scales;
  };
  const auto run = [&](Isa isa, std::uint64_t seed, std::int64_t step, bool out_of_place) {
    Out o{w0, std::vector<std::uint16_t>(n, 0), std::vector<std::uint8_t>(2 * n, 140), std::vector<float>(2 * blocks, 0.25f)};
    std::vector<std::uint16_t> w_out(n, 0);
    std::vector<std::uint8_t> c_out(2 * n, 0);
    std::vector<float> s_out(2 * blocks, 0.0f);
    AdamW8bitBuffers b;
    b.param16 = o.w.data();
    b.grad = g.data();
    b.grad_dtype = DType::bfloat16;
    b.exp_avg = {o.codes.data(), o.scales.data()};
    b.exp_avg_sq = {o.codes.data() + n, o.scales.data() + blocks};
    b.signed_qmap = map.data();
    b.unsigned_qmap = unsigned_map.data();
    b.param_bf16 = o.copy.data();
    b.numel = n;
    if (out_of_place) {
      b.param16_out = w_out.data();
      b.exp_avg_out = {c_out.data(), s_out.data()};
      b.exp_avg_sq_out = {c_out.data() + n, s_out.data() + blocks};
    }
    AdamW8bitHyper h;
    h.lr = 1e-2f;
    h.step = step;
    h.stochastic_round = true;
    h.seed = seed;
    ThreadPool pool(3);
    adamw8bit_step(pool, b, h, isa);
    if (out_of_place) {
      CHECK(o.w == w0);  // what it read is untouched
      o.w = w_out;
      o.codes = c_out;
      o.scales = s_out;
    }
    return o;
  };
  const Out want = run(Isa::scalar, 11, 4, false);
  CHECK(want.copy == want.w);  // the upload copy is the same rounding
  CHECK(want.w[5] == 0x7fc0 && want.w[6] == 0x7fc0);
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) {
      skip(std::string(isa_name(isa)) + " stochastic rounding", "this CPU lacks it");
      continue;
    }
    for (bool out_of_place : {false, true}) {
      const Out got = run(isa, 11, 4, out_of_place);
      CHECK(got.w == want.w && got.copy == want.copy && got.codes == want.codes && got.scales == want.scales);
    }
  }
  // Another seed or another step draws other bits; the moments do not depend on them.
  for (const Out& other : {run(Isa::scalar, 12, 4, false), run(Isa::scalar, 11, 5, false)}) {
    std::size_t differ = 0;
    for (std::size_t i = 0; i < n; ++i) differ += other.w[i] != want.w[i];
    CHECK(differ > n / 100);
  }
  CHECK(run(Isa::scalar, 12, 4, false).codes == want.codes);
  // Each result is one of the two bf16 neighbours of the fp32 update (here the RNE kernel's
  // fp32 weights, from the same bf16 start), and rounds up about as often as its fraction says.
  std::vector<float> master(n);
  for (std::size_t i = 0; i < n; ++i) master[i] = bf16_to_float(w0[i]);
  AdamW8bitBuffers b;
  std::vector<std::uint8_t> codes(2 * n, 140);
  std::vector<float> scales(2 * blocks, 0.25f);
  b.param = master.data();
  b.grad = g.data();
  b.grad_dtype = DType::bfloat16;
  b.exp_avg = {codes.data(), scales.data()};
  b.exp_avg_sq = {codes.data() + n, scales.data() + blocks};
  b.signed_qmap = map.data();
  b.unsigned_qmap = unsigned_map.data();
  b.numel = n;
  AdamW8bitHyper h;
  h.lr = 1e-2f;
  h.step = 4;
  ThreadPool pool(1);
  adamw8bit_step(pool, b, h, Isa::scalar);
  double expected_up = 0, up = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(master[i])) continue;
    const std::uint32_t bits = bits_of(master[i]);
    const std::uint16_t down = static_cast<std::uint16_t>(bits >> 16);
    CHECK((want.w[i] == down || want.w[i] == down + 1));
    expected_up += (bits & 0xffff) / 65536.0;
    up += want.w[i] == down + 1;
  }
  CHECK(std::fabs(up - expected_up) < 4 * std::sqrt(expected_up) + 1);
  // The bits themselves: uniform over 16 bits (each of 16 bins within 5% of its share).
  std::vector<std::size_t> bins(16, 0);
  const RoundingKey key = rounding_key(1, 1);
  for (std::uint32_t i = 0; i < (1u << 20); ++i) ++bins[rounding_bits(key, i) >> 12];
  for (std::size_t count : bins) CHECK(count > 62259 && count < 68813);
  // Refused: stochastic rounding with fp32 weights, bf16 weights without it.
  b.param16 = w0.data();
  CHECK_THROWS_AS(adamw8bit_step(pool, b, h, Isa::scalar), std::invalid_argument);
  b.param = nullptr;
  CHECK_THROWS_AS(adamw8bit_step(pool, b, h, Isa::scalar), std::invalid_argument);
}

TEST_CASE("every supported vector kernel matches the scalar kernel bit for bit") {
  for (Isa isa : kVectorIsas) {
    if (!isa_supported(isa)) {
      skip(std::string(isa_name(isa)) + " vs scalar", "this CPU lacks it");
      continue;
    }
    int compared = 0;
    for (std::size_t n : kSizes) {
      for (DType dtype : {DType::float32, DType::bfloat16}) {
        for (Output out : {Output::none, Output::separate, Output::into_grad}) {
          if (out == Output::into_grad && dtype != DType::bfloat16) continue;
          for (const Variant& v : variants()) {
            State want(n, 1000 + n), got(n, 1000 + n);
            two_steps(adamw_kernel(Isa::scalar), want, dtype, out, v);
            two_steps(adamw_kernel(isa), got, dtype, out, v);
            CHECK(same_state(got, want, describe(isa, n, dtype, v, out)));
            ++compared;
          }
        }
      }
    }
    std::printf("  %s: %d configurations compared\n", isa_name(isa), compared);
  }
}

TEST_CASE("kernels write only inside [begin, end), from any start") {
  const std::size_t n = 300;
  const std::size_t ranges[][2] = {{0, 1}, {3, 4}, {5, 21}, {7, 40}, {16, 32}, {17, 299}, {1, 300}, {299, 300}};
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) {
      skip(std::string(isa_name(isa)) + " partial ranges", "this CPU lacks it");
      continue;
    }
    for (DType dtype : {DType::float32, DType::bfloat16}) {
      for (const auto& r : ranges) {
        const Variant v{0.1, 0.9, 1.0, false};
        State whole(n, 77), part(n, 77);
        const State before(n, 77);
        const AdamWCoeffs c = adamw_coeffs(hyper_for(v, 3));
        adamw_kernel(Isa::scalar)(whole.buffers(dtype, true), c, 0, n);
        adamw_kernel(isa)(part.buffers(dtype, true), c, r[0], r[1]);
        bool ok = true;
        for (std::size_t i = 0; i < n; ++i) {
          const bool inside = i >= r[0] && i < r[1];
          const State& ref = inside ? whole : before;
          ok = ok && bits_of(part.param[i]) == bits_of(ref.param[i]) &&
               bits_of(part.exp_avg[i]) == bits_of(ref.exp_avg[i]) &&
               bits_of(part.exp_avg_sq[i]) == bits_of(ref.exp_avg_sq[i]) &&
               part.out16[i] == ref.out16[i] && part.grad16[i] == ref.grad16[i];
          if (!ok) {
            std::fprintf(stderr, "  %s range [%zu, %zu): wrong element %zu (%s)\n", isa_name(isa),
                         r[0], r[1], i, inside ? "inside" : "outside");
            break;
          }
        }
        CHECK(ok);
      }
    }
  }
}

TEST_CASE("term_only writes the term that weight * decay + term turns into the update, bit for bit") {
  const std::size_t n = 300;
  const std::size_t ranges[][2] = {{0, 1}, {3, 4}, {5, 21}, {16, 32}, {17, 299}, {0, 300}, {1, 300}};
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) {
      skip(std::string(isa_name(isa)) + " term_only", "this CPU lacks it");
      continue;
    }
    for (DType dtype : {DType::float32, DType::bfloat16}) {
      for (const Variant& v : variants()) {
        for (const auto& r : ranges) {
          State full(n, 91), term(n, 91);
          const State before(n, 91);
          const AdamWCoeffs c = adamw_coeffs(hyper_for(v, 4));
          adamw_kernel(isa)(full.buffers(dtype, false), c, r[0], r[1]);
          AdamWBuffers tb = term.buffers(dtype, false);
          tb.term_only = true;
          validate_buffers(tb);
          adamw_kernel(isa)(tb, c, r[0], r[1]);
          bool ok = true;
          for (std::size_t i = 0; i < n && ok; ++i) {
            const bool inside = i >= r[0] && i < r[1];
            volatile float decayed = before.param[i] * c.decay;  // two roundings, as the device does
            const float applied = inside ? decayed + term.param[i] : term.param[i];
            ok = bits_of(applied) == bits_of(full.param[i]) &&
                 bits_of(term.exp_avg[i]) == bits_of(full.exp_avg[i]) &&
                 bits_of(term.exp_avg_sq[i]) == bits_of(full.exp_avg_sq[i]);
            if (!ok) {
              std::fprintf(stderr, "  %s term_only [%zu, %zu): wrong element %zu\n", isa_name(isa), r[0], r[1], i);
            }
          }
          CHECK(ok);
        }
      }
    }
  }
  State s(16, 5);
  AdamWBuffers b = s.buffers(DType::float32, true);
  b.term_only = true;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);  // bf16 weights need the master
}

TEST_CASE("out-of-place outputs get the in-place results and leave the inputs untouched") {
  const std::size_t n = 300;
  const std::size_t ranges[][2] = {{0, 1}, {5, 21}, {16, 288}, {17, 299}, {0, 300}};
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) {
      skip(std::string(isa_name(isa)) + " out of place", "this CPU lacks it");
      continue;
    }
    for (DType dtype : {DType::float32, DType::bfloat16}) {
      for (bool bf16_weights : {false, true}) {
        for (const auto& r : ranges) {
          State in_place(n, 17), inputs(n, 17), out(n, 3);
          const State before(n, 17);
          const AdamWCoeffs c = adamw_coeffs(hyper_for(variants()[0], 3));
          adamw_kernel(isa)(in_place.buffers(dtype, bf16_weights), c, r[0], r[1]);
          // Outputs on cache-line boundaries, as the pipeline's are: the vector kernels stream there.
          std::vector<float> raw(3 * (n + 16));
          float* aligned = raw.data();
          while (reinterpret_cast<std::uintptr_t>(aligned) % 64) ++aligned;
          float* outs[3] = {aligned, aligned + (n + 16), aligned + 2 * (n + 16)};
          AdamWBuffers b = inputs.buffers(dtype, bf16_weights);
          b.exp_avg_out = outs[0];
          b.exp_avg_sq_out = outs[1];
          b.param_out = outs[2];
          if (bf16_weights) b.param_bf16 = out.out16.data();
          validate_buffers(b);
          adamw_kernel(isa)(b, c, r[0], r[1]);
          bool ok = inputs.param == before.param && inputs.exp_avg == before.exp_avg &&
                    inputs.exp_avg_sq == before.exp_avg_sq;
          for (std::size_t i = r[0]; i < r[1] && ok; ++i) {
            ok = bits_of(outs[2][i]) == bits_of(in_place.param[i]) &&
                 bits_of(outs[0][i]) == bits_of(in_place.exp_avg[i]) &&
                 bits_of(outs[1][i]) == bits_of(in_place.exp_avg_sq[i]) &&
                 (!bf16_weights || out.out16[i] == in_place.out16[i]);
          }
          if (!ok) std::fprintf(stderr, "  %s out of place [%zu, %zu): wrong\n", isa_name(isa), r[0], r[1]);
          CHECK(ok);
        }
      }
    }
  }
  State s(16, 5), o(16, 6);
  AdamWBuffers b = s.buffers(DType::float32, false);
  b.exp_avg_out = s.exp_avg_sq.data();  // overlaps an input
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = s.buffers(DType::float32, false);
  b.term_only = true;
  b.param_out = o.param.data();  // the term goes to param
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
}

TEST_CASE("bf16 output equals float_to_bf16 of the fp32 result, for any bit pattern in any lane") {
  // lr = 0 and no weight decay leave every weight as it was (x * 1 + (-0 * m) / denom), so
  // the weights can be arbitrary bit patterns: NaNs, infinities, rounding ties, denormals.
  const std::size_t n = 4099;
  std::vector<std::uint32_t> patterns = {
      0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0xbf808000u, 0xbf818000u,
      0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x7f800000u, 0xff800000u,
      0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fffffffu, 0xff800001u, 0x00008000u,
      0x00018000u, 0x00000001u, 0x80000000u, 0x00000000u, 0x3f800000u, 0x477fe000u};
  for (std::size_t i = patterns.size(); i < n; ++i) {
    patterns.push_back(static_cast<std::uint32_t>(mix(i) >> 17));
  }
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) {
      skip(std::string(isa_name(isa)) + " bf16 rounding of special values", "this CPU lacks it");
      continue;
    }
    // Shift the specials through every lane position of a vector.
    for (std::size_t shift : {0u, 1u, 5u, 8u, 15u}) {
      State s(n, 5);
      for (std::size_t i = 0; i < n; ++i) s.param[i] = from_bits(patterns[(i + n - shift) % n]);
      AdamWHyper h;
      h.lr = 0.0;
      h.weight_decay = 0.0;
      h.step = 2;
      for (DType dtype : {DType::float32, DType::bfloat16}) {
        State run = s;
        adamw_kernel(isa)(run.buffers(dtype, true), adamw_coeffs(h), 0, n);
        bool ok = true;
        for (std::size_t i = 0; i < n && ok; ++i) {
          const std::uint32_t in = bits_of(s.param[i]);
          const bool nan = (in & 0x7fffffffu) > 0x7f800000u;
          // The weights pass unchanged (but that a NaN may come back quieted and a -0 as +0).
          const bool unchanged = nan ? std::isnan(run.param[i])
                                     : (in << 1) == 0 ? run.param[i] == 0.0f
                                                      : bits_of(run.param[i]) == in;
          ok = unchanged && run.out16[i] == float_to_bf16(run.param[i]);
          if (!ok) {
            std::fprintf(stderr, "  %s shift %zu: element %zu in 0x%08x -> param 0x%08x bf16 0x%04x\n",
                         isa_name(isa), shift, i, in, bits_of(run.param[i]), unsigned(run.out16[i]));
          }
        }
        CHECK(ok);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The scalar kernel's semantics, through equivalent inputs

TEST_CASE("a bf16 gradient is the same as its exact fp32 upcast") {
  for (const Variant& v : variants()) {
    State as_bf16(4099, 11), as_fp32(4099, 11);
    for (std::size_t i = 0; i < as_fp32.grad32.size(); ++i) {
      as_fp32.grad32[i] = bf16_to_float(as_fp32.grad16[i]);
    }
    const AdamWCoeffs c = adamw_coeffs(hyper_for(v, 4));
    adamw_kernel(Isa::scalar)(as_bf16.buffers(DType::bfloat16, true), c, 0, 4099);
    adamw_kernel(Isa::scalar)(as_fp32.buffers(DType::float32, true), c, 0, 4099);
    CHECK(same_bits(as_bf16.param, as_fp32.param, "param", "bf16 vs upcast"));
    CHECK(same_bits(as_bf16.exp_avg, as_fp32.exp_avg, "exp_avg", "bf16 vs upcast"));
    CHECK(same_bits(as_bf16.exp_avg_sq, as_fp32.exp_avg_sq, "exp_avg_sq", "bf16 vs upcast"));
  }
}

TEST_CASE("grad_scale multiplies the gradient (in fp32) before anything else") {
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    const double scale = 0.37;
    State scaled(4099, 12), prescaled(4099, 12);
    for (std::size_t i = 0; i < prescaled.grad32.size(); ++i) {
      const float g = dtype == DType::bfloat16 ? bf16_to_float(prescaled.grad16[i]) : prescaled.grad32[i];
      prescaled.grad32[i] = g * static_cast<float>(scale);
    }
    AdamWHyper h;
    h.step = 3;
    h.grad_scale = scale;
    adamw_kernel(Isa::scalar)(scaled.buffers(dtype, false), adamw_coeffs(h), 0, 4099);
    h.grad_scale = 1.0;
    adamw_kernel(Isa::scalar)(prescaled.buffers(DType::float32, false), adamw_coeffs(h), 0, 4099);
    CHECK(same_bits(scaled.param, prescaled.param, "param", "grad_scale"));
    CHECK(same_bits(scaled.exp_avg, prescaled.exp_avg, "exp_avg", "grad_scale"));
    CHECK(same_bits(scaled.exp_avg_sq, prescaled.exp_avg_sq, "exp_avg_sq", "grad_scale"));
  }
}

TEST_CASE("maximize is the update for the negated gradient") {
  State maximized(4099, 13), negated(4099, 13);
  for (float& g : negated.grad32) g = -g;
  AdamWHyper h;
  h.step = 2;
  h.maximize = true;
  adamw_kernel(Isa::scalar)(maximized.buffers(DType::float32, false), adamw_coeffs(h), 0, 4099);
  h.maximize = false;
  adamw_kernel(Isa::scalar)(negated.buffers(DType::float32, false), adamw_coeffs(h), 0, 4099);
  CHECK(same_bits(maximized.param, negated.param, "param", "maximize"));
  CHECK(same_bits(maximized.exp_avg, negated.exp_avg, "exp_avg", "maximize"));
  CHECK(same_bits(maximized.exp_avg_sq, negated.exp_avg_sq, "exp_avg_sq", "maximize"));
}

TEST_CASE("the first step from zero moments moves each weight by lr against its gradient") {
  // With m = v = 0 and eps = 0, step 1 gives m/(sqrt(v)/sqrt(1-b2)) = (1-b1) g/|g| and a step of
  // exactly lr * sign(g) up to a few roundings; weight decay first scales p by 1 - lr*wd.
  const std::size_t n = 1000;
  for (bool maximize : {false, true}) {
    for (double wd : {0.0, 0.1}) {
      State s(n, 14);
      std::fill(s.exp_avg.begin(), s.exp_avg.end(), 0.0f);
      std::fill(s.exp_avg_sq.begin(), s.exp_avg_sq.end(), 0.0f);
      for (float& g : s.grad32) g = (g == 0.0f ? 0.5f : g) + (g < 0 ? -1e-3f : 1e-3f);
      const State before = s;
      AdamWHyper h;
      h.lr = 1e-3;
      h.eps = 0.0;
      h.weight_decay = wd;
      h.step = 1;
      h.maximize = maximize;
      adamw_kernel(Isa::scalar)(s.buffers(DType::float32, false), adamw_coeffs(h), 0, n);
      int wrong = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const double direction = (before.grad32[i] > 0) != maximize ? -1.0 : 1.0;
        const double expected = double(before.param[i]) * (1.0 - h.lr * wd) + direction * h.lr;
        // Two roundings of p (decay, update: half an ulp each), the decay factor's own rounding
        // to float (2^-24 relative), and 1e-6 of lr for the rest.
        const float p = std::fabs(before.param[i]);
        const double tolerance = (std::nextafter(p, INFINITY) - p) + p * 0x1p-24 + 1e-6 * h.lr;
        if (std::fabs(s.param[i] - expected) > tolerance) {
          if (wrong++ == 0) {
            std::fprintf(stderr, "  first step, element %zu: %.9g, want %.9g\n", i, s.param[i], expected);
          }
        }
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("adamw_coeffs picks torch's lerp branch by whether 1 - beta1 is below 0.5") {
  AdamWHyper h;
  h.beta1 = 0.9;
  AdamWCoeffs c = adamw_coeffs(h);
  CHECK(c.lerp_from_start && c.lerp_coeff == static_cast<float>(1.0 - 0.9));
  h.beta1 = 0.3;
  c = adamw_coeffs(h);
  CHECK(!c.lerp_from_start && c.lerp_coeff == static_cast<float>(1.0 - 0.3) - 1.0f);
  h.beta1 = 0.5;  // weight exactly 0.5: torch takes the "from end" branch (|w| < 0.5 is false)
  c = adamw_coeffs(h);
  CHECK(!c.lerp_from_start && c.lerp_coeff == -0.5f);
  h.beta1 = 0.0;  // weight 1: m becomes g exactly
  c = adamw_coeffs(h);
  CHECK(!c.lerp_from_start && c.lerp_coeff == 0.0f);
}

// ---------------------------------------------------------------------------------------------
// The threaded engine

TEST_CASE("HostAdamW with 1 and 4 threads equals one kernel call") {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) {
      skip(std::string("HostAdamW ") + isa_name(isa), "this CPU lacks it");
      continue;
    }
    HostAdamW one(1, isa), four(4, isa);
    CHECK(one.threads() == 1 && four.threads() == 4);
    CHECK(one.isa() == isa && four.isa() == isa);
    // 100003: 7 chunks of 16384; 1 << 20 | 3: 16 chunks and a short tail.
    for (std::size_t n : {std::size_t(17), std::size_t(100003), (std::size_t(1) << 20) | 3}) {
      for (DType dtype : {DType::float32, DType::bfloat16}) {
        const Variant v{0.1, 0.9, 0.5, false};
        State want(n, 21), got1(n, 21), got4(n, 21);
        for (std::int64_t step : {1, 2}) {
          const AdamWHyper h = hyper_for(v, step);
          adamw_kernel(isa)(want.buffers(dtype, true), adamw_coeffs(h), 0, n);
          one.step(got1.buffers(dtype, true), h);
          four.step(got4.buffers(dtype, true), h);
        }
        const std::string ctx = std::string(isa_name(isa)) + " n=" + std::to_string(n);
        CHECK(same_state(got1, want, ctx + " 1 thread"));
        CHECK(same_state(got4, want, ctx + " 4 threads"));
      }
    }
  }
}

TEST_CASE("HostAdamW rejects bad calls without writing anything") {
  HostAdamW engine(2, Isa::scalar);
  State s(64, 31);
  const State before = s;
  AdamWHyper bad;
  bad.lr = -1.0;
  CHECK_THROWS_AS(engine.step(s.buffers(DType::float32, true), bad), std::invalid_argument);
  AdamWBuffers overlapping = s.buffers(DType::float32, false);
  overlapping.exp_avg_sq = overlapping.exp_avg + 1;
  CHECK_THROWS_AS(engine.step(overlapping, AdamWHyper{}), std::invalid_argument);
  CHECK(same_state(s, before, "after rejected calls"));
}

TEST_CASE("chunk_elements gives whole norm blocks that cover numel in at most 4 chunks per thread") {
  const std::size_t sizes[] = {1, 15, 16, 17, 16383, 16384, 16385, 100003, 1u << 20,
                               (std::size_t(1) << 28) + 5, std::size_t(3) << 32};
  for (std::size_t numel : sizes) {
    for (std::size_t threads : {1, 2, 3, 4, 7, 16, 64, 256}) {
      const std::size_t chunk = chunk_elements(numel, threads);
      const std::size_t tasks = (numel + chunk - 1) / chunk;
      const bool ok = chunk > 0 && chunk % kChunkAlignment == 0 && tasks * chunk >= numel &&
                      (tasks - 1) * chunk < numel && tasks <= 4 * threads;
      if (!ok) std::fprintf(stderr, "  numel %zu threads %zu: chunk %zu\n", numel, threads, chunk);
      CHECK(ok);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// fp32 -> bf16

TEST_CASE("float_to_bf16 rounds to nearest even and maps every NaN to 0x7fc0") {
  struct Case {
    std::uint32_t in;
    std::uint16_t out;
  };
  const Case cases[] = {
      {0x3f800000u, 0x3f80},  // 1.0
      {0x3f808000u, 0x3f80},  // tie, even below
      {0x3f818000u, 0x3f82},  // tie, even above
      {0x3f807fffu, 0x3f80},  // just below the tie
      {0x3f808001u, 0x3f81},  // just above the tie
      {0xbf808000u, 0xbf80},  // negative ties
      {0xbf818000u, 0xbf82},
      {0x00000000u, 0x0000},
      {0x80000000u, 0x8000},  // -0 keeps its sign
      {0x00008000u, 0x0000},  // denormal tie, even below
      {0x00018000u, 0x0002},  // denormal tie, even above
      {0x7f800000u, 0x7f80},  // +inf
      {0xff800000u, 0xff80},  // -inf
      {0x7f7fffffu, 0x7f80},  // max finite rounds to inf
      {0xff7fffffu, 0xff80},
      {0x7f7f8000u, 0x7f80},  // tie above the largest odd bf16: up to inf
      {0x7f7f7fffu, 0x7f7f},
      {0x7fc00000u, 0x7fc0},  // NaNs: quiet, signalling (must not become inf), negative, payload
      {0x7f800001u, 0x7fc0},
      {0xffc00001u, 0x7fc0},
      {0x7fffffffu, 0x7fc0},
      {0xff800001u, 0x7fc0},
  };
  for (const Case& c : cases) {
    const std::uint16_t got = float_to_bf16(from_bits(c.in));
    if (got != c.out) std::fprintf(stderr, "  0x%08x -> 0x%04x, want 0x%04x\n", c.in, got, c.out);
    CHECK(got == c.out);
  }
}

TEST_CASE("every bf16 value survives a round trip through fp32") {
  int wrong = 0;
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    const bool nan = (h & 0x7fffu) > 0x7f80u;
    const std::uint16_t back = float_to_bf16(bf16_to_float(static_cast<std::uint16_t>(h)));
    wrong += back != (nan ? 0x7fc0u : h);
  }
  CHECK(wrong == 0);
}

// ---------------------------------------------------------------------------------------------
// Validation

TEST_CASE("validate_buffers rejects empty, null, misaligned and overlapping buffers") {
  State s(64, 41);
  const auto valid = [&](DType dtype = DType::float32) { return s.buffers(dtype, true); };
  CHECK(accepted(valid()));
  CHECK(accepted(valid(DType::bfloat16)));

  AdamWBuffers b = valid();
  b.numel = 0;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);

  b = valid(); b.param = nullptr;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.grad = nullptr;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.exp_avg = nullptr;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.exp_avg_sq = nullptr;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.grad_dtype = static_cast<DType>(7);
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);

  // Misaligned: a float* one byte (or, for the fp32 gradient, two bytes) past a float.
  const auto shifted = [](auto* p, std::size_t bytes) {
    return reinterpret_cast<decltype(p)>(reinterpret_cast<std::uintptr_t>(p) + bytes);
  };
  std::vector<float> spare(200);
  b = valid(); b.param = shifted(spare.data(), 1); b.numel = 32;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.exp_avg = shifted(spare.data(), 1); b.numel = 32;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.exp_avg_sq = shifted(spare.data(), 3); b.numel = 32;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.grad = shifted(spare.data(), 2); b.numel = 32;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(DType::bfloat16); b.grad = shifted(s.grad16.data(), 1); b.numel = 32;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.param_bf16 = shifted(s.out16.data(), 1); b.numel = 32;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);

  // Overlaps: identical, partial, bf16 output inside an fp32 buffer or offset into a bf16 grad.
  b = valid(); b.exp_avg = b.param;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.exp_avg_sq = s.exp_avg.data() + 63;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.grad = s.param.data() + 10;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.param_bf16 = reinterpret_cast<std::uint16_t*>(s.param.data() + 32);
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);
  b = valid(); b.param_bf16 = reinterpret_cast<std::uint16_t*>(s.grad32.data());
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);  // fp32 grad: not the bf16 alias
  b = valid(DType::bfloat16); b.param_bf16 = s.grad16.data() + 1;
  CHECK_THROWS_AS(validate_buffers(b), std::invalid_argument);

  // Allowed: the bf16 output in place of a bf16 gradient; buffers that touch without overlap.
  b = valid(DType::bfloat16); b.param_bf16 = s.grad16.data();
  CHECK(accepted(b));
  std::vector<float> packed(4 * 16);
  b = valid();
  b.numel = 16;
  b.param = packed.data();
  b.grad = packed.data() + 16;
  b.exp_avg = packed.data() + 32;
  b.exp_avg_sq = packed.data() + 48;
  b.param_bf16 = nullptr;
  CHECK(accepted(b));
}

TEST_CASE("adamw_coeffs rejects bad hyperparameters") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const auto with = [](auto set) {
    AdamWHyper h;
    set(h);
    return h;
  };
  const AdamWHyper bad[] = {
      with([](AdamWHyper& h) { h.lr = -1e-3; }),
      with([&](AdamWHyper& h) { h.lr = nan; }),
      with([&](AdamWHyper& h) { h.lr = inf; }),
      with([](AdamWHyper& h) { h.beta1 = 1.0; }),
      with([](AdamWHyper& h) { h.beta1 = -0.1; }),
      with([&](AdamWHyper& h) { h.beta1 = nan; }),
      with([](AdamWHyper& h) { h.beta2 = 1.0; }),
      with([](AdamWHyper& h) { h.beta2 = 1.5; }),
      with([](AdamWHyper& h) { h.eps = -1e-8; }),
      with([&](AdamWHyper& h) { h.eps = nan; }),
      with([](AdamWHyper& h) { h.weight_decay = -0.01; }),
      with([&](AdamWHyper& h) { h.weight_decay = inf; }),
      with([](AdamWHyper& h) { h.step = 0; }),
      with([](AdamWHyper& h) { h.step = -3; }),
      with([&](AdamWHyper& h) { h.grad_scale = nan; }),
      with([&](AdamWHyper& h) { h.grad_scale = inf; }),
  };
  for (const AdamWHyper& h : bad) CHECK_THROWS_AS(adamw_coeffs(h), std::invalid_argument);
  // The edges that torch accepts.
  const AdamWHyper edges = with([](AdamWHyper& h) {
    h.lr = 0;
    h.beta1 = 0;
    h.beta2 = 0;
    h.eps = 0;
    h.weight_decay = 0;
  });
  bool edges_accepted = true;
  try {
    adamw_coeffs(edges);
  } catch (const std::invalid_argument&) {
    edges_accepted = false;
  }
  CHECK(edges_accepted);
}

// ---------------------------------------------------------------------------------------------
// ISA selection

TEST_CASE("parse_isa knows exactly scalar, avx2 and avx512") {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) CHECK(parse_isa(isa_name(isa)) == isa);
  for (const char* name : {"", "AVX2", "avx", "avx512f", "sse", "auto", "scalar "}) {
    CHECK_THROWS_AS(parse_isa(name), std::invalid_argument);
  }
}

TEST_CASE("select_isa refuses an ISA the CPU lacks and honours TRAINSTREAM_ISA") {
  CHECK(isa_supported(Isa::scalar));
  int missing = 0;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (isa_supported(isa)) {
      CHECK(select_isa(isa) == isa);
      CHECK(HostAdamW(1, isa).isa() == isa);
    } else {
      ++missing;
      CHECK_THROWS_AS(select_isa(isa), Unsupported);
      CHECK_THROWS_AS(HostAdamW(1, isa), Unsupported);
    }
  }
  if (missing == 0) skip("select_isa(unsupported ISA)", "this CPU supports every ISA");
  CHECK(!isa_supported(Isa::avx512) || isa_supported(Isa::avx2));  // the detection is nested

  const Isa best = isa_supported(Isa::avx512) ? Isa::avx512
                   : isa_supported(Isa::avx2) ? Isa::avx2
                                              : Isa::scalar;
  const char* saved = std::getenv("TRAINSTREAM_ISA");
  const std::string saved_value = saved ? saved : "";
  unsetenv("TRAINSTREAM_ISA");
  CHECK(select_isa() == best);
  setenv("TRAINSTREAM_ISA", "auto", 1);
  CHECK(select_isa() == best);
  setenv("TRAINSTREAM_ISA", "scalar", 1);
  CHECK(select_isa() == Isa::scalar);
  CHECK(HostAdamW(1).isa() == Isa::scalar);
  CHECK(select_isa(best) == best);  // an explicit request wins over the variable
  setenv("TRAINSTREAM_ISA", "sse9", 1);
  CHECK_THROWS_AS(select_isa(), std::invalid_argument);
  if (!isa_supported(Isa::avx512)) {
    setenv("TRAINSTREAM_ISA", "avx512", 1);
    CHECK_THROWS_AS(select_isa(), Unsupported);
  }
  if (saved) {
    setenv("TRAINSTREAM_ISA", saved_value.c_str(), 1);
  } else {
    unsetenv("TRAINSTREAM_ISA");
  }
}

TS_TEST_MAIN
