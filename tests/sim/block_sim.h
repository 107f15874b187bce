// A thread block simulated on the CPU for kernel bodies written once against a block interface
// (kernels/cuda/ops/topk_block.h): the body's Each(f) runs f for every thread in turn, Sync() is a
// barrier, shared memory is 32-bit words checked as the hardware would punish their misuse.
// The GPU runs the same body through DeviceBlock (kernels/cuda/ops/selection.cu), one thread per
// call of f.
//
// The interface a body uses (Block):
//   int threads()                      threads in the block
//   void Each(f)                       f(tid) for every thread, as one phase between barriers
//   void Sync()                        __syncthreads()
//   uint32_t Ld(word, tid)             shared-memory read
//   void St(word, value, tid)          shared-memory write
//   void Add(word, value, tid)         atomicAdd on a shared-memory word
// A body keeps nothing per thread across Each calls except in shared memory: on the GPU a
// local is a register, here one variable for every thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace attnd::cuda::sim {

// Shared memory as words. Between two barriers (a phase): a word written by one thread may be
// neither read nor written by another; a word read by several threads may be written by none
// of them but its only reader; atomic adds may come from every thread, but then no thread may
// read or write that word plainly in the phase; no word is read before it was ever written;
// every index is bounds checked.
class SharedWords {
 public:
  explicit SharedWords(size_t words)
      : v_(words, 0),
        writer_(words, -1),
        wphase_(words, -1),
        reader_(words, -1),
        rphase_(words, -1),
        aphase_(words, -1) {}
  uint32_t Ld(size_t w, int tid) {
    Check(w);
    if (wphase_[w] < 0 && aphase_[w] < 0)
      throw std::runtime_error("read of unwritten shared word " + std::to_string(w));
    if (wphase_[w] == phase_ && writer_[w] != tid) Fail("write-read race", w, writer_[w], tid);
    if (aphase_[w] == phase_) Fail("atomic-read race", w, -1, tid);
    reader_[w] = (rphase_[w] == phase_ && reader_[w] != tid) ? -2 : tid;
    rphase_[w] = phase_;
    return v_[w];
  }
  void St(size_t w, uint32_t x, int tid) {
    Check(w);
    if (wphase_[w] == phase_ && writer_[w] != tid) Fail("write-write race", w, writer_[w], tid);
    if (rphase_[w] == phase_ && reader_[w] != tid) Fail("read-write race", w, reader_[w], tid);
    if (aphase_[w] == phase_) Fail("atomic-write race", w, -1, tid);
    writer_[w] = tid;
    wphase_[w] = phase_;
    v_[w] = x;
  }
  void Add(size_t w, uint32_t x, int tid) {
    Check(w);
    if (wphase_[w] == phase_) Fail("write-atomic race", w, writer_[w], tid);
    if (rphase_[w] == phase_) Fail("read-atomic race", w, reader_[w], tid);
    if (wphase_[w] < 0 && aphase_[w] < 0)
      throw std::runtime_error("atomic add to unwritten shared word " + std::to_string(w));
    aphase_[w] = phase_;
    v_[w] += x;
  }
  void Barrier() { ++phase_; }
  int phases() const { return phase_; }

 private:
  void Check(size_t w) const {
    if (w >= v_.size())
      throw std::runtime_error("shared word out of bounds: " + std::to_string(w) + " of " +
                               std::to_string(v_.size()));
  }
  [[noreturn]] static void Fail(const char* what, size_t w, int a, int b) {
    throw std::runtime_error(std::string("shared-memory ") + what + " on word " +
                             std::to_string(w) + " (threads " + std::to_string(a) + ", " +
                             std::to_string(b) + ")");
  }
  std::vector<uint32_t> v_;
  std::vector<int> writer_, wphase_, reader_, rphase_, aphase_;
  int phase_ = 0;
};

// A block of `threads` threads over `words` words of shared memory.
class SimBlock {
 public:
  SimBlock(int threads, size_t words) : threads_(threads), smem_(words) {}
  int threads() const { return threads_; }
  template <typename F>
  void Each(F&& f) {
    for (int t = 0; t < threads_; ++t) f(t);
  }
  void Sync() { smem_.Barrier(); }
  uint32_t Ld(size_t w, int tid) { return smem_.Ld(w, tid); }
  void St(size_t w, uint32_t v, int tid) { smem_.St(w, v, tid); }
  void Add(size_t w, uint32_t v, int tid) { smem_.Add(w, v, tid); }
  int barriers() const { return smem_.phases(); }

 private:
  int threads_;
  SharedWords smem_;
};

}  // namespace attnd::cuda::sim
