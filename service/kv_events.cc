#include "service/kv_events.h"

#include <chrono>
#include <msgpack.hpp>
#include <zmq.hpp>

#include "absl/strings/str_cat.h"

namespace attnd {

namespace {

const char* MediumOf(const PrefixEvent& e, const std::vector<std::string>& device_medium) {
  switch (e.tier) {
    case Tier::kDevice:
      return e.device >= 0 && e.device < static_cast<int>(device_medium.size())
                 ? device_medium[e.device].c_str()
                 : "GPU";
    case Tier::kHost:
      return "CPU";
    case Tier::kDisk:
      return "DISK";
  }
  return "GPU";
}

void PackHash(msgpack::packer<msgpack::sbuffer>& pk, const BlockHash& h) {
  pk.pack_bin(static_cast<uint32_t>(h.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(h.data()), static_cast<uint32_t>(h.size()));
}

void PackStr(msgpack::packer<msgpack::sbuffer>& pk, const std::string& s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

}  // namespace

std::string EncodeKvEventBatch(double ts, const std::vector<PrefixEvent>& events, int device,
                               int32_t block_size, const std::vector<std::string>& device_medium,
                               bool cleared) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(events.size() + (cleared ? 1 : 0)));
  if (cleared) {
    pk.pack_array(1);
    PackStr(pk, "AllBlocksCleared");
  }
  for (const PrefixEvent& e : events) {
    if (e.kind == PrefixEvent::Kind::kStored) {
      pk.pack_array(7);
      PackStr(pk, "BlockStored");
      pk.pack_array(static_cast<uint32_t>(e.hashes.size()));
      for (const BlockHash& h : e.hashes) PackHash(pk, h);
      if (e.has_parent)
        PackHash(pk, e.parent);
      else
        pk.pack_nil();
      pk.pack_array(static_cast<uint32_t>(e.tokens.size()));
      for (uint32_t t : e.tokens) pk.pack_uint32(t);
      pk.pack_int32(block_size);
      pk.pack_nil();  // lora_id: adapters are told apart by the hash's salt
      PackStr(pk, MediumOf(e, device_medium));
    } else {
      pk.pack_array(3);
      PackStr(pk, "BlockRemoved");
      pk.pack_array(static_cast<uint32_t>(e.hashes.size()));
      for (const BlockHash& h : e.hashes) PackHash(pk, h);
      PackStr(pk, MediumOf(e, device_medium));
    }
  }
  if (device >= 0)
    pk.pack_int32(device);
  else
    pk.pack_nil();
  return std::string(buf.data(), buf.size());
}

struct KvEventPublisher::Impl {
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::pub};
};

KvEventPublisher::KvEventPublisher(const KvEventsOptions& options)
    : options_(options), impl_(std::make_unique<Impl>()) {}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Create(
    const KvEventsOptions& options) {
  std::unique_ptr<KvEventPublisher> p(new KvEventPublisher(options));
  try {
    p->impl_->socket.set(zmq::sockopt::linger, 200);  // what is queued at exit, within 0.2 s
    p->impl_->socket.set(zmq::sockopt::sndhwm, 100000);
    p->impl_->socket.bind(options.endpoint);
    p->bound_ = p->impl_->socket.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-events ", options.endpoint, ": cannot bind (", e.what(), ")"));
  }
  p->Send("", -1, {}, true);
  p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
  return p;
}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void KvEventPublisher::Publish(const PrefixEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.size() >= options_.max_queue) {
      dropped_ += static_cast<int64_t>(event.hashes.size());
      gap_ = true;
      return;
    }
    queue_.push_back(event);
  }
  wake_.notify_one();
}

void KvEventPublisher::Send(const std::string& tenant, int device,
                            const std::vector<PrefixEvent>& events, bool cleared) {
  const double ts =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string payload =
      EncodeKvEventBatch(ts, events, device, options_.block_size, options_.device_medium, cleared);
  const std::string topic = absl::StrCat("kv@", options_.replica, "@", tenant);
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (gap_) ++seq_;  // the subscriber sees a number missing: events were dropped
    gap_ = false;
    seq = seq_++;
  }
  unsigned char be[8];
  for (int i = 0; i < 8; ++i) be[i] = static_cast<unsigned char>(seq >> (56 - 8 * i));
  try {
    zmq::socket_t& s = impl_->socket;
    s.send(zmq::buffer(topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    s.send(zmq::buffer(be, sizeof(be)), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    s.send(zmq::buffer(payload), zmq::send_flags::dontwait);
  } catch (const zmq::error_t&) {
    // A PUB socket does not fail a send for want of subscribers; anything else drops this batch.
  }
  for (const PrefixEvent& e : events) published_ += static_cast<int64_t>(e.hashes.size());
}

void KvEventPublisher::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty() && stopping_) return;
    std::deque<PrefixEvent> take;
    take.swap(queue_);
    lock.unlock();
    // Consecutive events of one tenant and device go in one message, in order.
    std::vector<PrefixEvent> run;
    for (PrefixEvent& e : take) {
      if (!run.empty() && (run.back().tenant != e.tenant || run.back().device != e.device)) {
        Send(run.back().tenant, run.back().device, run, false);
        run.clear();
      }
      run.push_back(std::move(e));
    }
    if (!run.empty()) Send(run.back().tenant, run.back().device, run, false);
    lock.lock();
  }
}

}  // namespace attnd
