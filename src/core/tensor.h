// Non-owning tensor views: a pointer, a dtype, a shape and strides (in elements), up to 8 dims.
// Views never own memory; whoever made the buffer (an mmap, a Buffer, a device allocation) does.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace kiln {

inline constexpr int kMaxDims = 8;

struct Shape {
  int ndim = 0;
  std::array<int64_t, kMaxDims> dims{};

  Shape() = default;
  Shape(std::initializer_list<int64_t> d) {
    KILN_CHECK(d.size() <= kMaxDims, "too many dims: {}", d.size());
    for (int64_t v : d) dims[ndim++] = v;
  }
  static Shape from(const std::vector<int64_t>& d) {
    Shape s;
    KILN_CHECK(d.size() <= kMaxDims, "too many dims: {}", d.size());
    for (int64_t v : d) s.dims[s.ndim++] = v;
    return s;
  }
  int64_t operator[](int i) const { return dims[i < 0 ? ndim + i : i]; }
  int64_t& operator[](int i) { return dims[i < 0 ? ndim + i : i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= dims[i];
    return n;
  }
  bool operator==(const Shape& o) const {
    if (ndim != o.ndim) return false;
    for (int i = 0; i < ndim; ++i)
      if (dims[i] != o.dims[i]) return false;
    return true;
  }
  std::vector<int64_t> vec() const { return {dims.begin(), dims.begin() + ndim}; }
  std::string str() const;  // "[4096, 2048]"
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  Shape shape;
  std::array<int64_t, kMaxDims> strides{};  // in elements

  TensorView() = default;
  TensorView(void* d, DType t, Shape s) : data(d), dtype(t), shape(s) { set_contiguous_strides(); }

  void set_contiguous_strides() {
    int64_t st = 1;
    for (int i = shape.ndim - 1; i >= 0; --i) {
      strides[i] = st;
      st *= shape.dims[i];
    }
  }
  int ndim() const { return shape.ndim; }
  int64_t dim(int i) const { return shape[i]; }
  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const {
    int64_t st = 1;
    for (int i = shape.ndim - 1; i >= 0; --i) {
      if (shape.dims[i] != 1 && strides[i] != st) return false;
      st *= shape.dims[i];
    }
    return true;
  }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  // Row `i` of the first dimension (a view of the remaining dims).
  TensorView row(int64_t i) const {
    TensorView v;
    v.dtype = dtype;
    v.data = static_cast<char*>(data) + i * strides[0] * static_cast<int64_t>(dtype_size(dtype));
    v.shape.ndim = shape.ndim - 1;
    for (int d = 1; d < shape.ndim; ++d) {
      v.shape.dims[d - 1] = shape.dims[d];
      v.strides[d - 1] = strides[d];
    }
    return v;
  }
};

// An owning, 64-byte aligned host buffer.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t nbytes);
  ~Buffer();
  Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_) { o.data_ = nullptr; o.size_ = 0; }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kiln
