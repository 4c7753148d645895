// The backend interface: the table of ops a forward pass needs, over TensorViews, with shape comments on every
// parameter. It is defined in the model layer (model/ops.h: the model says what it needs, layers point one way)
// and re-exported here under the backend's name; the generic runner (model/runner.h) drives any implementation.
//
//   kiln::backend::Backend      = kiln::model::Ops            (implement this for a new backend)
//   kiln::backend::LinearWeight = kiln::model::LinearWeight   (BF16 / FP8-per-tensor / NVFP4 weight descriptor)
//
// Backends: cpu/ (the oracle, always built; load_cpu_model in cpu/cpu_backend.h), cuda/ (when nvcc is present).
#pragma once
#include "model/ops.h"
#include "model/runner.h"

namespace kiln::backend {

using Backend = model::Ops;
using model::DeltaRuleMode;
using model::ExpertWeights;
using model::KvLayerView;
using model::LinearWeight;
using model::NormKind;
using model::StepLayout;
using model::WeightFormat;

}  // namespace kiln::backend
