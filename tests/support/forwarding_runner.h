// A ModelRunner that hands everything to another one: tests derive from it and override the one part they stand in
// for (a vision encoder, scripted drafts).
#pragma once
#include <memory>
#include <string>

#include "model/model_runner.h"

namespace kiln::test {

class ForwardingRunner : public model::ModelRunner {
 public:
  explicit ForwardingRunner(std::unique_ptr<model::ModelRunner> inner) : inner_(std::move(inner)) {}
  model::RunnerCapacity capacity() const override { return inner_->capacity(); }
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  void forward(std::span<const model::SeqChunk> c, std::span<float> l) override { inner_->forward(c, l); }
  void forward_argmax(std::span<const model::SeqChunk> c, std::span<int32_t> t) override {
    inner_->forward_argmax(c, t);
  }
  bool can_copy_state() const override { return inner_->can_copy_state(); }
  void copy_state(int src, int dst) override { inner_->copy_state(src, dst); }
  bool has_recurrent_state() const override { return inner_->has_recurrent_state(); }
  std::string describe() const override { return inner_->describe(); }

 protected:
  std::unique_ptr<model::ModelRunner> inner_;
};

}  // namespace kiln::test
