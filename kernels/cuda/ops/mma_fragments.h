// Where each lane's registers sit in the tiles of mma.sync.aligned.m16n8k16 with bf16 inputs and
// fp32 accumulators (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
// Lane = 4 * group + thread_in_group. The kernels address shared memory through these, and the
// CPU lane-level simulations (tests/sim/indexer_mma_sim.h) run the same code, so the two
// cannot drift apart.
#pragma once

#include "common/host_device.h"

namespace attnd::cuda::mma {

ATTND_HD inline int Group(int lane) { return lane >> 2; }
ATTND_HD inline int InGroup(int lane) { return lane & 3; }

// A (16 x 16, row-major): register r (0..3) of a lane holds two bf16, halves h = 0, 1 (low, high).
ATTND_HD inline int RowA(int lane, int r) { return Group(lane) + (r & 1) * 8; }
ATTND_HD inline int ColA(int lane, int r, int h) { return InGroup(lane) * 2 + h + (r >> 1) * 8; }
// B (16 x 8, "col": k down, n across): register r (0..1), halves h.
ATTND_HD inline int RowB(int lane, int r, int h) { return InGroup(lane) * 2 + h + r * 8; }
ATTND_HD inline int ColB(int lane) { return Group(lane); }
// C/D (16 x 8 fp32): element i (0..3).
ATTND_HD inline int RowC(int lane, int i) { return Group(lane) + (i >> 1) * 8; }
ATTND_HD inline int ColC(int lane, int i) { return InGroup(lane) * 2 + (i & 1); }

}  // namespace attnd::cuda::mma
