// Unicode data for NFC normalisation, generated into unicode_tables.cpp by
// tools/unicode/gen_nfc_tables.py (from Python's unicodedata), plus small accessors.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>

namespace kiln::tok::unicode {

extern const char* const kUnicodeVersion;
extern const uint16_t kPropStage1[];        // [0x110000 >> 7] block index per 128 code points
extern const uint16_t kPropStage2[];        // [n_blocks * 128] ccc | qc << 8 | boundary << 10
extern const uint32_t kDecompCodePoints[];  // sorted code points that have a canonical decomposition
extern const uint32_t kDecompIndex[];       // offset << 4 | length into kDecompData
extern const uint32_t kDecompData[];
extern const uint64_t kComposePairs[];    // sorted first << 32 | second
extern const uint32_t kComposeResults[];  // the primary composite of each pair
extern const size_t kDecompCount;
extern const size_t kComposeCount;

enum class QuickCheck : uint8_t { kYes = 0, kMaybe = 1, kNo = 2 };

inline uint16_t props(char32_t cp) {
  return kPropStage2[(static_cast<uint32_t>(kPropStage1[cp >> 7]) << 7) | (cp & 127)];
}
inline uint8_t combining_class(uint16_t p) { return static_cast<uint8_t>(p & 0xff); }
inline QuickCheck nfc_quick_check(uint16_t p) { return static_cast<QuickCheck>((p >> 8) & 3); }
// No character before this one can change when it is normalised (a safe place to cut the text).
inline bool nfc_boundary_before(uint16_t p) { return (p >> 10) & 1; }

// Full canonical decomposition of cp (empty if it has none; Hangul syllables excluded).
std::span<const uint32_t> canonical_decomposition(char32_t cp);
// The primary composite of (first, second), Hangul included; 0 if none.
char32_t compose_pair(char32_t first, char32_t second);

}  // namespace kiln::tok::unicode
