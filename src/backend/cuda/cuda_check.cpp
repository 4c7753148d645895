#include "backend/cuda/cuda_check.h"

#include <fmt/args.h>
#include <fmt/format.h>

#include "core/error.h"

namespace kiln::cuda {

void throw_cuda_error(const char* file, int line, const char* expr, cudaError_t err) {
  throw InternalError(fmt::format("{}:{}: CUDA error {} ({}) in {}", file, line, cudaGetErrorName(err),
                                  cudaGetErrorString(err), expr));
}

void throw_cublas_error(const char* file, int line, const char* expr, int status) {
  throw InternalError(fmt::format("{}:{}: cuBLAS status {} in {}", file, line, status, expr));
}

void cuda_fail(const std::string& format, std::initializer_list<int64_t> args) {
  fmt::dynamic_format_arg_store<fmt::format_context> store;
  for (int64_t a : args) store.push_back(a);
  throw Error(fmt::vformat(format, store));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error so later checks start clean
    return 0;
  }
  return n;
}

}  // namespace kiln::cuda
