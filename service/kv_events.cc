#include "service/kv_events.h"

#include <chrono>
#include <msgpack.hpp>
#include <zmq.hpp>

#include "absl/strings/str_cat.h"

namespace attnd {

namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

const char* MediumOf(const PrefixEvent& e, const KvEventsOptions& o) {
  switch (e.tier) {
    case Tier::kDevice:
      return e.device >= 0 && e.device < static_cast<int>(o.device_medium.size())
                 ? o.device_medium[e.device].c_str()
                 : "GPU";
    case Tier::kHost:
      return "CPU";
    case Tier::kDisk:
      return o.array_form ? "DISK" : "STORAGE";
  }
  return "GPU";
}

void PackHash(Packer& pk, const BlockHash& h) {
  pk.pack_bin(static_cast<uint32_t>(h.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(h.data()), static_cast<uint32_t>(h.size()));
}

void PackStr(Packer& pk, const std::string& s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

// An event's head: the tagged array's size and tag, or the tagged map's size and "type".
void PackHead(Packer& pk, bool array_form, uint32_t fields, const char* tag) {
  if (array_form) {
    pk.pack_array(fields + 1);
  } else {
    pk.pack_map(fields + 1);
    PackStr(pk, "type");
  }
  PackStr(pk, tag);
}

// A field: its name first in the map form.
void Key(Packer& pk, bool array_form, const char* name) {
  if (!array_form) PackStr(pk, name);
}

void PackHashes(Packer& pk, const std::vector<BlockHash>& hashes) {
  pk.pack_array(static_cast<uint32_t>(hashes.size()));
  for (const BlockHash& h : hashes) PackHash(pk, h);
}

void PackBe64(zmq::socket_t& s, uint64_t v, zmq::send_flags more) {
  unsigned char be[8];
  for (int i = 0; i < 8; ++i) be[i] = static_cast<unsigned char>(v >> (56 - 8 * i));
  s.send(zmq::buffer(be, sizeof(be)), more);
}

}  // namespace

std::string KvEventTopic(const std::string& replica, const std::string& tenant) {
  std::string topic = absl::StrCat("kv@", replica, "@");
  for (char c : tenant) {
    if (c == '%')
      topic += "%25";
    else if (c == '@')
      topic += "%40";
    else
      topic += c;
  }
  return topic;
}

std::string EncodeKvEventBatch(double ts, const std::vector<PrefixEvent>& events, int device,
                               const KvEventsOptions& o, bool cleared) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  const bool a = o.array_form;
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(events.size() + (cleared ? 1 : 0)));
  if (cleared) PackHead(pk, a, 0, "AllBlocksCleared");
  for (const PrefixEvent& e : events) {
    if (e.kind == PrefixEvent::Kind::kStored) {
      // vLLM's BlockStored in declaration order: the array form stops after medium; the map form
      // goes on with lora_name (nil) and group_idx (attnd's one cache group: 0), and leaves out
      // the fields whose default is None (extra_keys: the tenant's salt is in the hash).
      PackHead(pk, a, a ? 6 : 8, "BlockStored");
      Key(pk, a, "block_hashes");
      PackHashes(pk, e.hashes);
      Key(pk, a, "parent_block_hash");
      if (e.has_parent)
        PackHash(pk, e.parent);
      else
        pk.pack_nil();
      Key(pk, a, "token_ids");
      pk.pack_array(static_cast<uint32_t>(e.tokens.size()));
      for (uint32_t t : e.tokens) pk.pack_uint32(t);
      Key(pk, a, "block_size");
      pk.pack_int32(o.block_size);
      Key(pk, a, "lora_id");
      pk.pack_nil();  // adapters are told apart by the hash's salt
      Key(pk, a, "medium");
      PackStr(pk, MediumOf(e, o));
      if (!a) {
        Key(pk, a, "lora_name");
        pk.pack_nil();
        Key(pk, a, "group_idx");
        pk.pack_int32(0);
      }
    } else {
      PackHead(pk, a, a ? 2 : 3, "BlockRemoved");
      Key(pk, a, "block_hashes");
      PackHashes(pk, e.hashes);
      Key(pk, a, "medium");
      PackStr(pk, MediumOf(e, o));
      if (!a) {
        Key(pk, a, "group_idx");
        pk.pack_int32(0);
      }
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
  zmq::socket_t replay{context, zmq::socket_type::router};
};

KvEventPublisher::KvEventPublisher(const KvEventsOptions& options)
    : options_(options),
      impl_(std::make_unique<Impl>()),
      first_seq_(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                           std::chrono::system_clock::now().time_since_epoch())
                                           .count())) {}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Create(
    const KvEventsOptions& options) {
  std::unique_ptr<KvEventPublisher> p(new KvEventPublisher(options));
  std::string binding = options.endpoint;
  try {
    p->impl_->socket.set(zmq::sockopt::linger, 200);  // what is queued at exit, within 0.2 s
    p->impl_->socket.set(zmq::sockopt::sndhwm, 100000);
    p->impl_->socket.bind(options.endpoint);
    p->bound_ = p->impl_->socket.get(zmq::sockopt::last_endpoint);
    if (!options.replay_endpoint.empty()) {
      binding = options.replay_endpoint;
      p->impl_->replay.set(zmq::sockopt::linger, 0);
      p->impl_->replay.set(zmq::sockopt::sndhwm, 100000);
      p->impl_->replay.set(zmq::sockopt::rcvhwm, 64);
      p->impl_->replay.set(zmq::sockopt::maxmsgsize, int64_t{4096});  // a request is a few bytes
      p->impl_->replay.bind(options.replay_endpoint);
      p->replay_bound_ = p->impl_->replay.get(zmq::sockopt::last_endpoint);
    }
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(binding == options.endpoint ? "--kv-events " : "--kv-events-replay ", binding,
                     ": cannot bind (", e.what(), ")"));
  }
  p->Send("", -1, {}, true);
  p->thread_ = std::thread([raw = p.get()] { raw->Loop(); });
  if (!p->replay_bound_.empty())
    p->replay_thread_ = std::thread([raw = p.get()] { raw->ReplayLoop(); });
  return p;
}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  replay_stop_ = true;
  if (replay_thread_.joinable()) replay_thread_.join();
}

void KvEventPublisher::Publish(const PrefixEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.size() >= options_.max_queue) {
      dropped_ += static_cast<int64_t>(event.hashes.size());
      gapped_.insert(event.tenant);
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
  auto payload = std::make_shared<const std::string>(
      EncodeKvEventBatch(ts, events, device, options_, cleared));
  const std::string topic = KvEventTopic(options_.replica, tenant);
  bool gap;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gap = gapped_.erase(tenant) > 0;
  }
  auto [next, fresh] = next_.try_emplace(topic, first_seq_);
  if (gap && !fresh) ++next->second;  // the subscriber sees a number missing: events were dropped
  const uint64_t seq = next->second++;
  try {
    zmq::socket_t& s = impl_->socket;
    s.send(zmq::buffer(topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    PackBe64(s, seq, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    s.send(zmq::buffer(*payload), zmq::send_flags::dontwait);
  } catch (const zmq::error_t&) {
    // A PUB socket does not fail a send for want of subscribers; anything else drops this batch.
  }
  for (const PrefixEvent& e : events) published_ += static_cast<int64_t>(e.hashes.size());
  if (replay_bound_.empty() && !cleared) return;
  std::lock_guard<std::mutex> lock(replay_mu_);
  if (cleared) {
    cleared_ = {topic, seq, payload};
    return;
  }
  sent_.push_back({topic, seq, payload});
  sent_bytes_ += static_cast<int64_t>(payload->size());
  while (!sent_.empty() &&
         (sent_bytes_ > options_.replay_bytes || sent_.size() > options_.replay_messages)) {
    sent_bytes_ -= static_cast<int64_t>(sent_.front().payload->size());
    sent_.pop_front();
  }
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

void KvEventPublisher::ReplayLoop() {
  zmq::socket_t& s = impl_->replay;
  const auto more = zmq::send_flags::sndmore | zmq::send_flags::dontwait;
  while (!replay_stop_) {
    zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
    try {
      if (zmq::poll(&item, 1, std::chrono::milliseconds(100)) == 0) continue;
      std::vector<zmq::message_t> frames;
      zmq::message_t m;
      do {
        if (!s.recv(m, zmq::recv_flags::dontwait)) break;
        if (frames.size() < 5) frames.push_back(std::move(m));
      } while (s.get(zmq::sockopt::rcvmore));
      // [identity, "", start (8 bytes)] or the same + a topic; anything else is not answered.
      if ((frames.size() != 3 && frames.size() != 4) || frames[1].size() != 0 ||
          frames[2].size() != 8)
        continue;
      uint64_t start = 0;
      for (int i = 0; i < 8; ++i) start = start << 8 | frames[2].data<unsigned char>()[i];
      const std::string only = frames.size() == 4 ? frames[3].to_string() : "";
      std::vector<Sent> answer;
      {
        std::lock_guard<std::mutex> lock(replay_mu_);
        if (cleared_.payload != nullptr && cleared_.seq >= start) answer.push_back(cleared_);
        for (const Sent& e : sent_)
          if (e.seq >= start && (only.empty() || e.topic == only)) answer.push_back(e);
      }
      const std::string identity = frames[0].to_string();
      for (const Sent& e : answer) {
        s.send(zmq::buffer(identity), more);
        s.send(zmq::message_t(), more);
        s.send(zmq::buffer(e.topic), more);
        PackBe64(s, e.seq, more);
        s.send(zmq::buffer(*e.payload), zmq::send_flags::dontwait);
      }
      s.send(zmq::buffer(identity), more);
      s.send(zmq::message_t(), more);
      s.send(zmq::message_t(), more);
      PackBe64(s, ~uint64_t{0}, more);  // vLLM's end marker: -1 as 8 signed bytes
      s.send(zmq::message_t(), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      // A peer gone mid-answer (ROUTER drops what it cannot route): the next request.
    }
  }
}

}  // namespace attnd
