// The table of the embedded default model's files. Defined by a .cpp generated at configure time
// (src/format/CMakeLists.txt): from models/kiln-tiny when it exists, else an empty table.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kiln::format::embedded {

struct EmbeddedFile {
  const char* name;
  const uint8_t* begin;
  const uint8_t* end;
};

extern const EmbeddedFile kFiles[];
extern const size_t kNumFiles;
extern const char* const kSourceDir;  // the folder embedded at build time (for tests)

}  // namespace kiln::format::embedded
