// Normalizers of the tokenizer.json pipeline. Supported: NFC (and a Sequence of normalizers).
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::tok {

// Appends the NFC form of valid UTF-8 text to out. Text that is already NFC (the common case) is
// copied after a quick check; only the stretches around characters that may change are rebuilt.
void nfc_append(std::string_view text, std::string& out);
std::string nfc(std::string_view text);
// True when the NFC quick check proves text is already NFC (false: it may or may not be).
bool is_nfc_quick(std::string_view text);

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Appends the normalised form of text to out.
  virtual void normalize(std::string_view text, std::string& out) const = 0;
  // True if normalize(text) would return text unchanged (a cheap check; false when unsure).
  virtual bool is_normalized(std::string_view text) const { return false; }
};

class NfcNormalizer final : public Normalizer {
 public:
  void normalize(std::string_view text, std::string& out) const override { nfc_append(text, out); }
  bool is_normalized(std::string_view text) const override { return is_nfc_quick(text); }
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  void normalize(std::string_view text, std::string& out) const override;
  bool is_normalized(std::string_view text) const override;

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

}  // namespace kiln::tok
