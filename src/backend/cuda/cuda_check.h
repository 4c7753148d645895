// Error checking and small RAII helpers for the CUDA backend (host code; no kernels here).
// Every CUDA runtime / cuBLAS call goes through KILN_CUDA_CHECK / KILN_CUBLAS_CHECK, which throw
// kiln::InternalError with file:line and the library's own error name.
// This header must stay free of fmt (core/error.h): nvcc 13's front end cannot compile fmt 9's
// constexpr machinery, so .cu files see only these declarations and the .cpp does the formatting.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

namespace kiln::cuda {

[[noreturn]] void throw_cuda_error(const char* file, int line, const char* expr, cudaError_t err);
[[noreturn]] void throw_cublas_error(const char* file, int line, const char* expr, int status);

// kiln::fail for .cu files, formatted in a .cpp: nvcc's front end rejects parts of fmt's compile-time
// machinery, so kernel files pass the arguments (integers) to a run-time formatter instead.
[[noreturn]] void cuda_fail(const std::string& format, std::initializer_list<int64_t> args = {});

// Number of CUDA devices usable by this process; 0 when there is no driver or no GPU (never throws).
int device_count();

}  // namespace kiln::cuda

#define KILN_CUDA_CHECK(expr)                                                        \
  do {                                                                               \
    cudaError_t kiln_cuda_err_ = (expr);                                             \
    if (kiln_cuda_err_ != cudaSuccess) [[unlikely]]                                  \
      ::kiln::cuda::throw_cuda_error(__FILE__, __LINE__, #expr, kiln_cuda_err_);     \
  } while (0)

// After a kernel launch: reports launch-configuration errors at the launch site.
#define KILN_CUDA_CHECK_LAUNCH() KILN_CUDA_CHECK(cudaGetLastError())

#define KILN_CUBLAS_CHECK(expr)                                                      \
  do {                                                                               \
    int kiln_cublas_st_ = static_cast<int>(expr);                                    \
    if (kiln_cublas_st_ != 0) [[unlikely]]                                           \
      ::kiln::cuda::throw_cublas_error(__FILE__, __LINE__, #expr, kiln_cublas_st_);  \
  } while (0)

namespace kiln::cuda {

// An owning device allocation (cudaMalloc / cudaFree). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t nbytes) : size_(nbytes) {
    if (nbytes) KILN_CUDA_CHECK(cudaMalloc(&data_, nbytes));
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void reset() {
    if (data_) cudaFree(data_);
    data_ = nullptr;
    size_ = 0;
  }
  // cudaMalloc without throwing (the caller words the error): cudaSuccess and `out` holds nbytes, or the error
  // (cleared from the runtime's last-error state).
  static cudaError_t try_allocate(size_t nbytes, DeviceBuffer& out) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, nbytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return e;
    }
    out.reset();
    out.data_ = p;
    out.size_ = nbytes;
    return cudaSuccess;
  }
  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kiln::cuda
