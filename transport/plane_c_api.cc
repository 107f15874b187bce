#include "transport/plane_c_api.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "transport/ucx_plane_client.h"

struct attnd_plane {
  std::unique_ptr<attnd::transport::UcxPlaneClient> client;
};
struct attnd_plane_send {
  std::shared_ptr<attnd::transport::UcxWorker::Pending> pending;
};

namespace {
int Error(const absl::Status& s, char* err, size_t errlen) {
  if (err != nullptr && errlen > 0) {
    const std::string text = s.ToString();
    const size_t n = std::min(text.size(), errlen - 1);
    std::memcpy(err, text.data(), n);
    err[n] = '\0';
  }
  return static_cast<int>(s.code());
}
absl::Time After(double seconds) { return absl::Now() + absl::Seconds(seconds > 0 ? seconds : 0); }
}  // namespace

extern "C" {

attnd_plane* attnd_plane_create(int64_t output_bytes, char* err, size_t errlen) {
  return attnd_plane_create_for(output_bytes, 0, err, errlen);
}

attnd_plane* attnd_plane_create_for(int64_t output_bytes, int local, char* err, size_t errlen) {
  auto c = attnd::transport::UcxPlaneClient::Create(
      output_bytes, local != 0 ? attnd::transport::LoopbackDevices() : "");
  if (!c.ok()) {
    Error(c.status(), err, errlen);
    return nullptr;
  }
  return new attnd_plane{std::move(*c)};
}

void attnd_plane_destroy(attnd_plane* p) { delete p; }

void attnd_plane_address(attnd_plane* p, const char** address, size_t* len) {
  *address = p->client->address().data();
  *len = p->client->address().size();
}

int attnd_plane_attach(attnd_plane* p, uint64_t plane_id, const char* token, size_t token_len,
                       const char* server_address, size_t address_len, int64_t input_bytes,
                       char* err, size_t errlen) {
  return attnd_plane_attach_with(p, plane_id, token, token_len, server_address, address_len,
                                 input_bytes, 0, err, errlen);
}

int attnd_plane_attach_with(attnd_plane* p, uint64_t plane_id, const char* token, size_t token_len,
                            const char* server_address, size_t address_len, int64_t input_bytes,
                            int pushes_outputs, char* err, size_t errlen) {
  absl::Status s =
      p->client->Attach(plane_id, std::string(token, token_len),
                        std::string(server_address, address_len), input_bytes, pushes_outputs != 0);
  return s.ok() ? 0 : Error(s, err, errlen);
}

int64_t attnd_plane_take_input(attnd_plane* p, int64_t bytes) {
  return p->client->input_space().Take(bytes);
}
void attnd_plane_give_input(attnd_plane* p, int64_t offset) {
  p->client->input_space().Give(offset);
}
int64_t attnd_plane_take_output(attnd_plane* p, int64_t bytes) {
  return bytes > p->client->output_bytes() ? -1 : p->client->output_space().Take(bytes);
}
void attnd_plane_give_output(attnd_plane* p, int64_t offset) {
  p->client->output_space().Give(offset);
}
uint64_t attnd_plane_next_transfer(attnd_plane* p) { return p->client->NextTransfer(); }
void attnd_plane_want(attnd_plane* p, uint64_t transfer) { p->client->Want(transfer); }

void attnd_plane_keepalive(attnd_plane* p, int64_t period_ms) {
  if (period_ms > 0) p->client->KeepAlive(absl::Milliseconds(period_ms));
}

int attnd_plane_lost(attnd_plane* p) { return p->client->Lost().ok() ? 0 : 1; }

attnd_plane_send* attnd_plane_put(attnd_plane* p, const void* const* pieces, const size_t* lengths,
                                  size_t n, int64_t offset, uint64_t transfer) {
  std::vector<attnd::transport::UcxWorker::Piece> v;
  for (size_t i = 0; i < n; ++i) v.push_back({pieces[i], lengths[i]});
  return new attnd_plane_send{p->client->PutPieces(std::move(v), offset, transfer)};
}

int attnd_plane_wait(attnd_plane_send* s, double timeout_s, char* err, size_t errlen) {
  absl::Status st = s->pending->Wait(After(timeout_s));
  delete s;
  return st.ok() ? 0 : Error(st, err, errlen);
}

int attnd_plane_await(attnd_plane* p, uint64_t transfer, int64_t offset, size_t n, double timeout_s,
                      const char** where, char* err, size_t errlen) {
  auto r = p->client->Await(transfer, offset, n, After(timeout_s));
  if (!r.ok()) return Error(r.status(), err, errlen);
  *where = *r;
  return 0;
}

void attnd_plane_forget(attnd_plane* p, uint64_t transfer) { p->client->Forget(transfer); }

}  // extern "C"
