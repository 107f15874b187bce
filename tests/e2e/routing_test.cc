// Routing through membership changes (issue 28 item 3), end to end: real attnd replicas named
// with --replica-name, a decode workload through client::Router, and the fleet changing under it
// — a replica drained and back under a new address, then one added. Every step lands: a miss
// (NOT_FOUND or UNAVAILABLE on the replica the hash names) is answered by Router::Locate, which
// finds the sequence on the next-ranked replicas and pulls it to its owner.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/kv_events.h"
#include "client/router.h"
#include "client/workload.h"
#include "tests/server_process.h"

namespace attnd::testing {
namespace {

using client::Client;
using client::Replica;
using client::Router;

constexpr int kSequences = 24;
constexpr int64_t kPrompt = 20;

std::unique_ptr<ServerProcess> StartReplica(const std::string& name,
                                            std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "--model=tiny",     "--kv-pages=400",         "--threads=2",
      "--metrics-port=0", "--replica-name=" + name, "--step-idle-timeout-ms=5000"};
  args.insert(args.end(), extra.begin(), extra.end());
  return std::make_unique<ServerProcess>(ATTND_BINARY, args);
}

// One whole step (every layer) of `tokens` for `id` on `c`.
absl::Status Step(Client& c, const ModelSpec& spec, const std::string& id, int64_t tokens,
                  std::mt19937_64& rng) {
  auto g = client::GenerateStep(spec, tokens, DType::kBF16, /*write_only=*/false, rng);
  auto b = c.BeginStep({{id, tokens}});
  if (!b.ok()) return b.status();
  for (const auto& l : g) {
    auto o = c.AttendLayer(b->step_id(), l.wire);
    if (!o.ok()) return o.status();
  }
  return absl::OkStatus();
}

bool IsMiss(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound || s.code() == absl::StatusCode::kUnavailable;
}

struct Workload {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> steps{0}, misses{0}, failures{0};
  std::atomic<int64_t> rounds{0};         // passes over every sequence
  std::map<std::string, int64_t> length;  // the decode thread's alone until it is joined
  std::string first_failure;
};

// Decodes one token on every sequence, round after round, through the router; a miss is
// located and retried (for up to 20 s: a sequence being drained is nowhere for a moment).
void Decode(Router& router, const ModelSpec& spec, Workload& w) {
  std::mt19937_64 rng(7);
  while (!w.stop) {
    for (auto& [id, length] : w.length) {
      Client* c = router.ClientFor(id);
      absl::Status s = c ? Step(*c, spec, id, 1, rng) : absl::UnavailableError("no replica");
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (IsMiss(s) && std::chrono::steady_clock::now() < deadline) {
        ++w.misses;
        auto where = router.Locate(id);
        if (where.ok()) {
          s = Step(**where, spec, id, 1, rng);
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      }
      if (s.ok()) {
        ++length;
        ++w.steps;
      } else if (w.failures++ == 0) {
        w.first_failure = absl::StrCat(id, ": ", s.ToString());
      }
    }
    ++w.rounds;
  }
}

std::vector<Replica> Members(
    const std::vector<std::pair<std::string, const ServerProcess*>>& servers) {
  std::vector<Replica> out;
  for (const auto& [name, p] : servers) out.push_back({name, p->target()});
  return out;
}

TEST(Routing, DecodeSurvivesADrainARejoinUnderANewAddressAndAScaleUp) {
  auto a = StartReplica("attnd-0");
  auto c = StartReplica("attnd-2");
  auto b = StartReplica(
      "attnd-1", {"--drain-peers=" + a->target() + "," + c->target(), "--drain-timeout-ms=20000"});
  Router router(Members({{"attnd-0", a.get()}, {"attnd-1", b.get()}, {"attnd-2", c.get()}}), {});
  auto info = router.ClientFor("x")->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  const ModelSpec spec = ModelSpecFromProto(info->model()).value();

  // The names are what ServerInfo reports, and what the hash ranks.
  for (const auto& [name, p] : {std::pair{"attnd-0", a.get()}, {"attnd-1", b.get()}}) {
    auto i = Client::Connect(p->target())->Info();
    ASSERT_TRUE(i.ok()) << i.status();
    EXPECT_EQ(i->replica_name(), name);
  }

  Workload w;
  std::mt19937_64 rng(3);
  int on_b = 0, on_d = 0;
  const std::vector<std::string> all = {"attnd-0", "attnd-1", "attnd-2", "attnd-3"};
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = absl::StrCat("conv-", i);
    Client* owner = router.ClientFor(id);
    ASSERT_TRUE(owner->OpenSequence(id).ok()) << id;
    ASSERT_TRUE(Step(*owner, spec, id, kPrompt, rng).ok()) << id;
    w.length[id] = kPrompt;
    on_b += router.Pick(id) == "attnd-1";
    on_d += client::Route(all, id) == "attnd-3";
  }
  ASSERT_GE(on_b, 3) << "too few sequences on the replica that drains";
  ASSERT_GE(on_d, 3) << "too few sequences for the replica that joins";

  std::thread decode(Decode, std::ref(router), std::cref(spec), std::ref(w));
  // At least `ms`, and two whole passes over every sequence (a loaded machine's CI runs tests
  // side by side: a pass may take longer than `ms` there).
  auto run_for = [&](int ms) {
    const int64_t before = w.steps, rounds = w.rounds;
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (w.rounds < rounds + 2 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_GT(w.steps, before) << "the workload made progress";
  };
  run_for(300);

  // attnd-1 drains (SIGTERM): its sequences go to the peer the hash ranks next over the names.
  // The workload still routes to it until the membership changes, and locates them there.
  const std::string b_address = b->target();
  EXPECT_EQ(b->Stop(), 0);
  router.SetReplicas(Members({{"attnd-0", a.get()}, {"attnd-2", c.get()}}));
  run_for(300);
  const int64_t pulls_before_rejoin = router.pulls();

  // attnd-1 comes back under a new address (a new pod IP): by name it owns what it owned, and
  // the workload pulls each of those sequences back on its first miss there.
  auto b2 = StartReplica("attnd-1");
  ASSERT_NE(b2->target(), b_address) << "the rejoin must come under another address";
  router.SetReplicas(Members({{"attnd-0", a.get()}, {"attnd-1", b2.get()}, {"attnd-2", c.get()}}));
  run_for(500);
  EXPECT_EQ(router.pulls() - pulls_before_rejoin, on_b) << "each of attnd-1's sequences came home";

  // Scale-up: attnd-3 joins and takes the sequences the hash now gives it.
  auto d = StartReplica("attnd-3");
  const int64_t pulls_before_join = router.pulls();
  router.SetReplicas(Members(
      {{"attnd-0", a.get()}, {"attnd-1", b2.get()}, {"attnd-2", c.get()}, {"attnd-3", d.get()}}));
  run_for(500);
  EXPECT_EQ(router.pulls() - pulls_before_join, on_d) << "the new replica holds its share";

  w.stop = true;
  decode.join();
  EXPECT_EQ(w.failures, 0) << w.first_failure;
  EXPECT_GT(w.misses, 0) << "the membership changes were felt";
  // Every committed step is there, each sequence on the replica its hash names, once.
  std::map<std::string, ServerProcess*> by_name = {
      {"attnd-0", a.get()}, {"attnd-1", b2.get()}, {"attnd-2", c.get()}, {"attnd-3", d.get()}};
  for (const auto& [id, length] : w.length) {
    const std::string owner = router.Pick(id);
    for (const auto& [name, p] : by_name) {
      auto seq = Client::Connect(p->target())->DescribeSequence(id);
      if (name == owner) {
        ASSERT_TRUE(seq.ok()) << id << " on " << name << ": " << seq.status();
        EXPECT_EQ(seq->length(), length) << id;
      } else {
        EXPECT_EQ(seq.status().code(), absl::StatusCode::kNotFound) << id << " also on " << name;
      }
    }
  }
  EXPECT_GT(w.steps, kSequences * 3) << "enough decode steps ran to mean something";
  std::printf("decode steps %lld, misses located %lld, sequences pulled %lld, failed %lld\n",
              static_cast<long long>(w.steps), static_cast<long long>(w.misses),
              static_cast<long long>(router.pulls()), static_cast<long long>(w.failures.load()));
}

// Rebalancing without a miss (issue 53 item 4): ChangeReplicas keeps every sequence whose owner
// changes where it is, Rebalance moves it between steps and routes it there. A replica joins a
// loaded fleet and another leaves it; every step of every round lands where its sequence is.
TEST(Routing, AReplicaJoinsAndOneLeavesALoadedFleetWithoutAMisroutedStep) {
  auto a = StartReplica("attnd-0");
  auto b = StartReplica("attnd-1");
  Router router(Members({{"attnd-0", a.get()}, {"attnd-1", b.get()}}), {});
  auto info = router.ClientFor("x")->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  const ModelSpec spec = ModelSpecFromProto(info->model()).value();
  std::mt19937_64 rng(12);
  std::vector<std::string> ids;
  std::map<std::string, int64_t> length;
  for (int i = 0; i < 16; ++i) {
    ids.push_back(absl::StrCat("load-", i));
    Client* owner = router.ClientFor(ids.back());
    ASSERT_TRUE(owner->OpenSequence(ids.back()).ok());
    ASSERT_TRUE(Step(*owner, spec, ids.back(), kPrompt, rng).ok());
    length[ids.back()] = kPrompt;
  }
  auto round = [&] {  // one decode step each; any error (a miss included) fails
    for (const std::string& id : ids) {
      const absl::Status s = Step(*router.ClientFor(id), spec, id, 1, rng);
      ASSERT_TRUE(s.ok()) << id << " on " << router.Pick(id) << ": " << s;
      ++length[id];
    }
  };
  auto expect_only_on = [&](const std::map<std::string, ServerProcess*>& servers) {
    for (const std::string& id : ids)
      for (const auto& [name, p] : servers) {
        auto seq = Client::Connect(p->target())->DescribeSequence(id);
        if (name == router.Pick(id)) {
          ASSERT_TRUE(seq.ok()) << id << " on " << name << ": " << seq.status();
          EXPECT_EQ(seq->length(), length[id]) << id;
        } else {
          EXPECT_EQ(seq.status().code(), absl::StatusCode::kNotFound) << id << " on " << name;
        }
      }
  };
  round();
  auto c = StartReplica("attnd-2");  // joins
  const std::vector<Replica> three =
      Members({{"attnd-0", a.get()}, {"attnd-1", b.get()}, {"attnd-2", c.get()}});
  std::vector<std::string> moving = router.ChangeReplicas(three, ids);
  int want = 0;
  for (const std::string& id : ids)
    want += client::Route({"attnd-0", "attnd-1", "attnd-2"}, id) == "attnd-2";
  ASSERT_GT(want, 0) << "the new replica has a share";
  EXPECT_EQ(static_cast<int>(moving.size()), want);
  round();  // before the moves: where they were
  EXPECT_EQ(router.Rebalance(), want);
  EXPECT_TRUE(router.moving().empty());
  round();
  expect_only_on({{"attnd-0", a.get()}, {"attnd-1", b.get()}, {"attnd-2", c.get()}});
  for (const std::string& id : ids)
    EXPECT_EQ(router.Pick(id), client::Route({"attnd-0", "attnd-1", "attnd-2"}, id));

  // attnd-0 leaves: its sequences stay routed to it until they moved.
  moving = router.ChangeReplicas(Members({{"attnd-1", b.get()}, {"attnd-2", c.get()}}), ids);
  EXPECT_FALSE(moving.empty());
  for (const std::string& id : moving) EXPECT_EQ(router.Pick(id), "attnd-0");
  round();
  EXPECT_EQ(router.Rebalance(), static_cast<int64_t>(moving.size()));
  round();
  expect_only_on({{"attnd-0", a.get()}, {"attnd-1", b.get()}, {"attnd-2", c.get()}});
  EXPECT_EQ(a->Stop(), 0);  // nothing of the workload left there
  round();
  EXPECT_EQ(router.pulls(), 0) << "no step ever missed";
  EXPECT_EQ(router.rebalanced(), want + static_cast<int64_t>(moving.size()));
}

// Issue 53 (pins kept wrongly): a sequence kept in place by ChangeReplicas and moved meanwhile by
// someone else (by hand here, as a drain would) misses once; Locate finds it on its owner, and
// its pin and pending move are dropped: it routes there, and Rebalance has nothing left to move.
TEST(Routing, ASequenceLocatedElsewhereDropsItsPinAndPendingMove) {
  auto a = StartReplica("attnd-0");
  auto b = StartReplica("attnd-1");
  Router router(Members({{"attnd-0", a.get()}}), {});
  const std::vector<std::string> two = {"attnd-0", "attnd-1"};
  std::string id;
  for (int i = 0; id.empty(); ++i)
    if (client::Route(two, absl::StrCat("pin-", i)) == "attnd-1") id = absl::StrCat("pin-", i);
  auto info = router.ClientFor(id)->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  const ModelSpec spec = ModelSpecFromProto(info->model()).value();
  std::mt19937_64 rng(4);
  ASSERT_TRUE(router.ClientFor(id)->OpenSequence(id).ok());
  ASSERT_TRUE(Step(*router.ClientFor(id), spec, id, kPrompt, rng).ok());
  ASSERT_EQ(router.ChangeReplicas(Members({{"attnd-0", a.get()}, {"attnd-1", b.get()}}), {id}),
            std::vector<std::string>{id});
  auto to = Client::Connect(b->target());
  ASSERT_TRUE(client::HandOffSequence(*router.ClientFor(id), *to, id).ok());
  ASSERT_TRUE(router.ClientFor(id)->CloseSequence(id).ok());  // moved behind the router's back
  const absl::Status miss = Step(*router.ClientFor(id), spec, id, 1, rng);
  EXPECT_EQ(miss.code(), absl::StatusCode::kNotFound) << miss;
  auto found = router.Locate(id);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_TRUE(Step(**found, spec, id, 1, rng).ok());
  EXPECT_EQ(router.Pick(id), "attnd-1");
  EXPECT_TRUE(router.moving().empty());
  EXPECT_TRUE(Step(*router.ClientFor(id), spec, id, 1, rng).ok()) << "no second miss";
  EXPECT_EQ(router.Rebalance(), 0);
}

// A sequence found nowhere is NOT_FOUND with a short message; one whose owner is down is served
// where it is (no move), and one mid-step where it is stays there.
TEST(Routing, LocateWithoutAnOwnerToMoveTo) {
  auto a = StartReplica("r-a");
  auto b = StartReplica("r-b");
  Router router({{"r-a", a->target()}, {"r-b", b->target()}, {"r-gone", "127.0.0.1:1"}}, {});
  auto missing = router.Locate("nobody");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_LT(missing.status().message().size(), 300u);

  // A sequence whose owner is the unreachable replica: Locate answers where it is.
  std::string id;
  for (int i = 0; id.empty(); ++i)
    if (router.Pick(absl::StrCat("s", i)) == "r-gone") id = absl::StrCat("s", i);
  auto holder = Client::Connect(a->target());
  ASSERT_TRUE(holder->OpenSequence(id).ok());
  auto where = router.Locate(id);
  ASSERT_TRUE(where.ok()) << where.status();
  EXPECT_TRUE((*where)->DescribeSequence(id).ok());
  EXPECT_EQ(router.pulls(), 0);

  // A sequence in a step on a non-owner stays there until the step ends.
  std::string id2;
  for (int i = 0; id2.empty(); ++i)
    if (router.Pick(absl::StrCat("t", i)) == "r-a") id2 = absl::StrCat("t", i);
  auto other = Client::Connect(b->target());
  ASSERT_TRUE(other->OpenSequence(id2).ok());
  auto step = other->BeginStep({{id2, 1}});
  ASSERT_TRUE(step.ok()) << step.status();
  auto at = router.Locate(id2);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_TRUE((*at)->DescribeSequence(id2)->in_step());
  EXPECT_EQ(router.pulls(), 0);
  ASSERT_TRUE(other->AbortStep(step->step_id()).ok());
  // Idle now: the next Locate moves it to its owner, r-a.
  auto home = router.Locate(id2);
  ASSERT_TRUE(home.ok()) << home.status();
  EXPECT_EQ(router.pulls(), 1);
  EXPECT_TRUE(holder->DescribeSequence(id2).ok());
  EXPECT_EQ(other->DescribeSequence(id2).status().code(), absl::StatusCode::kNotFound);
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Standby replicas (docs/replication.md) through the C++ router: three replicas copying each
// other's commits (sync), one killed with SIGKILL; Router::FailOver promotes each of its
// sequences on the standby the hash ranks next, routes it there, and the next steps answer bit
// for bit as a twin that never failed.
TEST(Routing, FailOverPromotesTheStandbyAndTheSequenceDecodesOn) {
  const std::vector<int> ports = {FreePort(), FreePort(), FreePort()};
  std::string peers;
  for (int p : ports) absl::StrAppend(&peers, peers.empty() ? "" : ",", "127.0.0.1:", p);
  std::vector<std::unique_ptr<ServerProcess>> r;
  std::vector<Replica> replicas;
  for (int i = 0; i < 3; ++i) {
    const std::string name = absl::StrCat("f", i);
    r.push_back(
        StartReplica(name, {absl::StrCat("--grpc-port=", ports[i]), "--standby-peers=" + peers,
                            "--replication=sync", "--replication-ack-timeout-ms=500"}));
    replicas.push_back({name, r.back()->target()});
  }
  auto twin_server = StartReplica("twin");
  auto twin = Client::Connect(twin_server->target());
  for (auto& p : r) {  // every replica resolved its peers
    auto c = Client::Connect(p->target());
    for (int t = 0; t < 500 && c->Info()->replication().peers_size() < 2; ++t)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(c->Info()->replication().peers_size(), 2);
  }
  client::ConnectOptions o;
  o.call_timeout_ms = 2000;
  Router router(replicas, o);
  const ModelSpec spec = PresetModelSpec("tiny").value();
  std::mt19937_64 rng(5);
  std::map<std::string, int64_t> length;
  std::map<std::string, uint64_t> generation;
  std::map<std::string, std::string> protection;  // the last commit's LayerOutput.protection
  // A step on the sequence's replica and on the twin: the same outputs, bit for bit.
  auto step = [&](const std::string& id, int64_t tokens) -> absl::Status {
    auto g = client::GenerateStep(spec, tokens, DType::kBF16, false, rng);
    Client* c = router.ClientFor(id);
    v1::BeginStepRequest req;
    auto* e = req.add_batch();
    e->set_sequence_id(id);
    e->set_q_len(tokens);
    e->set_generation(generation[id]);
    auto b = c->BeginStep(req);
    if (!b.ok()) return b.status();
    auto tb = twin->BeginStep({{id, tokens}});
    EXPECT_TRUE(tb.ok()) << tb.status();
    for (const auto& l : g) {
      auto got = c->AttendLayer(b->step_id(), l.wire);
      if (!got.ok()) {
        (void)twin->AbortStep(tb->step_id());
        return got.status();
      }
      auto want = twin->AttendLayer(tb->step_id(), l.wire);
      EXPECT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(got->out().data(), want->out().data()) << id << " layer " << l.wire.layer();
      if (got->committed())
        protection[id] = got->protection_size() == 1 ? got->protection(0) : "(not one word)";
    }
    length[id] += tokens;
    return absl::OkStatus();
  };
  std::vector<std::string> ids;
  for (int i = 0; i < 9; ++i) ids.push_back(absl::StrCat("fo", i));
  for (const std::string& id : ids) {
    auto info = router.ClientFor(id)->OpenSequence(id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->standby_replica(), client::Ranked({"f0", "f1", "f2"}, id)[1]);
    generation[id] = info->generation();
    ASSERT_TRUE(twin->OpenSequence(id).ok());
    ASSERT_TRUE(step(id, kPrompt).ok());
    ASSERT_TRUE(step(id, 1).ok());
    EXPECT_EQ(protection[id], "replicated") << id;  // sync, every replica up
  }
  const std::string victim = router.Pick(ids[0]);
  const int v = victim[1] - '0';
  // Issue 53: a stale (empty) copy left on the replica that is neither the primary nor the
  // standby, named to FailOver as the standby: the caught-up copy must still win.
  std::map<std::string, std::string> stale_on;
  for (const std::string& id : ids) {
    const std::vector<std::string> ranked = client::Ranked({"f0", "f1", "f2"}, id);
    if (ranked[0] != victim) continue;
    stale_on[id] = ranked[2];
    auto there = Client::Connect(r[ranked[2][1] - '0']->target());
    v1::OpenSequenceRequest copy;
    copy.set_sequence_id(id);
    copy.set_standby_generation(generation[id]);
    ASSERT_TRUE(there->OpenSequence(copy).ok()) << id;
  }
  kill(r[v]->pid(), SIGKILL);
  int failed_over = 0;
  for (const std::string& id : ids) {
    absl::Status s = step(id, 1);
    if (s.ok()) continue;
    ASSERT_EQ(router.Pick(id), victim) << s;
    auto moved = router.FailOver(id, generation[id], length[id], victim, stale_on[id]);
    ASSERT_TRUE(moved.ok()) << moved.status();
    EXPECT_EQ(moved->name, client::Ranked({"f0", "f1", "f2"}, id)[1]) << "the longest copy";
    EXPECT_EQ(moved->info.length(), length[id]);  // sync: nothing committed lost
    EXPECT_EQ(moved->info.generation(), generation[id] + 1);
    EXPECT_NE(moved->name, victim);
    EXPECT_EQ(router.Pick(id), moved->name);
    generation[id] = moved->info.generation();
    ++failed_over;
    ASSERT_TRUE(step(id, 1).ok());
  }
  EXPECT_GE(failed_over, 1);
  for (const std::string& id : ids) ASSERT_TRUE(step(id, 1).ok()) << id;
  // A second promotion of a promoted sequence at its old generation is refused.
  for (const std::string& id : ids)
    if (generation[id] == 2) {
      auto again = router.ClientFor(id)->PromoteSequence(id, 2, length[id]);
      EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
    }
}

// Through two real replicas: a prompt whose blocks one of them holds goes there, whatever its id
// hashes to, and stays there for Pick and ClientFor; nothing cached: the rendezvous owner.
TEST(Routing, ChooseByPrefixSendsAPromptToTheReplicaHoldingItsBlocks) {
  auto a = StartReplica("p-a");
  auto b = StartReplica("p-b");
  Router router({{"p-a", a->target()}, {"p-b", b->target()}}, {});
  auto holder = Client::Connect(b->target());
  auto info = holder->Info();
  ASSERT_TRUE(info.ok());
  const ModelSpec spec = ModelSpecFromProto(info->model()).value();
  const int64_t P = spec.page_size;
  std::mt19937_64 rng(3);
  v1::OpenSequenceRequest open;
  open.set_sequence_id("first");
  for (int64_t t = 0; t < 3 * P + 2; ++t) open.add_prompt_token_ids(static_cast<uint32_t>(rng()));
  auto opened = holder->OpenSequence(open);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->cached_tokens(), 0);
  ASSERT_TRUE(Step(*holder, spec, "first", 3 * P, rng).ok());
  ASSERT_TRUE(holder->CloseSequence("first").ok());
  v1::LookupPrefixRequest lookup;
  *lookup.mutable_token_ids() = open.prompt_token_ids();
  int placed_by_hash_on_a = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string id = absl::StrCat("next", i);
    placed_by_hash_on_a += client::Route({"p-a", "p-b"}, id) == "p-a";
    int64_t cached = -1;
    auto chosen = router.ChooseByPrefix(id, lookup, &cached);
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_EQ(*chosen, "p-b");
    EXPECT_EQ(cached, 3);
    EXPECT_EQ(router.Pick(id), "p-b");
    EXPECT_EQ(router.ClientFor(id)->Info()->replica_name(), "p-b");
    open.set_sequence_id(id);
    auto again = router.ClientFor(id)->OpenSequence(open);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->cached_tokens(), 3 * P);
    ASSERT_TRUE(router.ClientFor(id)->CloseSequence(id).ok());
    router.Forget(id);
    EXPECT_EQ(router.Pick(id), client::Route({"p-a", "p-b"}, id));
  }
  EXPECT_GT(placed_by_hash_on_a, 0) << "the ids should not all hash to p-b";
  // Nothing cached anywhere: the most room, then the hash (both replicas are alike here).
  v1::LookupPrefixRequest fresh;
  for (int t = 0; t < 40; ++t) fresh.add_token_ids(static_cast<uint32_t>(rng()));
  int64_t cached = -1;
  auto chosen = router.ChooseByPrefix("fresh", fresh, &cached);
  ASSERT_TRUE(chosen.ok());
  EXPECT_EQ(cached, 0);
  // A malformed request is refused as the replicas refuse it.
  v1::LookupPrefixRequest bad;
  bad.add_block_hashes("short");
  EXPECT_EQ(router.ChooseByPrefix("bad", bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// Stores a prompt of `blocks` full blocks (and 2 tokens) on `c` under `id` and closes it: its
// blocks stay in the prefix cache. Returns the lookup for that prompt.
v1::LookupPrefixRequest CachePrompt(Client& c, const ModelSpec& spec, const std::string& id,
                                    int64_t blocks, std::mt19937_64& rng) {
  v1::OpenSequenceRequest open;
  open.set_sequence_id(id);
  for (int64_t t = 0; t < blocks * spec.page_size + 2; ++t)
    open.add_prompt_token_ids(static_cast<uint32_t>(rng()));
  EXPECT_TRUE(c.OpenSequence(open).ok());
  EXPECT_TRUE(Step(c, spec, id, blocks * spec.page_size, rng).ok());
  EXPECT_TRUE(c.CloseSequence(id).ok());
  v1::LookupPrefixRequest lookup;
  *lookup.mutable_token_ids() = open.prompt_token_ids();
  return lookup;
}

// Two real replicas' KV events, decoded and replayed in C++: the index says what each replica
// says it holds (LookupPrefix), a router following it chooses by prefix without asking, and a
// gap in a replica's events makes the router ask that one again.
TEST(Routing, ChooseByPrefixFollowsTheReplicasKvEvents) {
  auto a = StartReplica("e-a", {"--kv-events=tcp://127.0.0.1:0"});
  auto b = StartReplica("e-b", {"--kv-events=tcp://127.0.0.1:0"});
  auto ca = Client::Connect(a->target());
  auto cb = Client::Connect(b->target());
  auto ia = ca->Info();
  auto ib = cb->Info();
  ASSERT_TRUE(ia.ok() && ib.ok());
  const std::string ea = ia->prefix_cache().kv_events(), eb = ib->prefix_cache().kv_events();
  ASSERT_EQ(ea.rfind("tcp://127.0.0.1:", 0), 0u) << ea;
  auto sub = client::KvEventSubscriber::Start({{"e-a", ea}, {"e-b", eb}});
  ASSERT_TRUE(sub.ok()) << sub.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the subscription lands
  const ModelSpec spec = ModelSpecFromProto(ib->model()).value();
  std::mt19937_64 rng(5);
  const v1::LookupPrefixRequest on_a = CachePrompt(*ca, spec, "pa", 2, rng);
  const v1::LookupPrefixRequest on_b = CachePrompt(*cb, spec, "pb", 3, rng);
  std::vector<uint32_t> tokens(on_b.token_ids().begin(), on_b.token_ids().end());
  const std::vector<BlockHash> hashes = HashBlocks(tokens, spec.page_size);
  std::shared_ptr<client::KvBlockIndex> index = (*sub)->index();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((index->CachedBlocks("e-b", "", hashes) != 3 || index->blocks("e-a", "") != 2) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(index->CachedBlocks("e-b", "", hashes), cb->LookupPrefix(on_b)->cached_blocks());
  EXPECT_EQ(index->CachedBlocks("e-a", "", hashes), 0);
  EXPECT_EQ((*sub)->errors(), 0);
  Router router({{"e-a", a->target()}, {"e-b", b->target()}}, {});
  router.SetPrefixView(index);
  int64_t cached = -1;
  auto chosen = router.ChooseByPrefix("next", on_b, &cached);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(*chosen, "e-b");
  EXPECT_EQ(cached, 3);
  EXPECT_EQ(router.prefix_lookups(), 0) << "the events answered for both replicas";
  chosen = router.ChooseByPrefix("other", on_a, &cached);
  EXPECT_EQ(*chosen, "e-a");
  EXPECT_EQ(cached, 2);
  // A gap in e-a's events: the router asks e-a (and e-a only).
  const std::optional<uint64_t> last = index->LastSeq("e-a", "");
  ASSERT_TRUE(last.has_value());
  index->Apply("e-a", "", *last + 5, client::KvEventBatch{});
  EXPECT_TRUE(index->stale("e-a"));
  EXPECT_EQ(index->gaps(), 1);
  EXPECT_EQ(*router.ChooseByPrefix("third", on_a), "e-a");
  EXPECT_EQ(router.prefix_lookups(), 1);
  // Numbers counting back (a restart under a clock set back) empty a replica's view.
  index->Apply("e-b", "", 0, client::KvEventBatch{});
  EXPECT_EQ(index->restarts(), 1);
  EXPECT_EQ(index->CachedBlocks("e-b", "", hashes), 0);
  EXPECT_EQ(client::DecodeKvEventBatch("\xc1").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(client::ParseKvTopic("metrics").ok());
}

}  // namespace
}  // namespace attnd::testing
