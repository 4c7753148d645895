// The launchers' view (kernels.h) of a step layout and of a layer's KV pool on the device: what every
// CudaOps op passes its kernels, shared with the GPU tests that call launchers directly. Plain C++.
#pragma once
#include "backend/cuda/kernels.h"
#include "model/ops.h"

namespace kiln::backend::cuda {

// Device pointers of the layout's tensors, counts, and the longest sequence (from the host mirrors).
::kiln::cuda::ops::StepArgs step_args(const model::StepLayout& step);
// The pool's pointers, element type (F32, BF16 or F8_E4M3), scales and [pages, page_size, kv_heads, head_dim] sizes.
::kiln::cuda::ops::KvPoolArgs pool_args(const model::KvLayerView& cache);

}  // namespace kiln::backend::cuda
