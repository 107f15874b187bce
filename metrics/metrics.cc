#include "metrics/metrics.h"

#include <algorithm>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace attnd::metrics {
namespace {

// prometheus-cpp 1.0 writes help texts unescaped: a newline or backslash in one would corrupt the
// exposition, so such a text is refused where it is defined.
const std::string& CheckHelp(const std::string& name, const std::string& help) {
  if (help.find_first_of("\\\n") != std::string::npos)
    throw std::invalid_argument(absl::StrCat(name, ": help text with a newline or backslash"));
  return help;
}

}  // namespace

std::vector<double> DefaultLatencyBuckets() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,  0.1,    0.25,   0.5,    1.0,   2.5,    5.0,   10.0};
}

Histogram& HistogramFamily::Add(const Labels& labels) {
  if (labels.count("le") != 0) throw std::invalid_argument("a histogram's label named \"le\"");
  return family_->Add(labels, bounds_);
}

Family<Counter>& Registry::AddCounter(const std::string& name, const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(CheckHelp(name, help)).Register(registry_);
}

Family<Gauge>& Registry::AddGauge(const std::string& name, const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(CheckHelp(name, help)).Register(registry_);
}

HistogramFamily& Registry::AddHistogram(const std::string& name, const std::string& help,
                                        std::vector<double> bucket_bounds) {
  Family<Histogram>& family =
      prometheus::BuildHistogram().Name(name).Help(CheckHelp(name, help)).Register(registry_);
  std::lock_guard<std::mutex> lock(mu_);
  for (HistogramFamily& known : histograms_) {
    if (known.family_ != &family) continue;
    if (known.bounds_ != bucket_bounds)
      throw std::invalid_argument(absl::StrCat(name, ": defined again with other bucket bounds"));
    return known;
  }
  return histograms_.emplace_back(&family, std::move(bucket_bounds));
}

void Registry::AddCollectHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(serialize_mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::Serialize() {
  std::lock_guard<std::mutex> lock(serialize_mu_);
  for (const auto& hook : hooks_) hook();
  // In a stable order, families by name and series by labels, for people and diffs to read.
  std::vector<prometheus::MetricFamily> families = registry_.Collect();
  std::sort(families.begin(), families.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (prometheus::MetricFamily& f : families)
    std::sort(f.metric.begin(), f.metric.end(),
              [](const auto& a, const auto& b) { return a.label < b.label; });
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace attnd::metrics
