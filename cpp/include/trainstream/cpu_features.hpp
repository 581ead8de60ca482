// Which vector instruction sets the host CPU (and its operating system) can run, and which one
// the AdamW engine should use.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace trainstream {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

struct CpuFeatures {
  bool avx2_fma = false;  // AVX2 + FMA, with YMM state enabled by the OS
  bool avx512 = false;    // AVX-512 F/BW/VL, with ZMM state enabled by the OS
  bool avx512_vbmi = false;  // and VBMI's byte permutes (the 8-bit update decodes with them)
};

CpuFeatures detect_cpu_features();

const char* isa_name(Isa isa);

// "scalar" | "avx2" | "avx512"; throws std::invalid_argument for anything else.
Isa parse_isa(std::string_view name);

bool isa_supported(Isa isa);

// The ISA to run: `requested` if given, else $TRAINSTREAM_ISA if set, else the best supported.
// A requested ISA the CPU cannot run is an error (Unsupported), never a silent fallback.
Isa select_isa(std::optional<Isa> requested = std::nullopt);

}  // namespace trainstream
