// The metrics registry (prometheus-cpp's, with attnd's collect hooks and checks) and the /metrics
// endpoint (cpp-httplib) over HTTP and HTTPS, IPv4 and IPv6, whose output must pass
// `promtool check metrics`.
#include "metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "metrics/metrics_http.h"
#include "tests/test_pki.h"

namespace attnd::metrics {
namespace {

// ---- helpers ----

struct HttpResponse {
  int status = -1;
  std::string headers;  // lower-cased, "name: value\r\n" lines
  std::string body;
};

// Sends `request` on a fresh loopback connection and returns all it reads until the server closes
// ("" and a test failure if the connection fails).
std::string RawExchange(int port, const std::string& request, bool ipv6 = false) {
  const int fd = testing::ConnectLoopback(port, ipv6);
  if (fd < 0) return "";
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    ADD_FAILURE() << "send to port " << port << ": " << std::strerror(errno);
    close(fd);
    return "";
  }
  std::string raw;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) raw.append(buffer, n);
  close(fd);
  return raw;
}

// A plain HTTP/1.1 request; status -1 (and a test failure) if the exchange breaks.
HttpResponse HttpRequest(int port, absl::string_view method, absl::string_view path,
                         bool ipv6 = false) {
  HttpResponse response;
  const std::string raw = RawExchange(
      port,
      absl::StrCat(
          method, " ", path,
          " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
      ipv6);
  const size_t header_end = raw.find("\r\n\r\n");
  if (header_end == std::string::npos) {
    ADD_FAILURE() << "no end of headers in: " << raw;
    return response;
  }
  const std::string head = raw.substr(0, header_end);
  response.body = raw.substr(header_end + 4);
  const size_t status_end = head.find("\r\n");
  const std::vector<std::string> status_line = absl::StrSplit(head.substr(0, status_end), ' ');
  if (status_line.size() < 2 || !absl::StartsWith(status_line[0], "HTTP/1.") ||
      !absl::SimpleAtoi(status_line[1], &response.status)) {
    ADD_FAILURE() << "bad status line in: " << head;
    response.status = -1;
  }
  if (status_end != std::string::npos) {
    response.headers = absl::AsciiStrToLower(head.substr(status_end + 2)) + "\r\n";
  }
  return response;
}

// The first executable `promtool` on PATH, or "" if there is none.
std::string FindPromtool() {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "", ':')) {
    if (dir.empty()) continue;
    const std::string candidate = absl::StrCat(dir, "/promtool");
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

struct PromtoolResult {
  int exit_status = -1;
  std::string output;
};

// Runs `promtool check metrics` (parse and lint) on `text`.
PromtoolResult PromtoolCheckMetrics(const std::string& text) {
  PromtoolResult result;
  const std::string promtool = FindPromtool();
  if (promtool.empty()) {
    ADD_FAILURE() << "promtool not found on PATH; install it with scripts/install-deps.sh "
                     "(Debian package prometheus)";
    return result;
  }
  const std::string dir = ::testing::TempDir();
  const std::string input = absl::StrCat(dir, "/metrics_test_", getpid(), ".prom");
  const std::string output = input + ".out";
  std::ofstream(input, std::ios::binary) << text;
  const std::string command =
      absl::StrCat("'", promtool, "' check metrics < '", input, "' > '", output, "' 2>&1");
  const int status = std::system(command.c_str());
  result.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::stringstream captured;
  captured << std::ifstream(output).rdbuf();
  result.output = captured.str();
  std::remove(input.c_str());
  std::remove(output.c_str());
  return result;
}

// ---- the registry ----

TEST(MetricsTest, ExpositionHasHelpTypeSortedLabelsEscapesAndSpecialValues) {
  Registry registry;
  Family<Counter>& steps = registry.AddCounter("attnd_steps_total", "Steps finished, by outcome.");
  steps.Add({{"outcome", "committed"}}).Increment();
  steps.Add({{"outcome", "committed"}}).Increment(2);
  steps.Add({{"reason", "quote\" backslash\\ newline\n end"}, {"outcome", "aborted"}})
      .Increment(0.5);
  steps.Add({{"outcome", "negative"}}).Increment(-1);  // a counter never decreases
  Family<Gauge>& values = registry.AddGauge("attnd_test_values", "Values.");
  values.Add({{"case", "tenth"}}).Set(0.1);
  values.Add({{"case", "large"}}).Set(123456789012.0);
  values.Add({{"case", "inf"}}).Set(std::numeric_limits<double>::infinity());
  values.Add({{"case", "nan"}}).Set(std::numeric_limits<double>::quiet_NaN());
  Gauge& moved = values.Add({{"case", "moved"}});
  moved.Set(10);
  moved.Increment(2.5);
  moved.Decrement();
  registry.AddCounter("attnd_never_used_total", "Has no series: not printed.");

  const std::string text = registry.Serialize();
  for (const char* line :
       {"# HELP attnd_steps_total Steps finished, by outcome.\n",
        "# TYPE attnd_steps_total counter\n", "attnd_steps_total{outcome=\"committed\"} 3\n",
        "attnd_steps_total{outcome=\"aborted\",reason=\"quote\\\" backslash\\\\ "
        "newline\\n end\"} 0.5\n",
        "attnd_steps_total{outcome=\"negative\"} 0\n", "# TYPE attnd_test_values gauge\n",
        "attnd_test_values{case=\"tenth\"} 0.1\n",
        "attnd_test_values{case=\"large\"} 123456789012\n",
        "attnd_test_values{case=\"inf\"} +Inf\n", "attnd_test_values{case=\"moved\"} 11.5\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n--- in ---\n" << text;
  EXPECT_NE(text.find("attnd_test_values{case=\"nan\"} "), std::string::npos) << text;
  EXPECT_EQ(text.find("attnd_never_used_total"), std::string::npos) << text;
  // Families in name order, series in label order, whatever order they were made in.
  EXPECT_LT(text.find("# TYPE attnd_steps_total"), text.find("# TYPE attnd_test_values"));
  EXPECT_LT(text.find("{outcome=\"aborted\""), text.find("{outcome=\"committed\""));
  EXPECT_LT(text.find("{case=\"inf\"}"), text.find("{case=\"large\"}"));
  EXPECT_LT(text.find("{case=\"moved\"}"), text.find("{case=\"tenth\"}"));
  const PromtoolResult check = PromtoolCheckMetrics(text);
  EXPECT_EQ(check.exit_status, 0) << check.output << "\n--- text ---\n" << text;
}

TEST(MetricsTest, HistogramHasCumulativeBucketsInfSumAndCountAndItsOwnBounds) {
  Registry registry;
  HistogramFamily& latency =
      registry.AddHistogram("attnd_layer_seconds", "Layer latency.", {0.25, 1, 4});
  Histogram& full = latency.Add({{"kind", "full"}});
  full.Observe(0.125);
  full.Observe(0.25);  // on a bound: counts as <= 0.25
  full.Observe(2);
  full.Observe(8);  // above every bound: only +Inf
  latency.Add({{"kind", "shared"}});
  const std::string text = registry.Serialize();
  for (const char* line : {"# TYPE attnd_layer_seconds histogram\n",
                           "attnd_layer_seconds_bucket{kind=\"full\",le=\"0.25\"} 2\n",
                           "attnd_layer_seconds_bucket{kind=\"full\",le=\"1\"} 2\n",
                           "attnd_layer_seconds_bucket{kind=\"full\",le=\"4\"} 3\n",
                           "attnd_layer_seconds_bucket{kind=\"full\",le=\"+Inf\"} 4\n",
                           "attnd_layer_seconds_sum{kind=\"full\"} 10.375\n",
                           "attnd_layer_seconds_count{kind=\"full\"} 4\n",
                           "attnd_layer_seconds_bucket{kind=\"shared\",le=\"4\"} 0\n",
                           "attnd_layer_seconds_count{kind=\"shared\"} 0\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n--- in ---\n" << text;

  const std::vector<double> bounds = DefaultLatencyBuckets();
  ASSERT_EQ(bounds.size(), 17u);
  EXPECT_EQ(bounds.front(), 50e-6);
  EXPECT_EQ(bounds.back(), 10.0);
  for (size_t i = 1; i < bounds.size(); ++i) EXPECT_LT(bounds[i - 1], bounds[i]) << i;
  registry.AddHistogram("attnd_test_seconds", "T.", bounds).Add({}).Observe(0.003);
  const std::string all = registry.Serialize();
  int buckets = 0;
  for (absl::string_view line : absl::StrSplit(all, '\n'))
    buckets += absl::StartsWith(line, "attnd_test_seconds_bucket{");
  EXPECT_EQ(buckets, 18) << all;  // 17 bounds and +Inf
  EXPECT_NE(all.find("attnd_test_seconds_bucket{le=\"0.005\"} 1\n"), std::string::npos) << all;
}

TEST(MetricsTest, AddingAgainReturnsTheSameFamilyAndMetric) {
  Registry registry;
  Family<Counter>& family = registry.AddCounter("attnd_test_total", "Test.");
  EXPECT_EQ(&registry.AddCounter("attnd_test_total", "Test."), &family);
  Counter& a = family.Add({{"x", "1"}, {"y", "2"}});
  EXPECT_EQ(&family.Add({{"y", "2"}, {"x", "1"}}), &a);
  EXPECT_NE(&family.Add({{"x", "1"}}), &a);
  HistogramFamily& histograms = registry.AddHistogram("attnd_test_seconds", "T.", {1, 2});
  EXPECT_EQ(&registry.AddHistogram("attnd_test_seconds", "T.", {1, 2}), &histograms);
}

TEST(MetricsTest, MisusedNamesAndTextsThrowWhereTheyAreDefined) {
  Registry registry;
  EXPECT_THROW(registry.AddCounter("attnd-bad", "x"), std::invalid_argument);
  Family<Gauge>& gauges = registry.AddGauge("attnd_ok", "x");
  EXPECT_THROW(gauges.Add({{"bad-label", "v"}}), std::invalid_argument);
  EXPECT_THROW(gauges.Add({{"__reserved", "v"}}), std::invalid_argument);
  EXPECT_THROW(registry.AddCounter("attnd_ok", "A gauge already."), std::invalid_argument);
  // prometheus-cpp 1.0 prints help texts unescaped and "le" twice: both refused here.
  EXPECT_THROW(registry.AddGauge("attnd_multi", "Two\nlines."), std::invalid_argument);
  EXPECT_THROW(registry.AddGauge("attnd_slash", "Back\\slash."), std::invalid_argument);
  HistogramFamily& histograms = registry.AddHistogram("attnd_ok_seconds", "x", {1});
  EXPECT_THROW(histograms.Add({{"le", "1"}}), std::invalid_argument);
  EXPECT_THROW(registry.AddHistogram("attnd_ok_seconds", "x", {1, 2}), std::invalid_argument);
  const std::string text = registry.Serialize();
  EXPECT_EQ(PromtoolCheckMetrics(text).exit_status, 0) << text;
}

TEST(MetricsTest, ConcurrentUpdatesFromManyThreadsSumExactly) {
  Registry registry;
  Family<Counter>& counters = registry.AddCounter("attnd_test_total", "T.");
  Family<Gauge>& gauges = registry.AddGauge("attnd_test_level", "T.");
  HistogramFamily& histograms = registry.AddHistogram("attnd_test_seconds", "T.", {1});
  constexpr int kThreads = 8;
  constexpr int kIterations = 20000;
  std::atomic<bool> stop_serializing{false};
  std::thread serializer([&] {
    while (!stop_serializing.load()) registry.Serialize();
  });
  std::vector<std::thread> threads;
  std::vector<Counter*> seen(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Every thread creates (or finds) the same label set concurrently.
      Counter& counter = counters.Add({{"shared", "yes"}});
      seen[t] = &counter;
      Gauge& gauge = gauges.Add({});
      Histogram& histogram = histograms.Add({});
      for (int i = 0; i < kIterations; ++i) {
        counter.Increment();
        gauge.Increment();
        gauge.Decrement(0.5);
        histogram.Observe(i % 2 == 0 ? 0.5 : 2.0);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  stop_serializing = true;
  serializer.join();

  for (int t = 1; t < kThreads; ++t) EXPECT_EQ(seen[t], seen[0]);
  constexpr double kTotal = static_cast<double>(kThreads) * kIterations;
  EXPECT_EQ(counters.Add({{"shared", "yes"}}).Value(), kTotal);
  EXPECT_EQ(gauges.Add({}).Value(), kTotal * 0.5);
  const std::string text = registry.Serialize();
  EXPECT_NE(text.find("attnd_test_total{shared=\"yes\"} 160000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("attnd_test_seconds_bucket{le=\"1\"} 80000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("attnd_test_seconds_count 160000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("attnd_test_seconds_sum 200000\n"), std::string::npos) << text;
}

TEST(MetricsTest, CollectHooksRunBeforeEachSerialization) {
  Registry registry;
  Gauge& runs = registry.AddGauge("attnd_test_hook_runs", "Hook runs.").Add({});
  int calls = 0;
  registry.AddCollectHook([&] { runs.Set(++calls); });
  // A hook may add families (again: the same family); they show in the same serialization.
  registry.AddCollectHook([&] { registry.AddGauge("attnd_test_late", "Late.").Add({}).Set(5); });
  EXPECT_EQ(calls, 0);

  const std::string first = registry.Serialize();
  EXPECT_EQ(calls, 1);
  EXPECT_NE(first.find("attnd_test_hook_runs 1\n"), std::string::npos) << first;
  EXPECT_NE(first.find("attnd_test_late 5\n"), std::string::npos) << first;
  const std::string second = registry.Serialize();
  EXPECT_EQ(calls, 2);
  EXPECT_NE(second.find("attnd_test_hook_runs 2\n"), std::string::npos) << second;
}

// ---- the HTTP endpoint ----

// Metrics of every type, with the awkward cases: escapes, special values.
void PopulateForScrape(Registry& registry) {
  Family<Counter>& steps = registry.AddCounter("attnd_steps_total", "Steps finished, by outcome.");
  steps.Add({{"outcome", "committed"}}).Increment(41);
  steps.Add({{"outcome", "aborted"}, {"reason", "quote\" back\\slash\nnew line"}}).Increment();
  Family<Gauge>& pages = registry.AddGauge("attnd_cache_pages", "Cache pages, by state.");
  pages.Add({{"state", "used"}}).Set(1234);
  pages.Add({{"state", "free"}}).Set(std::numeric_limits<double>::infinity());
  pages.Add({{"state", "unknown"}}).Set(std::numeric_limits<double>::quiet_NaN());
  HistogramFamily& latency = registry.AddHistogram("attnd_layer_latency_seconds", "Layer latency.",
                                                   DefaultLatencyBuckets());
  for (double seconds : {30e-6, 0.0007, 0.02, 0.3, 4.0, 99.0}) {
    latency.Add({{"kind", "full"}}).Observe(seconds);
  }
  latency.Add({{"kind", "shared"}}).Observe(0.001);
}

TEST(MetricsHttpTest, PromtoolRejectsMalformedExposition) {
  // Shows that the promtool checks here can fail: a parse error and a lint error.
  EXPECT_NE(PromtoolCheckMetrics("attnd_no_value\n").exit_status, 0);
  EXPECT_NE(
      PromtoolCheckMetrics("# HELP attnd_steps Steps.\n# TYPE attnd_steps counter\nattnd_steps 1\n")
          .exit_status,
      0);
}

TEST(MetricsHttpTest, ServesMetricsThatPromtoolAccepts) {
  Registry registry;
  PopulateForScrape(registry);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1", 0, &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);

  const HttpResponse response = HttpRequest((*server)->port(), "GET", "/metrics");
  EXPECT_EQ(response.status, 200);
  EXPECT_NE(response.headers.find("content-type: text/plain; version=0.0.4; charset=utf-8\r\n"),
            std::string::npos)
      << response.headers;
  EXPECT_EQ(response.body, registry.Serialize());
  EXPECT_NE(response.body.find("attnd_steps_total{outcome=\"committed\"} 41\n"), std::string::npos)
      << response.body;

  const PromtoolResult check = PromtoolCheckMetrics(response.body);
  EXPECT_EQ(check.exit_status, 0) << check.output << "\n--- body ---\n" << response.body;
}

TEST(MetricsHttpTest, UnknownPathIs404AndOtherMethodsAre405) {
  Registry registry;
  PopulateForScrape(registry);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1", 0, &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  EXPECT_EQ(HttpRequest(port, "GET", "/").status, 404);
  EXPECT_EQ(HttpRequest(port, "GET", "/metricsx").status, 404);
  EXPECT_EQ(HttpRequest(port, "GET", "/metrics/extra").status, 404);
  for (const char* method : {"POST", "PUT", "DELETE", "PATCH", "OPTIONS"}) {
    const HttpResponse refused = HttpRequest(port, method, "/metrics");
    EXPECT_EQ(refused.status, 405) << method;
    EXPECT_NE(refused.headers.find("allow: get, head\r\n"), std::string::npos) << refused.headers;
  }
  const HttpResponse head = HttpRequest(port, "HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_TRUE(head.body.empty()) << head.body;
  // Still serving after all of that.
  EXPECT_EQ(HttpRequest(port, "GET", "/metrics").status, 200);
}

TEST(MetricsHttpTest, StartOnAPortInUseReturnsAnError) {
  Registry registry;
  // A port held by a plain listening socket...
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0)
      << std::strerror(errno);
  ASSERT_EQ(listen(fd, 1), 0) << std::strerror(errno);
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int taken = ntohs(address.sin_port);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1", taken, &registry);
  close(fd);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(server.status().message().find(absl::StrCat("127.0.0.1:", taken)), std::string::npos)
      << server.status();
  EXPECT_NE(server.status().message().find("in use"), std::string::npos) << server.status();

  // ...and one held by another metrics server.
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> first =
      MetricsHttpServer::Start("127.0.0.1", 0, &registry);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> second =
      MetricsHttpServer::Start("127.0.0.1", (*first)->port(), &registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  // The first keeps serving.
  EXPECT_EQ(HttpRequest((*first)->port(), "GET", "/metrics").status, 200);
}

TEST(MetricsHttpTest, StartRejectsBadAddressesPortsAndRegistries) {
  Registry registry;
  for (const char* host :
       {"", "[]", "no-such-host.invalid", "127.0.0.1:9090", "::1::2", "1.2.3.4.5"}) {
    EXPECT_EQ(MetricsHttpServer::Start(host, 0, &registry).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "\"" << host << "\"";
  }
  for (int port : {-1, 65536, 1 << 20}) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
        MetricsHttpServer::Start("127.0.0.1", port, &registry);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << port;
  }
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1", 0, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

bool HaveIpv6Loopback() {
  const int fd = socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in6 address = {};
  address.sin6_family = AF_INET6;
  address.sin6_addr = in6addr_loopback;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return ok;
}

TEST(MetricsHttpTest, ServesOnIpv6LoopbackAndOnBothFamiliesOfTheWildcard) {
  if (!HaveIpv6Loopback()) GTEST_SKIP() << "this host has no IPv6 loopback";
  Registry registry;
  PopulateForScrape(registry);
  for (const char* host : {"::1", "[::1]"}) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
        MetricsHttpServer::Start(host, 0, &registry);
    ASSERT_TRUE(server.ok()) << host << ": " << server.status();
    EXPECT_EQ(HttpRequest((*server)->port(), "GET", "/metrics", /*ipv6=*/true).status, 200);
  }
  // "::" is every interface of both families (IPV6_V6ONLY off, Linux's default).
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> any =
      MetricsHttpServer::Start("::", 0, &registry);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ(HttpRequest((*any)->port(), "GET", "/metrics", /*ipv6=*/true).status, 200);
  EXPECT_EQ(HttpRequest((*any)->port(), "GET", "/metrics", /*ipv6=*/false).status, 200);
}

// ---- HTTPS ----

// The identity a test gives the HTTPS port: a fixed pair (service/tls's RotatingCertificate,
// which the server uses, has its own test in tls_test).
std::function<bool(SSL_CTX&)> FixedPair(const std::string& cert, const std::string& key) {
  return [cert, key](SSL_CTX& ctx) {
    return SSL_CTX_use_certificate_chain_file(&ctx, cert.c_str()) == 1 &&
           SSL_CTX_use_PrivateKey_file(&ctx, key.c_str(), SSL_FILETYPE_PEM) == 1;
  };
}

TEST(MetricsHttpsTest, ServesOverTls12OrNewerOnly) {
  testing::TestPki pki;
  pki.MakeCa("ca");
  pki.MakeLeaf("server", "ca", "metrics-server", "IP:127.0.0.1");
  Registry registry;
  PopulateForScrape(registry);
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server = MetricsHttpServer::Start(
      "127.0.0.1", 0, &registry, FixedPair(pki.Cert("server"), pki.Key("server")));
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();

  const testing::TlsResponse got = testing::TlsGet(port, pki.Cert("ca"), "/metrics");
  ASSERT_TRUE(got.handshake);
  EXPECT_NE(got.subject.find("CN=metrics-server"), std::string::npos) << got.subject;
  EXPECT_EQ(got.status, 200);
  EXPECT_EQ(got.body, registry.Serialize());
  // Plain HTTP on the HTTPS port gets no metrics; TLS 1.1 is refused.
  EXPECT_EQ(RawExchange(port, "GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
                .find("attnd_steps_total"),
            std::string::npos);
  EXPECT_FALSE(testing::TlsGet(port, pki.Cert("ca"), "/metrics", TLS1_1_VERSION).handshake);
  EXPECT_EQ(testing::TlsGet(port, pki.Cert("ca"), "/nothing").status, 404);
}

TEST(MetricsHttpsTest, AFailingTlsSetUpIsAnInvalidArgument) {
  Registry registry;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1", 0, &registry, [](SSL_CTX&) { return false; });
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
}

}  // namespace
}  // namespace attnd::metrics
