// libFuzzer target: the UCX data plane's handshake and the messages clients send it. Each input
// is a sequence of operations on one server-side plane (transport/ucx_plane.h): handshakes with
// any sizes and tenants, active messages with any header bytes and payloads delivered to the
// handlers exactly as UCX would (OnToServer, OnPull; eager payloads), region lookups by any name,
// offset and size, waits for and reads of any transfer id, output staging, closes. Messages naming
// the real plane get its real secret some of the time, so accepted landings are exercised too.
// Afterwards every landed transfer the plane answers for is read back in full: its bytes must be
// what was sent, and every wait for a landing has ended, once. A crash, sanitizer report or failed
// self-check is a failure.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "fuzz/fuzz_input.h"
#include "transport/plane_wire.h"
#include "transport/ucx_plane.h"

namespace attnd {
namespace {

using transport::UcxPlane;
using transport::UcxWorker;

constexpr int64_t kRegion = 1 << 14;

UcxPlane& Plane() {
  static UcxPlane* plane = [] {
    UcxPlane::Options o;
    o.max_planes = 8;
    o.max_region_bytes = kRegion;
    o.transfer_timeout = absl::Milliseconds(1);  // a transfer that never came fails at once
    return UcxPlane::Create(o).value().release();
  }();
  return *plane;
}

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "data_plane_fuzz: self-check failed: %s\n", what);
    std::abort();
  }
}

}  // namespace
}  // namespace attnd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnd;
  FuzzInput in(data, size);
  UcxPlane& plane = Plane();
  auto conn = plane.Connect("a", kRegion, kRegion, 0);
  if (!conn.ok()) return 0;
  // What this input landed for real (transfer -> offset and bytes), to read back at the end.
  std::map<uint64_t, std::pair<int64_t, std::string>> sent;
  struct Waits {
    int registered = 0;
    std::atomic<int> fired{0};
  };
  auto waits = std::make_shared<Waits>();
  while (!in.empty()) {
    switch (in.Int(0, 5)) {
      case 0: {  // a handshake with any sizes, for one of two tenants; closed by its own
        const char* tenant = in.Bool(0.5) ? "a" : "b";
        auto c = plane.Connect(tenant, in.Int64() % (2 * kRegion), in.Int64() % (2 * kRegion),
                               in.Int(0, 3));
        if (!c.ok()) break;
        Check(plane.Close(tenant[0] == 'a' ? "b" : "a", c->name).code() ==
                  absl::StatusCode::kNotFound,
              "another tenant cannot close a plane");
        Check(plane.Close(tenant, c->name).ok(), "its tenant closes a plane");
        break;
      }
      case 1: {  // a client's bytes: header built or raw, the real secret or not
        transport::ToServerHeader h;
        std::string header;
        if (in.Bool(0.8)) {
          h.plane = in.Bool(0.8) ? conn->id : static_cast<uint64_t>(in.Int64());
          if (in.Bool(0.8)) std::memcpy(h.token, conn->token.data(), transport::kTokenBytes);
          h.transfer = static_cast<uint64_t>(in.Int(0, 64));
          h.offset = in.Bool(0.8) ? in.Int(0, kRegion) : in.Int64();
          header = transport::PackHeader(h);
          if (in.Bool(0.1)) header.resize(static_cast<size_t>(in.Int(0, 80)));
        } else {
          header = in.Bytes(80);
        }
        std::string payload = in.Bytes(static_cast<size_t>(in.Int(0, 3) == 0 ? 2 * kRegion : 512));
        UcxWorker::Message m{header.data(),  header.size(), payload.data(),
                             payload.size(), false,         nullptr};
        // Mostly on the plane's own worker; now and then on another plane's (refused).
        const uint64_t on = in.Bool(0.9) ? conn->id : static_cast<uint64_t>(in.Int64());
        plane.OnToServer(m, on);
        transport::ToServerHeader got;
        const bool valid =
            on == conn->id && transport::UnpackHeader(header.data(), header.size(), &got) &&
            got.plane == conn->id &&
            std::memcmp(got.token, conn->token.data(), transport::kTokenBytes) == 0 &&
            got.transfer != 0 && got.offset >= 0 &&
            static_cast<int64_t>(payload.size()) <= kRegion &&
            got.offset <= kRegion - static_cast<int64_t>(payload.size());
        const bool ours = on == conn->id &&
                          transport::UnpackHeader(header.data(), header.size(), &got) &&
                          got.plane == conn->id &&
                          std::memcmp(got.token, conn->token.data(), transport::kTokenBytes) == 0 &&
                          got.transfer != 0;
        if (ours && !valid) sent.erase(got.transfer);  // refused to its transfer's call
        if (valid) {
          // A later landing supersedes the ones it overlaps.
          for (auto it = sent.begin(); it != sent.end();) {
            const int64_t o = it->second.first, n = static_cast<int64_t>(it->second.second.size());
            it = o < got.offset + static_cast<int64_t>(payload.size()) && got.offset < o + n
                     ? sent.erase(it)
                     : std::next(it);
          }
          sent[got.transfer] = {got.offset, payload};
        }
        break;
      }
      case 2: {  // a pull with any header (no reply endpoint: refused, never answered)
        const std::string header = in.Bytes(80);
        UcxWorker::Message m{header.data(), header.size(), nullptr, 0, false, nullptr};
        plane.OnPull(m, in.Bool(0.9) ? conn->id : static_cast<uint64_t>(in.Int64()));
        break;
      }
      case 3: {  // a region by any name, offset and size; a read of any transfer
        std::string name = in.Bool(0.7) ? (in.Bool(0.5) ? conn->input_region : conn->output_region)
                                        : "ucx-" + in.Bytes(12);
        const int64_t off = in.Bool(0.8) ? in.Int(0, kRegion) : in.Int64();
        const int64_t n = in.Bool(0.8) ? in.Int(0, 4096) : in.Int64();
        auto r = plane.Resolve(in.Bool(0.9) ? "a" : "b", "fuzz", name, off, n);
        if (!r.ok()) break;
        const auto t = static_cast<uint64_t>(in.Int(0, 64));
        if (in.Bool(0.5)) {  // a call's wait for its input, as the service does first
          ++waits->registered;
          (*r)->WhenLanded(t, [waits] { waits->fired.fetch_add(1); });
        }
        std::string buf(static_cast<size_t>(n), '\0');
        (void)(*r)->Read(off, buf.data(), buf.size(), t,
                         absl::Now() + plane.options().transfer_timeout);
        break;
      }
      case 4: {  // an output staged for a pull
        const int64_t off = in.Int(0, kRegion - 1), n = in.Int(1, static_cast<int>(kRegion - off));
        auto r = plane.Resolve("a", "out", conn->output_region, off, n);
        Check(r.ok(), "the output region resolves inside its bounds");
        char* staged = (*r)->Staging(off, static_cast<size_t>(n));
        std::memset(staged, 0x5a, static_cast<size_t>(n));
        Check((*r)->Write(off, staged, static_cast<size_t>(n), static_cast<uint64_t>(in.Int(1, 64)))
                  .ok(),
              "an output is staged");
        break;
      }
      default:
        break;
    }
  }
  // Every transfer that landed for real reads back as sent (the last 256 are kept).
  if (sent.size() <= 200)
    for (const auto& [t, v] : sent) {
      auto r = plane.Resolve("a", "in", conn->input_region, v.first,
                             static_cast<int64_t>(v.second.size()));
      Check(r.ok(), "a landed transfer's bytes resolve");
      std::string back(v.second.size(), '\0');
      const absl::Status s = (*r)->Read(v.first, back.data(), back.size(), t, absl::Now());
      Check(s.ok() && back == v.second, "a landed transfer reads back as sent");
    }
  Check(plane.Close("a", conn->name).ok(), "the plane closes");
  // Every wait for a landing ended, each once (the close ends those left; a deadline's may be
  // finishing on the timer's thread).
  for (int i = 0; i < 1000 && waits->fired.load() < waits->registered; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Check(waits->fired.load() == waits->registered, "every wait for a landing ends once");
  return 0;
}
