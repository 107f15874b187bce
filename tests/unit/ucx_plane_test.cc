// The UCX data plane's two ends in one process (two workers): bytes land where and as the
// transfer ids say, outputs reach the client, and every refusal the plane promises
// (docs/data-plane.md, docs/trust.md). ctest runs it under UCX's default transports and again
// with UCX_TLS=tcp and UCX_TLS=sm.
#include "transport/ucx_plane.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/unit/ucx_plane_pair.h"
#include "transport/plane_wire.h"
#include "transport/ucx_log.h"
#include "transport/ucx_plane_client.h"

namespace attnd::transport {
namespace {

TEST(UcxPlane, SmallAndLargeTransfersLandWhereTheirIdsSay) {
  Pair p = Connect(4 << 20);
  // Eager (small) and rendezvous (large) payloads, at offsets of their own.
  const std::string small = RandomBytes(300, 1), large = RandomBytes(3 << 20, 2);
  const uint64_t t1 = p.client->NextTransfer(), t2 = p.client->NextTransfer();
  auto s1 = p.client->Put(small.data(), small.size(), 64, t1);
  auto s2 = p.client->Put(large.data(), large.size(), 4096, t2);
  ASSERT_TRUE(s1->Wait(absl::Now() + absl::Seconds(5)).ok());
  ASSERT_TRUE(s2->Wait(absl::Now() + absl::Seconds(5)).ok());
  absl::Status st;
  EXPECT_EQ(ReadBack(p, 64, small.size(), t1, &st), small);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(ReadBack(p, 4096, large.size(), t2, &st), large);
  EXPECT_TRUE(st.ok()) << st;
  // A part of a transfer reads too; bytes it did not bring do not.
  EXPECT_EQ(ReadBack(p, 4096 + 10, 100, t2, &st), large.substr(10, 100));
  ReadBack(p, 64, small.size() + 1, t1, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("brought bytes [64, 364)"), std::string::npos) << st;
}

TEST(UcxPlane, OutputsReachTheClientsRegion) {
  Pair p = Connect();
  for (size_t n : {size_t{200}, size_t{700} << 10}) {
    const std::string out = RandomBytes(n, n);
    const int64_t at = p.client->output_space().Take(n);
    ASSERT_GE(at, 0);
    const uint64_t t = p.client->NextTransfer();
    auto r = p.server->Resolve("tenant-a", "out_shm", p.conn.output_region, at, n);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE((*r)->CheckStillCovers(at, n).ok());
    char* staged = (*r)->Staging(at, n);  // the server builds outputs in its own mirror
    std::memcpy(staged, out.data(), n);
    ASSERT_TRUE((*r)->Write(at, staged, n, t).ok());
    auto got = p.client->Await(t, at, n, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(std::string(*got, n), out);
    p.client->output_space().Give(at);
  }
}

TEST(UcxPlane, ATransferThatNeverCameTimesOutAndALaterOneSupersedesAnOverlap) {
  Pair p = Connect(1 << 20, 1 << 20, absl::Milliseconds(200));
  absl::Status st;
  ReadBack(p, 0, 16, 999, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  ReadBack(p, 0, 16, 0, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  const std::string a = RandomBytes(1000, 3), b = RandomBytes(1000, 4);
  ASSERT_TRUE(p.client->Put(a.data(), a.size(), 0, 10)->Wait(absl::Now() + absl::Seconds(5)).ok());
  ASSERT_TRUE(
      p.client->Put(b.data(), b.size(), 500, 11)->Wait(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(ReadBack(p, 500, 1000, 11, &st), b);
  ReadBack(p, 0, 100, 10, &st);  // transfer 11 overwrote part of 10's bytes
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("overwritten by transfer 11"), std::string::npos) << st;
}

TEST(UcxPlane, AWaitForALandingEndsAsItLandsOrAtItsDeadlineOrAtTheClose) {
  // The service waits so for a call's inputs before the call takes an executor thread, then
  // reads with a deadline of now: whatever ended the wait, the read answers at once.
  Pair p = Connect(1 << 20, 1 << 20, absl::Milliseconds(300));
  auto in = p.server->Resolve("tenant-a", "q", p.conn.input_region, 0, 1 << 20);
  ASSERT_TRUE(in.ok()) << in.status();
  auto wait_for = [](const std::atomic<int>& n, int want) {
    const absl::Time until = absl::Now() + absl::Seconds(5);
    while (n.load() < want && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    return n.load();
  };
  // Lands: the wait ends with it, not before.
  const std::string bytes = RandomBytes(3000, 21);
  const uint64_t t = p.client->NextTransfer();
  std::atomic<int> landed{0};
  (*in)->WhenLanded(t, [&] { ++landed; });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(landed.load(), 0) << "ended before anything was sent";
  ASSERT_TRUE(
      p.client->Put(bytes.data(), bytes.size(), 0, t)->Wait(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(wait_for(landed, 1), 1);
  EXPECT_EQ(p.server->pending_deadlines(), 0u) << "the landing cancels the wait's deadline";
  std::string got(bytes.size(), '\0');
  ASSERT_TRUE((*in)->Read(0, got.data(), got.size(), t, absl::Now()).ok());
  EXPECT_EQ(got, bytes);
  // Already landed: at once, inline.
  int inline_ran = 0;
  (*in)->WhenLanded(t, [&] { ++inline_ran; });
  EXPECT_EQ(inline_ran, 1);
  // Never sent: the wait ends at the plane's timeout, and a read then fails at once.
  const uint64_t u = p.client->NextTransfer();
  std::atomic<int> expired{0};
  const absl::Time t0 = absl::Now();
  (*in)->WhenLanded(u, [&] { ++expired; });
  (*in)->WhenLanded(u, [&] { ++expired; });  // two calls naming it: both end
  EXPECT_EQ(wait_for(expired, 2), 2);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  const absl::Time r0 = absl::Now();
  absl::Status late = (*in)->Read(0, got.data(), 16, u, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_NE(late.message().find("did not arrive within 300ms"), std::string::npos) << late;
  EXPECT_LT(absl::Now() - r0, absl::Milliseconds(100)) << "the read waited again";
  // If it comes after all, a later call naming it reads it.
  ASSERT_TRUE(p.client->Put(bytes.data(), 16, 0, u)->Wait(absl::Now() + absl::Seconds(5)).ok());
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (!(*in)->Read(0, got.data(), 16, u, absl::Now()).ok() && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(1));
  EXPECT_TRUE((*in)->Read(0, got.data(), 16, u, absl::Now()).ok());
  // The plane closes: every wait ends at once, and reads say why.
  std::atomic<int> closed{0};
  const uint64_t v = p.client->NextTransfer();
  (*in)->WhenLanded(v, [&] { ++closed; });
  ASSERT_TRUE(p.server->Close("tenant-a", p.conn.name).ok());
  EXPECT_EQ(closed.load(), 1) << "ended by the close, not its deadline (300 ms on)";
  EXPECT_EQ((*in)->Read(0, got.data(), 16, v, absl::Now()).code(),
            absl::StatusCode::kFailedPrecondition);
  int after_close = 0;
  (*in)->WhenLanded(p.client->NextTransfer(), [&] { ++after_close; });
  EXPECT_EQ(after_close, 1) << "a closed plane's wait ends inline";
}

TEST(UcxPlane, APlaneHoldsAtMostItsQuotaOfWaitingCallsAndEachTransferOnce) {
  // A client naming transfers it never sends: beyond the plane's quota of waiting calls, a call
  // is not made to wait (it runs at once, and its read fails at once, saying why).
  UcxPlane::Options o;
  o.transfer_timeout = absl::Seconds(30);
  o.max_waiting_calls = 3;
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok());
  auto conn = (*server)->Connect("t", 4096, 0, 0);
  ASSERT_TRUE(conn.ok());
  auto in = (*server)->Resolve("t", "q", conn->input_region, 0, 4096);
  ASSERT_TRUE(in.ok());
  std::atomic<int> ran{0};
  for (uint64_t t = 1; t <= 5; ++t) (*in)->WhenLanded(t, [&] { ++ran; });
  EXPECT_EQ(ran.load(), 2) << "the fourth and fifth run at once";
  EXPECT_EQ((*server)->pending_deadlines(), 3u);
  char buf[16];
  const absl::Status st = (*in)->Read(0, buf, 16, 5, absl::Now());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("3 calls already wait"), std::string::npos) << st;
  ASSERT_TRUE((*server)->Close("t", conn->name).ok());
  EXPECT_EQ(ran.load(), 5) << "the close ends the three waiting";
}

TEST(UcxPlane, AnOverrunningTransferIsRefusedToItsCallAndWritesNothing) {
  Pair p = Connect(4096);
  const std::string first = RandomBytes(4096, 5), big = RandomBytes(5000, 6);
  ASSERT_TRUE(
      p.client->Put(first.data(), first.size(), 0, 1)->Wait(absl::Now() + absl::Seconds(5)).ok());
  (void)p.client->Put(big.data(), big.size(), 0, 2)->Wait(absl::Now() + absl::Seconds(5));
  (void)p.client->Put(first.data(), 100, 4000, 3)->Wait(absl::Now() + absl::Seconds(5));
  absl::Status st;
  ReadBack(p, 0, 16, 2, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("overrun"), std::string::npos) << st;
  ReadBack(p, 4000, 96, 3, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(ReadBack(p, 0, 4096, 1, &st), first) << "the refused transfers wrote nothing";
  EXPECT_TRUE(st.ok()) << st;
}

TEST(UcxPlane, AForgedSecretOrPlaneIsDroppedUnread) {
  Pair p = Connect(1 << 20, 0, absl::Milliseconds(200));
  // A second client that knows the plane's id but not its secret.
  auto intruder = UcxPlaneClient::Create(0);
  ASSERT_TRUE(intruder.ok());
  ASSERT_TRUE((*intruder)
                  ->Attach(p.conn.id, std::string(kTokenBytes, 'x'), p.conn.server_address, 1 << 20)
                  .ok());
  const std::string evil = RandomBytes(256, 7);
  (void)(*intruder)->Put(evil.data(), evil.size(), 0, 77)->Wait(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(
      (*intruder)->Attach(p.conn.id + 100, p.conn.token, p.conn.server_address, 1 << 20).ok());
  (void)(*intruder)->Put(evil.data(), evil.size(), 0, 78)->Wait(absl::Now() + absl::Seconds(5));
  for (int i = 0; i < 200 && p.server->refused_messages() < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(p.server->refused_messages(), 2);
  absl::Status st;
  ReadBack(p, 0, 256, 77, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
}

// attnd's workers enable active messages only (docs/trust.md, "UCX trusts its peers"): a client
// that uses UCX's own API to put bytes at an address in the server's memory, with an rkey it
// packed itself (nothing of the server's), writes nothing there, and the plane serves on. UCX
// routes such a put as a message the server's worker has no handler for.
TEST(UcxPlane, AnRmaPutThroughUcxsApiWritesNothingInTheServer) {
  Pair p = Connect();
  auto out = p.server->Resolve("tenant-a", "out", p.conn.output_region, 0, 4096);
  ASSERT_TRUE(out.ok()) << out.status();
  char* victim = (*out)->Staging(0, 4096);  // server memory: the output mirror
  ASSERT_NE(victim, nullptr);
  const std::string before = RandomBytes(4096, 11);
  std::memcpy(victim, before.data(), before.size());
  // UCX warns of the put (with a backtrace): routed as attnd routes it, into its log.
  std::mutex routed_mu;
  std::vector<std::string> routed;
  ASSERT_TRUE(RouteUcxLogs([&](UcxLogLevel, const std::string& line) {
    std::lock_guard<std::mutex> lock(routed_mu);
    routed.push_back(line);
  }));

  ucp_config_t* config = nullptr;
  ASSERT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
  // As attnd's workers do (shared memory stays among the transports of an endpoint that
  // detects a dead peer), unless the environment says so already.
  if (UcxTransports() != "tcp" && getenv("UCX_POSIX_ERROR_HANDLING") == nullptr) {
    ASSERT_EQ(ucp_config_modify(config, "MM_ERROR_HANDLING", "y"), UCS_OK);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  ASSERT_EQ(ucp_init(&params, config, &context), UCS_OK);
  ucp_config_release(config);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  ASSERT_EQ(ucp_worker_create(context, &wp, &worker), UCS_OK);
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(p.conn.server_address.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ucp_ep_h ep = nullptr;
  ASSERT_EQ(ucp_ep_create(worker, &ep_params, &ep), UCS_OK);
  std::string own = RandomBytes(4096, 12);
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = own.data();
  mp.length = own.size();
  ucp_mem_h memh = nullptr;
  ASSERT_EQ(ucp_mem_map(context, &mp, &memh), UCS_OK);
  void* packed = nullptr;
  size_t packed_size = 0;
  ASSERT_EQ(ucp_rkey_pack(context, memh, &packed, &packed_size), UCS_OK);
  ucp_rkey_h rkey = nullptr;
  ASSERT_EQ(ucp_ep_rkey_unpack(ep, packed, &rkey), UCS_OK);
  const std::string evil = RandomBytes(4096, 13);
  ucp_request_param_t rp{};
  ucs_status_ptr_t put =
      ucp_put_nbx(ep, evil.data(), evil.size(), reinterpret_cast<uint64_t>(victim), rkey, &rp);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (std::chrono::steady_clock::now() < until) ucp_worker_progress(worker);
  EXPECT_EQ(std::string(victim, before.size()), before) << "a put wrote the server's memory";
  // Closing by force ends the put (the server never acknowledges it).
  ucp_request_param_t close{};
  close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  close.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t closing = ucp_ep_close_nbx(ep, &close);
  while (closing != nullptr && !UCS_PTR_IS_ERR(closing) &&
         ucp_request_check_status(closing) == UCS_INPROGRESS)
    ucp_worker_progress(worker);
  if (closing != nullptr && !UCS_PTR_IS_ERR(closing)) ucp_request_free(closing);
  if (put != nullptr && !UCS_PTR_IS_ERR(put)) {
    while (ucp_request_check_status(put) == UCS_INPROGRESS) ucp_worker_progress(worker);
    ucp_request_free(put);
  }
  ucp_rkey_destroy(rkey);
  ucp_rkey_buffer_release(packed);
  ASSERT_EQ(ucp_mem_unmap(context, memh), UCS_OK);
  ucp_worker_destroy(worker);
  ucp_cleanup(context);
  {
    std::lock_guard<std::mutex> lock(routed_mu);
    EXPECT_TRUE(std::any_of(routed.begin(), routed.end(),
                            [](const std::string& l) {
                              return l.find("but no handler installed") != std::string::npos;
                            }))
        << routed.size() << " lines routed";
  }
  RouteUcxLogs(nullptr);
  // The plane serves on.
  const std::string bytes = RandomBytes(1000, 14);
  ASSERT_TRUE(p.client->Put(bytes.data(), bytes.size(), 64, 5)->Wait(Patience(p)).ok());
  absl::Status st;
  EXPECT_EQ(ReadBack(p, 64, bytes.size(), 5, &st), bytes);
  EXPECT_TRUE(st.ok()) << st;
}

TEST(UcxPlane, RegionsResolveOnlyForTheirTenantAndInsideTheirBounds) {
  Pair p = Connect(4096, 8192);
  EXPECT_EQ(p.server->Resolve("tenant-b", "q", p.conn.input_region, 0, 16).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(p.server->Resolve("tenant-a", "q", p.conn.input_region, 4000, 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.server->Resolve("tenant-a", "q", p.conn.output_region, 4000, 100).status().code(),
            absl::StatusCode::kOk);
  for (const char* bad : {"ucx-", "ucx-1", "ucx-01.in", "ucx-99.in", "ucx-1.in.in", "ucx-x.out"})
    EXPECT_EQ(p.server->Resolve("tenant-a", "q", bad, 0, 1).status().code(),
              absl::StatusCode::kNotFound)
        << bad;
  // The input region takes no writes, the output region no reads.
  auto in = p.server->Resolve("tenant-a", "q", p.conn.input_region, 0, 16);
  auto out = p.server->Resolve("tenant-a", "o", p.conn.output_region, 0, 16);
  char buf[16] = {};
  EXPECT_EQ((*in)->Write(0, buf, 16, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*out)->Read(0, buf, 16, 1, Patience(p)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.server->Close("tenant-b", p.conn.name).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(p.server->Close("tenant-a", p.conn.name).ok());
  EXPECT_EQ((*in)->CheckStillCovers(0, 16).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.server->Resolve("tenant-a", "q", p.conn.input_region, 0, 16).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(UcxPlane, HandshakeLimitsAndBadValuesAreRefused) {
  UcxPlane::Options o;
  o.max_planes = 2;
  o.max_region_bytes = 1 << 20;
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok());
  auto code = [&](const std::string& tenant, int64_t in, int64_t out, int limit) {
    return (*server)->Connect(tenant, in, out, limit).status().code();
  };
  EXPECT_EQ(code("t", 0, 0, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("t", -5, 0, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("t", (1 << 20) + 1, 0, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("t", 4096, -1, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("t", 4096, (1 << 20) + 1, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("t", 4096, 0, 1), absl::StatusCode::kOk);
  EXPECT_EQ(code("t", 4096, 0, 1), absl::StatusCode::kResourceExhausted);  // tenant quota
  EXPECT_EQ(code("u", 4096, 0, 0), absl::StatusCode::kOk);
  EXPECT_EQ(code("v", 4096, 0, 0), absl::StatusCode::kResourceExhausted);  // server limit
  EXPECT_EQ((*server)->num_planes(), 2);
  EXPECT_EQ((*server)->planes_of("t"), 1);
}

TEST(UcxPlane, APlaneLeftIdleIsClosedWhenAnotherConnects) {
  UcxPlane::Options o;
  o.max_planes = 1;
  o.idle_timeout = absl::Milliseconds(100);
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok());
  auto first = (*server)->Connect("t", 4096, 4096, 0);
  ASSERT_TRUE(first.ok());
  auto in = (*server)->Resolve("t", "q", first->input_region, 0, 16);
  ASSERT_TRUE(in.ok());
  EXPECT_EQ((*server)->Connect("u", 4096, 4096, 0).status().code(),
            absl::StatusCode::kResourceExhausted);  // in use a moment ago
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  ASSERT_TRUE((*server)->Connect("u", 4096, 4096, 0).ok());  // the idle one made room
  EXPECT_EQ((*in)->CheckStillCovers(0, 16).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*server)->Resolve("t", "q", first->input_region, 0, 16).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(UcxPlane, PullsOfOutputsNeverStagedOrAlreadyTakenAreRefusedAtOnce) {
  Pair p = Connect();
  const int64_t at = p.client->output_space().Take(1024);
  // Never staged: the server answers "none" rather than letting the client wait.
  const auto t0 = absl::Now();
  auto none = p.client->Await(4242, at, 1024, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  // Staged, then pulled once; a second pull, or one naming other bytes, finds nothing.
  auto r = p.server->Resolve("tenant-a", "out_shm", p.conn.output_region, at, 1024);
  ASSERT_TRUE(r.ok());
  const std::string out = RandomBytes(1024, 9);
  std::memcpy((*r)->Staging(at, 1024), out.data(), 1024);
  ASSERT_TRUE((*r)->Write(at, (*r)->Staging(at, 1024), 1024, 77).ok());
  EXPECT_EQ(p.client->Await(77, at, 512, absl::Now() + absl::Seconds(5)).status().code(),
            absl::StatusCode::kNotFound);  // the wrong size: refused, the output kept
  auto got = p.client->Await(77, at, 1024, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::string(*got, 1024), out);
  EXPECT_EQ(p.client->Await(77, at, 1024, absl::Now() + absl::Seconds(5)).status().code(),
            absl::StatusCode::kNotFound);
  // A buffer other than the staging is refused.
  EXPECT_EQ((*r)->Write(at, out.data(), 1024, 78).code(), absl::StatusCode::kInternal);
}

TEST(UcxPlane, AClientThatDiesLeavesItsPlaneServingNothingAndClosable) {
  Pair p = Connect(1 << 20, 1 << 20, absl::Milliseconds(300));
  auto out = p.server->Resolve("tenant-a", "out_shm", p.conn.output_region, 0, 1 << 20);
  auto in = p.server->Resolve("tenant-a", "q", p.conn.input_region, 0, 1 << 20);
  ASSERT_TRUE(out.ok() && in.ok());
  const std::string big = RandomBytes(1 << 20, 8);
  auto sent = p.client->Put(big.data(), big.size(), 0, 9);
  ASSERT_TRUE(sent->Wait(absl::Now() + absl::Seconds(5)).ok());
  p.client.reset();  // the worker goes mid-plane
  // What landed stays readable; what never comes times out; an output is staged for a pull that
  // never comes, and nothing is sent to the dead peer.
  char* staged = (*out)->Staging(0, big.size());
  std::memcpy(staged, big.data(), big.size());
  EXPECT_TRUE((*out)->Write(0, staged, big.size(), 10).ok());
  std::string got(big.size(), '\0');
  EXPECT_TRUE((*in)->Read(0, got.data(), got.size(), 9, Patience(p)).ok());
  EXPECT_EQ(got, big);
  EXPECT_EQ((*in)->Read(0, got.data(), 16, 11, Patience(p)).code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(p.server->Close("tenant-a", p.conn.name).ok());
  EXPECT_EQ((*out)->CheckStillCovers(0, 16).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.server->num_planes(), 0);
}

TEST(UcxPlane, ARegionHeldPastItsPlaneRefusesReadsAndIsReleasedSafely) {
  // A call still holding a region when the server's plane goes (shutdown): reading it fails
  // cleanly, and dropping it afterwards touches no UCX worker (ASan runs this).
  Pair p = Connect();
  const std::string bytes = RandomBytes(5000, 9);
  const uint64_t t = p.client->NextTransfer();
  ASSERT_TRUE(
      p.client->Put(bytes.data(), bytes.size(), 0, t)->Wait(absl::Now() + absl::Seconds(5)).ok());
  auto in = p.server->Resolve("tenant-a", "q", p.conn.input_region, 0, bytes.size());
  auto out = p.server->Resolve("tenant-a", "out", p.conn.output_region, 0, 4096);
  ASSERT_TRUE(in.ok() && out.ok());
  std::string got(bytes.size(), '\0');
  ASSERT_TRUE((*in)->Read(0, got.data(), got.size(), t, Patience(p)).ok());
  EXPECT_EQ(got, bytes);
  p.server.reset();
  const absl::Status read =
      (*in)->Read(0, got.data(), got.size(), t, absl::Now() + absl::Seconds(2));
  EXPECT_EQ(read.code(), absl::StatusCode::kUnavailable) << read;
  char* staged = (*out)->Staging(0, 4096);
  std::memset(staged, 1, 4096);
  EXPECT_EQ((*out)->Write(0, staged, 4096, t + 1).code(), absl::StatusCode::kUnavailable);
  in->reset();
  out->reset();
}

TEST(UcxPlane, ARendezvousClaimingMoreThanTheRegionIsRefusedBeforeAnyReceive) {
  // A sender's claimed size is its word: a modified client's claim of up to 2^64 - 1 bytes must
  // not wrap past the bounds checks into a receive (the descriptor here is nothing: a receive
  // would crash).
  Pair p = Connect();
  ToServerHeader h;
  h.plane = p.conn.id;
  std::memcpy(h.token, p.conn.token.data(), kTokenBytes);
  h.offset = 0;
  uint64_t t = 100;
  for (size_t claim : {SIZE_MAX, SIZE_MAX - 4095, size_t{1} << 63, size_t{(1 << 20) + 1}}) {
    h.transfer = ++t;
    const std::string header = PackHeader(h);
    p.server->OnToServer(UcxWorker::Message{header.data(), header.size(), nullptr, claim,
                                            /*rndv=*/true, nullptr},
                         p.conn.id);
    absl::Status st;
    ReadBack(p, 0, 16, t, &st);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << claim << " " << st;
  }
}

TEST(UcxPlane, ConcurrentHandshakesCannotPassTheLimitsTogether) {
  // Each handshake allocates and registers its regions between its checks and its insert:
  // eight at once must still leave a tenant at its quota and the server at its limit.
  UcxPlane::Options o;
  o.max_planes = 3;
  o.max_region_bytes = 8 << 20;
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok());
  for (auto [tenants, limit, want] : {std::tuple{1, 2, 2}, std::tuple{4, 0, 1}}) {
    std::atomic<int> connected{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < 8; ++i)
      threads.emplace_back([&, i, tenants = tenants, limit = limit] {
        const std::string tenant = tenants == 1 ? "t" : absl::StrCat("u", i % tenants);
        if ((*server)->Connect(tenant, 4 << 20, 4 << 20, limit).ok()) ++connected;
      });
    for (auto& th : threads) th.join();
    EXPECT_EQ(connected.load(), want) << tenants << " tenant(s)";
  }
  EXPECT_EQ((*server)->num_planes(), 3);
  EXPECT_EQ((*server)->planes_of("t"), 2);
}

TEST(UcxPlane, ReapingIdlePlanesWhileMessagesArriveDoesNotDeadlock) {
  // Every plane is idle at once (idle_timeout 0), so each handshake closes the one before,
  // stopping its worker, while a forger sends to that plane without pause, keeping its worker's
  // thread looking planes up. Neither may wait for the other with the plane table locked.
  UcxPlane::Options o;
  o.idle_timeout = absl::ZeroDuration();
  auto server = UcxPlane::Create(o);
  ASSERT_TRUE(server.ok());
  std::mutex mu;
  std::shared_ptr<UcxPlaneClient> forger;  // the newest plane's
  std::atomic<bool> stop{false};
  std::thread spam([&] {
    const std::string bytes(64, 'f');
    while (!stop.load()) {
      std::shared_ptr<UcxPlaneClient> f;
      {
        std::lock_guard<std::mutex> lock(mu);
        f = forger;
      }
      if (f == nullptr) continue;
      (void)f->Put(bytes.data(), bytes.size(), 0, 1)->Wait(absl::Now() + absl::Milliseconds(50));
    }
  });
  auto connects = std::async(std::launch::async, [&] {
    for (int i = 0; i < 40; ++i) {
      auto c = (*server)->Connect("t", 1 << 20, 1 << 20, 0);  // closes the last one meanwhile
      if (!c.ok()) continue;
      auto f = UcxPlaneClient::Create(0);
      if (!f.ok() ||
          !(*f)->Attach(c->id, std::string(kTokenBytes, 'x'), c->server_address, 1 << 20).ok())
        continue;
      const int64_t before = (*server)->refused_messages();
      {
        std::lock_guard<std::mutex> lock(mu);
        forger = std::move(*f);
      }
      // Its messages arrive (and are refused) before the next handshake closes this plane.
      const absl::Time until = absl::Now() + absl::Seconds(2);
      while ((*server)->refused_messages() == before && absl::Now() < until)
        absl::SleepFor(absl::Milliseconds(1));
    }
  });
  if (connects.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    ADD_FAILURE() << "handshakes stuck: a deadlock between the plane table and a progress thread";
    std::abort();  // the stuck threads cannot be joined
  }
  stop = true;
  spam.join();
  EXPECT_GT((*server)->refused_messages(), 0);
}

TEST(UcxPlane, AWorkerWhoseTransfersAllEndedIsReleasedCleanly) {
  // Rendezvous both ways (a 3 MiB input, a 1 MiB output), then both ends go: no transfer may be
  // counted as still under way (which would leave each worker unreleased until process exit).
  Pair p = Connect(4 << 20, 4 << 20);
  const std::string in = RandomBytes(3 << 20, 11), out = RandomBytes(1 << 20, 12);
  const uint64_t t = p.client->NextTransfer();
  ASSERT_TRUE(p.client->Put(in.data(), in.size(), 0, t)->Wait(absl::Now() + absl::Seconds(5)).ok());
  absl::Status st;
  EXPECT_EQ(ReadBack(p, 0, in.size(), t, &st), in);
  ASSERT_TRUE(st.ok()) << st;
  const int64_t at = p.client->output_space().Take(out.size());
  auto r = p.server->Resolve("tenant-a", "out_shm", p.conn.output_region, at, out.size());
  ASSERT_TRUE(r.ok());
  std::memcpy((*r)->Staging(at, out.size()), out.data(), out.size());
  ASSERT_TRUE((*r)->Write(at, (*r)->Staging(at, out.size()), out.size(), 5).ok());
  auto got = p.client->Await(5, at, out.size(), absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::string(*got, out.size()), out);
  r->reset();
  testing::internal::CaptureStderr();
  p.client.reset();
  p.server.reset();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("never completed"), std::string::npos) << err;
}

TEST(UcxPlane, SpaceMapHandsOutDisjointPieces) {
  SpaceMap m(4096);
  const int64_t a = m.Take(1000), b = m.Take(1000), c = m.Take(3000);
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1024);
  EXPECT_EQ(c, -1);
  m.Give(a);
  EXPECT_EQ(m.Take(1024), 0);
  EXPECT_EQ(m.Take(2048), 2048);
  EXPECT_EQ(m.Take(1), -1);
  m.Give(0);
  EXPECT_EQ(m.Take(0), -1) << "nothing to place";
  EXPECT_EQ(m.Take(-5), -1);
  EXPECT_EQ(m.Take(std::numeric_limits<int64_t>::max()), -1) << "refused before rounding";
  EXPECT_EQ(m.Take(1024), 0) << "the refusals took nothing";
}

}  // namespace
}  // namespace attnd::transport
