#include "tokenizer/normalizer.h"

#include <algorithm>

#include "tokenizer/unicode_tables.h"
#include "tokenizer/utf8.h"

namespace kiln::tok {
namespace unicode {

std::span<const uint32_t> canonical_decomposition(char32_t cp) {
  const uint32_t* end = kDecompCodePoints + kDecompCount;
  const uint32_t* it = std::lower_bound(kDecompCodePoints, end, static_cast<uint32_t>(cp));
  if (it == end || *it != cp) return {};
  uint32_t index = kDecompIndex[it - kDecompCodePoints];
  return {kDecompData + (index >> 4), index & 15};
}

// Hangul syllable arithmetic (Unicode ch. 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

char32_t compose_pair(char32_t first, char32_t second) {
  if (first >= kLBase && first < kLBase + kLCount && second >= kVBase && second < kVBase + kVCount)
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  if (first >= kSBase && first < kSBase + kSCount && (first - kSBase) % kTCount == 0 && second > kTBase &&
      second < kTBase + kTCount)
    return first + (second - kTBase);
  uint64_t key = (static_cast<uint64_t>(first) << 32) | second;
  const uint64_t* end = kComposePairs + kComposeCount;
  const uint64_t* it = std::lower_bound(kComposePairs, end, key);
  if (it == end || *it != key) return 0;
  return kComposeResults[it - kComposePairs];
}

}  // namespace unicode

namespace {

using unicode::combining_class;
using unicode::props;

// NFC of a stretch of text that starts at a normalisation boundary (or at the start of the text):
// canonical decomposition, canonical ordering, canonical composition.
void nfc_segment(std::string_view text, std::string& out) {
  std::vector<char32_t> buf;
  buf.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    size_t len;
    char32_t cp = utf8::decode(text, i, len);
    i += len;
    if (cp >= unicode::kSBase && cp < unicode::kSBase + unicode::kSCount) {
      char32_t s = cp - unicode::kSBase;
      buf.push_back(unicode::kLBase + s / unicode::kNCount);
      buf.push_back(unicode::kVBase + (s % unicode::kNCount) / unicode::kTCount);
      if (s % unicode::kTCount != 0) buf.push_back(unicode::kTBase + s % unicode::kTCount);
      continue;
    }
    auto decomposition = unicode::canonical_decomposition(cp);
    if (decomposition.empty()) {
      buf.push_back(cp);
    } else {
      buf.insert(buf.end(), decomposition.begin(), decomposition.end());
    }
  }

  // Canonical ordering: stable sort of each run of non-starters by combining class.
  std::vector<uint8_t> ccc(buf.size());
  for (size_t i = 0; i < buf.size(); ++i) ccc[i] = combining_class(props(buf[i]));
  for (size_t i = 1; i < buf.size(); ++i) {
    if (ccc[i] == 0) continue;
    for (size_t j = i; j > 0 && ccc[j - 1] > ccc[j]; --j) {
      std::swap(buf[j - 1], buf[j]);
      std::swap(ccc[j - 1], ccc[j]);
    }
  }

  // Canonical composition: each character composes with the last starter unless blocked (a character
  // in between with a combining class >= its own, or a starter).
  if (!buf.empty()) {
    size_t starter = 0;
    int last_class = ccc[0] == 0 ? 0 : 256;  // text starting with a non-starter: nothing composes
    size_t n_out = 1;
    for (size_t i = 1; i < buf.size(); ++i) {
      char32_t cp = buf[i];
      int cls = ccc[i];
      char32_t composite = 0;
      if (last_class < cls || last_class == 0) composite = unicode::compose_pair(buf[starter], cp);
      if (composite != 0 && last_class != 256) {
        buf[starter] = composite;
        continue;
      }
      if (cls == 0) starter = n_out;
      last_class = cls;
      buf[n_out++] = cp;
    }
    buf.resize(n_out);
  }
  for (char32_t cp : buf) utf8::append(out, cp);
}

}  // namespace

void nfc_append(std::string_view text, std::string& out) {
  size_t copied = 0;         // text[0, copied) is already in out
  size_t last_boundary = 0;  // start of the last character before which nothing can change
  uint8_t last_ccc = 0;
  size_t i = 0;
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  while (i < text.size()) {
    if (bytes[i] < 0x80) {
      last_boundary = i++;
      last_ccc = 0;
      continue;
    }
    size_t len;
    char32_t cp = utf8::decode(text, i, len);
    uint16_t p = props(cp);
    if (unicode::nfc_boundary_before(p)) {
      last_boundary = i;
      last_ccc = 0;
      i += len;
      continue;
    }
    uint8_t cls = combining_class(p);
    if (unicode::nfc_quick_check(p) == unicode::QuickCheck::kYes && (cls == 0 || last_ccc <= cls)) {
      last_ccc = cls;
      i += len;
      continue;
    }
    // This character may change: rebuild from the last boundary up to the next one.
    size_t end = i + len;
    while (end < text.size()) {
      if (bytes[end] < 0x80) break;
      size_t len2;
      char32_t cp2 = utf8::decode(text, end, len2);
      if (unicode::nfc_boundary_before(props(cp2))) break;
      end += len2;
    }
    out.append(text.data() + copied, last_boundary - copied);
    nfc_segment(text.substr(last_boundary, end - last_boundary), out);
    copied = end;
    last_boundary = end;
    last_ccc = 0;
    i = end;
  }
  out.append(text.data() + copied, text.size() - copied);
}

std::string nfc(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  nfc_append(text, out);
  return out;
}

bool is_nfc_quick(std::string_view text) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
  uint8_t last_ccc = 0;
  for (size_t i = 0; i < text.size();) {
    if (bytes[i] < 0x80) {
      last_ccc = 0;
      ++i;
      continue;
    }
    size_t len;
    uint16_t p = props(utf8::decode(text, i, len));
    uint8_t cls = combining_class(p);
    if (unicode::nfc_quick_check(p) != unicode::QuickCheck::kYes || (cls != 0 && last_ccc > cls))
      return false;
    last_ccc = cls;
    i += len;
  }
  return true;
}

bool SequenceNormalizer::is_normalized(std::string_view text) const {
  for (const auto& step : steps_)
    if (!step->is_normalized(text)) return false;
  return true;
}

void SequenceNormalizer::normalize(std::string_view text, std::string& out) const {
  std::string current(text);
  std::string next;
  for (const auto& step : steps_) {
    next.clear();
    step->normalize(current, next);
    std::swap(current, next);
  }
  out.append(current);
}

}  // namespace kiln::tok
