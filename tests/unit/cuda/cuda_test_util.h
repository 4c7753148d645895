// Helpers for the GPU kernel tests: skip without a GPU, random data, device round trips, error norms.
// Every test draws fresh random inputs, poisons outputs (0xff bytes: bf16/f32 NaN) before the launch,
// and compares with the CPU reference by ||out - ref|| / ||ref|| (NaN or inf never passes).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <random>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/reference.h"
#include "core/dtype.h"
#include "core/error.h"

#define KILN_REQUIRE_GPU()                                                                \
  do {                                                                                    \
    if (::kiln::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine"; \
  } while (0)

// Checks err < tol and prints the measured error (the GPU run's log keeps every number).
#define KILN_EXPECT_ERR(err, tol, label)                                                              \
  do {                                                                                                \
    const double kiln_err_ = (err);                                                                   \
    std::printf("[ err      ] %s: %.3e (tol %.0e)\n", std::string(label).c_str(), kiln_err_, double(tol)); \
    EXPECT_LT(kiln_err_, (tol)) << (label);                                                           \
  } while (0)

namespace kiln::cuda::test {

// Sets environment variables for a scope (a null value leaves that one alone) and unsets them when the scope ends,
// also when it throws: for the backends' switches, which are read when an object is constructed.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [name, value] : vars)
      if (value) {
        ::setenv(name, value, 1);
        names_.push_back(name);
      }
  }
  ~ScopedEnv() {
    for (const char* name : names_) ::unsetenv(name);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::vector<const char*> names_;
};

inline std::mt19937& rng() {
  static std::mt19937 gen(std::random_device{}());
  return gen;
}

inline std::vector<uint16_t> random_bf16(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(d(rng()));
  return v;
}
inline std::vector<float> random_f32(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng());
  return v;
}
inline std::vector<uint8_t> random_bytes(size_t n) {
  std::uniform_int_distribution<int> d(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(d(rng()));
  return v;
}
// E4M3 block scales with values spread over [2^lo_exp, 2^hi_exp).
inline std::vector<uint8_t> random_e4m3_scales(size_t n, float lo_exp = -3.0f, float hi_exp = 3.0f) {
  std::uniform_real_distribution<float> d(lo_exp, hi_exp);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = f32_to_e4m3(std::exp2(d(rng())));
  return v;
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& h) {
  DeviceBuffer d(h.size() * sizeof(T));
  if (!h.empty()) KILN_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
std::vector<T> download(const DeviceBuffer& d, size_t n) {
  std::vector<T> h(n);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  if (n) KILN_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
inline DeviceBuffer poisoned(size_t bytes) {
  DeviceBuffer d(bytes);
  KILN_CUDA_CHECK(cudaMemset(d.data(), 0xff, bytes));
  return d;
}

// ||out - ref|| / ||ref||; infinity if anything is NaN/inf.
template <typename A, typename B>
double rel_err(const std::vector<A>& out, const std::vector<B>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = static_cast<double>(out[i]), r = static_cast<double>(ref[i]);
    if (!std::isfinite(o) || !std::isfinite(r)) return INFINITY;
    num += (o - r) * (o - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
inline std::vector<float> bf16_to_float(const std::vector<uint16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_f32(v[i]);
  return f;
}

}  // namespace kiln::cuda::test
