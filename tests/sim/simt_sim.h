// A thread block run on the CPU as the GPU runs it, for kernel bodies written once against a
// thread interface (kernels/cuda/ops/simt.cuh has the GPU's; kernels/cuda/ops/indexer_stream.h is
// such a body): every thread is a fiber that runs the body's own code until it reaches a barrier or
// a warp-wide instruction (mma.sync, a shuffle), which completes when every thread that must take
// part has arrived. Used by tests only (tests/sim/indexer_stream_sim_test.cc).
//
// Ordering is happens-before, by vector clocks: a thread's accesses are ordered after another's
// by a barrier both passed (__syncthreads, or a named barrier bar.sync id, count both took part
// in), or by an mbarrier (an arrive releases what the arriving thread did before it; a wait that
// sees that phase complete acquires it).
//
// What it checks, as errors (std::runtime_error naming the thread and address):
//  - shared memory, byte by byte: a byte written by one thread and read or written by another
//    with no ordering between the two; a byte read before it was ever written; an access out of
//    bounds or not aligned to its size; a generic access to an mbarrier's 8 bytes;
//  - cp.async: a 16-byte copy not 16-byte aligned at either end; its bytes read or written
//    before the issuing thread waited for its group (the copy lands only then); a copy issued
//    over bytes another thread read or wrote with no ordering before the issue;
//  - barriers and mbarriers: named barriers taken with different counts, or by more threads than
//    their count; an mbarrier used before its mbarrier.init is ordered before the use, or
//    initialised twice; a wait that acquires a phase other than the one after the last it
//    acquired (parity aliasing); threads left waiting (a deadlock, named with what each waits in);
//  - global memory: a read or write outside the buffers the test registered, a write to an
//    input, a misaligned access; each output byte's writes are counted (every output element
//    written exactly once is the test's to assert);
//  - warps: lanes that reach different warp-wide instructions, or a lane that exits while the
//    others wait in one; barriers that some threads never reach (a deadlock);
//  - ldmatrix: a row address not 16-byte aligned; its rows are read (and race-checked) as the
//    lanes that name them reading 16 bytes;
//  - wgmma (sm_90a, m64n32k16 bf16 -> fp32; kernels/cuda/experimental/wgmma_layout.h has the
//  layouts): the 128
//    threads of a warpgroup reaching different instructions or operands; an issue without
//    wgmma.fence since the thread's last wait; registers (accumulators, A) not held (WgmmaHold)
//    before that fence or written after it; a descriptor with swizzle, base offset or reserved
//    bits set; an operand byte out of bounds, never written, in a cp.async copy, written with no
//    ordering before the wgmma (in every thread of the warpgroup), or written by a thread that
//    did not execute fence.proxy.async between the write and the barrier or mbarrier arrive that
//    orders it before the wgmma; any write to an operand byte before every thread of the
//    warpgroup waited for the wgmma, or after, with no ordering after every thread's wait (the
//    conservative rule: a kernel where one elected lane a warp arrives after the wait would be
//    reported; attnd's kernels have every thread arrive);
//    accumulators or A's registers changed between the issue and the wait that lands them; a thread
//    exiting with wgmma not waited for. A wgmma's result is computed from the operands as they are
//    at its issue and lands at the wait (a body that reads its accumulators earlier reads the old
//    values, and the outputs show it).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/experimental/wgmma_layout.h"
#include "kernels/cuda/ops/mma_fragments.h"
#include "tests/sim/mma_sim.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTND_SIMT_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define ATTND_SIMT_ASAN 1
#endif
#ifdef ATTND_SIMT_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__)
// The fibers' context switch: saves the callee-saved registers, MXCSR and the x87 control word on
// the current stack, stores its stack pointer in *from and resumes the context saved (or made by
// FiberContext::Prepare) at `to`. swapcontext does the same plus a signal-mask system call per
// switch, which was most of the simulation's time. Weak: every test that includes this defines it.
extern "C" void attnd_simt_switch(void** from, void* to);
asm(R"(
  .text
  .weak attnd_simt_switch
  .type attnd_simt_switch, @function
attnd_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size attnd_simt_switch, .-attnd_simt_switch
)");
#endif

namespace attnd::cuda::sim {

// A fiber's saved context: Prepare makes one that starts `entry` (which must never return) on a
// stack; Switch saves the running context in `from` and resumes `to`.
#if defined(__x86_64__)
struct FiberContext {
  void* sp = nullptr;
  void Prepare(char* stack, size_t bytes, void (*entry)()) {
    auto* s =
        reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t{15});
    uint32_t csr = 0;
    uint16_t cw = 0;
    asm volatile("stmxcsr %0" : "=m"(csr));
    asm volatile("fnstcw %0" : "=m"(cw));
    *--s = 0;                                  // entry's return address (it never returns)
    *--s = reinterpret_cast<uint64_t>(entry);  // where the first switch's ret goes
    for (int r = 0; r < 6; ++r) *--s = 0;      // rbp, rbx, r12-r15
    *--s = csr | (uint64_t{cw} << 32);
    sp = s;
  }
  static void Switch(FiberContext& from, FiberContext& to) { attnd_simt_switch(&from.sp, to.sp); }
};
#else
struct FiberContext {
  ucontext_t ctx;
  void Prepare(char* stack, size_t bytes, void (*entry)()) {
    getcontext(&ctx);
    ctx.uc_stack.ss_sp = stack;
    ctx.uc_stack.ss_size = bytes;
    ctx.uc_link = nullptr;
    makecontext(&ctx, entry, 0);
  }
  static void Switch(FiberContext& from, FiberContext& to) { swapcontext(&from.ctx, &to.ctx); }
};
#endif

// Global memory a simulated grid may touch: buffers registered by the test, inputs read-only,
// outputs with a write count per byte.
class SimtMemory {
 public:
  void Input(const void* p, size_t bytes, std::string name) {
    regions_.push_back({static_cast<const uint8_t*>(p), bytes, std::move(name), false, {}});
  }
  void Output(void* p, size_t bytes, std::string name) {
    regions_.push_back(
        {static_cast<const uint8_t*>(p), bytes, std::move(name), true, std::vector<int>(bytes)});
  }
  // How many times each byte of output `name` was written.
  const std::vector<int>& Writes(const std::string& name) const {
    for (const Region& r : regions_)
      if (r.name == name) return r.writes;
    throw std::runtime_error("no output " + name);
  }
  void CheckRead(const void* p, size_t bytes, int tid) const { Find(p, bytes, tid, "read"); }
  void CheckWrite(const void* p, size_t bytes, int tid) {
    Region& r = Find(p, bytes, tid, "write");
    if (!r.output) throw std::runtime_error(At("write to input " + r.name, p, tid));
    const size_t off = static_cast<const uint8_t*>(p) - r.base;
    for (size_t i = 0; i < bytes; ++i) ++r.writes[off + i];
  }

 private:
  struct Region {
    const uint8_t* base;
    size_t bytes;
    std::string name;
    bool output;
    std::vector<int> writes;
  };
  static std::string At(const std::string& what, const void* p, int tid) {
    return what + " at " + std::to_string(reinterpret_cast<uintptr_t>(p)) + " by thread " +
           std::to_string(tid);
  }
  Region& Find(const void* p, size_t bytes, int tid, const char* what) const {
    const uint8_t* a = static_cast<const uint8_t*>(p);
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0 && bytes <= 16)
      throw std::runtime_error(At(std::string("misaligned global ") + what, p, tid));
    for (const Region& r : regions_)
      if (a >= r.base && a + bytes <= r.base + r.bytes) return const_cast<Region&>(r);
    throw std::runtime_error(At(std::string("global ") + what + " outside every buffer", p, tid));
  }
  std::vector<Region> regions_;
};

class SimtBlock;

// What a kernel body calls, on the CPU (the GPU's twin is GpuThread in kernels/cuda/ops/simt.cuh):
// the thread's place, barriers, shared memory, cp.async, warp-wide instructions, global memory.
class SimtThread {
 public:
  int tid() const { return tid_; }
  int lane() const { return tid_ & 31; }
  int warp() const { return tid_ >> 5; }
  inline void Sync();
  // bar.sync id, count: waits until `count` threads (whole warps) reached named barrier `id`
  // (1-15; 0 is Sync's).
  inline void NamedSync(int id, int count);
  // mbarrier (sm_90) at shared offset `off` (8 bytes, 8-aligned): init for `count` arrivals a
  // phase; arrive (release); wait until the phase of parity `parity` has completed (acquire:
  // try_wait.parity in a loop — the phase after the last completed one has the other parity).
  inline void MbarInit(uint32_t off, int count);
  // setmaxnreg: a warpgroup-wide instruction (all 128 threads, the same count: else an error);
  // the registers themselves are not modelled. The count must be one the GPU takes (24-256, a
  // multiple of 8).
  template <int kRegs>
  void RegsDown() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg count");
    SetMaxNreg(-kRegs);
  }
  template <int kRegs>
  void RegsUp() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg count");
    SetMaxNreg(kRegs);
  }
  inline void MbarArrive(uint32_t off);
  inline void MbarWait(uint32_t off, int parity);
  template <typename T>
  inline T Ld(uint32_t off);
  template <typename T>
  inline void St(uint32_t off, T v);
  // 16 bytes from global `src` to shared `off`, landing at CpWait; !valid fills zeros and reads
  // nothing.
  inline void CpAsync16(uint32_t off, const void* src, bool valid);
  inline void CpCommit();
  // Waits until at most `pending` of this thread's committed groups are still in flight.
  inline void CpWait(int pending);
  inline void SetMaxNreg(int regs);  // > 0: .inc to regs; < 0: .dec to -regs
  inline float ShflXor(float v, int mask);
  // mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: d = a b + c, from every lane's registers.
  inline void Mma(float c[4], const uint32_t a[4], const uint32_t b[2]);
  // ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: four 8 x 8 matrices of 16-bit values;
  // lane l gives the shared address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned);
  // r[m] of lane l holds matrix m's row l / 4, values 2 (l % 4) and 2 (l % 4) + 1 (low half
  // first), or with trans its column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1.
  inline void LdMatrixX4(uint32_t r[4], uint32_t row_off, bool trans);
  // wgmma: the address a descriptor names (the GPU's shared window; here the offset), the fences,
  // wgmma.mma_async m64n32k16 with A from shared memory (descriptor a) or from registers (a[4],
  // m16n8k16's A layout), B by descriptor (trans_b: MN-major), groups and waits.
  uint32_t SmemAddr(uint32_t off) const { return off; }
  inline void WgmmaFence();
  inline void Wgmma(float d[16], uint64_t a, uint64_t b, bool trans_b);
  inline void WgmmaRegA(float d[16], const uint32_t a[4], uint64_t b, bool trans_b);
  inline void WgmmaCommit();
  inline void WgmmaWait(int pending);
  inline void FenceProxyAsync();
  // The GPU's compiler barriers on accumulators and A's registers; here they name the registers
  // wgmma.fence vouches for (a wgmma on registers not held, or written after the fence, is an
  // error).
  inline void WgmmaHold(float* d, int n);
  inline void WgmmaHoldA(uint32_t* a, int n);
  // After the wait, the GPU's same compiler barrier; here nothing (the registers may leave scope
  // before the next fence, so they are not held).
  void WgmmaLanded(float*, int) {}
  void WgmmaLandedA(uint32_t*, int) {}
  template <typename T>
  T Gld(const T* p) const {
    memory_->CheckRead(p, sizeof(T), tid_);
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
  }
  template <typename T>
  void Gst(T* p, T v) {
    memory_->CheckWrite(p, sizeof(T), tid_);
    std::memcpy(p, &v, sizeof(T));
  }

 private:
  friend class SimtBlock;
  inline void WgmmaOp(float* d, const uint32_t* a_regs, uint64_t a_desc, uint64_t b, bool trans_b);
  SimtBlock* block_ = nullptr;
  SimtMemory* memory_ = nullptr;
  int tid_ = 0;
};

// One block: `threads` fibers over `smem_bytes` of shared memory. Run(body) runs body(thread) on
// every thread to its end and throws on the first fault.
class SimtBlock {
 public:
  SimtBlock(SimtMemory& memory, int threads, size_t smem_bytes)
      : memory_(memory), n_(threads), smem_(smem_bytes), meta_(smem_bytes), fibers_(threads) {
    if (threads % 32 != 0) throw std::runtime_error("threads must be whole warps");
    if (threads > kMaxGroups * wgmma::kGroupThreads)
      throw std::runtime_error("at most " + std::to_string(kMaxGroups) + " warpgroups");
    for (int t = 0; t < n_; ++t) {
      fibers_[t].thread.block_ = this;
      fibers_[t].thread.memory_ = &memory_;
      fibers_[t].thread.tid_ = t;
      fibers_[t].vc.assign(n_, 0);
      fibers_[t].vc[t] = 1;
    }
  }

  template <typename Body>
  void Run(Body body) {
    body_ = [&](SimtThread& t) { body(t); };
    for (Fiber& f : fibers_) {
      if (!f.stack) f.stack.reset(new char[kStackBytes]);  // not zeroed: pages as touched
      f.ctx.Prepare(f.stack.get(), kStackBytes, &SimtBlock::Entry);
      f.state = kRunnable;
    }
    try {
      while (true) {
        bool ran = false;
        for (int t = 0; t < n_; ++t) {
          if (fibers_[t].state != kRunnable) continue;
          ran = true;
          SwitchTo(t);
          if (!error_.empty()) throw std::runtime_error(error_);
        }
        if (ran) continue;
        if (ReleaseWarps() || ReleaseNamed()) continue;
        int done = 0, barrier = 0;
        for (const Fiber& f : fibers_) done += f.state == kDone, barrier += f.state == kBarrier;
        if (done == n_) break;
        if (barrier == n_) {
          // Everything before the barrier is ordered before everything after it.
          std::vector<Fiber*> all;
          for (Fiber& f : fibers_) all.push_back(&f);
          Join(all);
          ++phase_;
          read_sets_.clear();
          continue;
        }
        throw std::runtime_error(Stuck());
      }
    } catch (...) {
      // Every fiber still inside the body unwinds (its objects destroyed) before the error
      // leaves: resumed with the error set, it throws from where it waits.
      if (error_.empty()) error_ = "aborted";
      for (int t = 0; t < n_; ++t)
        if (fibers_[t].state != kDone) SwitchTo(t);
      throw;
    }
  }
  int barriers() const { return phase_; }

 private:
  friend class SimtThread;
  static constexpr size_t kStackBytes = 256 << 10;
  static constexpr int kMaxGroups = 4;  // warpgroups a block (a byte's landed wgmma reads)
  enum State { kRunnable, kBarrier, kNamed, kMbar, kWarpOp, kDone };
  enum Op { kNone, kMma, kShfl, kLdMatrix, kWgmma, kRegs };
  // A wgmma in flight: the 16-byte operand ranges it reads, and the threads yet to land it.
  // When every thread has waited, its reads are complete as of each thread's clock at its wait
  // (`landed`): a later write to those bytes must be ordered after all of them.
  struct WgOp {
    std::vector<uint32_t> ranges;
    int waiting = wgmma::kGroupThreads;
    int group = 0;
    int phase = 0;  // the barrier phase its last thread waited in
    uint32_t landed[wgmma::kGroupThreads] = {};
    int ok_tid = -1;  // the last writer found ordered after every wait, and its clock's version
    uint64_t ok_version = 0;
  };
  struct Pending {
    float* d;
    float val[16], at_issue[16];
    bool chained;       // another wgmma of this thread in flight accumulates into d before it
    const uint32_t* a;  // A's registers (null: A from shared memory), as they were issued
    uint32_t a_at_issue[4];
    std::shared_ptr<WgOp> op;
  };
  struct Fiber {
    FiberContext ctx;
    std::unique_ptr<char[]> stack;
    State state = kRunnable;
    SimtThread thread;
    // A warp-wide instruction's operands while the lane waits in it.
    Op op = kNone;
    float* c = nullptr;
    const uint32_t* a = nullptr;
    const uint32_t* b = nullptr;
    float shfl_in = 0, shfl_out = 0;
    int shfl_mask = 0;
    uint32_t* ldm_out = nullptr;  // ldmatrix: the lane's 4 registers, its row's address
    uint32_t ldm_row = 0;
    bool ldm_trans = false;
    // wgmma: the operands while the thread waits in the issue; fenced since its last wait; its
    // wgmma in flight, by group (the last is still open); its last fence.proxy.async.
    float* wg_d = nullptr;
    const uint32_t* wg_a = nullptr;
    uint64_t wg_desc_a = 0, wg_desc_b = 0;
    bool wg_trans = false, wg_fenced = false;
    std::vector<std::vector<Pending>> wg_groups{1};
    // Happens-before: vc[u] is the last clock of thread u ordered before this thread's next
    // action (vc[tid] its own clock, advanced by each release: a barrier, an mbarrier arrive);
    // version counts its changes. fence_upto[c]: the tick of its last fence.proxy.async at its
    // own clock c or earlier.
    std::vector<uint32_t> vc;
    uint64_t version = 0;
    std::vector<uint64_t> fence_upto{0, 0};
    // What it waits in: named barrier (id, count), mbarrier (offset, parity).
    int bar_id = 0, bar_count = 0;
    int regs = 0;  // setmaxnreg's count (negative: .dec)
    uint32_t mbar_off = 0;
    int mbar_parity = 0;
    int64_t mbar_woke = 0;  // the phase a wake-up acquired
    // Per mbarrier: the last phase this thread's waits acquired (-1: the one before the first).
    std::map<uint32_t, int64_t> mbar_phase;
    // Registers held (WgmmaHold) since the last wait, and their contents at the last fence.
    struct Held {
      const void* p;
      size_t bytes;
      std::vector<uint8_t> at_fence;
    };
    std::vector<Held> held;
    // cp.async: copies issued and not yet landed, by group (the last is still open).
    struct Copy {
      uint32_t off;
      uint8_t bytes[16];
    };
    std::vector<std::vector<Copy>> groups{1};
  };
  // Per shared-memory byte: its last write (thread, its clock, the barrier phase), its reads
  // since (one thread's, or several in read_sets_[rset]; reads of an earlier phase are ordered
  // by the barrier and forgotten), whether a copy is in flight or it is an mbarrier's, the wgmma
  // reading it in flight, and per warpgroup the last landed wgmma that read it.
  struct Meta {
    int writer = -1, wphase = -1, reader = -1, rphase = -1, rset = -1;
    uint32_t wclk = 0, rclk = 0;
    bool written = false, in_flight = false, mbar = false;
    uint64_t wtick = 0;   // when it was last written
    int async_reads = 0;  // wgmma in flight reading it
    int landed[kMaxGroups] = {-1, -1, -1, -1};
  };
  struct Mbar {
    int count = 0, pending = 0;
    uint32_t completed = 0;      // phases completed
    std::vector<uint32_t> acc;   // the arrivals of the open phase, joined
    std::vector<uint32_t> done;  // ...of the last completed phase
    int init_tid = 0;
    uint32_t init_clk = 0;
  };

  static void Entry() {
    SimtBlock* b = current_;
#ifdef ATTND_SIMT_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &b->main_bottom_, &b->main_size_);
#endif
    Fiber& f = b->fibers_[b->running_];
    try {
      b->body_(f.thread);
    } catch (const std::exception& e) {
      if (b->error_.empty()) b->error_ = e.what();
    }
    for (const auto& g : f.wg_groups)
      if (!g.empty() && b->error_.empty())
        b->error_ = "thread " + std::to_string(f.thread.tid_) + " exited with wgmma not waited for";
    f.state = kDone;
    // An exiting lane leaves its warp's waiting lanes stuck: Run reports it.
#ifdef ATTND_SIMT_ASAN
    __sanitizer_start_switch_fiber(nullptr, b->main_bottom_, b->main_size_);
#endif
    FiberContext::Switch(f.ctx, b->main_);  // never resumed
    __builtin_unreachable();
  }
  void SwitchTo(int t) {
    running_ = t;
    current_ = this;
#ifdef ATTND_SIMT_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, fibers_[t].stack.get(), kStackBytes);
#endif
    FiberContext::Switch(main_, fibers_[t].ctx);
#ifdef ATTND_SIMT_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  }
  // A warp-wide op of the running fiber (thread tid): `fill` sets its operands on the fiber; the
  // scheduler runs the op once the warp (or warpgroup) has arrived. The fiber, with any result.
  template <typename Fill>
  Fiber& WarpOp(int tid, Op op, Fill fill) {
    Fiber& f = fibers_[tid];
    f.op = op;
    fill(f);
    Yield(kWarpOp);
    return f;
  }
  // Back to the scheduler from the running fiber (it waits in state `s`).
  void Yield(State s) {
    Fiber& f = fibers_[running_];
    f.state = s;
#ifdef ATTND_SIMT_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, main_bottom_, main_size_);
#endif
    FiberContext::Switch(f.ctx, main_);
#ifdef ATTND_SIMT_ASAN
    __sanitizer_finish_switch_fiber(fake, &main_bottom_, &main_size_);
#endif
    if (!error_.empty()) throw std::runtime_error("aborted");  // unwind the fiber
  }
  // Completes every warp whose 32 lanes all wait in the same warp-wide instruction.
  bool ReleaseWarps() {
    bool any = false;
    for (int w = 0; w < n_ / 32; ++w) {
      Fiber* lanes = &fibers_[w * 32];
      int waiting = 0, done = 0;
      for (int l = 0; l < 32; ++l)
        waiting += lanes[l].state == kWarpOp, done += lanes[l].state == kDone;
      if (waiting == 0) continue;
      if (waiting + done == 32 && done > 0)
        throw std::runtime_error("warp " + std::to_string(w) +
                                 ": lanes exited while the others wait in a warp-wide instruction");
      // wgmma, setmaxnreg: ReleaseWarpgroups
      if (waiting != 32 || lanes[0].op == kWgmma || lanes[0].op == kRegs) continue;
      const Op op = lanes[0].op;
      for (int l = 1; l < 32; ++l)
        if (lanes[l].op != op || (op == kShfl && lanes[l].shfl_mask != lanes[0].shfl_mask) ||
            (op == kLdMatrix && lanes[l].ldm_trans != lanes[0].ldm_trans))
          throw std::runtime_error("warp " + std::to_string(w) +
                                   ": lanes reached different warp-wide instructions");
      if (op == kShfl) {
        for (int l = 0; l < 32; ++l) lanes[l].shfl_out = lanes[l ^ lanes[0].shfl_mask].shfl_in;
      } else if (op == kLdMatrix) {
        uint16_t m[4][8][8];  // [matrix][row][value], each row read by the lane that named it
        for (int l = 0; l < 32; ++l) {
          if (lanes[l].ldm_row % 16 != 0)
            Fail("ldmatrix row not 16-byte aligned", lanes[l].ldm_row, w * 32 + l);
          Read(lanes[l].ldm_row, m[l / 8][l % 8], 16, w * 32 + l);
        }
        for (int l = 0; l < 32; ++l)
          for (int i = 0; i < 4; ++i) {
            const int a = l / 4, b = 2 * (l % 4);
            const uint16_t lo = lanes[0].ldm_trans ? m[i][b][a] : m[i][a][b];
            const uint16_t hi = lanes[0].ldm_trans ? m[i][b + 1][a] : m[i][a][b + 1];
            lanes[l].ldm_out[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
          }
      } else {
        float a[32][8], b[32][4], c[32][4];
        for (int l = 0; l < 32; ++l) {
          for (int r = 0; r < 4; ++r) {
            a[l][2 * r] = BF16ToF32(static_cast<uint16_t>(lanes[l].a[r] & 0xffff));
            a[l][2 * r + 1] = BF16ToF32(static_cast<uint16_t>(lanes[l].a[r] >> 16));
          }
          for (int r = 0; r < 2; ++r) {
            b[l][2 * r] = BF16ToF32(static_cast<uint16_t>(lanes[l].b[r] & 0xffff));
            b[l][2 * r + 1] = BF16ToF32(static_cast<uint16_t>(lanes[l].b[r] >> 16));
          }
          std::memcpy(c[l], lanes[l].c, sizeof(c[l]));
        }
        MmaSync(a, b, c);
        for (int l = 0; l < 32; ++l) std::memcpy(lanes[l].c, c[l], sizeof(c[l]));
      }
      for (int l = 0; l < 32; ++l) lanes[l].state = kRunnable, lanes[l].op = kNone;
      any = true;
    }
    return ReleaseWarpgroups() || any;
  }
  // Issues the wgmma (or completes the setmaxnreg) every thread of a warpgroup waits in.
  bool ReleaseWarpgroups() {
    constexpr int kG = wgmma::kGroupThreads;
    bool any = false;
    for (int g = 0; g * kG < n_; ++g) {
      Fiber* f = &fibers_[g * kG];
      int waiting = 0;
      for (int l = 0; l < kG && g * kG + l < n_; ++l)
        waiting += f[l].state == kWarpOp && (f[l].op == kWgmma || f[l].op == kRegs);
      if (waiting == 0) continue;
      if ((g + 1) * kG > n_)
        throw std::runtime_error("wgmma or setmaxnreg in a block of partial warpgroups");
      if (waiting != kG) continue;
      for (int l = 1; l < kG; ++l)
        if (f[l].op != f[0].op || (f[0].op == kRegs && f[l].regs != f[0].regs))
          throw std::runtime_error("warpgroup " + std::to_string(g) +
                                   ": threads reached different warpgroup-wide instructions");
      if (f[0].op == kWgmma) IssueWgmma(g, f);
      for (int l = 0; l < kG; ++l) f[l].state = kRunnable, f[l].op = kNone;
      any = true;
    }
    return any;
  }
  // A wgmma operand's 16 bytes at `off`, as the async proxy reads them (see the header).
  // `meet`: the clocks every thread of the issuing warpgroup is ordered after (Meet).
  void ReadOperand(uint32_t off, uint16_t out[8], WgOp& op, int tid,
                   const std::vector<uint32_t>& meet) {
    if (off + 16 > smem_.size() || off % 16 != 0)
      Fail("wgmma operand out of bounds or misaligned", off, tid);
    for (uint32_t i = off; i < off + 16; ++i) {
      const Meta& m = meta_[i];
      if (m.mbar) Fail("wgmma operand in an mbarrier", i, tid);
      if (m.in_flight) Fail("wgmma operand in a cp.async copy not waited for", i, tid);
      if (!m.written) Fail("wgmma operand never written", i, tid);
      const uint32_t seen = meet[m.writer];  // the writer's last clock every issuer is after
      if (m.wclk > seen)
        Fail("wgmma operand written by thread " + std::to_string(m.writer) +
                 " with no barrier before the wgmma",
             i, tid);
      // The writer must have executed fence.proxy.async after the write and before the release
      // (barrier, mbarrier arrive) that orders it before the wgmma: its last fence at clock
      // `seen` or earlier, not one it executes later.
      const auto& fu = fibers_[m.writer].fence_upto;
      if (fu[std::min<size_t>(seen, fu.size() - 1)] < m.wtick)
        Fail("wgmma operand written by thread " + std::to_string(m.writer) +
                 " without fence.proxy.async between the write and a barrier before the wgmma",
             i, tid);
    }
    for (uint32_t i = off; i < off + 16; ++i) ++meta_[i].async_reads;
    op.ranges.push_back(off);
    std::memcpy(out, smem_.data() + off, 16);
  }
  void IssueWgmma(int g, Fiber* f) {
    constexpr int kG = wgmma::kGroupThreads;
    const int tid0 = g * kG;
    const bool reg_a = f[0].wg_a != nullptr;
    for (int l = 0; l < kG; ++l) {
      if (!f[l].wg_fenced)
        throw std::runtime_error("thread " + std::to_string(tid0 + l) +
                                 ": wgmma without wgmma.fence since its last wait");
      if ((f[l].wg_a != nullptr) != reg_a || f[l].wg_desc_b != f[0].wg_desc_b ||
          f[l].wg_trans != f[0].wg_trans || (!reg_a && f[l].wg_desc_a != f[0].wg_desc_a))
        throw std::runtime_error("warpgroup " + std::to_string(g) +
                                 ": threads reached different wgmma instructions or operands");
    }
    for (int l = 0; l < kG; ++l) {
      CheckHeld(f[l], f[l].wg_d, 16 * sizeof(float), tid0 + l);
      if (reg_a) CheckHeld(f[l], f[l].wg_a, 4 * sizeof(uint32_t), tid0 + l);
    }
    const uint64_t da = f[0].wg_desc_a, db = f[0].wg_desc_b;
    if ((!reg_a && !wgmma::DescPlain(da)) || !wgmma::DescPlain(db))
      throw std::runtime_error("wgmma descriptor with swizzle, base offset or reserved bits");
    auto op = std::make_shared<WgOp>();
    op->group = g;
    const std::vector<uint32_t>& meet = Meet(g);
    float A[64][16], B[16][32];  // A [m][k], B [k][n]
    uint16_t v[8];
    if (reg_a) {
      for (int l = 0; l < kG; ++l)
        for (int r = 0; r < 4; ++r)
          for (int h = 0; h < 2; ++h)
            A[16 * (l / 32) + mma::RowA(l % 32, r)][mma::ColA(l % 32, r, h)] =
                BF16ToF32(static_cast<uint16_t>(f[l].wg_a[r] >> (16 * h)));
    } else {
      for (int m = 0; m < 64; ++m)
        for (int k = 0; k < 16; k += 8) {
          ReadOperand(wgmma::DescAddr(da) + wgmma::KMajorAt(da, m, k), v, *op, tid0, meet);
          for (int e = 0; e < 8; ++e) A[m][k + e] = BF16ToF32(v[e]);
        }
    }
    if (f[0].wg_trans) {
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 32; n += 8) {
          ReadOperand(wgmma::DescAddr(db) + wgmma::MnMajorAt(db, k, n), v, *op, tid0, meet);
          for (int e = 0; e < 8; ++e) B[k][n + e] = BF16ToF32(v[e]);
        }
    } else {
      for (int n = 0; n < 32; ++n)
        for (int k = 0; k < 16; k += 8) {
          ReadOperand(wgmma::DescAddr(db) + wgmma::KMajorAt(db, n, k), v, *op, tid0, meet);
          for (int e = 0; e < 8; ++e) B[k + e][n] = BF16ToF32(v[e]);
        }
    }
    // Each thread's accumulators going in: the last wgmma in flight into the same registers, or
    // the registers.
    std::vector<Pending> next(kG);
    for (int l = 0; l < kG; ++l) {
      Pending& p = next[l];
      p.d = f[l].wg_d;
      p.op = op;
      p.chained = false;
      p.a = f[l].wg_a;
      if (p.a != nullptr) std::memcpy(p.a_at_issue, p.a, sizeof(p.a_at_issue));
      std::memcpy(p.at_issue, p.d, sizeof(p.at_issue));
      std::memcpy(p.val, p.d, sizeof(p.val));
      for (const auto& grp : f[l].wg_groups)
        for (const Pending& q : grp)
          if (q.d == p.d) {
            p.chained = true;
            std::memcpy(p.val, q.val, sizeof(p.val));
          }
    }
    // D = A B + D per warp (its 16 rows) and n-tile of 8 columns, by the m16n8k16 model.
    for (int w = 0; w < 4; ++w)
      for (int nt = 0; nt < 4; ++nt) {
        float a[32][8], b[32][4], c[32][4];
        for (int l = 0; l < 32; ++l) {
          for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h)
              a[l][2 * r + h] = A[16 * w + mma::RowA(l, r)][mma::ColA(l, r, h)];
          for (int r = 0; r < 2; ++r)
            for (int h = 0; h < 2; ++h)
              b[l][2 * r + h] = B[mma::RowB(l, r, h)][8 * nt + mma::ColB(l)];
          for (int i = 0; i < 4; ++i) c[l][i] = next[32 * w + l].val[4 * nt + i];
        }
        MmaSync(a, b, c);
        for (int l = 0; l < 32; ++l)
          for (int i = 0; i < 4; ++i) next[32 * w + l].val[4 * nt + i] = c[l][i];
      }
    for (int l = 0; l < kG; ++l) f[l].wg_groups.back().push_back(next[l]);
  }
  // Registers a wgmma takes must be held and unchanged since the thread's wgmma.fence.
  static void CheckHeld(const Fiber& f, const void* p, size_t bytes, int tid) {
    for (const Fiber::Held& h : f.held)
      if (h.p == p && h.bytes >= bytes) {
        if (h.at_fence.size() != h.bytes || std::memcmp(h.at_fence.data(), p, bytes) != 0)
          throw std::runtime_error("thread " + std::to_string(tid) +
                                   ": wgmma registers written after wgmma.fence");
        return;
      }
    throw std::runtime_error("thread " + std::to_string(tid) +
                             ": wgmma registers not held (WgmmaHold) before wgmma.fence");
  }
  // Thread tid's oldest group of wgmma lands.
  void LandWgmmaGroup(int tid) {
    auto& groups = fibers_[tid].wg_groups;
    for (size_t k = 0; k < groups.front().size(); ++k) {
      Pending& p = groups.front()[k];
      if (!p.chained && std::memcmp(p.d, p.at_issue, sizeof(p.at_issue)) != 0)
        throw std::runtime_error("thread " + std::to_string(tid) +
                                 ": accumulators changed while their wgmma was in flight");
      if (p.a != nullptr && std::memcmp(p.a, p.a_at_issue, sizeof(p.a_at_issue)) != 0)
        throw std::runtime_error("thread " + std::to_string(tid) +
                                 ": A's registers changed while their wgmma was in flight");
      std::memcpy(p.d, p.val, sizeof(p.val));
      // The next wgmma in flight into d now expects d as this one left it.
      bool next = false;
      for (size_t g = 0; g < groups.size() && !next; ++g)
        for (size_t j = g == 0 ? k + 1 : 0; j < groups[g].size() && !next; ++j)
          if (groups[g][j].d == p.d && groups[g][j].chained) {
            std::memcpy(groups[g][j].at_issue, p.val, sizeof(p.val));
            groups[g][j].chained = false;
            next = true;
          }
      p.op->landed[tid % wgmma::kGroupThreads] = fibers_[tid].vc[tid];
      if (--p.op->waiting == 0) {
        const int id = static_cast<int>(landed_.size());
        p.op->phase = phase_;
        for (uint32_t off : p.op->ranges)
          for (uint32_t i = off; i < off + 16; ++i) {
            --meta_[i].async_reads;
            meta_[i].landed[p.op->group] = id;
          }
        p.op->ranges = {};
        landed_.push_back(p.op);
      }
    }
    groups.erase(groups.begin());
  }
  std::string Stuck() const {
    int count[kDone + 1] = {};
    for (const Fiber& f : fibers_) ++count[f.state];
    return "block stuck: " + std::to_string(count[kBarrier]) + " threads at a barrier, " +
           std::to_string(count[kNamed]) + " at a named barrier, " + std::to_string(count[kMbar]) +
           " waiting on an mbarrier, " + std::to_string(count[kWarpOp]) +
           " in a warp-wide instruction, " + std::to_string(count[kDone]) +
           " exited (a barrier some threads never reach)";
  }
  // Happens-before. A release advances the thread's clock (what it does next is not ordered by
  // it); a join orders each thread after all of them (a barrier).
  void Release(Fiber& f) {
    const int t = f.thread.tid_;
    ++f.vc[t];
    f.fence_upto.push_back(f.fence_upto.back());
    ++f.version;
  }
  void Acquire(Fiber& f, const std::vector<uint32_t>& clocks) {
    for (int u = 0; u < n_; ++u) f.vc[u] = std::max(f.vc[u], clocks[u]);
    ++f.version;
  }
  void Join(const std::vector<Fiber*>& fs) {
    std::vector<uint32_t> j(n_, 0);
    for (const Fiber* f : fs)
      for (int u = 0; u < n_; ++u) j[u] = std::max(j[u], f->vc[u]);
    for (Fiber* f : fs) {
      Acquire(*f, j);
      Release(*f);
      f->state = kRunnable;
    }
  }
  // Whether thread u's action at clock `clk` is ordered before thread t's next one.
  bool Before(int u, uint32_t clk, int t) const { return u == t || clk <= fibers_[t].vc[u]; }
  // The clocks every thread of warpgroup g is ordered after (the least of each), cached until
  // one of them changes.
  const std::vector<uint32_t>& Meet(int g) {
    constexpr int kG = wgmma::kGroupThreads;
    uint64_t sig = 0;
    for (int l = 0; l < kG; ++l) sig += fibers_[g * kG + l].version;
    MeetCache& c = meet_[g];
    if (c.sig != sig || c.clocks.empty()) {
      c.clocks = fibers_[g * kG].vc;
      for (int l = 1; l < kG; ++l)
        for (int u = 0; u < n_; ++u) c.clocks[u] = std::min(c.clocks[u], fibers_[g * kG + l].vc[u]);
      c.sig = sig;
    }
    return c.clocks;
  }
  // Releases each named barrier `count` threads wait at.
  bool ReleaseNamed() {
    bool any = false;
    for (int id = 1; id < 16; ++id) {
      std::vector<Fiber*> at;
      for (Fiber& f : fibers_)
        if (f.state == kNamed && f.bar_id == id) {
          if (!at.empty() && f.bar_count != at[0]->bar_count)
            throw std::runtime_error("named barrier " + std::to_string(id) +
                                     " taken with different thread counts");
          at.push_back(&f);
        }
      if (at.empty() || static_cast<int>(at.size()) < at[0]->bar_count) continue;
      if (static_cast<int>(at.size()) > at[0]->bar_count)
        throw std::runtime_error("named barrier " + std::to_string(id) + ": " +
                                 std::to_string(at.size()) + " threads wait at a barrier of " +
                                 std::to_string(at[0]->bar_count));
      Join(at);
      any = true;
    }
    return any;
  }
  // A wait of thread tid that acquired `phase` of mbarrier off: the phase after the last one it
  // acquired there. A later one means a phase went by unwaited for, whose parity the wait then
  // confused with the one it meant (on the GPU, a wait two phases behind passes on the wrong
  // phase or blocks for a later one).
  void CheckPhase(uint32_t off, int64_t phase, int tid) {
    auto [it, fresh] = fibers_[tid].mbar_phase.try_emplace(off, -1);
    if (phase > it->second + 1)
      Fail("mbarrier wait acquired phase " + std::to_string(phase) + " after phase " +
               std::to_string(it->second) + " (a phase gone by unwaited for: parity aliasing)",
           off, tid);
    it->second = phase;
  }
  Mbar& MbarAt(uint32_t off, int tid) {
    auto it = mbars_.find(off);
    if (it == mbars_.end()) Fail("not an initialised mbarrier", off, tid);
    if (!Before(it->second.init_tid, it->second.init_clk, tid))
      Fail("mbarrier used with no barrier after its mbarrier.init", off, tid);
    return it->second;
  }
  [[noreturn]] void Fail(const std::string& what, uint32_t off, int tid) const {
    throw std::runtime_error("shared memory: " + what + " at byte " + std::to_string(off) +
                             " by thread " + std::to_string(tid));
  }
  void CheckRange(uint32_t off, size_t bytes, int tid) const {
    if (off + bytes > smem_.size()) Fail("out of bounds", off, tid);
    if (off % bytes != 0) Fail("misaligned " + std::to_string(bytes) + "-byte access", off, tid);
  }
  void Read(uint32_t off, void* out, size_t bytes, int tid) {
    CheckRange(off, bytes, tid);
    const uint32_t clk = fibers_[tid].vc[tid];
    for (size_t i = 0; i < bytes; ++i) {
      Meta& m = meta_[off + i];
      if (m.mbar) Fail("generic access to an mbarrier", off + i, tid);
      if (m.in_flight) Fail("read of a cp.async copy not waited for", off + i, tid);
      if (!m.written) Fail("read of a never-written byte", off + i, tid);
      if (m.wphase == phase_ && !Before(m.writer, m.wclk, tid))
        Fail("read of a byte thread " + std::to_string(m.writer) + " wrote with no barrier between",
             off + i, tid);
      // The reads a later write must be ordered after: one thread's, or a set.
      if (m.rphase != phase_ || (m.reader >= 0 && Before(m.reader, m.rclk, tid))) {
        m.reader = tid, m.rclk = clk, m.rphase = phase_;
      } else if (m.reader >= 0) {
        m.rset = static_cast<int>(read_sets_.size());
        read_sets_.push_back({{m.reader, m.rclk}, {tid, clk}});
        m.reader = -2;
      } else {
        auto& set = read_sets_[m.rset];
        auto e =
            std::find_if(set.begin(), set.end(), [&](const auto& r) { return r.first == tid; });
        if (e != set.end()) {
          e->second = clk;
        } else {
          set.push_back({tid, clk});
        }
      }
    }
    std::memcpy(out, smem_.data() + off, bytes);
  }
  // A write (or a copy's issue) by tid over byte i: every earlier access ordered before it.
  void CheckWrite(uint32_t i, int tid, const char* in_flight) {
    Meta& m = meta_[i];
    if (m.mbar) Fail("generic access to an mbarrier", i, tid);
    if (m.in_flight) Fail(in_flight, i, tid);
    if (m.async_reads > 0) Fail("write over an operand of a wgmma in flight", i, tid);
    if (m.wphase == phase_ && !Before(m.writer, m.wclk, tid)) Fail("write-write race", i, tid);
    if (m.rphase == phase_) {
      bool ordered = m.reader >= 0 && Before(m.reader, m.rclk, tid);
      if (m.reader == -2) {
        ordered = true;
        for (const auto& r : read_sets_[m.rset])
          ordered = ordered && Before(r.first, r.second, tid);
      }
      if (!ordered) Fail("write of a byte another thread read", i, tid);
    }
    for (int g = 0; g < kMaxGroups; ++g) {
      if (m.landed[g] < 0) continue;
      WgOp& op = *landed_[m.landed[g]];
      const Fiber& f = fibers_[tid];
      if (op.phase != phase_) continue;  // a barrier since every wait
      if (op.ok_tid == tid && op.ok_version == f.version) continue;
      for (int l = 0; l < wgmma::kGroupThreads; ++l)
        if (!Before(g * wgmma::kGroupThreads + l, op.landed[l], tid))
          Fail("write of a byte a wgmma of thread " + std::to_string(g * wgmma::kGroupThreads + l) +
                   " read, with no barrier after its wait",
               i, tid);
      op.ok_tid = tid, op.ok_version = f.version;
    }
  }
  void Write(uint32_t off, const void* in, size_t bytes, int tid, bool landing = false) {
    CheckRange(off, bytes, tid);
    const uint32_t clk = fibers_[tid].vc[tid];
    for (size_t i = 0; i < bytes; ++i) {
      // A copy landing was checked at its issue (its bytes were in flight since).
      if (!landing) CheckWrite(off + i, tid, "write over a cp.async copy in flight");
      Meta& m = meta_[off + i];
      m.writer = tid;
      m.wclk = clk;
      m.wphase = phase_;
      m.written = true;
      m.in_flight = false;
      m.wtick = ++tick_;
      m.rphase = -1;
      for (int& l : m.landed) l = -1;
    }
    std::memcpy(smem_.data() + off, in, bytes);
  }

  static inline thread_local SimtBlock* current_ = nullptr;
  SimtMemory& memory_;
  int n_;
  std::vector<uint8_t> smem_;
  std::vector<Meta> meta_;
  std::vector<Fiber> fibers_;
  std::function<void(SimtThread&)> body_;
  FiberContext main_;
  int running_ = 0;
  int phase_ = 0;      // full barriers passed
  uint64_t tick_ = 0;  // orders shared-memory writes and proxy fences
  std::vector<std::vector<std::pair<int, uint32_t>>> read_sets_;  // this phase's (Meta::rset)
  std::vector<std::shared_ptr<WgOp>> landed_;                     // landed wgmma (Meta::landed)
  std::map<uint32_t, Mbar> mbars_;
  struct MeetCache {
    uint64_t sig = 0;
    std::vector<uint32_t> clocks;
  };
  MeetCache meet_[kMaxGroups];
  std::string error_;
  const void* main_bottom_ = nullptr;
  size_t main_size_ = 0;
};

inline void SimtThread::Sync() { block_->Yield(SimtBlock::kBarrier); }

void SimtThread::NamedSync(int id, int count) {
  if (id < 1 || id > 15 || count <= 0 || count % 32 != 0 || count > block_->n_)
    throw std::runtime_error("thread " + std::to_string(tid_) + ": named barrier " +
                             std::to_string(id) + " of " + std::to_string(count) + " threads");
  auto& f = block_->fibers_[tid_];
  f.bar_id = id;
  f.bar_count = count;
  block_->Yield(SimtBlock::kNamed);
}

void SimtThread::MbarInit(uint32_t off, int count) {
  block_->CheckRange(off, 8, tid_);
  if (count < 1) block_->Fail("mbarrier.init with no arrivals", off, tid_);
  if (block_->mbars_.count(off) != 0) block_->Fail("mbarrier initialised twice", off, tid_);
  for (uint32_t i = off; i < off + 8; ++i) {
    block_->CheckWrite(i, tid_, "mbarrier.init over a cp.async copy in flight");
    block_->meta_[i].mbar = true;
  }
  SimtBlock::Mbar m;
  m.count = m.pending = count;
  m.acc.assign(block_->n_, 0);
  m.done.assign(block_->n_, 0);
  m.init_tid = tid_;
  m.init_clk = block_->fibers_[tid_].vc[tid_];
  block_->mbars_[off] = std::move(m);
}

void SimtThread::MbarArrive(uint32_t off) {
  SimtBlock::Mbar& m = block_->MbarAt(off, tid_);
  auto& f = block_->fibers_[tid_];
  for (int u = 0; u < block_->n_; ++u) m.acc[u] = std::max(m.acc[u], f.vc[u]);
  block_->Release(f);
  if (--m.pending > 0) return;
  // The phase completes: its waiters see everything its arrivals did before arriving.
  m.done.swap(m.acc);
  m.acc.assign(block_->n_, 0);
  m.pending = m.count;
  ++m.completed;
  for (auto& w : block_->fibers_)
    if (w.state == SimtBlock::kMbar && w.mbar_off == off &&
        static_cast<int>(m.completed & 1) != w.mbar_parity) {
      block_->Acquire(w, m.done);
      w.mbar_woke = static_cast<int64_t>(m.completed) - 1;
      w.state = SimtBlock::kRunnable;
    }
}

void SimtThread::MbarWait(uint32_t off, int parity) {
  SimtBlock::Mbar& m = block_->MbarAt(off, tid_);
  auto& f = block_->fibers_[tid_];
  if (static_cast<int>(m.completed & 1) != (parity & 1)) {  // that phase has completed
    block_->Acquire(f, m.done);
    block_->CheckPhase(off, static_cast<int64_t>(m.completed) - 1, tid_);
    return;
  }
  f.mbar_off = off;
  f.mbar_parity = parity & 1;
  block_->Yield(SimtBlock::kMbar);  // MbarArrive wakes it, ordered after the phase's arrivals
  block_->CheckPhase(off, f.mbar_woke, tid_);
}

template <typename T>
T SimtThread::Ld(uint32_t off) {
  T v;
  block_->Read(off, &v, sizeof(T), tid_);
  return v;
}

template <typename T>
void SimtThread::St(uint32_t off, T v) {
  block_->Write(off, &v, sizeof(T), tid_);
}

void SimtThread::CpAsync16(uint32_t off, const void* src, bool valid) {
  block_->CheckRange(off, 16, tid_);
  SimtBlock::Fiber::Copy c{off, {}};
  if (valid) {
    memory_->CheckRead(src, 16, tid_);
    std::memcpy(c.bytes, src, 16);
  }
  for (int i = 0; i < 16; ++i) {
    // The copy may land any time from now: everything before it must be ordered before now.
    block_->CheckWrite(off + i, tid_, "cp.async over a copy in flight");
    block_->meta_[off + i].in_flight = true;
  }
  block_->fibers_[tid_].groups.back().push_back(c);
}

void SimtThread::SetMaxNreg(int regs) {
  block_->WarpOp(tid_, SimtBlock::kRegs, [&](auto& f) { f.regs = regs; });
}

void SimtThread::CpCommit() { block_->fibers_[tid_].groups.emplace_back(); }

void SimtThread::CpWait(int pending) {
  auto& groups = block_->fibers_[tid_].groups;  // the last one is open (uncommitted)
  while (static_cast<int>(groups.size()) - 1 > pending) {
    for (const auto& c : groups.front()) block_->Write(c.off, c.bytes, 16, tid_, true);
    groups.erase(groups.begin());
  }
}

float SimtThread::ShflXor(float v, int mask) {
  const auto& done = block_->WarpOp(tid_, SimtBlock::kShfl, [&](auto& f) {
    f.shfl_in = v;
    f.shfl_mask = mask;
  });
  return done.shfl_out;
}

void SimtThread::LdMatrixX4(uint32_t r[4], uint32_t row_off, bool trans) {
  block_->WarpOp(tid_, SimtBlock::kLdMatrix, [&](auto& f) {
    f.ldm_out = r;
    f.ldm_row = row_off;
    f.ldm_trans = trans;
  });
}

void SimtThread::Mma(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  block_->WarpOp(tid_, SimtBlock::kMma, [&](auto& f) {
    f.a = a;
    f.b = b;
    f.c = c;
  });
}

void SimtThread::WgmmaFence() {
  auto& f = block_->fibers_[tid_];
  f.wg_fenced = true;
  for (auto& h : f.held) {
    const uint8_t* b = static_cast<const uint8_t*>(h.p);
    h.at_fence.assign(b, b + h.bytes);
  }
}

void SimtThread::WgmmaHold(float* d, int n) {
  block_->fibers_[tid_].held.push_back({d, n * sizeof(float), {}});
}

void SimtThread::WgmmaHoldA(uint32_t* a, int n) {
  block_->fibers_[tid_].held.push_back({a, n * sizeof(uint32_t), {}});
}

// A from shared memory (descriptor a_desc) or, with a_regs, from registers.
void SimtThread::WgmmaOp(float* d, const uint32_t* a_regs, uint64_t a_desc, uint64_t b,
                         bool trans_b) {
  block_->WarpOp(tid_, SimtBlock::kWgmma, [&](auto& f) {
    f.wg_d = d;
    f.wg_a = a_regs;
    f.wg_desc_a = a_desc;
    f.wg_desc_b = b;
    f.wg_trans = trans_b;
  });
}

void SimtThread::Wgmma(float d[16], uint64_t a, uint64_t b, bool trans_b) {
  WgmmaOp(d, nullptr, a, b, trans_b);
}

void SimtThread::WgmmaRegA(float d[16], const uint32_t a[4], uint64_t b, bool trans_b) {
  WgmmaOp(d, a, 0, b, trans_b);
}

void SimtThread::WgmmaCommit() { block_->fibers_[tid_].wg_groups.emplace_back(); }

void SimtThread::WgmmaWait(int pending) {
  auto& f = block_->fibers_[tid_];
  while (static_cast<int>(f.wg_groups.size()) - 1 > pending) block_->LandWgmmaGroup(tid_);
  f.wg_fenced = false;
  f.held.clear();
}

void SimtThread::FenceProxyAsync() {
  auto& f = block_->fibers_[tid_];
  f.fence_upto[f.vc[tid_]] = ++block_->tick_;
}

// A thread interface that passes every call on to another (`t`): tests derive their fault
// injectors from it (a barrier skipped, a fence dropped, an operand changed in flight) and hide
// only the calls they change.
template <typename T>
struct ForwardingThread {
  T& t;
  explicit ForwardingThread(T& inner) : t(inner) {}
  int tid() const { return t.tid(); }
  int lane() const { return t.lane(); }
  int warp() const { return t.warp(); }
  void Sync() { t.Sync(); }
  void NamedSync(int id, int count) { t.NamedSync(id, count); }
  void MbarInit(uint32_t off, int count) { t.MbarInit(off, count); }
  void MbarArrive(uint32_t off) { t.MbarArrive(off); }
  void MbarWait(uint32_t off, int parity) { t.MbarWait(off, parity); }
  template <int kRegs>
  void RegsDown() {
    t.template RegsDown<kRegs>();
  }
  template <int kRegs>
  void RegsUp() {
    t.template RegsUp<kRegs>();
  }
  template <typename V>
  V Ld(uint32_t off) {
    return t.template Ld<V>(off);
  }
  template <typename V>
  void St(uint32_t off, V v) {
    t.St(off, v);
  }
  void CpAsync16(uint32_t off, const void* src, bool valid) { t.CpAsync16(off, src, valid); }
  void CpCommit() { t.CpCommit(); }
  void CpWait(int n) { t.CpWait(n); }
  float ShflXor(float v, int mask) { return t.ShflXor(v, mask); }
  void Mma(float c[4], const uint32_t a[4], const uint32_t b[2]) { t.Mma(c, a, b); }
  void LdMatrixX4(uint32_t r[4], uint32_t off, bool trans) { t.LdMatrixX4(r, off, trans); }
  uint32_t SmemAddr(uint32_t off) const { return t.SmemAddr(off); }
  void WgmmaFence() { t.WgmmaFence(); }
  void Wgmma(float d[16], uint64_t a, uint64_t b, bool tr) { t.Wgmma(d, a, b, tr); }
  void WgmmaRegA(float d[16], const uint32_t a[4], uint64_t b, bool tr) {
    t.WgmmaRegA(d, a, b, tr);
  }
  void WgmmaCommit() { t.WgmmaCommit(); }
  void WgmmaWait(int n) { t.WgmmaWait(n); }
  void FenceProxyAsync() { t.FenceProxyAsync(); }
  void WgmmaHold(float* d, int n) { t.WgmmaHold(d, n); }
  void WgmmaHoldA(uint32_t* a, int n) { t.WgmmaHoldA(a, n); }
  void WgmmaLanded(float* d, int n) { t.WgmmaLanded(d, n); }
  void WgmmaLandedA(uint32_t* a, int n) { t.WgmmaLandedA(a, n); }
  template <typename V>
  V Gld(const V* p) const {
    return t.Gld(p);
  }
  template <typename V>
  void Gst(V* p, V v) {
    t.Gst(p, v);
  }
};

}  // namespace attnd::cuda::sim
