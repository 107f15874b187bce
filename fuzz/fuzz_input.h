// Draws values from a fuzzer's input bytes (what libFuzzer's FuzzedDataProvider does, small
// enough to keep here): once the bytes run out every draw returns its lowest value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace attnd {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  bool empty() const { return n_ == 0; }
  // Uniform-ish in [lo, hi].
  int Int(int lo, int hi) {
    const uint64_t span = static_cast<uint64_t>(static_cast<int64_t>(hi) - lo) + 1;
    return static_cast<int>(lo + static_cast<int64_t>(Raw(span > 255 ? 4 : 1) % span));
  }
  int64_t Int64() {
    int64_t v;
    const uint64_t r = Raw(8);
    std::memcpy(&v, &r, 8);
    return v;
  }
  bool Bool(double p_true) { return Raw(1) < static_cast<uint64_t>(p_true * 256); }
  // Up to `max` bytes (the length drawn first).
  std::string Bytes(size_t max) {
    size_t len = static_cast<size_t>(Int(0, static_cast<int>(max)));
    if (len > n_) len = n_;
    std::string s(reinterpret_cast<const char*>(p_), len);
    p_ += len;
    n_ -= len;
    return s;
  }

 private:
  uint64_t Raw(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes && n_ > 0; ++i, ++p_, --n_) v = (v << 8) | *p_;
    return v;
  }
  const uint8_t* p_;
  size_t n_;
};

}  // namespace attnd
