// Math shared by the project's C++ CPU operators.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace spmd_cpu {

// exp(x) without a library call: Cephes' expf, range-reduced by
// powers of two, within 2 ulp of std::exp; arguments are clamped to [-87.3, 88.3], where it
// neither underflows to a denormal nor overflows.
inline float exp_vectorisable(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.f;
  return y * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace spmd_cpu
