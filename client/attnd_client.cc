#include "client/attnd_client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/data_plane_session.h"
#include "client/sequence_import.h"
#include "common/fp8.h"

namespace attnd::client {

v1::Tensor MakeTensor(DType dtype, const std::vector<int64_t>& shape, const void* data,
                      size_t bytes) {
  v1::Tensor t;
  t.set_datatype(std::string(DTypeName(dtype)));
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(static_cast<const char*>(data), bytes);
  return t;
}

v1::Tensor MakeFp8Tensor(const std::vector<int64_t>& shape, const float* values) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t width = shape.empty() ? 1 : shape.back(), rows = width > 0 ? n / width : 0;
  std::string codes(static_cast<size_t>(n), '\0');
  std::vector<float> scales(static_cast<size_t>(rows));
  if (rows > 0)  // a tile per row
    fp8::QuantizeTiles(values, n, static_cast<int>(width), reinterpret_cast<uint8_t*>(codes.data()),
                       scales.data());
  v1::Tensor t = MakeTensor(DType::kFP8E4M3, shape, codes.data(), codes.size());
  std::vector<int64_t> sshape(shape.begin(), shape.end());
  if (sshape.empty()) sshape.push_back(1);
  sshape.back() = 1;
  *t.mutable_scales() = MakeTensor(DType::kF32, sshape, scales.data(), 4 * scales.size());
  return t;
}

absl::StatusOr<std::vector<float>> TensorValues(const v1::Tensor& t) {
  const auto dt = ParseDType(t.datatype());
  if (!dt) return absl::InvalidArgumentError(absl::StrCat("unknown datatype ", t.datatype()));
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  if (t.data().size() != static_cast<size_t>(n) * DTypeSize(*dt))
    return absl::InvalidArgumentError(
        absl::StrCat("tensor: ", t.data().size(), " bytes for ", n, " ", t.datatype(), " values"));
  std::vector<float> f(static_cast<size_t>(n));
  if (*dt != DType::kFP8E4M3) {
    ConvertToF32(*dt, t.data().data(), f.data(), f.size());
    return f;
  }
  int64_t rows = 1;
  for (int i = 0; i + 1 < t.shape_size(); ++i) rows *= t.shape(i);
  const int64_t per_row =
      t.scales().shape_size() > 0 ? t.scales().shape(t.scales().shape_size() - 1) : 0;
  const int64_t width = t.shape_size() > 0 ? t.shape(t.shape_size() - 1) : 1;
  if (t.scales().datatype() != "FP32" || per_row <= 0 || width % per_row != 0 ||
      t.scales().data().size() != static_cast<size_t>(rows * per_row) * 4)
    return absl::InvalidArgumentError("FP8_E4M3 tensor: its scales do not match its shape");
  const auto* codes = reinterpret_cast<const uint8_t*>(t.data().data());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = i / width, tile = (i % width) / (width / per_row);
    float scale;
    std::memcpy(&scale, t.scales().data().data() + 4 * (row * per_row + tile), 4);
    f[i] = fp8::E4M3ToF32(codes[i]) * scale;
  }
  return f;
}

v1::Tensor ShmTensor(DType dtype, const std::vector<int64_t>& shape, const std::string& region,
                     int64_t offset) {
  v1::Tensor t;
  t.set_datatype(std::string(DTypeName(dtype)));
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  t.mutable_shm()->set_region(region);
  t.mutable_shm()->set_offset(offset);
  t.mutable_shm()->set_byte_size(n * static_cast<int64_t>(DTypeSize(dtype)));
  return t;
}

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(const std::string& key,
                                                                   size_t bytes) {
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    return absl::InternalError(absl::StrCat("shm_open ", key, ": ", std::strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    shm_unlink(key.c_str());
    return absl::InternalError(absl::StrCat("ftruncate ", key, ": ", std::strerror(errno)));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::InternalError(absl::StrCat("mmap ", key, ": ", std::strerror(errno)));
  }
  std::unique_ptr<SharedMemory> m(new SharedMemory());
  m->key_ = key;
  m->base_ = base;
  m->size_ = bytes;
  return m;
}

SharedMemory::~SharedMemory() {
  munmap(base_, size_);
  shm_unlink(key_.c_str());
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  std::string token;
  if (!in || !std::getline(in, token))
    return absl::NotFoundError(absl::StrCat("cannot read ", path));
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  return token;
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.error_code())),
                      s.error_message());
}

absl::Status FromGrpcNotCancelled(const grpc::Status& s) {
  if (s.error_code() == grpc::StatusCode::CANCELLED && s.error_message() == "CANCELLED")
    return absl::UnavailableError(
        "the server shut down before handling the call (gRPC said CANCELLED); retry");
  return FromGrpc(s);
}

std::unique_ptr<Client> Client::Connect(const std::string& target, int max_message_bytes) {
  ConnectOptions o;
  o.max_message_bytes = max_message_bytes;
  return std::move(Connect(target, o)).value();  // no files to read: cannot fail
}

namespace {
absl::StatusOr<std::string> ReadPem(const char* what, const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}
}  // namespace

bool IsLocalTarget(absl::string_view target) {
  if (absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:")) return true;
  absl::string_view t = target;
  if (!absl::ConsumePrefix(&t, "dns:///") && !absl::ConsumePrefix(&t, "dns:") &&
      !absl::ConsumePrefix(&t, "ipv4:"))
    (void)absl::ConsumePrefix(&t, "ipv6:");
  absl::string_view host = t;
  if (absl::ConsumePrefix(&host, "[")) {
    host = host.substr(0, host.find(']'));
  } else if (size_t colon = host.rfind(':');
             colon != absl::string_view::npos && host.find(':') == colon) {
    host = host.substr(0, colon);  // host:port (one colon: not a bare IPv6 address)
  }
  const bool dotted = !host.empty() && std::all_of(host.begin(), host.end(), [](char ch) {
    return ch == '.' || std::isdigit(static_cast<unsigned char>(ch));
  });
  return host == "localhost" || host == "::1" || (dotted && absl::StartsWith(host, "127."));
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        const ConnectOptions& o) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(o.max_message_bytes);
  args.SetMaxSendMessageSize(o.max_message_bytes);
  if (o.reconnect_backoff_ms > 0) {
    const int b = static_cast<int>(std::min<int64_t>(o.reconnect_backoff_ms, 60000));
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, b);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, b);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 20 * b);
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!o.tls_ca_file.empty() || !o.tls_cert_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    auto ca = ReadPem("tls CA", o.tls_ca_file);
    auto cert = ReadPem("tls certificate", o.tls_cert_file);
    auto key = ReadPem("tls key", o.tls_key_file);
    for (const auto* r : {&ca, &cert, &key})
      if (!r->ok()) return r->status();
    if (cert->empty() != key->empty())
      return absl::InvalidArgumentError("a client certificate and its key go together");
    ssl.pem_root_certs = *ca;
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
    creds = grpc::SslCredentials(ssl);
    if (!o.tls_server_name.empty()) args.SetSslTargetNameOverride(o.tls_server_name);
  }
  Metadata md;
  if (!o.token.empty()) md.emplace_back("authorization", absl::StrCat("Bearer ", o.token));
  if (!o.act_as_tenant.empty()) md.emplace_back("attnd-tenant", o.act_as_tenant);
  if (o.data_plane != "auto" && o.data_plane != "off")
    return absl::InvalidArgumentError(
        absl::StrCat("data_plane: \"", o.data_plane, "\" is not auto or off"));
  std::unique_ptr<Client> c(
      new Client(grpc::CreateCustomChannel(target, creds, args), std::move(md), o.call_timeout_ms));
  c->data_plane_mode_ = o.data_plane;
  c->data_plane_bytes_ = o.data_plane_bytes;
  c->local_target_ = IsLocalTarget(target);
  return c;
}

Client::~Client() {
  // A probe under way ends within its bounds (2 s a call, the UCX connect's 5 s).
  if (plane_probe_.joinable()) plane_probe_.join();
  RetirePlane(plane_);
}

void Client::Authorize(grpc::ClientContext* ctx) const {
  for (const auto& [k, v] : metadata_) ctx->AddMetadata(k, v);
}

void Client::PrepareUnary(grpc::ClientContext* ctx) const {
  Authorize(ctx);
  if (call_timeout_ms_ > 0)
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(call_timeout_ms_));
}

Client::Client(std::shared_ptr<grpc::Channel> channel, Metadata metadata, int64_t call_timeout_ms)
    : channel_(std::move(channel)),
      stub_(v1::Attention::NewStub(channel_)),
      metadata_(std::move(metadata)),
      call_timeout_ms_(call_timeout_ms) {}

absl::StatusOr<v1::ServerInfoResponse> Client::Info() {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::ServerInfoResponse resp;
  absl::Status s = FromGrpcNotCancelled(stub_->ServerInfo(&ctx, v1::ServerInfoRequest(), &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::SequenceInfo> Client::OpenSequence(const std::string& id,
                                                      const std::string& parent, int64_t prefix_len,
                                                      int64_t import_length) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::OpenSequenceRequest req;
  req.set_sequence_id(id);
  req.set_fork_parent_id(parent);
  req.set_fork_prefix_len(prefix_len);
  req.set_import_length(import_length);
  v1::SequenceInfo resp;
  absl::Status s = FromGrpcNotCancelled(stub_->OpenSequence(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::Status Client::CloseSequence(const std::string& id, uint64_t standby_generation) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::CloseSequenceRequest req;
  req.set_sequence_id(id);
  req.set_standby_generation(standby_generation);
  v1::CloseSequenceResponse resp;
  return FromGrpcNotCancelled(stub_->CloseSequence(&ctx, req, &resp));
}

absl::StatusOr<v1::SequenceInfo> Client::OpenSequence(const v1::OpenSequenceRequest& request) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::SequenceInfo resp;
  absl::Status s = FromGrpcNotCancelled(stub_->OpenSequence(&ctx, request, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::LookupPrefixResponse> Client::LookupPrefix(
    const v1::LookupPrefixRequest& request) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::LookupPrefixResponse resp;
  absl::Status s = FromGrpcNotCancelled(stub_->LookupPrefix(&ctx, request, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::Status Client::PrefetchSequences(const std::vector<std::string>& ids) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::PrefetchSequencesRequest req;
  for (const std::string& id : ids) req.add_sequence_ids(id);
  v1::PrefetchSequencesResponse resp;
  return FromGrpcNotCancelled(stub_->PrefetchSequences(&ctx, req, &resp));
}

absl::Status Client::OffloadSequences(const std::vector<std::string>& ids) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::OffloadSequencesRequest req;
  for (const std::string& id : ids) req.add_sequence_ids(id);
  v1::OffloadSequencesResponse resp;
  return FromGrpcNotCancelled(stub_->OffloadSequences(&ctx, req, &resp));
}

absl::StatusOr<v1::ListSequencesResponse> Client::ListSequences(bool all_tenants) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::ListSequencesRequest req;
  req.set_all_tenants(all_tenants);
  v1::ListSequencesResponse resp;
  absl::Status s = FromGrpcNotCancelled(stub_->ListSequences(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::SequenceInfo> Client::DescribeSequence(const std::string& id, int64_t lease_ms) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::DescribeSequenceRequest req;
  req.set_sequence_id(id);
  req.set_lease_ms(lease_ms);
  v1::SequenceInfo resp;
  absl::Status s = FromGrpcNotCancelled(stub_->DescribeSequence(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::SequenceInfo> Client::PromoteSequence(const std::string& id, uint64_t generation,
                                                         int64_t length,
                                                         const std::string& failed_replica,
                                                         bool release_lease) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::PromoteSequenceRequest req;
  req.set_sequence_id(id);
  req.set_generation(generation);
  req.set_length(length);
  req.set_failed_replica(failed_replica);
  req.set_release_lease(release_lease);
  v1::SequenceInfo resp;
  absl::Status s = FromGrpcNotCancelled(stub_->PromoteSequence(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

v1::BeginStepRequest MakeBeginRequest(const Batch& batch, bool write_only, int num_shards) {
  v1::BeginStepRequest req;
  for (const auto& [id, q] : batch) {
    auto* e = req.add_batch();
    e->set_sequence_id(id);
    e->set_q_len(q);
  }
  req.set_write_only(write_only);
  req.set_num_shards(num_shards);
  return req;
}

absl::StatusOr<v1::BeginStepResponse> Client::BeginStep(const Batch& batch, bool write_only,
                                                        int num_shards) {
  return BeginStep(MakeBeginRequest(batch, write_only, num_shards));
}

absl::StatusOr<v1::BeginStepResponse> Client::BeginStep(const v1::BeginStepRequest& request) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::BeginStepResponse resp;
  absl::Status s = FromGrpcNotCancelled(stub_->BeginStep(&ctx, request, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::LayerOutput> Client::AttendLayer(uint64_t step_id, const v1::LayerInputs& in) {
  return AttendLayer(step_id, in, nullptr, 0);
}

absl::StatusOr<v1::LayerOutput> Client::AttendLayer(uint64_t step_id, const v1::LayerInputs& in,
                                                    void* dest, size_t dest_bytes) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::AttendLayerRequest req;
  req.set_step_id(step_id);
  std::shared_ptr<DataPlaneSession> plane = Plane();
  DataPlaneSession::Call call;
  if (plane == nullptr ||
      !plane->Stage(in, req.mutable_inputs(), &call, static_cast<char*>(dest), dest_bytes))
    *req.mutable_inputs() = in;
  v1::AttendLayerResponse resp;
  absl::Status s = FromGrpcNotCancelled(stub_->AttendLayer(&ctx, req, &resp));
  if (!s.ok()) {
    if (plane != nullptr) plane->Failed(s);
    return s;
  }
  if (plane != nullptr)
    if (absl::Status f = plane->Finish(&call, resp.mutable_output()); !f.ok()) return f;
  if (absl::Status f = IntoCallerBuffer(resp.mutable_output(), dest, dest_bytes); !f.ok()) return f;
  return std::move(*resp.mutable_output());
}

absl::Status Client::AbortStep(uint64_t step_id) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::AbortStepRequest req;
  req.set_step_id(step_id);
  v1::AbortStepResponse resp;
  return FromGrpcNotCancelled(stub_->AbortStep(&ctx, req, &resp));
}

absl::Status Client::RegisterSharedMemory(const std::string& name, const std::string& key,
                                          int64_t offset, int64_t bytes) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::RegisterSharedMemoryRequest req;
  req.set_name(name);
  req.set_key(key);
  req.set_offset(offset);
  req.set_byte_size(bytes);
  v1::RegisterSharedMemoryResponse resp;
  return FromGrpcNotCancelled(stub_->RegisterSharedMemory(&ctx, req, &resp));
}

absl::Status Client::UnregisterSharedMemory(const std::string& name) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::UnregisterSharedMemoryRequest req;
  req.set_name(name);
  v1::UnregisterSharedMemoryResponse resp;
  return FromGrpcNotCancelled(stub_->UnregisterSharedMemory(&ctx, req, &resp));
}

absl::Status Client::Echo(const std::string& payload, int64_t response_bytes) {
  grpc::ClientContext ctx;
  PrepareUnary(&ctx);
  v1::EchoRequest req;
  req.set_payload(payload);
  req.set_response_bytes(response_bytes);
  v1::EchoResponse resp;
  return FromGrpcNotCancelled(stub_->Echo(&ctx, req, &resp));
}

std::unique_ptr<StepStream> Client::OpenStream(int64_t deadline_ms) {
  return std::unique_ptr<StepStream>(new StepStream(*this, stub_.get(), deadline_ms));
}

}  // namespace attnd::client

namespace attnd::client {

absl::Status HandOffSequence(Client& from, Client& to, const std::string& id,
                             int64_t chunk_tokens) {
  auto source = from.DescribeSequence(id);
  if (!source.ok()) return source.status();
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader;  // once the copy is open
  bool finished = false;
  auto next = [&](v1::ExportChunk* chunk) -> absl::StatusOr<bool> {
    if (reader == nullptr) {
      from.Authorize(&ctx);
      v1::ExportSequenceRequest req;
      req.set_sequence_id(id);
      req.set_chunk_tokens(chunk_tokens);
      reader = from.stub()->ExportSequence(&ctx, req);
    }
    if (reader->Read(chunk)) return true;
    finished = true;
    if (absl::Status s = FromGrpcNotCancelled(reader->Finish()); !s.ok()) return s;
    return false;
  };
  absl::Status s = ImportSequence(
      to, {.id = id, .length = source->length(), .generation = source->generation()}, next);
  if (reader != nullptr && !finished) {
    ctx.TryCancel();
    (void)reader->Finish();
  }
  return s;
}

}  // namespace attnd::client
