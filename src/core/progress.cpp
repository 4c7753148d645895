#include "core/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/log.h"

namespace kiln {

namespace {
// GB from 1 GB up, MB below (a small model's load would read "0.0 GB").
struct Unit {
  double div;
  const char* name;
};
Unit unit_for(uint64_t bytes) { return bytes >= 1'000'000'000ull ? Unit{1e9, "GB"} : Unit{1e6, "MB"}; }
std::string rate_str(double bytes_per_s) {
  return bytes_per_s >= 1e9 ? fmt::format("{:.1f} GB/s", bytes_per_s / 1e9) : fmt::format("{:.0f} MB/s", bytes_per_s / 1e6);
}
}  // namespace

std::string format_progress(uint64_t done_bytes, uint64_t total_bytes, double elapsed_s) {
  total_bytes = std::max(total_bytes, done_bytes);  // a total estimated low never shows more done than total
  const Unit u = unit_for(total_bytes);
  std::string s = fmt::format("{:.1f} / {:.1f} {}", static_cast<double>(done_bytes) / u.div,
                              static_cast<double>(total_bytes) / u.div, u.name);
  if (elapsed_s > 0 && done_bytes > 0) {
    const double rate = static_cast<double>(done_bytes) / elapsed_s;
    const double eta = static_cast<double>(total_bytes - done_bytes) / rate;
    s += fmt::format(", {}, ETA {:.0f} s", rate_str(rate), std::ceil(eta));
  }
  return s;
}

std::string format_progress_done(uint64_t done_bytes, double elapsed_s) {
  const Unit u = unit_for(done_bytes);
  std::string s = fmt::format("{:.1f} {} in {:.1f} s", static_cast<double>(done_bytes) / u.div, u.name, elapsed_s);
  if (elapsed_s > 0) s += fmt::format(" ({})", rate_str(static_cast<double>(done_bytes) / elapsed_s));
  return s;
}

ByteProgress::ByteProgress(Clock clock, Sink sink, double interval_s)
    : clock_(std::move(clock)), sink_(std::move(sink)), interval_s_(interval_s) {
  if (!clock_)
    clock_ = [] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    };
  if (!sink_) sink_ = [](const std::string& line) { KILN_LOG_INFO("{}", line); };
}

void ByteProgress::begin(uint64_t total_bytes, const std::string& label) {
  std::lock_guard lock(mu_);
  if (loaders_++ == 0) {
    total_ = done_ = 0;
    failed_ = false;
    start_ = last_print_ = clock_();
  }
  total_ += total_bytes;
  label_ = label;
}

void ByteProgress::add(uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (loaders_ == 0) return;
  done_ += bytes;
  const double now = clock_();
  if (now - last_print_ >= interval_s_) line_locked(now, false);
}

void ByteProgress::end(bool ok) {
  std::lock_guard lock(mu_);
  if (loaders_ == 0) return;
  if (!ok) failed_ = true;
  if (--loaders_ > 0) return;
  if (done_ > 0 && !failed_) line_locked(clock_(), true);
  total_ = done_ = 0;
}

void ByteProgress::line_locked(double now, bool final) {
  last_print_ = now;
  const double elapsed = now - start_;
  if (final) {
    std::string done_label = label_;
    if (done_label.rfind("loading ", 0) == 0) done_label = "loaded " + done_label.substr(8);
    sink_(fmt::format("{}: {}", done_label, format_progress_done(done_, elapsed)));
  } else {
    sink_(fmt::format("{}: {}", label_, format_progress(done_, total_, elapsed)));
  }
}

uint64_t ByteProgress::done() const {
  std::lock_guard lock(mu_);
  return done_;
}
uint64_t ByteProgress::total() const {
  std::lock_guard lock(mu_);
  return total_;
}
int ByteProgress::loaders() const {
  std::lock_guard lock(mu_);
  return loaders_;
}

ByteProgress& weight_progress() {
  static ByteProgress p;
  return p;
}

}  // namespace kiln
