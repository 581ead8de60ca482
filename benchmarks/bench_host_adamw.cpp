// bench_host_adamw: ns/param and memory bandwidth of the host AdamW engine, for each ISA and
// thread count, against a STREAM triad measured in the same run with the same threads.
//
//   bench_host_adamw [--params N] [--threads 1,4,8,16] [--isa avx2,scalar] [--repeats R]
//                    [--json PATH]
//
// Bytes per parameter: read p, g, m, v and write p, m, v: 28 B with an fp32 gradient, 26 B
// with a bf16 one. Each is also timed writing only the update term (term_only, what the offload
// pipeline does for fp32 weights): p is not read, so 4 B less. The blockwise 8-bit update
// (output "8bit": torchao's AdamW8bit over an fp32 master) reads p, g and the two moments' codes
// and writes p and the codes: 16 B with an fp32 gradient, 14 B with a bf16 one (+ 1/32 B of
// block scales). "8bit-sr" (bf16_stochastic_round: bf16 weights without a master, bf16 gradient)
// reads and writes 2 B weights instead: 10 B.
//
// Memory: the four fp32 buffers, 16 N bytes (the bf16 gradient reuses the fp32 gradient's
// memory), and the triad's three arrays of T = max(N/2, 64M) floats, 12 T bytes: 64M floats
// (256 MiB an array) keeps the triad far outside any last-level cache, N/2 keeps it on the scale
// of the AdamW working set. The triad runs (and frees its arrays) before the AdamW buffers are
// allocated for each thread count, so the peak is max(16 N, 12 T) bytes, not their sum:
// 4 GiB for the default N = 256M.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "trainstream/adamw.hpp"
#include "trainstream/adamw8bit.hpp"
#include "trainstream/bandwidth.hpp"
#include "trainstream/cpu_features.hpp"
#include "trainstream/thread_pool.hpp"

using namespace trainstream;

namespace {

constexpr double kBytesFp32Grad = 28.0;  // p r/w 8, g 4, m r/w 8, v r/w 8
constexpr double kBytesBf16Grad = 26.0;  // p r/w 8, g 2, m r/w 8, v r/w 8
constexpr double kBytesTermSaved = 4.0;   // term_only: p written, not read
constexpr double kBytes8bitSaved = 12.0;  // 8-bit moments: codes r/w 4 instead of fp32 r/w 16
constexpr double kBytesScales = 16.0 / kQuantBlock;  // two scales read and written a block
constexpr double kBytesMasterSaved = 4.0;  // 8bit-sr: bf16 weights r/w 4 instead of fp32 r/w 8

struct Options {
  std::size_t params = std::size_t(1) << 28;
  std::vector<std::size_t> threads;  // empty: 1, 2, 4, ..., available_cpus()
  std::vector<Isa> isas;             // empty: every supported ISA
  int repeats = 5;
  std::string json_path;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: bench_host_adamw [--params N] [--threads 1,4,8,16] "
               "[--isa avx512,avx2,scalar] [--repeats R] [--json PATH]\n",
               why);
  std::exit(2);
}

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = list.find(',', start);
    out.push_back(list.substr(start, comma - start));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

std::size_t parse_count(const std::string& text, const char* flag) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value == 0 || text[0] == '-') {
    usage((std::string(flag) + " needs a positive integer, got '" + text + "'").c_str());
  }
  return static_cast<std::size_t>(value);
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("bench_host_adamw: host AdamW ns/param and GB/s");
    if (i + 1 >= argc) usage(("missing value after " + flag).c_str());
    const std::string value = argv[++i];
    if (flag == "--params") {
      o.params = parse_count(value, "--params");
    } else if (flag == "--threads") {
      for (const std::string& t : split_commas(value)) o.threads.push_back(parse_count(t, "--threads"));
    } else if (flag == "--isa") {
      for (const std::string& name : split_commas(value)) {
        try {
          o.isas.push_back(parse_isa(name));
        } catch (const std::invalid_argument& e) {
          usage(e.what());
        }
      }
    } else if (flag == "--repeats") {
      o.repeats = static_cast<int>(parse_count(value, "--repeats"));
    } else if (flag == "--json") {
      o.json_path = value;
    } else {
      usage(("unknown option " + flag).c_str());
    }
  }
  if (o.threads.empty()) {
    const std::size_t all = available_cpus();
    for (std::size_t t = 1; t < all; t *= 2) o.threads.push_back(t);
    o.threads.push_back(all);
  }
  if (o.isas.empty()) {
    for (Isa isa : {Isa::avx512, Isa::avx2, Isa::scalar}) {
      if (isa_supported(isa)) o.isas.push_back(isa);
    }
  }
  for (Isa isa : o.isas) {
    if (!isa_supported(isa)) {
      std::fprintf(stderr, "bench_host_adamw: this CPU cannot run %s\n", isa_name(isa));
      std::exit(2);
    }
  }
  return o;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

// 64-byte aligned and rounded up to whole cache lines; the pages stay untouched (unmapped)
// until first touch.
Buffer alloc_floats(std::size_t n) {
  const std::size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (!p) {
    std::fprintf(stderr, "bench_host_adamw: cannot allocate %zu bytes\n", bytes);
    std::exit(1);
  }
  return Buffer(static_cast<float*>(p));
}

// Cheap deterministic values that differ per element (a hash, not a PRNG stream, so that any
// thread can fill any range): uniform in [-1, 1).
inline float hashed_unit(std::uint64_t i, std::uint32_t salt) {
  std::uint32_t x = static_cast<std::uint32_t>(i * 2654435761u) ^ salt;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  return static_cast<float>(x >> 8) / 8388608.0f - 1.0f;
}

inline float grad_value(std::size_t i) { return 1e-2f * hashed_unit(i, 0x85ebca6bu); }

struct AdamWState {
  Buffer param, grad, exp_avg, exp_avg_sq;
};

// Runs fn(begin, end) over [0, n) on `pool` with the engine's own chunking, so that each page
// is first touched by a thread of the pool that later streams it.
template <typename Fn>
void for_chunks(ThreadPool& pool, std::size_t n, Fn fn) {
  const std::size_t chunk = chunk_elements(n, pool.size());
  pool.parallel_for((n + chunk - 1) / chunk, [&](std::size_t t) {
    const std::size_t begin = t * chunk;
    fn(begin, std::min(n, begin + chunk));
  });
}

AdamWState make_state(ThreadPool& pool, std::size_t n) {
  AdamWState s{alloc_floats(n), alloc_floats(n), alloc_floats(n), alloc_floats(n)};
  for_chunks(pool, n, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      s.param[i] = hashed_unit(i, 0x9e3779b9u);
      s.grad[i] = grad_value(i);
      s.exp_avg[i] = 1e-3f * hashed_unit(i, 0x7f4a7c15u);
      const float r = hashed_unit(i, 0x165667b1u);
      s.exp_avg_sq[i] = 1e-5f * r * r + 1e-12f;
    }
  });
  return s;
}

// Rewrites the gradient buffer's first half as the bf16 gradient (its own values, not a
// conversion of the fp32 data in place, which would race between chunks).
void write_bf16_grad(ThreadPool& pool, AdamWState& s, std::size_t n) {
  auto* g16 = reinterpret_cast<std::uint16_t*>(s.grad.get());
  for_chunks(pool, n, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) g16[i] = float_to_bf16(grad_value(i));
  });
}

// The dynamic quantization map of torchao's (and bitsandbytes') 8-bit optimizers, built the same
// way (7 exponent levels of linearly spaced fractions, then 0 and 1): the values the kernels'
// tables are made for. The tests check the kernels against torchao's own map.
std::vector<float> dynamic_qmap(bool is_signed) {
  std::vector<float> map;
  for (int level = 0; level < 7; ++level) {
    const int items = is_signed ? (1 << level) + 1 : (1 << (level + 1)) + 1;
    const double scale = std::pow(10.0, -6 + level);
    for (int k = 0; k + 1 < items; ++k) {
      const double lo = 0.1 + 0.9 * k / (items - 1), hi = 0.1 + 0.9 * (k + 1) / (items - 1);
      map.push_back(static_cast<float>(scale * (lo + hi) / 2));
      if (is_signed) map.push_back(static_cast<float>(-scale * (lo + hi) / 2));
    }
  }
  map.push_back(0.0f);
  map.push_back(1.0f);
  while (map.size() < 256) map.push_back(0.0f);  // (the signed map's one spare code)
  std::sort(map.begin(), map.end());
  return map;
}

struct EightBitState {
  std::unique_ptr<std::uint8_t[]> m_codes, v_codes;
  Buffer m_scale, v_scale;
  std::vector<float> signed_qmap = dynamic_qmap(true), unsigned_qmap = dynamic_qmap(false);
};

EightBitState make_8bit_state(ThreadPool& pool, std::size_t n) {
  EightBitState s{std::unique_ptr<std::uint8_t[]>(new std::uint8_t[n]), std::unique_ptr<std::uint8_t[]>(new std::uint8_t[n]),
                  alloc_floats(n / kQuantBlock), alloc_floats(n / kQuantBlock)};
  for_chunks(pool, n, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      s.m_codes[i] = static_cast<std::uint8_t>(128 + 100 * hashed_unit(i, 0x7f4a7c15u));
      s.v_codes[i] = static_cast<std::uint8_t>(128 + 127 * hashed_unit(i, 0x165667b1u));
      if (i % kQuantBlock == 0) {
        s.m_scale[i / kQuantBlock] = 1e-3f;
        s.v_scale[i / kQuantBlock] = 1e-5f;
      }
    }
  });
  return s;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Median wall time of `repeats` full-parameter steps, after one warm-up step; step(n) runs the
// n-th (1-based) step.
template <typename Step>
double median_seconds(int repeats, Step step) {
  std::vector<double> times;
  for (int r = 0; r <= repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    step(r + 1);
    if (r > 0) times.push_back(seconds_since(t0));
  }
  std::sort(times.begin(), times.end());
  const std::size_t mid = times.size() / 2;
  return times.size() % 2 ? times[mid] : 0.5 * (times[mid - 1] + times[mid]);
}

double median_step_seconds(HostAdamW& engine, const AdamWBuffers& buffers, int repeats) {
  AdamWHyper hyper;
  hyper.lr = 1e-4;
  hyper.weight_decay = 0.01;
  return median_seconds(repeats, [&](int step) {
    hyper.step = step;
    engine.step(buffers, hyper);
  });
}

double median_8bit_step_seconds(HostAdamW& engine, const AdamW8bitBuffers& buffers, int repeats) {
  AdamW8bitHyper hyper;
  hyper.lr = 1e-4f;
  hyper.weight_decay = 0.01;
  hyper.stochastic_round = buffers.param16 != nullptr;
  hyper.seed = 1;
  return median_seconds(repeats, [&](int step) {
    hyper.step = step;
    adamw8bit_step(engine.pool(), buffers, hyper, engine.isa());
  });
}

struct Row {
  std::string isa;
  std::size_t threads;
  std::string grad;
  // "weights" (p updated in place), "term" (term_only), "next" (term, moments out of place) or
  // "8bit" (p updated in place, blockwise 8-bit moments) or "8bit-sr" (bf16 p, no master)
  std::string output;
  double bytes_per_param;
  double ns_per_param;
  double gbps;
  double triad_gbps;
};

std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return "unknown";
  char line[512];
  std::string model = "unknown";
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "model name", 10) == 0) {
      const char* colon = std::strchr(line, ':');
      if (colon) {
        model = colon + 1;
        model.erase(0, model.find_first_not_of(" \t"));
        model.erase(model.find_last_not_of(" \t\n") + 1);
      }
      break;
    }
  }
  std::fclose(f);
  return model;
}

// Size in bytes of the largest cache of CPU 0 (sysfs), or 0 if unknown.
std::size_t last_level_cache_bytes() {
  std::size_t largest = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string path = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size";
    std::FILE* f = std::fopen(path.c_str(), "r");
    if (!f) break;
    std::size_t value = 0;
    char unit = 0;
    if (std::fscanf(f, "%zu%c", &value, &unit) >= 1) {
      const std::size_t scale = unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1;
      largest = std::max(largest, value * scale);
    }
    std::fclose(f);
  }
  return largest;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

void write_json(const std::string& path, const Options& o, std::size_t triad_numel,
                const std::vector<Row>& rows) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "bench_host_adamw: cannot write %s\n", path.c_str());
    std::exit(1);
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::fprintf(f, "{\n  \"benchmark\": \"bench_host_adamw\",\n  \"date\": \"%s\",\n", date);
  std::fprintf(f, "  \"cpu\": \"%s\",\n  \"available_cpus\": %zu,\n", json_escape(cpu_model()).c_str(),
               available_cpus());
  std::fprintf(f, "  \"params\": %zu,\n  \"repeats\": %d,\n  \"triad_numel\": %zu,\n", o.params,
               o.repeats, triad_numel);
  std::fprintf(f, "  \"rows\": [\n");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "    {\"isa\": \"%s\", \"threads\": %zu, \"grad\": \"%s\", \"output\": \"%s\", "
                 "\"bytes_per_param\": %g, \"ns_per_param\": %.6g, \"GBps\": %.6g, \"triad_GBps\": %.6g, "
                 "\"triad_share\": %.4f}%s\n",
                 r.isa.c_str(), r.threads, r.grad.c_str(), r.output.c_str(), r.bytes_per_param, r.ns_per_param, r.gbps,
                 r.triad_gbps, r.gbps / r.triad_gbps, i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}

}  // namespace

int run(const Options& o) {
  const std::size_t n = o.params;
  const std::size_t triad_numel = std::max<std::size_t>(n / 2, std::size_t(64) << 20);
  // The triad always uses the best ISA (streaming stores), whatever ISAs AdamW is timed with.
  const Isa triad_isa = isa_supported(Isa::avx512) ? Isa::avx512
                        : isa_supported(Isa::avx2) ? Isa::avx2
                                                   : Isa::scalar;

  std::printf("bench_host_adamw: %zu params (%.2f GiB of fp32 state), triad over %zu floats x 3 "
              "with %s, median of %d steps after a warm-up\n",
              n, 16.0 * n / (1u << 30), triad_numel, isa_name(triad_isa), o.repeats);
  std::printf("cpu: %s, %zu CPUs available\n", cpu_model().c_str(), available_cpus());
  const std::size_t llc = last_level_cache_bytes();
  if (llc && 16.0 * n < 4.0 * llc) {
    std::printf("note: the AdamW state (%.0f MiB) is under 4x the last-level cache (%.0f MiB): "
                "expect cache, not memory, speeds\n",
                16.0 * n / (1 << 20), double(llc) / (1 << 20));
  }
  std::printf("\n");
  std::printf("%-7s %7s %5s %8s %8s %10s %9s %11s %7s\n", "isa", "threads", "grad", "output", "B/param",
              "ns/param", "GB/s", "triad GB/s", "share");

  std::vector<Row> rows;
  for (std::size_t threads : o.threads) {
    // The triad first, its arrays freed before the AdamW state exists: peak memory is the
    // larger of the two, not their sum.
    double triad_gbps;
    {
      ThreadPool pool(threads);
      triad_gbps = measure_triad(pool, triad_numel, o.repeats, triad_isa).best_gbps;
    }
    // One engine per ISA, all with this thread count; the first one's pool first-touches the
    // state. Workers are not pinned, so any pool of this size streams it equally well.
    std::vector<std::unique_ptr<HostAdamW>> engines;
    for (Isa isa : o.isas) engines.push_back(std::make_unique<HostAdamW>(threads, isa));
    AdamWState state = make_state(engines.front()->pool(), n);
    AdamWBuffers buffers;
    buffers.param = state.param.get();
    buffers.grad = state.grad.get();
    buffers.exp_avg = state.exp_avg.get();
    buffers.exp_avg_sq = state.exp_avg_sq.get();
    buffers.numel = n;
    // "next" writes the moments here (touched first by the untimed warm-up step)
    Buffer next_exp_avg = alloc_floats(n), next_exp_avg_sq = alloc_floats(n);
    const std::size_t n8 = n / kQuantBlock * kQuantBlock;
    EightBitState compact = make_8bit_state(engines.front()->pool(), n8);
    AdamW8bitBuffers buffers8;
    buffers8.param = state.param.get();
    buffers8.grad = state.grad.get();
    buffers8.exp_avg = {compact.m_codes.get(), compact.m_scale.get()};
    buffers8.exp_avg_sq = {compact.v_codes.get(), compact.v_scale.get()};
    buffers8.signed_qmap = compact.signed_qmap.data();
    buffers8.unsigned_qmap = compact.unsigned_qmap.data();
    buffers8.numel = n8;
    const auto report = [&](Row r) {
      std::printf("%-7s %7zu %5s %8s %8.1f %10.4f %9.1f %11.1f %6.0f%%\n", r.isa.c_str(), r.threads, r.grad.c_str(),
                  r.output.c_str(), r.bytes_per_param, r.ns_per_param, r.gbps, r.triad_gbps,
                  100.0 * r.gbps / r.triad_gbps);
      std::fflush(stdout);
      rows.push_back(r);
    };

    for (DType grad_dtype : {DType::float32, DType::bfloat16}) {
      if (grad_dtype == DType::bfloat16) write_bf16_grad(engines.front()->pool(), state, n);
      buffers.grad_dtype = grad_dtype;
      for (const char* output : {"weights", "term", "next"}) {
        // "next": what a speculated update writes, the term and the moments into a second set
        const bool term = output != std::string("weights"), next = output == std::string("next");
        buffers.term_only = term;
        buffers.exp_avg_out = next ? next_exp_avg.get() : nullptr;
        buffers.exp_avg_sq_out = next ? next_exp_avg_sq.get() : nullptr;
        const double bytes =
            (grad_dtype == DType::float32 ? kBytesFp32Grad : kBytesBf16Grad) - (term ? kBytesTermSaved : 0.0);
        for (auto& engine : engines) {
          const double seconds = median_step_seconds(*engine, buffers, o.repeats);
          report({isa_name(engine->isa()), threads, grad_dtype == DType::float32 ? "fp32" : "bf16", output, bytes,
                  seconds * 1e9 / n, bytes * n / seconds / 1e9, triad_gbps});
        }
      }
      buffers8.grad_dtype = grad_dtype;
      const double bytes =
          (grad_dtype == DType::float32 ? kBytesFp32Grad : kBytesBf16Grad) - kBytes8bitSaved + kBytesScales;
      for (auto& engine : engines) {
        const double seconds = median_8bit_step_seconds(*engine, buffers8, o.repeats);
        report({isa_name(engine->isa()), threads, grad_dtype == DType::float32 ? "fp32" : "bf16", "8bit", bytes,
                seconds * 1e9 / n8, bytes * n8 / seconds / 1e9, triad_gbps});
      }
      if (grad_dtype == DType::bfloat16) {  // bf16 weights without a master, rounded stochastically
        std::unique_ptr<std::uint16_t[]> weights16(new std::uint16_t[n8]);
        for_chunks(engines.front()->pool(), n8, [&](std::size_t begin, std::size_t end) {
          for (std::size_t i = begin; i < end; ++i) weights16[i] = float_to_bf16(state.param[i]);
        });
        AdamW8bitBuffers sr = buffers8;
        sr.param = nullptr;
        sr.param16 = weights16.get();
        const double sr_bytes = bytes - kBytesMasterSaved;
        for (auto& engine : engines) {
          const double seconds = median_8bit_step_seconds(*engine, sr, o.repeats);
          report({isa_name(engine->isa()), threads, "bf16", "8bit-sr", sr_bytes, seconds * 1e9 / n8,
                  sr_bytes * n8 / seconds / 1e9, triad_gbps});
        }
      }
    }
  }
  std::printf("\nshare: AdamW GB/s (median step) / triad GB/s (best of %d), same threads.\n",
              o.repeats);
  if (!o.json_path.empty()) {
    write_json(o.json_path, o, triad_numel, rows);
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  const Options options = parse_options(argc, argv);
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_host_adamw: %s\n", e.what());
    return 1;
  }
}
