// The metrics registry's exposition text, its thread safety and collect hooks, and the HTTP
// endpoint, whose output must pass `promtool check metrics`.
#include "metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
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

namespace attnd::metrics {
namespace {

// ---- exposition text ----

TEST(MetricsTest, CounterTextHasHelpTypeSortedLabelsAndEscapedValues) {
  Registry registry;
  Family<Counter>& steps = registry.AddCounter(
      "attnd_steps_total", "Steps finished, by outcome.\nBack\\slash and \"quotes\".");
  steps.Add({{"outcome", "committed"}}).Increment();
  steps.Add({{"outcome", "committed"}}).Increment(2);
  steps.Add({{"reason", "quote\" backslash\\ newline\n end"}, {"outcome", "aborted"}})
      .Increment(0.5);

  EXPECT_EQ(registry.Serialize(),
            "# HELP attnd_steps_total Steps finished, by outcome.\\nBack\\\\slash and "
            "\"quotes\".\n"
            "# TYPE attnd_steps_total counter\n"
            "attnd_steps_total{outcome=\"aborted\",reason=\"quote\\\" backslash\\\\ newline\\n "
            "end\"} 0.5\n"
            "attnd_steps_total{outcome=\"committed\"} 3\n");
}

TEST(MetricsTest, GaugeValuesPrintAsPrometheusNumbers) {
  Registry registry;
  Family<Gauge>& values = registry.AddGauge("attnd_test_values", "Values.");
  values.Add({{"case", "a_million"}}).Set(1e6);
  values.Add({{"case", "b_tenth"}}).Set(0.1);
  values.Add({{"case", "c_negative"}}).Set(-2.5);
  values.Add({{"case", "d_small"}}).Set(1e-5);
  values.Add({{"case", "e_pos_inf"}}).Set(std::numeric_limits<double>::infinity());
  values.Add({{"case", "f_neg_inf"}}).Set(-std::numeric_limits<double>::infinity());
  values.Add({{"case", "g_nan"}}).Set(std::numeric_limits<double>::quiet_NaN());
  values.Add({{"case", "h_large_integer"}}).Set(123456789012.0);
  values.Add({{"case", "i_negative_zero"}}).Set(-0.0);
  Gauge& moved = values.Add({{"case", "j_moved"}});
  moved.Set(10);
  moved.Increment(2.5);
  moved.Decrement();
  registry.AddGauge("attnd_test_unlabelled", "No labels.").Add({}).Set(7);

  EXPECT_EQ(registry.Serialize(),
            "# HELP attnd_test_unlabelled No labels.\n"
            "# TYPE attnd_test_unlabelled gauge\n"
            "attnd_test_unlabelled 7\n"
            "# HELP attnd_test_values Values.\n"
            "# TYPE attnd_test_values gauge\n"
            "attnd_test_values{case=\"a_million\"} 1000000\n"
            "attnd_test_values{case=\"b_tenth\"} 0.1\n"
            "attnd_test_values{case=\"c_negative\"} -2.5\n"
            "attnd_test_values{case=\"d_small\"} 1e-05\n"
            "attnd_test_values{case=\"e_pos_inf\"} +Inf\n"
            "attnd_test_values{case=\"f_neg_inf\"} -Inf\n"
            "attnd_test_values{case=\"g_nan\"} NaN\n"
            "attnd_test_values{case=\"h_large_integer\"} 123456789012\n"
            "attnd_test_values{case=\"i_negative_zero\"} 0\n"
            "attnd_test_values{case=\"j_moved\"} 11.5\n");
}

TEST(MetricsTest, HistogramTextHasCumulativeBucketsInfSumAndCount) {
  Registry registry;
  Family<Histogram>& latency =
      registry.AddHistogram("attnd_layer_seconds", "Layer latency.", {0.25, 1, 4});
  Histogram& full = latency.Add({{"kind", "full"}});
  full.Observe(0.125);
  full.Observe(0.25);  // on a bound: counts as <= 0.25
  full.Observe(2);
  full.Observe(8);  // above every bound: only +Inf
  latency.Add({{"kind", "shared"}});

  EXPECT_EQ(registry.Serialize(),
            "# HELP attnd_layer_seconds Layer latency.\n"
            "# TYPE attnd_layer_seconds histogram\n"
            "attnd_layer_seconds_bucket{kind=\"full\",le=\"0.25\"} 2\n"
            "attnd_layer_seconds_bucket{kind=\"full\",le=\"1\"} 2\n"
            "attnd_layer_seconds_bucket{kind=\"full\",le=\"4\"} 3\n"
            "attnd_layer_seconds_bucket{kind=\"full\",le=\"+Inf\"} 4\n"
            "attnd_layer_seconds_sum{kind=\"full\"} 10.375\n"
            "attnd_layer_seconds_count{kind=\"full\"} 4\n"
            "attnd_layer_seconds_bucket{kind=\"shared\",le=\"0.25\"} 0\n"
            "attnd_layer_seconds_bucket{kind=\"shared\",le=\"1\"} 0\n"
            "attnd_layer_seconds_bucket{kind=\"shared\",le=\"4\"} 0\n"
            "attnd_layer_seconds_bucket{kind=\"shared\",le=\"+Inf\"} 0\n"
            "attnd_layer_seconds_sum{kind=\"shared\"} 0\n"
            "attnd_layer_seconds_count{kind=\"shared\"} 0\n");
}

TEST(MetricsTest, HistogramWithoutLabelsAndNanObservation) {
  Registry registry;
  Histogram& h = registry.AddHistogram("attnd_test_nan", "NaN goes to +Inf.", {1}).Add({});
  h.Observe(0.5);
  h.Observe(std::numeric_limits<double>::quiet_NaN());
  const Histogram::Snapshot snapshot = h.Collect();
  EXPECT_EQ(snapshot.cumulative_counts, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(snapshot.count, 2u);
  EXPECT_EQ(registry.Serialize(),
            "# HELP attnd_test_nan NaN goes to +Inf.\n"
            "# TYPE attnd_test_nan histogram\n"
            "attnd_test_nan_bucket{le=\"1\"} 1\n"
            "attnd_test_nan_bucket{le=\"+Inf\"} 2\n"
            "attnd_test_nan_sum NaN\n"
            "attnd_test_nan_count 2\n");
}

TEST(MetricsTest, FamiliesPrintInNameOrderAndEmptyFamiliesAreOmitted) {
  Registry registry;
  registry.AddGauge("zz_last", "Last.").Add({}).Set(1);
  registry.AddCounter("never_used_total", "Has no metric yet.");
  registry.AddCounter("aa_first_total", "First.").Add({}).Increment();
  EXPECT_EQ(registry.Serialize(),
            "# HELP aa_first_total First.\n"
            "# TYPE aa_first_total counter\n"
            "aa_first_total 1\n"
            "# HELP zz_last Last.\n"
            "# TYPE zz_last gauge\n"
            "zz_last 1\n");
}

TEST(MetricsTest, InvalidUtf8InLabelValuesAndHelpIsReplaced) {
  Registry registry;
  // "\xC3\xA9" is a well-formed e-acute and stays; a lone continuation byte, a truncated sequence
  // and an overlong '/' each become U+FFFD per byte.
  registry.AddGauge("attnd_test_utf8", "Help \xFF.")
      .Add({{"v", "ok\xC3\xA9 bad\x80 cut\xE2\x82 overlong\xC0\xAF"}})
      .Set(1);
  EXPECT_EQ(registry.Serialize(),
            "# HELP attnd_test_utf8 Help \xEF\xBF\xBD.\n"
            "# TYPE attnd_test_utf8 gauge\n"
            "attnd_test_utf8{v=\"ok\xC3\xA9 bad\xEF\xBF\xBD cut\xEF\xBF\xBD\xEF\xBF\xBD "
            "overlong\xEF\xBF\xBD\xEF\xBF\xBD\"} 1\n");
}

// ---- identity and validation ----

TEST(MetricsTest, AddReturnsTheSameMetricAndFamilyForTheSameKey) {
  Registry registry;
  Family<Counter>& family = registry.AddCounter("attnd_test_total", "Test.");
  EXPECT_EQ(&registry.AddCounter("attnd_test_total", "Test."), &family);
  Counter& a = family.Add({{"x", "1"}, {"y", "2"}});
  EXPECT_EQ(&family.Add({{"y", "2"}, {"x", "1"}}), &a);
  EXPECT_NE(&family.Add({{"x", "1"}}), &a);
  Family<Histogram>& histograms = registry.AddHistogram("attnd_test_seconds", "T.", {1, 2});
  EXPECT_EQ(&registry.AddHistogram("attnd_test_seconds", "T.", {1, 2}), &histograms);
}

TEST(MetricsTest, CounterIgnoresNegativeAndNanIncrements) {
  Counter counter;
  counter.Increment(2);
  counter.Increment(-1);
  counter.Increment(std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(counter.Value(), 2);
}

TEST(MetricsTest, NameValidation) {
  EXPECT_TRUE(ValidateMetricName("attnd_steps_total").ok());
  EXPECT_TRUE(ValidateMetricName("job:attnd_steps:rate5m").ok());
  EXPECT_TRUE(ValidateMetricName("_x9").ok());
  EXPECT_FALSE(ValidateMetricName("").ok());
  EXPECT_FALSE(ValidateMetricName("9steps").ok());
  EXPECT_FALSE(ValidateMetricName("attnd-steps").ok());
  EXPECT_FALSE(ValidateMetricName("attnd steps").ok());
  EXPECT_EQ(ValidateMetricName("bad.name").code(), absl::StatusCode::kInvalidArgument);

  EXPECT_TRUE(ValidateLabelName("outcome").ok());
  EXPECT_TRUE(ValidateLabelName("_private1").ok());
  EXPECT_FALSE(ValidateLabelName("").ok());
  EXPECT_FALSE(ValidateLabelName("1st").ok());
  EXPECT_FALSE(ValidateLabelName("a:b").ok());
  EXPECT_FALSE(ValidateLabelName("__name__").ok());
}

TEST(MetricsTest, BucketHelpers) {
  const std::vector<double> latency = DefaultLatencyBuckets();
  ASSERT_FALSE(latency.empty());
  EXPECT_EQ(latency.front(), 50e-6);
  EXPECT_EQ(latency.back(), 10.0);
  for (size_t i = 1; i < latency.size(); ++i) EXPECT_LT(latency[i - 1], latency[i]) << i;
  EXPECT_EQ(ExponentialBuckets(0.5, 2, 4), (std::vector<double>{0.5, 1, 2, 4}));

  // The bounds print as the decimal literals they were written as.
  Registry registry;
  registry.AddHistogram("attnd_test_seconds", "T.", DefaultLatencyBuckets()).Add({});
  const std::string text = registry.Serialize();
  for (absl::string_view le : {"5e-05", "0.0001", "0.00025", "0.0025", "0.25", "2.5", "10"}) {
    EXPECT_NE(text.find(absl::StrCat("le=\"", le, "\"")), std::string::npos) << le << "\n" << text;
  }
}

// Death tests fork; "threadsafe" re-executes the binary so that threads of other tests don't
// matter.
class MetricsDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(MetricsDeathTest, InvalidNamesAbortWithTheReason) {
  Registry registry;
  EXPECT_DEATH(registry.AddCounter("attnd-bad", "x"), "invalid metric name \"attnd-bad\"");
  Family<Gauge>& gauges = registry.AddGauge("attnd_ok", "x");
  EXPECT_DEATH(gauges.Add({{"bad-label", "v"}}), "invalid label name \"bad-label\"");
  EXPECT_DEATH(gauges.Add({{"__reserved", "v"}}), "reserved");
  Family<Histogram>& histograms = registry.AddHistogram("attnd_ok_seconds", "x", {1});
  EXPECT_DEATH(histograms.Add({{"le", "1"}}), "\"le\" is reserved");
}

TEST_F(MetricsDeathTest, ConflictingDefinitionsAbort) {
  Registry registry;
  registry.AddCounter("attnd_thing_total", "Things.");
  EXPECT_DEATH(registry.AddGauge("attnd_thing_total", "Things."), "is a counter");
  EXPECT_DEATH(registry.AddCounter("attnd_thing_total", "Other help."), "help");
  registry.AddHistogram("attnd_wait_seconds", "Wait.", {1, 2});
  EXPECT_DEATH(registry.AddHistogram("attnd_wait_seconds", "Wait.", {1, 3}), "bucket bounds");
  EXPECT_DEATH(registry.AddGauge("attnd_wait_seconds_count", "Clash."), "emits already");
}

TEST_F(MetricsDeathTest, BadBucketBoundsAbort) {
  Registry registry;
  EXPECT_DEATH(registry.AddHistogram("attnd_a_seconds", "x", {1, 1}), "strictly increasing");
  EXPECT_DEATH(registry.AddHistogram("attnd_b_seconds", "x", {2, 1}), "strictly increasing");
  EXPECT_DEATH(
      registry.AddHistogram("attnd_c_seconds", "x", {1, std::numeric_limits<double>::infinity()}),
      "finite");
  EXPECT_DEATH(ExponentialBuckets(1, 1, 3), "factor > 1");
}

// ---- concurrency and hooks ----

TEST(MetricsTest, ConcurrentUpdatesFromManyThreadsSumExactly) {
  Registry registry;
  Family<Counter>& counters = registry.AddCounter("attnd_test_total", "T.");
  Family<Gauge>& gauges = registry.AddGauge("attnd_test_level", "T.");
  Family<Histogram>& histograms = registry.AddHistogram("attnd_test_seconds", "T.", {1});
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
  const Histogram::Snapshot snapshot = histograms.Add({}).Collect();
  EXPECT_EQ(snapshot.count, static_cast<uint64_t>(kTotal));
  EXPECT_EQ(snapshot.cumulative_counts[0], static_cast<uint64_t>(kTotal / 2));
  EXPECT_EQ(snapshot.sum, kTotal / 2 * 0.5 + kTotal / 2 * 2.0);
  const std::string text = registry.Serialize();
  EXPECT_NE(text.find("attnd_test_total{shared=\"yes\"} 160000\n"), std::string::npos) << text;
}

TEST(MetricsTest, CollectHooksRunBeforeEachSerialization) {
  Registry registry;
  Gauge& runs = registry.AddGauge("attnd_test_hook_runs", "Hook runs.").Add({});
  int calls = 0;
  registry.AddCollectHook([&] { runs.Set(++calls); });
  // A hook may add families; they show in the same serialization.
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

// ---- HTTP endpoint ----

struct HttpResponse {
  int status = -1;
  std::string headers;  // lower-cased, "name: value\r\n" lines
  std::string body;
};

// A plain HTTP/1.1 request on a fresh loopback connection; status -1 (and a test failure) if the
// exchange breaks.
HttpResponse HttpRequest(int port, absl::string_view method, absl::string_view path) {
  HttpResponse response;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    ADD_FAILURE() << "socket: " << std::strerror(errno);
    return response;
  }
  timeval timeout = {10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    ADD_FAILURE() << "connect to port " << port << ": " << std::strerror(errno);
    close(fd);
    return response;
  }
  const std::string request = absl::StrCat(method, " ", path,
                                           " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: "
                                           "close\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    ADD_FAILURE() << "send: " << std::strerror(errno);
    close(fd);
    return response;
  }
  std::string raw;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) raw.append(buffer, n);
  if (n < 0) ADD_FAILURE() << "recv: " << std::strerror(errno);
  close(fd);

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

// Metrics of every type, with the awkward cases: escapes, invalid UTF-8, special values.
void PopulateForScrape(Registry& registry) {
  Family<Counter>& steps = registry.AddCounter("attnd_steps_total", "Steps finished, by outcome.");
  steps.Add({{"outcome", "committed"}}).Increment(41);
  steps.Add({{"outcome", "aborted"}, {"reason", "quote\" back\\slash\nnew line \xFF"}}).Increment();
  Family<Gauge>& pages = registry.AddGauge("attnd_cache_pages", "Cache pages, by state.\nSee \\.");
  pages.Add({{"state", "used"}}).Set(1234);
  pages.Add({{"state", "free"}}).Set(std::numeric_limits<double>::infinity());
  pages.Add({{"state", "unknown"}}).Set(std::numeric_limits<double>::quiet_NaN());
  Family<Histogram>& latency = registry.AddHistogram("attnd_layer_latency_seconds",
                                                     "Layer latency.", DefaultLatencyBuckets());
  for (double seconds : {30e-6, 0.0007, 0.02, 0.3, 4.0, 99.0}) {
    latency.Add({{"kind", "full"}}).Observe(seconds);
  }
  latency.Add({{"kind", "shared"}}).Observe(0.001);
}

TEST(MetricsHttpTest, PromtoolRejectsMalformedExposition) {
  // Shows that the promtool check below can fail: a parse error and a lint error.
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
      MetricsHttpServer::Start("127.0.0.1:0", &registry);
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
      MetricsHttpServer::Start("127.0.0.1:0", &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  EXPECT_EQ(HttpRequest(port, "GET", "/").status, 404);
  EXPECT_EQ(HttpRequest(port, "GET", "/metricsx").status, 404);
  EXPECT_EQ(HttpRequest(port, "GET", "/metrics/extra").status, 404);
  EXPECT_EQ(HttpRequest(port, "POST", "/metrics").status, 405);
  const HttpResponse head = HttpRequest(port, "HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_TRUE(head.body.empty()) << head.body;
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
  const std::string taken = absl::StrCat("127.0.0.1:", ntohs(address.sin_port));
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start(taken, &registry);
  close(fd);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(server.status().message().find(taken), std::string::npos) << server.status();
  EXPECT_NE(server.status().message().find("in use"), std::string::npos) << server.status();

  // ...and one held by another metrics server.
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> first =
      MetricsHttpServer::Start("127.0.0.1:0", &registry);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> second =
      MetricsHttpServer::Start(absl::StrCat("127.0.0.1:", (*first)->port()), &registry);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  // The first keeps serving.
  EXPECT_EQ(HttpRequest((*first)->port(), "GET", "/metrics").status, 200);
}

TEST(MetricsHttpTest, StartRejectsMalformedListenAddresses) {
  Registry registry;
  for (const char* listen : {"", "127.0.0.1:", ":9090", "127.0.0.1:99999", "127.0.0.1:9090s",
                             "9090,9091", "[::1]:0", "127.0.0.1:http"}) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
        MetricsHttpServer::Start(listen, &registry);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument)
        << "\"" << listen << "\": " << server.status();
  }
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1:0", nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnd::metrics
