// libFuzzer target for the safetensors reader: any byte string must either parse into tensors whose
// bytes lie inside the input, or fail with kiln::Error. ASan catches any read outside the input.
//
// Input: first byte selects the mode. Even: the rest is a whole file. Odd: bytes 1-2 give a header
// length L (little endian, clamped to what is left); the file is the 8-byte length L followed by the
// rest, so mutations spend their time on the JSON header rather than on the length prefix.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::vector<uint8_t> file;
  if ((data[0] & 1) == 0) {
    file.assign(data + 1, data + size);
  } else {
    if (size < 3) return 0;
    uint64_t len = data[1] | (static_cast<uint64_t>(data[2]) << 8);
    const size_t rest = size - 3;
    if (len > rest) len = rest;
    for (int i = 0; i < 8; ++i) file.push_back(static_cast<uint8_t>(len >> (8 * i)));
    file.insert(file.end(), data + 3, data + size);
  }
  file.shrink_to_fit();  // exact-size heap block: ASan reports any overread
  try {
    kiln::format::SafetensorsFile sf({file.data(), file.size()}, "fuzz-input");
    unsigned sum = 0;
    for (const auto& t : sf.tensors()) {
      if (sf.find(t.name) != &t) __builtin_trap();
      if (t.nbytes && (t.data < file.data() || t.data + t.nbytes > file.data() + file.size())) __builtin_trap();
      for (size_t i = 0; i < t.nbytes; ++i) sum += t.data[i];  // touch every byte
    }
    volatile unsigned sink = sum;
    (void)sink;
  } catch (const kiln::Error&) {
  }
  return 0;
}
