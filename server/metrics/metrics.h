#ifndef MEMRA_SERVER_METRICS_H_
#define MEMRA_SERVER_METRICS_H_

// A small Prometheus metrics registry: counters, gauges, histograms and callback gauges, rendered
// in the text exposition format 0.0.4 (what Prometheus scrapes from GET /metrics).
//
// Thread-safety: every class here is safe to use from any number of threads. Updating a metric is
// lock-free (atomics); a mutex is taken only to register a family, to create a labelled child, and
// while rendering.
//
// Invariants:
//  (1) Families and children are never removed: every pointer handed out stays valid for the life
//      of the Registry, so callers look a child up once and keep the pointer for the hot path.
//  (2) A metric or label name that the format would refuse never enters the registry; the refusal
//      is INVALID_ARGUMENT naming it. Label values are free text, escaped when rendered.
//  (3) Render() lists families in registration order and the children of each family in
//      lexicographic order of their label values, so the exposition is deterministic.
//  (4) Callback gauges are read at scrape time, without the registry's lock held, so a callback
//      may take its own locks (even one held elsewhere while metrics are registered).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace memra::metrics {

// A monotonically increasing count (requests, bytes evicted). Integral so that concurrent
// increments sum exactly.
class Counter {
 public:
  void Increment(uint64_t amount = 1) { value_.fetch_add(amount, std::memory_order_relaxed); }
  uint64_t Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down (bytes in use, sessions). For values owned elsewhere prefer a
// callback gauge, which cannot go stale.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double amount) { value_.fetch_add(amount, std::memory_order_relaxed); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted into fixed buckets. Bucket i counts observations <= upper_bounds[i]; an
// implicit last bucket (+Inf) takes the rest, NaN included.
class Histogram {
 public:
  struct Snapshot {
    std::vector<uint64_t> cumulative_counts;  // one per upper bound, then +Inf (== count)
    double sum = 0;
    uint64_t count = 0;
  };

  // REQUIRES: `upper_bounds` strictly increasing and finite (the Registry checks), and it outlives
  // the histogram (the family owns it).
  explicit Histogram(const std::vector<double>* upper_bounds);

  void Observe(double value);
  // Buckets are read one by one, so a snapshot taken during Observe calls may pair a count with a
  // sum that lacks the newest observation; counts are always cumulative and end with `count`.
  Snapshot TakeSnapshot() const;
  const std::vector<double>& upper_bounds() const { return upper_bounds_; }

 private:
  // Constant after construction
  const std::vector<double>& upper_bounds_;
  // Per-bucket (not cumulative) counts: upper_bounds_.size() + 1 entries, the last for +Inf.
  const std::unique_ptr<std::atomic<uint64_t>[]> bucket_counts_;
  std::atomic<double> sum_{0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

// What every family shares: its name, help, type and label names, and how it renders.
class Family {
 public:
  virtual ~Family() = default;
  Family(const Family&) = delete;
  Family& operator=(const Family&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // Appends "# HELP", "# TYPE" and every sample of this family to `out`.
  void Render(std::string& out) const;

 protected:
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names);

  // Appends the samples alone.
  virtual void RenderSamples(std::string& out) const = 0;
  // INVALID_ARGUMENT unless there is one value per label name.
  absl::Status CheckLabelCount(size_t value_count) const;

 private:
  // Constant after construction
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

// A family of Counters, Gauges or Histograms told apart by their label values.
template <typename Metric>
class MetricFamily final : public Family {
 public:
  // The child for these label values (one per label name, in order), created on first use. The
  // pointer is stable (invariant 1): keep it rather than looking it up on every update.
  // INVALID_ARGUMENT when the number of values differs from the number of label names.
  absl::StatusOr<Metric*> WithLabels(absl::Span<const std::string_view> label_values);

 private:
  friend class Registry;
  using MakeChild = std::function<std::unique_ptr<Metric>()>;

  MetricFamily(std::string name, std::string help, MetricType type,
               std::vector<std::string> label_names, MakeChild make_child)
      : Family(std::move(name), std::move(help), type, std::move(label_names)),
        make_child_(std::move(make_child)) {}

  void RenderSamples(std::string& out) const override;

  // Constant after construction
  const MakeChild make_child_;

  mutable absl::Mutex mu_;
  absl::btree_map<std::vector<std::string>, std::unique_ptr<Metric>> children_ ABSL_GUARDED_BY(mu_);
};

using CounterFamily = MetricFamily<Counter>;
using GaugeFamily = MetricFamily<Gauge>;
using HistogramFamily = MetricFamily<Histogram>;

// One value a callback gauge reports, with one label value per label name of its family.
struct CallbackSample {
  std::vector<std::string> label_values;
  double value = 0;
};

// A gauge family whose samples come from a function called at each Render(). Samples whose
// number of label values differs from the family's are left out (the whole scrape would be
// refused by Prometheus otherwise); samples are sorted by label values.
class CallbackGaugeFamily final : public Family {
 public:
  using ReadSamples = std::function<std::vector<CallbackSample>()>;

 private:
  friend class Registry;
  CallbackGaugeFamily(std::string name, std::string help, std::vector<std::string> label_names,
                      ReadSamples read_samples)
      : Family(std::move(name), std::move(help), MetricType::kGauge, std::move(label_names)),
        read_samples_(std::move(read_samples)) {}

  void RenderSamples(std::string& out) const override;

  // Constant after construction
  const ReadSamples read_samples_;
};

// Owns every family. Registration refuses, with the name in the message: an invalid metric or
// label name (INVALID_ARGUMENT), a label named twice, "le" on a histogram or a name starting with
// "__" (INVALID_ARGUMENT), a metric name already registered (ALREADY_EXISTS), and histogram bounds
// that are not finite and strictly increasing (INVALID_ARGUMENT; +Inf is always implicit).
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  absl::StatusOr<CounterFamily*> AddCounterFamily(std::string_view name, std::string_view help,
                                                  std::vector<std::string> label_names);
  absl::StatusOr<GaugeFamily*> AddGaugeFamily(std::string_view name, std::string_view help,
                                              std::vector<std::string> label_names);
  absl::StatusOr<HistogramFamily*> AddHistogramFamily(std::string_view name,
                                                      std::string_view help,
                                                      std::vector<std::string> label_names,
                                                      std::vector<double> upper_bounds);
  absl::Status AddCallbackGaugeFamily(std::string_view name, std::string_view help,
                                      std::vector<std::string> label_names,
                                      CallbackGaugeFamily::ReadSamples read_samples);

  // Unlabelled shorthands: a family with no labels and its single child, rendered even at zero.
  absl::StatusOr<Counter*> AddCounter(std::string_view name, std::string_view help);
  absl::StatusOr<Gauge*> AddGauge(std::string_view name, std::string_view help);
  absl::StatusOr<Histogram*> AddHistogram(std::string_view name, std::string_view help,
                                          std::vector<double> upper_bounds);
  absl::Status AddCallbackGauge(std::string_view name, std::string_view help,
                                std::function<double()> read_value);

  // The whole exposition, text format 0.0.4.
  std::string Render() const;

 private:
  // Checks the names (see the class comment) and reserves `name`.
  absl::Status ReserveName(std::string_view name, const std::vector<std::string>& label_names,
                           MetricType type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  template <typename Metric>
  absl::StatusOr<MetricFamily<Metric>*> AddMetricFamily(
      std::string_view name, std::string_view help, MetricType type,
      std::vector<std::string> label_names,
      typename MetricFamily<Metric>::MakeChild make_child);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Family>> families_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> names_ ABSL_GUARDED_BY(mu_);
};

// Number formatting as Prometheus parses it: integral values without exponent or fraction ("3",
// "1000000"), others in the shortest form that reads back exactly ("0.25", "2.5e-05"), and
// "+Inf", "-Inf", "NaN".
std::string FormatValue(double value);

// A label value or help text escaped for the format: backslash, newline and (label values only)
// double quote.
std::string EscapeLabelValue(std::string_view value);
std::string EscapeHelp(std::string_view help);

}  // namespace memra::metrics

#endif  // MEMRA_SERVER_METRICS_H_
