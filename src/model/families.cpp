// The one table of supported model families, by architecture.
#include "core/error.h"
#include "model/family.h"

namespace kiln::model {
namespace {

struct Entry {
  format::Arch arch;
  const Family& (*get)();
};

constexpr Entry kFamilies[] = {
    {format::Arch::qwen3_5_moe, qwen3_5_moe_family},
    {format::Arch::qwen3_5, qwen3_5_family},
    {format::Arch::qwen3_next, qwen3_next_family},
    {format::Arch::qwen3_moe, qwen3_moe_family},
    {format::Arch::qwen3, qwen3_family},
};

}  // namespace

std::string supported_families() {
  std::string s;
  for (const Entry& e : kFamilies) s += (s.empty() ? "" : ", ") + std::string(format::arch_name(e.arch));
  return s;
}

const Family& family_for(format::Arch arch) {
  for (const Entry& e : kFamilies)
    if (e.arch == arch) return e.get();
  fail("model family '{}' is not supported (supported: {})", format::arch_name(arch), supported_families());
}

}  // namespace kiln::model
