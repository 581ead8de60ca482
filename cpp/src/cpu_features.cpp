#include "trainstream/cpu_features.hpp"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "trainstream/errors.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define TS_X86 1
#endif

namespace trainstream {

namespace {

#ifdef TS_X86
// XCR0: which register states the OS saves on a context switch.
unsigned long long read_xcr0() {
  unsigned int eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

}  // namespace

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#ifdef TS_X86
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = ecx & bit_OSXSAVE;
  const bool fma = ecx & bit_FMA;
  const bool avx = ecx & bit_AVX;
  if (!osxsave || !avx) return f;
  const unsigned long long xcr0 = read_xcr0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;           // SSE + AVX
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;         // + opmask, ZMM0-15 high, ZMM16-31
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  f.avx2_fma = ymm_state && fma && (ebx & bit_AVX2);
  f.avx512 = f.avx2_fma && zmm_state && (ebx & bit_AVX512F) && (ebx & bit_AVX512BW) &&
             (ebx & bit_AVX512VL);
  f.avx512_vbmi = f.avx512 && (ecx & bit_AVX512VBMI);
#endif
  return f;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "unknown";
}

Isa parse_isa(std::string_view name) {
  if (name == "scalar") return Isa::scalar;
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  throw std::invalid_argument("unknown ISA '" + std::string(name) +
                              "': expected scalar, avx2 or avx512");
}

bool isa_supported(Isa isa) {
  static const CpuFeatures f = detect_cpu_features();
  switch (isa) {
    case Isa::scalar: return true;
    case Isa::avx2: return f.avx2_fma;
    case Isa::avx512: return f.avx512;
  }
  return false;
}

Isa select_isa(std::optional<Isa> requested) {
  if (!requested) {
    if (const char* env = std::getenv("TRAINSTREAM_ISA"); env && *env && std::string(env) != "auto") {
      requested = parse_isa(env);
    }
  }
  if (requested) {
    if (!isa_supported(*requested)) {
      throw Unsupported(std::string("this CPU cannot run the ") + isa_name(*requested) +
                        " kernels (or the OS does not enable their registers); use one of: " +
                        (isa_supported(Isa::avx512) ? "avx512, " : "") +
                        (isa_supported(Isa::avx2) ? "avx2, " : "") + "scalar");
    }
    return *requested;
  }
  if (isa_supported(Isa::avx512)) return Isa::avx512;
  if (isa_supported(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

}  // namespace trainstream
