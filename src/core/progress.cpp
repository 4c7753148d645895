#include "core/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/log.h"

namespace kiln {

namespace {
double gb(uint64_t bytes) { return static_cast<double>(bytes) / 1e9; }
}  // namespace

std::string format_progress(uint64_t done_bytes, uint64_t total_bytes, double elapsed_s) {
  total_bytes = std::max(total_bytes, done_bytes);  // a total estimated low never shows more done than total
  std::string s = fmt::format("{:.1f} / {:.1f} GB", gb(done_bytes), gb(total_bytes));
  if (elapsed_s > 0 && done_bytes > 0) {
    const double rate = static_cast<double>(done_bytes) / elapsed_s;
    const double eta = static_cast<double>(total_bytes - done_bytes) / rate;
    s += fmt::format(", {:.1f} GB/s, ETA {:.0f} s", rate / 1e9, std::ceil(eta));
  }
  return s;
}

std::string format_progress_done(uint64_t done_bytes, double elapsed_s) {
  std::string s = fmt::format("{:.1f} GB in {:.1f} s", gb(done_bytes), elapsed_s);
  if (elapsed_s > 0) s += fmt::format(" ({:.1f} GB/s)", static_cast<double>(done_bytes) / elapsed_s / 1e9);
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
