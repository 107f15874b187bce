// StreamCopy (common/stream_copy.h) is memcpy for every length and alignment of both ends, and
// writes nothing outside its destination.
#include "common/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace attnd {
namespace {

TEST(StreamCopy, EqualsMemcpyAtEveryAlignmentAndLength) {
  std::mt19937 rng(11);
  std::vector<uint8_t> src(5000);
  for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
  for (size_t d_off : {0, 1, 7, 15, 16, 33})
    for (size_t s_off : {0, 3, 16})
      for (size_t n : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 1000, 4096 + 13}) {
        std::vector<uint8_t> dst(5200, 0xab);
        StreamCopy(dst.data() + d_off, src.data() + s_off, n);
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= d_off && i < d_off + n;
          ASSERT_EQ(dst[i], inside ? src[s_off + i - d_off] : 0xab)
              << "dst+" << d_off << " src+" << s_off << " n " << n << " at " << i;
        }
      }
}

}  // namespace
}  // namespace attnd
