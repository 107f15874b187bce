#include "metrics/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/enum_names.h"

namespace attnd::metrics {
namespace {

// Misuse of names is a bug in the calling code, not a run-time condition to handle (see the
// header), so it stops the process where the bug is, with the reason.
[[noreturn]] void Die(absl::string_view message) {
  std::fprintf(stderr, "attnd::metrics: %.*s\n", static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

bool IsAsciiLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

// Dies unless `bounds` are usable histogram bucket bounds; `what` names the histogram.
void CheckBucketBounds(const std::vector<double>& bounds, absl::string_view what) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i - 1] < bounds[i]))) {
      Die(absl::StrCat(what, ": bucket bounds must be finite and strictly increasing, got [",
                       absl::StrJoin(bounds, ", "), "]"));
    }
  }
}

// Length of the well-formed UTF-8 sequence starting at s[i], or 0 if the bytes there are not one
// (overlong forms, surrogates and code points above U+10FFFF included).
size_t Utf8SequenceLength(absl::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char second_lo = 0x80;
  unsigned char second_hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead == 0xE0) {
    length = 3;
    second_lo = 0xA0;
  } else if ((lead >= 0xE1 && lead <= 0xEC) || lead == 0xEE || lead == 0xEF) {
    length = 3;
  } else if (lead == 0xED) {
    length = 3;
    second_hi = 0x9F;
  } else if (lead == 0xF0) {
    length = 4;
    second_lo = 0x90;
  } else if (lead >= 0xF1 && lead <= 0xF3) {
    length = 4;
  } else if (lead == 0xF4) {
    length = 4;
    second_hi = 0x8F;
  } else {
    return 0;
  }
  if (i + length > s.size()) return 0;
  if (byte(i + 1) < second_lo || byte(i + 1) > second_hi) return 0;
  for (size_t k = 2; k < length; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return length;
}

// Appends `text` escaped as the exposition format wants: backslash and newline always, double quote
// inside label values only. Prometheus rejects invalid UTF-8, so each byte that is not part of a
// well-formed sequence becomes U+FFFD rather than breaking the whole scrape.
void AppendEscaped(absl::string_view text, bool escape_quote, std::string* out) {
  for (size_t i = 0; i < text.size();) {
    const size_t length = Utf8SequenceLength(text, i);
    if (length == 0) {
      out->append("\xEF\xBF\xBD");
      ++i;
      continue;
    }
    if (length > 1) {
      out->append(text.data() + i, length);
      i += length;
      continue;
    }
    const char c = text[i++];
    if (c == '\\') {
      out->append("\\\\");
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '"' && escape_quote) {
      out->append("\\\"");
    } else {
      out->push_back(c);
    }
  }
}

// Integers print as plain digits (counters read "1000000", not "1e+06"); other finite values as
// the shortest text that reads back to the same double, in %g style (0.0001 but 1e-05, as Go's
// strconv 'g' writes small numbers); infinities and NaN as Prometheus spells them.
void AppendValue(double value, std::string* out) {
  if (std::isnan(value)) {
    out->append("NaN");
  } else if (std::isinf(value)) {
    out->append(value > 0 ? "+Inf" : "-Inf");
  } else if (value == std::trunc(value) && std::fabs(value) < 9.0e18) {
    absl::StrAppend(out, static_cast<int64_t>(value));
  } else {
    char buffer[64];
    const std::to_chars_result result =
        std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::general);
    out->append(buffer, result.ptr);
  }
}

// One sample line: name+suffix{labels[,extra_label="extra_value"]} value
void AppendSample(absl::string_view name, absl::string_view suffix, const Labels& labels,
                  absl::string_view extra_label, absl::string_view extra_value, double value,
                  std::string* out) {
  absl::StrAppend(out, name, suffix);
  if (!labels.empty() || !extra_label.empty()) {
    out->push_back('{');
    bool first = true;
    const auto append_label = [&](absl::string_view label, absl::string_view label_value) {
      if (!first) out->push_back(',');
      first = false;
      absl::StrAppend(out, label, "=\"");
      AppendEscaped(label_value, /*escape_quote=*/true, out);
      out->push_back('"');
    };
    for (const auto& [label, label_value] : labels) append_label(label, label_value);
    if (!extra_label.empty()) append_label(extra_label, extra_value);
    out->push_back('}');
  }
  out->push_back(' ');
  AppendValue(value, out);
  out->push_back('\n');
}

void AppendSamples(absl::string_view name, const Labels& labels, const Counter& counter,
                   std::string* out) {
  AppendSample(name, "", labels, "", "", counter.Value(), out);
}

void AppendSamples(absl::string_view name, const Labels& labels, const Gauge& gauge,
                   std::string* out) {
  AppendSample(name, "", labels, "", "", gauge.Value(), out);
}

void AppendSamples(absl::string_view name, const Labels& labels, const Histogram& histogram,
                   std::string* out) {
  const Histogram::Snapshot snapshot = histogram.Collect();
  const std::vector<double>& bounds = histogram.bucket_bounds();
  std::string le;
  for (size_t i = 0; i < bounds.size(); ++i) {
    le.clear();
    AppendValue(bounds[i], &le);
    AppendSample(name, "_bucket", labels, "le", le,
                 static_cast<double>(snapshot.cumulative_counts[i]), out);
  }
  AppendSample(name, "_bucket", labels, "le", "+Inf", static_cast<double>(snapshot.count), out);
  AppendSample(name, "_sum", labels, "", "", snapshot.sum, out);
  AppendSample(name, "_count", labels, "", "", static_cast<double>(snapshot.count), out);
}

absl::string_view TypeName(MetricType type) {
  static constexpr NamedValue<MetricType> kNames[] = {{MetricType::kCounter, "counter"},
                                                      {MetricType::kGauge, "gauge"},
                                                      {MetricType::kHistogram, "histogram"}};
  return NameIn(kNames, type, "untyped");
}

// The sample names a family emits; two families must never share one.
std::vector<std::string> SeriesNames(absl::string_view name, MetricType type) {
  if (type == MetricType::kHistogram) {
    return {absl::StrCat(name, "_bucket"), absl::StrCat(name, "_sum"),
            absl::StrCat(name, "_count")};
  }
  return {std::string(name)};
}

}  // namespace

absl::Status ValidateMetricName(absl::string_view name) {
  bool ok = !name.empty();
  for (size_t i = 0; ok && i < name.size(); ++i) {
    const char c = name[i];
    ok = IsAsciiLetter(c) || c == '_' || c == ':' || (i > 0 && IsAsciiDigit(c));
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("invalid metric name \"", name, "\": must match [a-zA-Z_:][a-zA-Z0-9_:]*"));
}

absl::Status ValidateLabelName(absl::string_view name) {
  bool ok = !name.empty();
  for (size_t i = 0; ok && i < name.size(); ++i) {
    const char c = name[i];
    ok = IsAsciiLetter(c) || c == '_' || (i > 0 && IsAsciiDigit(c));
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid label name \"", name, "\": must match [a-zA-Z_][a-zA-Z0-9_]*"));
  }
  if (name.size() >= 2 && name[0] == '_' && name[1] == '_') {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid label name \"", name, "\": names starting with __ are reserved"));
  }
  return absl::OkStatus();
}

std::vector<double> DefaultLatencyBuckets() {
  return {50e-6, 100e-6, 250e-6, 500e-6, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,  0.1,    0.25,   0.5,    1.0,   2.5,    5.0,   10.0};
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  if (!(start > 0.0) || !(factor > 1.0) || count < 1 || !std::isfinite(start) ||
      !std::isfinite(factor)) {
    Die(absl::StrCat("ExponentialBuckets(", start, ", ", factor, ", ", count,
                     "): needs start > 0, factor > 1, count >= 1"));
  }
  std::vector<double> bounds(count);
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds[i] = bound;
  return bounds;
}

void Counter::Increment(double amount) {
  if (!(amount >= 0.0)) return;
  value_.fetch_add(amount, std::memory_order_relaxed);
}

void Gauge::Increment(double amount) { value_.fetch_add(amount, std::memory_order_relaxed); }

void Gauge::Decrement(double amount) { value_.fetch_sub(amount, std::memory_order_relaxed); }

Histogram::Histogram(std::vector<double> bucket_bounds)
    : bounds_(std::move(bucket_bounds)),
      counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1)) {
  CheckBucketBounds(bounds_, "Histogram");
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double value) {
  const size_t bucket =
      std::isnan(value)
          ? bounds_.size()
          : static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) -
                                bounds_.begin());
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot snapshot;
  snapshot.cumulative_counts.resize(bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    snapshot.cumulative_counts[i] = running;
  }
  snapshot.count = running;
  snapshot.sum = sum_.load(std::memory_order_relaxed);
  return snapshot;
}

template <typename T>
Family<T>::Family(std::string name, std::string help, std::vector<double> bucket_bounds)
    : FamilyBase(std::move(name), std::move(help),
                 std::is_same_v<T, Counter> ? MetricType::kCounter
                 : std::is_same_v<T, Gauge> ? MetricType::kGauge
                                            : MetricType::kHistogram),
      bucket_bounds_(std::move(bucket_bounds)) {
  static_assert(std::is_same_v<T, Counter> || std::is_same_v<T, Gauge> ||
                std::is_same_v<T, Histogram>);
}

template <typename T>
T& Family<T>::Add(const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = metrics_.find(labels);
  if (it != metrics_.end()) return *it->second;
  for (const auto& [label, value] : labels) {
    if (absl::Status status = ValidateLabelName(label); !status.ok()) {
      Die(absl::StrCat("metric ", name(), ": ", status.message()));
    }
    if (std::is_same_v<T, Histogram> && label == "le") {
      Die(absl::StrCat("histogram ", name(), ": label name \"le\" is reserved for bucket bounds"));
    }
  }
  std::unique_ptr<T> metric;
  if constexpr (std::is_same_v<T, Histogram>) {
    metric = std::make_unique<Histogram>(bucket_bounds_);
  } else {
    metric = std::make_unique<T>();
  }
  T& result = *metric;
  metrics_.emplace(labels, std::move(metric));
  return result;
}

template <typename T>
void Family<T>::AppendText(std::string* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (metrics_.empty()) return;
  absl::StrAppend(out, "# HELP ", name(), " ");
  AppendEscaped(help(), /*escape_quote=*/false, out);
  absl::StrAppend(out, "\n# TYPE ", name(), " ", TypeName(type()), "\n");
  for (const auto& [labels, metric] : metrics_) AppendSamples(name(), labels, *metric, out);
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Family<Counter>& Registry::AddCounter(absl::string_view name, absl::string_view help) {
  return static_cast<Family<Counter>&>(AddFamily(name, help, MetricType::kCounter, {}));
}

Family<Gauge>& Registry::AddGauge(absl::string_view name, absl::string_view help) {
  return static_cast<Family<Gauge>&>(AddFamily(name, help, MetricType::kGauge, {}));
}

Family<Histogram>& Registry::AddHistogram(absl::string_view name, absl::string_view help,
                                          std::vector<double> bucket_bounds) {
  return static_cast<Family<Histogram>&>(
      AddFamily(name, help, MetricType::kHistogram, std::move(bucket_bounds)));
}

internal::FamilyBase& Registry::AddFamily(absl::string_view name, absl::string_view help,
                                          MetricType type, std::vector<double> bucket_bounds) {
  if (absl::Status status = ValidateMetricName(name); !status.ok()) Die(status.message());
  CheckBucketBounds(bucket_bounds, absl::StrCat("histogram ", name));

  std::lock_guard<std::mutex> lock(mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    internal::FamilyBase& family = *it->second;
    if (family.type() != type) {
      Die(absl::StrCat("metric ", name, " added as a ", TypeName(type), " but it is a ",
                       TypeName(family.type())));
    }
    if (family.help() != help) {
      Die(absl::StrCat("metric ", name, " added with help \"", help, "\" but it has \"",
                       family.help(), "\""));
    }
    if (type == MetricType::kHistogram &&
        static_cast<Family<Histogram>&>(family).bucket_bounds_ != bucket_bounds) {
      Die(absl::StrCat("histogram ", name, " added again with other bucket bounds"));
    }
    return family;
  }

  const std::vector<std::string> series = SeriesNames(name, type);
  for (const std::string& series_name : series) {
    auto clash = series_names_.find(series_name);
    if (clash != series_names_.end()) {
      Die(absl::StrCat("metric ", name, " would emit samples named ", series_name,
                       ", which metric ", clash->second, " emits already"));
    }
  }

  std::unique_ptr<internal::FamilyBase> family;
  switch (type) {
    case MetricType::kCounter:
      family.reset(new Family<Counter>(std::string(name), std::string(help), {}));
      break;
    case MetricType::kGauge:
      family.reset(new Family<Gauge>(std::string(name), std::string(help), {}));
      break;
    case MetricType::kHistogram:
      family.reset(
          new Family<Histogram>(std::string(name), std::string(help), std::move(bucket_bounds)));
      break;
  }
  for (const std::string& series_name : series) series_names_.emplace(series_name, name);
  internal::FamilyBase& result = *family;
  families_.emplace(std::string(name), std::move(family));
  return result;
}

void Registry::AddCollectHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_.push_back(std::move(hook));
}

std::string Registry::Serialize() {
  std::lock_guard<std::mutex> serialize_lock(serialize_mu_);
  // A copy, so that hooks run without mu_ held and may add families (or hooks, for next time).
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hooks = hooks_;
  }
  for (const std::function<void()>& hook : hooks) hook();

  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, family] : families_) family->AppendText(&out);
  return out;
}

}  // namespace attnd::metrics
