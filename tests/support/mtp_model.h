// Test model folders with a multi-token-prediction head: a copy of a tiny model folder (config.json,
// model.safetensors) plus random mtp.* tensors (every tensor format::expected_tensors lists for the MTP layer, BF16,
// from a seeded generator), and config.json's mtp_num_hidden_layers set to 1.
#pragma once
#include <cstdint>
#include <string>

namespace kiln::test {

// Writes out_dir (created) from src_dir. The MTP weights depend only on `seed` and the config.
void write_model_with_mtp(const std::string& src_dir, const std::string& out_dir, uint64_t seed);

}  // namespace kiln::test
