#include "client/soak.h"

#include <dirent.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/workload.h"

namespace attnd::client {
namespace {

using Clock = std::chrono::steady_clock;

bool IsLoopback(const std::string& target) {
  return target.rfind("127.", 0) == 0 || target.rfind("localhost:", 0) == 0 ||
         target.rfind("[::1]:", 0) == 0 || target.rfind("unix:", 0) == 0;
}

int64_t RssBytes(int pid) { return ProcStatusBytes(pid, "VmRSS"); }

int OpenFds(int pid) {
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) ++n;
  closedir(d);
  return n - 2;
}

// Counters shared by the workers.
struct Tally {
  std::mutex mu;
  std::map<std::string, int64_t> counts;           // steps, aborts, cancels, ...
  std::map<std::string, int64_t> expected_errors;  // by status code, from bad requests
  std::map<std::string, int64_t> unexpected;       // by status code: failures
  std::vector<std::string> first_unexpected;
  void Count(const std::string& k, int64_t n = 1) {
    std::lock_guard<std::mutex> l(mu);
    counts[k] += n;
  }
  void Expected(const absl::Status& s) {
    std::lock_guard<std::mutex> l(mu);
    expected_errors[std::string(absl::StatusCodeToString(s.code()))]++;
  }
  void Unexpected(const std::string& what, const absl::Status& s) {
    std::lock_guard<std::mutex> l(mu);
    unexpected[std::string(absl::StatusCodeToString(s.code()))]++;
    if (first_unexpected.size() < 10)
      first_unexpected.push_back(absl::StrCat(what, ": ", s.ToString().substr(0, 200)));
  }
};

class Worker {
 public:
  Worker(const SoakOptions& o, int index, const ModelSpec& spec, Tally* tally)
      : o_(o), spec_(spec), tally_(tally), rng_(o.seed * 1000003 + index) {
    client_ = Client::Connect(o.target, 1 << 30);
    for (int j = 0; j < o.sequences_per_client; ++j)
      ids_.push_back(absl::StrCat("soak-", o.seed, "-", index, "-", j));
  }

  // Opens the sequences; false on failure.
  bool Start() {
    for (const auto& id : ids_) {
      auto s = client_->OpenSequence(id);
      if (!s.ok()) {
        tally_->Unexpected("open", s.status());
        return false;
      }
      length_[id] = 0;
    }
    return true;
  }

  void Run(Clock::time_point deadline) {
    while (Clock::now() < deadline) {
      const int r = static_cast<int>(rng_() % 100);
      if (r < 45) {
        StreamStep(kCommit);
      } else if (r < 53) {
        StreamStep(kAbort);
      } else if (r < 60) {
        StreamStep(kCancel);
      } else if (r < 65) {
        StreamStep(kDisconnect);
      } else if (r < 75) {
        UnaryStep();
      } else if (r < 90) {
        BadRequest();
      } else if (r < 95) {
        Echo();
      } else {
        Fork();
      }
    }
  }

  // Every sequence's length equals its committed tokens; then closes them.
  bool Audit() {
    bool ok = true;
    for (const auto& id : ids_) {
      auto d = client_->DescribeSequence(id);
      if (!d.ok() || d->length() != length_[id] || d->in_step()) {
        tally_->Unexpected(absl::StrCat("audit ", id, ": length ", d.ok() ? d->length() : -1,
                                        " expected ", length_[id]),
                           d.ok() ? absl::DataLossError("length mismatch") : d.status());
        ok = false;
      }
      if (auto s = client_->CloseSequence(id); !s.ok()) {
        tally_->Unexpected("close", s);
        ok = false;
      }
    }
    return ok;
  }

 private:
  enum Ending { kCommit, kAbort, kCancel, kDisconnect };

  Batch PickBatch() {
    Batch b;
    const int n = 1 + static_cast<int>(rng_() % std::min<size_t>(3, ids_.size()));
    std::vector<std::string> pool = ids_;
    std::shuffle(pool.begin(), pool.end(), rng_);
    for (int i = 0; i < n; ++i) {
      const std::string& id = pool[i];
      if (length_[id] + 64 > o_.max_length) Recycle(id);
      const int64_t q = rng_() % 4 == 0 ? 1 + static_cast<int64_t>(rng_() % 64) : 1;
      b.emplace_back(id, q);
    }
    return b;
  }

  void Recycle(const std::string& id) {
    if (auto s = client_->CloseSequence(id); !s.ok()) tally_->Unexpected("recycle close", s);
    if (auto s = client_->OpenSequence(id); !s.ok()) tally_->Unexpected("recycle open", s.status());
    length_[id] = 0;
  }

  static int64_t Tokens(const Batch& b) {
    int64_t t = 0;
    for (const auto& e : b) t += e.second;
    return t;
  }

  bool OutputOk(const v1::LayerOutput& out, int64_t T) {
    return out.out().data().size() ==
           static_cast<size_t>(T * spec_.num_heads * spec_.kv_lora_rank * 2);
  }

  void StreamStep(Ending ending) {
    const Batch b = PickBatch();
    const int64_t T = Tokens(b);
    auto g = GenerateStep(spec_, T, DType::kBF16, false, rng_);
    auto stream = client_->OpenStream();
    auto begun = stream->Begin(b);
    if (!begun.ok()) return tally_->Unexpected("stream begin", begun.status());
    const int stop =
        ending == kCommit ? spec_.num_layers() : static_cast<int>(rng_() % spec_.num_layers());
    for (int l = 0; l < stop; ++l) {
      auto o = stream->Layer(g[l].wire);
      if (!o.ok()) return tally_->Unexpected("stream layer", o.status());
      if (!OutputOk(*o, T)) return tally_->Unexpected("stream output", absl::DataLossError("size"));
    }
    switch (ending) {
      case kCommit:
        for (const auto& e : b) length_[e.first] += e.second;
        tally_->Count("steps committed");
        tally_->Count("tokens", T);
        if (auto s = stream->Close(); !s.ok()) tally_->Unexpected("stream close", s);
        break;
      case kAbort:
        if (auto s = stream->Abort(); !s.ok()) tally_->Unexpected("stream abort", s);
        tally_->Count("steps aborted");
        (void)stream->Close();
        break;
      case kCancel:
        stream->Cancel();  // returns once the server released the step
        tally_->Count("steps cancelled");
        break;
      case kDisconnect:
        stream.reset();  // the destructor cancels the call, as a crashed worker would
        tally_->Count("steps disconnected");
        WaitReleased(b);
        break;
    }
  }

  // After a disconnect the server aborts the step asynchronously; wait (bounded) for it.
  void WaitReleased(const Batch& b) {
    const auto until = Clock::now() + std::chrono::seconds(5);
    for (const auto& e : b)
      while (Clock::now() < until) {
        auto d = client_->DescribeSequence(e.first);
        if (!d.ok() || !d->in_step()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
  }

  void UnaryStep() {
    const Batch b = PickBatch();
    const int64_t T = Tokens(b);
    auto g = GenerateStep(spec_, T, DType::kBF16, false, rng_);
    auto begun = client_->BeginStep(b);
    if (!begun.ok()) return tally_->Unexpected("unary begin", begun.status());
    for (const auto& l : g) {
      auto o = client_->AttendLayer(begun->step_id(), l.wire);
      if (!o.ok()) return tally_->Unexpected("unary layer", o.status());
    }
    for (const auto& e : b) length_[e.first] += e.second;
    tally_->Count("steps committed");
    tally_->Count("tokens", T);
  }

  // A request that must fail with a known code and change nothing.
  void BadRequest() {
    const Batch b = PickBatch();
    const int64_t T = Tokens(b);
    auto g = GenerateStep(spec_, T, DType::kBF16, false, rng_);
    auto expect = [&](const absl::Status& s, absl::StatusCode code, const char* what) {
      if (s.code() == code) {
        tally_->Expected(s);
      } else {
        tally_->Unexpected(absl::StrCat("bad request '", what, "' got"), s);
      }
    };
    const int kind = static_cast<int>(rng_() % 6);
    tally_->Count("bad requests");
    if (kind == 0) {
      expect(client_->BeginStep({{b[0].first, INT64_MAX}}).status(), absl::StatusCode::kOutOfRange,
             "huge q_len");
      return;
    }
    if (kind == 1) {
      expect(client_->DescribeSequence(std::string(300, 'z')).status(), absl::StatusCode::kNotFound,
             "unknown id");
      return;
    }
    auto begun = client_->BeginStep(b);
    if (!begun.ok()) return tally_->Unexpected("bad-request begin", begun.status());
    v1::LayerInputs in = g[0].wire;
    absl::StatusCode code = absl::StatusCode::kInvalidArgument;
    const char* what = "";
    switch (kind) {
      case 2:
        in.mutable_q_latent()->set_shape(1, spec_.num_heads + 1);
        what = "wrong shape";
        break;
      case 3: {
        const uint16_t nan = 0x7fc0;
        std::memcpy(in.mutable_kv_latent()->mutable_data()->data(), &nan, 2);
        what = "NaN key";
        break;
      }
      case 4:
        in.set_layer(1);
        code = absl::StatusCode::kFailedPrecondition;
        what = "layer out of order";
        break;
      case 5:
        in.mutable_q_rope()->set_datatype(std::string(5000, 'X'));
        what = "long datatype";
        break;
    }
    expect(client_->AttendLayer(begun->step_id(), in).status(), code, what);
    // The failed layer aborted the step: a later layer learns it (CANCELLED).
    expect(client_->AttendLayer(begun->step_id(), g[0].wire).status(), absl::StatusCode::kCancelled,
           "layer after the abort");
  }

  void Echo() {
    if (auto s = client_->Echo("ping", 1 + static_cast<int64_t>(rng_() % 65536)); !s.ok())
      tally_->Unexpected("echo", s);
    tally_->Count("echo");
  }

  void Fork() {
    const std::string& parent = ids_[rng_() % ids_.size()];
    const std::string child = parent + "-fork";
    const int64_t prefix = length_[parent] > 0 ? static_cast<int64_t>(rng_() % length_[parent]) : 0;
    auto s = client_->OpenSequence(child, parent, prefix);
    if (!s.ok()) return tally_->Unexpected("fork", s.status());
    if (s->length() != prefix) tally_->Unexpected("fork length", absl::DataLossError("length"));
    if (auto c = client_->CloseSequence(child); !c.ok()) tally_->Unexpected("fork close", c);
    tally_->Count("forks");
  }

  const SoakOptions& o_;
  const ModelSpec& spec_;
  Tally* tally_;
  std::mt19937_64 rng_;
  std::unique_ptr<Client> client_;
  std::vector<std::string> ids_;
  std::map<std::string, int64_t> length_;
};

void Report(Tally& t, double elapsed, const SoakOptions& o) {
  std::lock_guard<std::mutex> l(t.mu);
  std::string line = absl::StrCat("soak: t=", static_cast<int>(elapsed), "s");
  for (const auto& [k, v] : t.counts) absl::StrAppend(&line, " ", k, "=", v);
  int64_t unexpected = 0;
  for (const auto& [k, v] : t.unexpected) unexpected += v;
  absl::StrAppend(&line, " unexpected=", unexpected);
  if (o.server_pid > 0)
    absl::StrAppend(&line, " server_rss_mb=", RssBytes(o.server_pid) >> 20,
                    " server_fds=", OpenFds(o.server_pid));
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

int64_t ProcStatusBytes(int pid, const char* field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  const std::string prefix = absl::StrCat(field, ":");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size())) * 1024;
  return -1;
}

int RunSoak(const SoakOptions& o) {
  if (!IsLoopback(o.target)) {
    std::fprintf(stderr, "attnctl soak: %s is not a loopback address; soak runs on loopback only\n",
                 o.target.c_str());
    return 2;
  }
  if (o.minutes <= 0 || o.minutes > 24 * 60 || o.clients < 1 || o.clients > 64 ||
      o.sequences_per_client < 1) {
    std::fprintf(stderr, "attnctl soak: --minutes in (0, 1440], --clients in [1, 64]\n");
    return 2;
  }
  auto probe = Client::Connect(o.target);
  auto info = probe->Info();
  if (!info.ok()) {
    std::fprintf(stderr, "attnctl soak: %s\n", info.status().ToString().c_str());
    return 1;
  }
  auto spec = ModelSpecFromProto(info->model());
  if (!spec.ok()) return 1;
  Tally tally;
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < o.clients; ++i)
    workers.push_back(std::make_unique<Worker>(o, i, *spec, &tally));
  for (auto& w : workers)
    if (!w->Start()) return 1;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(static_cast<int64_t>(o.minutes * 60000));
  const int64_t rss0 = o.server_pid > 0 ? RssBytes(o.server_pid) : -1;
  const int fds0 = o.server_pid > 0 ? OpenFds(o.server_pid) : -1;
  std::vector<std::thread> threads;
  for (auto& w : workers) threads.emplace_back([&w, deadline] { w->Run(deadline); });
  while (Clock::now() < deadline) {
    const auto next = std::min(deadline, Clock::now() + std::chrono::seconds(o.report_seconds));
    std::this_thread::sleep_until(next);
    Report(tally, std::chrono::duration<double>(Clock::now() - start).count(), o);
  }
  for (auto& t : threads) t.join();
  bool audit = true;
  for (auto& w : workers) audit = w->Audit() && audit;
  // Every page is back once the soak's sequences are closed (no other client on the server).
  auto after = probe->Info();
  if (after.ok()) {
    for (const auto& d : after->devices()) {
      std::printf("soak: audit %s: %d of %d pages free, %lld sequences\n", d.name().c_str(),
                  d.pages_free(), d.pages_total(), static_cast<long long>(d.sequences()));
      if (d.pages_free() != d.pages_total() || d.sequences() != 0) audit = false;
    }
  } else {
    audit = false;
  }
  Report(tally, std::chrono::duration<double>(Clock::now() - start).count(), o);
  std::lock_guard<std::mutex> l(tally.mu);
  std::string expected;
  for (const auto& [k, v] : tally.expected_errors) absl::StrAppend(&expected, " ", k, "=", v);
  std::printf("soak: expected errors by status:%s\n", expected.c_str());
  std::string bad;
  for (const auto& [k, v] : tally.unexpected) absl::StrAppend(&bad, " ", k, "=", v);
  std::printf("soak: unexpected errors by status:%s\n", bad.empty() ? " none" : bad.c_str());
  for (const auto& f : tally.first_unexpected) std::printf("soak:   %s\n", f.c_str());
  if (o.server_pid > 0)
    std::printf("soak: server RSS %lld MB -> %lld MB, open fds %d -> %d\n",
                static_cast<long long>(rss0 >> 20),
                static_cast<long long>(RssBytes(o.server_pid) >> 20), fds0, OpenFds(o.server_pid));
  std::printf("soak: audit %s\n",
              audit ? "passed: every length as committed, every page back" : "FAILED");
  return audit && tally.unexpected.empty() ? 0 : 1;
}

}  // namespace attnd::client
