// Prometheus metrics: a small registry of counter, gauge and histogram families with the text
// exposition format 0.0.4, modelled on prometheus-cpp (which Debian 12 does not package).
//
//   metrics::Registry registry;
//   metrics::Family<metrics::Counter>& steps =
//       registry.AddCounter("attnd_steps_total", "Steps finished, by outcome.");
//   metrics::Counter& committed = steps.Add({{"outcome", "committed"}});
//   committed.Increment();                      // hot path: one atomic add
//   std::string text = registry.Serialize();    // what GET /metrics returns
//
// Names are part of the program, not of its input: an invalid metric or label name, or two
// conflicting definitions of one name, is a programming error and aborts the process with a message
// on stderr (as prometheus-cpp throws). Callers that build names at run time can check them first
// with ValidateMetricName / ValidateLabelName. Label values and help texts may be anything; they
// are escaped (and invalid UTF-8 replaced by U+FFFD) on output.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attnd::metrics {

// A metric's labels, name -> value. Ordered by name, so every series prints its labels in one
// stable order whatever order the caller listed them in.
using Labels = std::map<std::string, std::string>;

// OK iff `name` is a valid Prometheus metric name: [a-zA-Z_:][a-zA-Z0-9_:]*.
absl::Status ValidateMetricName(absl::string_view name);

// OK iff `name` is a valid Prometheus label name, [a-zA-Z_][a-zA-Z0-9_]*, and not one of the names
// Prometheus reserves for itself (those starting with "__").
absl::Status ValidateLabelName(absl::string_view name);

// Histogram bucket upper bounds in seconds for latencies: 50us, 100us, 250us, 500us, 1ms, ...,
// 2.5s, 5s, 10s (1-2.5-5 steps, 17 bounds). Written as decimal literals so that `le` prints
// exactly.
std::vector<double> DefaultLatencyBuckets();

// `count` bounds start, start*factor, start*factor^2, ... Requires start > 0, factor > 1,
// count >= 1 (aborts otherwise). Products may print with many digits (0.1*3 is
// 0.30000000000000004).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

// A monotonically increasing value. Thread safe; Increment is one relaxed atomic add.
class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds `amount`. A counter never decreases, so a negative or NaN amount is ignored (as in
  // prometheus-cpp).
  void Increment(double amount = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down. Thread safe; every update is one atomic operation.
class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Increment(double amount = 1.0);
  void Decrement(double amount = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Counts observations into buckets fixed at construction. Thread safe; Observe is a binary search
// over the bounds plus two relaxed atomic adds, with no lock.
class Histogram {
 public:
  // A consistent-enough copy for exposition: `cumulative_counts[i]` counts observations
  // <= bucket_bounds[i]; the last entry (index bucket_bounds.size()) is the +Inf bucket and equals
  // `count`. `sum` is read separately and may lag the counts by observations in flight.
  struct Snapshot {
    std::vector<uint64_t> cumulative_counts;
    uint64_t count = 0;
    double sum = 0.0;
  };

  // `bucket_bounds` must be finite and strictly increasing (aborts otherwise); the +Inf bucket is
  // implicit. An empty list is valid: only +Inf, _sum and _count.
  explicit Histogram(std::vector<double> bucket_bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Counts `value` in the first bucket whose bound is >= value. NaN lands only in +Inf (and makes
  // the sum NaN, as in the Go client).
  void Observe(double value);
  Snapshot Collect() const;
  const std::vector<double>& bucket_bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;
  // [bounds_.size() + 1], per bucket (not cumulative), so Observe touches one counter.
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

namespace internal {

// What the registry needs of a family, independent of its metric type.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  // Appends the family's HELP, TYPE and sample lines; nothing if it has no metric yet.
  virtual void AppendText(std::string* out) const = 0;

 protected:
  FamilyBase(std::string name, std::string help, MetricType type)
      : name_(std::move(name)), help_(std::move(help)), type_(type) {}

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
};

}  // namespace internal

class Registry;

// All metrics of one name and type, one per label set. T is Counter, Gauge or Histogram. Created
// only by Registry; lives as long as it. Thread safe.
template <typename T>
class Family final : public internal::FamilyBase {
 public:
  Family(const Family&) = delete;
  Family& operator=(const Family&) = delete;

  // The metric with exactly these labels, created (at zero) on first use; the same object for the
  // same label set. The reference stays valid for the registry's lifetime. Takes the family's lock
  // and does a map lookup, so keep the reference instead of calling Add per update. Aborts on an
  // invalid label name, or on "le" for a histogram (Prometheus uses it for the bucket bound).
  T& Add(const Labels& labels);

  void AppendText(std::string* out) const override;

 private:
  friend class Registry;
  Family(std::string name, std::string help, std::vector<double> bucket_bounds);

  const std::vector<double> bucket_bounds_;  // histograms only
  mutable std::mutex mu_;                    // guards metrics_
  std::map<Labels, std::unique_ptr<T>> metrics_;
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

// The metric families of a process and their exposition. Thread safe: families and metrics may be
// added, updated and serialized from any thread at once.
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The family called `name`, created on first use. Adding a name again with the same type and help
  // (and, for histograms, the same bounds) returns the same family; anything else aborts, as does
  // an invalid name or a name whose series would clash with another family's (a counter
  // "x_count" next to a histogram "x"). Counter names should end in "_total" (promtool lints it).
  Family<Counter>& AddCounter(absl::string_view name, absl::string_view help);
  Family<Gauge>& AddGauge(absl::string_view name, absl::string_view help);
  // `bucket_bounds`: as for Histogram's constructor; every histogram of the family shares them.
  Family<Histogram>& AddHistogram(absl::string_view name, absl::string_view help,
                                  std::vector<double> bucket_bounds);

  // Registers `hook` to run at the start of every Serialize, e.g. to copy the engine's page counts
  // into gauges. Hooks run in registration order on the serializing thread, never two at once; a
  // hook may update metrics and add families but must not call Serialize.
  void AddCollectHook(std::function<void()> hook);

  // Runs the collect hooks, then returns every family with at least one metric in the Prometheus
  // text exposition format 0.0.4: families in name order, each with # HELP and # TYPE lines, its
  // series in label order.
  std::string Serialize();

 private:
  internal::FamilyBase& AddFamily(absl::string_view name, absl::string_view help, MetricType type,
                                  std::vector<double> bucket_bounds);

  // Held for a whole Serialize, so hooks never run concurrently with each other.
  std::mutex serialize_mu_;
  std::mutex mu_;  // guards the three below; taken after serialize_mu_, never before
  std::map<std::string, std::unique_ptr<internal::FamilyBase>, std::less<>> families_;
  // Every sample name a family emits (histogram "x" emits x_bucket, x_sum, x_count) -> its family.
  std::map<std::string, std::string, std::less<>> series_names_;
  std::vector<std::function<void()>> hooks_;
};

}  // namespace attnd::metrics
