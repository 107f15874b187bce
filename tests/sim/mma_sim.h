// Pieces shared by the lane-level CPU simulations of the tensor-core kernels
// (indexer_mma_sim.h, mla_mma_sim.h): the PTX ISA's m16n8k16 fragment tables written out by
// element index, mma.sync executed from 32 lanes' registers, and a block's shared memory with
// bounds, race and initialisation checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace attnd::cuda::sim {

// PTX ISA m16n8k16 (.bf16, fp32 accumulate) fragments by element index, as its tables give them.
// A: a0..a7; B: b0..b3; C: c0..c3. Lane = 4 * groupID + threadID_in_group.
inline void PtxA(int lane, int i, int* row, int* col) {
  const int g = lane / 4, t = lane % 4;
  *row = (i == 0 || i == 1 || i == 4 || i == 5) ? g : g + 8;
  *col = (i < 4) ? t * 2 + (i & 1) : t * 2 + (i & 1) + 8;
}
inline void PtxB(int lane, int i, int* row, int* col) {
  const int g = lane / 4, t = lane % 4;
  *row = (i < 2) ? t * 2 + (i & 1) : t * 2 + (i & 1) + 8;
  *col = g;
}
inline void PtxC(int lane, int i, int* row, int* col) {
  const int g = lane / 4, t = lane % 4;
  *row = (i < 2) ? g : g + 8;
  *col = t * 2 + (i & 1);
}

// Shared memory of one block as 16-bit cells. Between two barriers (a phase) a cell may be
// written by one thread only, and a cell written in the phase may be read only by its writer;
// a cell read in the phase may not be written by another thread; no cell is read before it was
// ever written; every index is bounds checked.
class Smem {
 public:
  explicit Smem(size_t cells)
      : v_(cells, 0),
        writer_(cells, -1),
        wphase_(cells, -1),
        reader_(cells, -1),
        rphase_(cells, -1) {}
  void Write(size_t i, uint16_t x, int thread) {
    Check(i);
    if (wphase_[i] == phase_ && writer_[i] != thread)
      Fail("write-write race", i, writer_[i], thread);
    if (rphase_[i] == phase_ && reader_[i] != thread)
      Fail("read-write race", i, reader_[i], thread);
    writer_[i] = thread;
    wphase_[i] = phase_;
    v_[i] = x;
  }
  uint16_t Read(size_t i, int thread) {
    Check(i);
    if (wphase_[i] < 0)
      throw std::runtime_error("read of unwritten shared-memory cell " + std::to_string(i));
    if (wphase_[i] == phase_ && writer_[i] != thread)
      Fail("write-read race", i, writer_[i], thread);
    if (rphase_[i] == phase_ && reader_[i] != thread)
      reader_[i] = -2;  // several readers
    else
      reader_[i] = thread;
    rphase_[i] = phase_;
    return v_[i];
  }
  // An fp32 value in two cells (low half first).
  void WriteF32(size_t cell, float x, int thread) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    Write(cell, static_cast<uint16_t>(b & 0xffff), thread);
    Write(cell + 1, static_cast<uint16_t>(b >> 16), thread);
  }
  float ReadF32(size_t cell, int thread) {
    const uint32_t b = Read(cell, thread) | (static_cast<uint32_t>(Read(cell + 1, thread)) << 16);
    float x;
    std::memcpy(&x, &b, 4);
    return x;
  }
  void Barrier() { ++phase_; }
  size_t size() const { return v_.size(); }

 private:
  void Check(size_t i) const {
    if (i >= v_.size())
      throw std::runtime_error("shared-memory access out of bounds: cell " + std::to_string(i) +
                               " of " + std::to_string(v_.size()));
  }
  [[noreturn]] static void Fail(const char* what, size_t i, int a, int b) {
    throw std::runtime_error(std::string("shared-memory ") + what + " on cell " +
                             std::to_string(i) + " (threads " + std::to_string(a) + ", " +
                             std::to_string(b) + ")");
  }
  std::vector<uint16_t> v_;
  std::vector<int> writer_, wphase_, reader_, rphase_;
  int phase_ = 0;
};

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 as the ISA defines it: A, B and C are
// assembled from the 32 lanes' registers (a: 8 bf16 values, b: 4, c: 4 fp32), D = A B + C
// (fp32 accumulation), scattered back into c.
inline void MmaSync(const float (&a)[32][8], const float (&b)[32][4], float (&c)[32][4]) {
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    int row, col;
    for (int i = 0; i < 8; ++i) PtxA(lane, i, &row, &col), A[row][col] = a[lane][i];
    for (int i = 0; i < 4; ++i) PtxB(lane, i, &row, &col), B[row][col] = b[lane][i];
    for (int i = 0; i < 4; ++i) PtxC(lane, i, &row, &col), C[row][col] = c[lane][i];
  }
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      float acc = C[i][j];
      for (int k = 0; k < 16; ++k) acc += A[i][k] * B[k][j];
      C[i][j] = acc;
    }
  for (int lane = 0; lane < 32; ++lane) {
    int row, col;
    for (int i = 0; i < 4; ++i) PtxC(lane, i, &row, &col), c[lane][i] = C[row][col];
  }
}

}  // namespace attnd::cuda::sim
