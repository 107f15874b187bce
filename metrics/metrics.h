// Prometheus metrics on prometheus-cpp's core (Debian 12: prometheus-cpp-dev): its registry,
// metric types and text serializer, plus attnd's collect hooks and checks. Knows nothing of the
// engine: service/service_metrics fills it.
//
//   metrics::Registry registry;
//   metrics::Counter& committed =
//       registry.AddCounter("attnd_steps_total", "Steps.").Add({{"outcome", "committed"}});
//   committed.Increment();                      // hot path: one atomic add
//   std::string text = registry.Serialize();    // what GET /metrics returns
//
// Names are part of the program, not of its input: an invalid metric or label name, a help text
// with a newline or backslash (prometheus-cpp 1.0 prints help unescaped), the label "le" on a
// histogram, or one name with two types throws std::invalid_argument where it is defined.
#pragma once

#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace attnd::metrics {

using prometheus::Counter;
using prometheus::Gauge;
using prometheus::Histogram;
using prometheus::Labels;
template <typename T>
using Family = prometheus::Family<T>;

// Latency bucket bounds in seconds: 50us, 100us, 250us, ..., 5s, 10s (1-2.5-5 steps, 17 bounds).
std::vector<double> DefaultLatencyBuckets();

// A histogram family whose series share the bounds it was made with.
class HistogramFamily {
 public:
  HistogramFamily(Family<Histogram>* family, std::vector<double> bounds)
      : family_(family), bounds_(std::move(bounds)) {}
  Histogram& Add(const Labels& labels);

 private:
  friend class Registry;
  Family<Histogram>* const family_;
  const std::vector<double> bounds_;
};

// The metric families of a process and their exposition. Thread safe. Adding a name again returns
// the family made first (a histogram's with other bounds throws).
class Registry {
 public:
  Family<Counter>& AddCounter(const std::string& name, const std::string& help);
  Family<Gauge>& AddGauge(const std::string& name, const std::string& help);
  HistogramFamily& AddHistogram(const std::string& name, const std::string& help,
                                std::vector<double> bucket_bounds);

  // `hook` runs at the start of every Serialize (e.g. to copy the engine's page counts into
  // gauges), in registration order, never two at once; it may add families, not hooks.
  void AddCollectHook(std::function<void()> hook);

  // Runs the hooks, then every family with a series in the text exposition format 0.0.4:
  // families in name order, series in label order.
  std::string Serialize();

 private:
  prometheus::Registry registry_;  // InsertBehavior::Merge
  std::mutex serialize_mu_;        // guards hooks_; held for a whole Serialize
  std::vector<std::function<void()>> hooks_;
  std::mutex mu_;  // guards histograms_
  std::deque<HistogramFamily> histograms_;
};

}  // namespace attnd::metrics
