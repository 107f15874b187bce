#include "client/attnctl_common.h"

#include <csignal>

#include "absl/strings/str_cat.h"
#include "proto/convert/model_spec_proto.h"

namespace attnd::client::ctl {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;  // the signal that came, 0 none

extern "C" void OnInterrupt(int sig) {
  g_interrupted = sig;
  std::signal(sig, SIG_DFL);  // a second one ends the process
}

}  // namespace

void StopOnInterrupt() {
  std::signal(SIGINT, OnInterrupt);
  std::signal(SIGTERM, OnInterrupt);
}

absl::Status Interrupted() {
  if (g_interrupted == 0) return absl::OkStatus();
  return absl::CancelledError("interrupted: closing what this command opened");
}

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "attnctl: %s: %s\n", what, s.ToString().c_str());
  // 128 + the signal, as shells say (130 for Ctrl-C, 143 for SIGTERM).
  return absl::IsCancelled(s) && g_interrupted != 0 ? 128 + g_interrupted : 1;
}

absl::Status CheckFits(const v1::ServerInfoResponse& info, const ModelSpec& spec,
                       const std::vector<int64_t>& lengths, const char* lower) {
  int64_t longest = 0, pages = 0, free_pages = 0;
  for (int64_t n : lengths) {
    longest = std::max(longest, n);
    pages += (n + spec.page_size - 1) / spec.page_size;
  }
  for (const auto& d : info.devices()) free_pages += d.pages_free();
  if (longest > spec.max_context)
    return absl::OutOfRangeError(absl::StrCat("a sequence would reach ", longest,
                                              " tokens, over the model's max_context ",
                                              spec.max_context, " (lower ", lower, ")"));
  if (pages > free_pages)
    return absl::ResourceExhaustedError(
        absl::StrCat("the sequences would take ", pages, " cache pages, the server has ",
                     free_pages, " free (raise its --kv-cache-bytes or lower ", lower, ")"));
  return absl::OkStatus();
}

absl::StatusOr<ModelSpec> ServedSpec(Client& c, v1::ServerInfoResponse* info) {
  auto got = c.Info();
  if (!got.ok()) return got.status();
  *info = std::move(*got);
  return ModelSpecFromProto(info->model());
}

}  // namespace attnd::client::ctl
