#include "server/metrics/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace memra::metrics {
namespace {

constexpr std::string_view kMetricNamePattern = "[a-zA-Z_:][a-zA-Z0-9_:]*";
constexpr std::string_view kLabelNamePattern = "[a-zA-Z_][a-zA-Z0-9_]*";

// Debian's Abseil predates absl::string_view being std::string_view, and StrCat takes only the
// former.
absl::string_view AbslView(std::string_view view) { return {view.data(), view.size()}; }

bool IsAsciiLetterOrUnderscore(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

// Matches [a-zA-Z_<extra>][a-zA-Z0-9_<extra>]*, where <extra> is ':' for metric names only.
bool IsValidName(std::string_view name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAsciiLetterOrUnderscore(c) || (allow_colon && c == ':') ||
                    (i > 0 && IsAsciiDigit(c));
    if (!ok) return false;
  }
  return true;
}

std::string_view TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// `a="x",b="y"`: the label pairs of one child, without braces; empty when there are no labels.
std::string FormatLabels(const std::vector<std::string>& names,
                         const std::vector<std::string>& values) {
  std::string labels;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&labels, i == 0 ? "" : ",", names[i], "=\"", EscapeLabelValue(values[i]),
                    "\"");
  }
  return labels;
}

// One line: `<name><suffix>{<labels>} <value>`.
void AppendSample(std::string& out, std::string_view name, std::string_view suffix,
                  std::string_view labels, std::string_view value) {
  out.append(name).append(suffix);
  if (!labels.empty()) out.append("{").append(labels).append("}");
  out.append(" ").append(value).append("\n");
}

void AppendChildSamples(std::string& out, std::string_view name, std::string_view labels,
                        const Counter& counter) {
  AppendSample(out, name, "", labels, absl::StrCat(counter.Value()));
}

void AppendChildSamples(std::string& out, std::string_view name, std::string_view labels,
                        const Gauge& gauge) {
  AppendSample(out, name, "", labels, FormatValue(gauge.Value()));
}

void AppendChildSamples(std::string& out, std::string_view name, std::string_view labels,
                        const Histogram& histogram) {
  const Histogram::Snapshot snapshot = histogram.TakeSnapshot();
  const std::string le_prefix = labels.empty() ? "le=\"" : absl::StrCat(AbslView(labels), ",le=\"");
  const std::vector<double>& bounds = histogram.upper_bounds();
  for (size_t i = 0; i <= bounds.size(); ++i) {
    const double bound =
        i < bounds.size() ? bounds[i] : std::numeric_limits<double>::infinity();
    AppendSample(out, name, "_bucket", absl::StrCat(le_prefix, FormatValue(bound), "\""),
                 absl::StrCat(snapshot.cumulative_counts[i]));
  }
  AppendSample(out, name, "_sum", labels, FormatValue(snapshot.sum));
  AppendSample(out, name, "_count", labels, absl::StrCat(snapshot.count));
}

absl::Status CheckUpperBounds(std::string_view name, const std::vector<double>& upper_bounds) {
  for (size_t i = 0; i < upper_bounds.size(); ++i) {
    const double bound = upper_bounds[i];
    if (!std::isfinite(bound)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram \"", AbslView(name), "\": bucket bound ", i, " is ", FormatValue(bound),
          "; bounds must be finite (the +Inf bucket is always there)"));
    }
    if (i > 0 && !(upper_bounds[i - 1] < bound)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram \"", AbslView(name), "\": bucket bound ", i, " (", FormatValue(bound),
          ") is not above bound ", i - 1, " (", FormatValue(upper_bounds[i - 1]),
          "); bounds must be strictly increasing"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Integral values below 2^53 are exact as int64; printing them so avoids "1e+06" and "-0".
  constexpr double kLargestExactInteger = 9007199254740992.0;
  if (std::trunc(value) == value && std::fabs(value) <= kLargestExactInteger) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  char buffer[32];
  const std::to_chars_result result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

namespace {
// Backslash and newline always; the double quote only where it would end a label value.
std::string Escape(std::string_view text, bool escape_double_quote) {
  std::string escaped;
  escaped.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') {
      escaped += "\\\\";
    } else if (c == '\n') {
      escaped += "\\n";
    } else if (c == '"' && escape_double_quote) {
      escaped += "\\\"";
    } else {
      escaped += c;
    }
  }
  return escaped;
}
}  // namespace

std::string EscapeLabelValue(std::string_view value) {
  return Escape(value, /*escape_double_quote=*/true);
}

std::string EscapeHelp(std::string_view help) { return Escape(help, /*escape_double_quote=*/false); }

// ---- Histogram ----

Histogram::Histogram(const std::vector<double>* upper_bounds)
    : upper_bounds_(*upper_bounds),
      bucket_counts_(std::make_unique<std::atomic<uint64_t>[]>(upper_bounds->size() + 1)) {}

void Histogram::Observe(double value) {
  // The first bound >= value. NaN compares false with every bound, so lower_bound would put it
  // first; it belongs with +Inf (what client_golang does).
  const size_t bucket =
      std::isnan(value)
          ? upper_bounds_.size()
          : std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) -
                upper_bounds_.begin();
  bucket_counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::TakeSnapshot() const {
  Snapshot snapshot;
  snapshot.cumulative_counts.reserve(upper_bounds_.size() + 1);
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
    snapshot.count += bucket_counts_[i].load(std::memory_order_relaxed);
    snapshot.cumulative_counts.push_back(snapshot.count);
  }
  snapshot.sum = sum_.load(std::memory_order_relaxed);
  return snapshot;
}

// ---- Families ----

Family::Family(std::string name, std::string help, MetricType type,
               std::vector<std::string> label_names)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(label_names)) {}

void Family::Render(std::string& out) const {
  absl::StrAppend(&out, "# HELP ", name_, " ", EscapeHelp(help_), "\n");
  absl::StrAppend(&out, "# TYPE ", name_, " ", AbslView(TypeName(type_)), "\n");
  RenderSamples(out);
}

absl::Status Family::CheckLabelCount(size_t value_count) const {
  if (value_count == label_names_.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("metric \"", name_, "\" has ", label_names_.size(), " labels (",
                   absl::StrJoin(label_names_, ", "), ") but ", value_count,
                   " label values were given"));
}

template <typename Metric>
absl::StatusOr<Metric*> MetricFamily<Metric>::WithLabels(
    absl::Span<const std::string_view> label_values) {
  if (absl::Status status = CheckLabelCount(label_values.size()); !status.ok()) return status;
  std::vector<std::string> key(label_values.begin(), label_values.end());
  {
    absl::ReaderMutexLock lock(&mu_);
    if (auto it = children_.find(key); it != children_.end()) return it->second.get();
  }
  absl::MutexLock lock(&mu_);
  // Another thread may have created the child between the two locks.
  std::unique_ptr<Metric>& child = children_[std::move(key)];
  if (child == nullptr) child = make_child_();
  return child.get();
}

template <typename Metric>
void MetricFamily<Metric>::RenderSamples(std::string& out) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [label_values, child] : children_) {
    AppendChildSamples(out, name(), FormatLabels(label_names(), label_values), *child);
  }
}

template class MetricFamily<Counter>;
template class MetricFamily<Gauge>;
template class MetricFamily<Histogram>;

void CallbackGaugeFamily::RenderSamples(std::string& out) const {
  std::vector<CallbackSample> samples = read_samples_();
  std::erase_if(samples, [this](const CallbackSample& sample) {
    return sample.label_values.size() != label_names().size();
  });
  std::sort(samples.begin(), samples.end(), [](const CallbackSample& a, const CallbackSample& b) {
    return a.label_values < b.label_values;
  });
  for (const CallbackSample& sample : samples) {
    AppendSample(out, name(), "", FormatLabels(label_names(), sample.label_values),
                 FormatValue(sample.value));
  }
}

// ---- Registry ----

absl::Status Registry::ReserveName(std::string_view name,
                                   const std::vector<std::string>& label_names, MetricType type) {
  if (!IsValidName(name, /*allow_colon=*/true)) {
    return absl::InvalidArgumentError(absl::StrCat("metric name \"", AbslView(name),
                                                   "\" is invalid: it must match ",
                                                   AbslView(kMetricNamePattern)));
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    const std::string& label = label_names[i];
    if (!IsValidName(label, /*allow_colon=*/false)) {
      return absl::InvalidArgumentError(absl::StrCat("label name \"", label, "\" of metric \"",
                                                     AbslView(name), "\" is invalid: it must match ",
                                                     AbslView(kLabelNamePattern)));
    }
    if (label.starts_with("__")) {
      return absl::InvalidArgumentError(absl::StrCat("label name \"", label, "\" of metric \"",
                                                     AbslView(name),
                                                     "\" is reserved: names starting with "
                                                     "\"__\" are Prometheus's own"));
    }
    if (type == MetricType::kHistogram && label == "le") {
      return absl::InvalidArgumentError(absl::StrCat(
          "label name \"le\" of histogram \"", AbslView(name), "\" is reserved for the bucket bounds"));
    }
    if (std::find(label_names.begin(), label_names.begin() + i, label) !=
        label_names.begin() + i) {
      return absl::InvalidArgumentError(
          absl::StrCat("label name \"", label, "\" of metric \"", AbslView(name), "\" is given twice"));
    }
  }
  if (!names_.insert(std::string(name)).second) {
    return absl::AlreadyExistsError(
        absl::StrCat("metric \"", AbslView(name), "\" is already registered"));
  }
  return absl::OkStatus();
}

template <typename Metric>
absl::StatusOr<MetricFamily<Metric>*> Registry::AddMetricFamily(
    std::string_view name, std::string_view help, MetricType type,
    std::vector<std::string> label_names, typename MetricFamily<Metric>::MakeChild make_child) {
  absl::MutexLock lock(&mu_);
  if (absl::Status status = ReserveName(name, label_names, type); !status.ok()) return status;
  // The constructor is private to the registry, hence no make_unique.
  auto* family = new MetricFamily<Metric>(std::string(name), std::string(help), type,
                                          std::move(label_names), std::move(make_child));
  families_.emplace_back(family);
  return family;
}

absl::StatusOr<CounterFamily*> Registry::AddCounterFamily(std::string_view name,
                                                          std::string_view help,
                                                          std::vector<std::string> label_names) {
  return AddMetricFamily<Counter>(name, help, MetricType::kCounter, std::move(label_names),
                                  [] { return std::make_unique<Counter>(); });
}

absl::StatusOr<GaugeFamily*> Registry::AddGaugeFamily(std::string_view name,
                                                      std::string_view help,
                                                      std::vector<std::string> label_names) {
  return AddMetricFamily<Gauge>(name, help, MetricType::kGauge, std::move(label_names),
                                [] { return std::make_unique<Gauge>(); });
}

absl::StatusOr<HistogramFamily*> Registry::AddHistogramFamily(
    std::string_view name, std::string_view help, std::vector<std::string> label_names,
    std::vector<double> upper_bounds) {
  if (absl::Status status = CheckUpperBounds(name, upper_bounds); !status.ok()) return status;
  // Shared by the children of the family, which live exactly as long as it does.
  auto shared_bounds = std::make_shared<const std::vector<double>>(std::move(upper_bounds));
  return AddMetricFamily<Histogram>(
      name, help, MetricType::kHistogram, std::move(label_names),
      [shared_bounds] { return std::make_unique<Histogram>(shared_bounds.get()); });
}

absl::Status Registry::AddCallbackGaugeFamily(std::string_view name, std::string_view help,
                                              std::vector<std::string> label_names,
                                              CallbackGaugeFamily::ReadSamples read_samples) {
  absl::MutexLock lock(&mu_);
  if (absl::Status status = ReserveName(name, label_names, MetricType::kGauge); !status.ok()) {
    return status;
  }
  families_.emplace_back(new CallbackGaugeFamily(std::string(name), std::string(help),
                                                 std::move(label_names),
                                                 std::move(read_samples)));
  return absl::OkStatus();
}

namespace {
// The single child of an unlabelled family.
template <typename Metric>
absl::StatusOr<Metric*> OnlyChild(absl::StatusOr<MetricFamily<Metric>*> family) {
  if (!family.ok()) return family.status();
  return (*family)->WithLabels({});
}
}  // namespace

absl::StatusOr<Counter*> Registry::AddCounter(std::string_view name, std::string_view help) {
  return OnlyChild(AddCounterFamily(name, help, {}));
}

absl::StatusOr<Gauge*> Registry::AddGauge(std::string_view name, std::string_view help) {
  return OnlyChild(AddGaugeFamily(name, help, {}));
}

absl::StatusOr<Histogram*> Registry::AddHistogram(std::string_view name, std::string_view help,
                                                  std::vector<double> upper_bounds) {
  return OnlyChild(AddHistogramFamily(name, help, {}, std::move(upper_bounds)));
}

absl::Status Registry::AddCallbackGauge(std::string_view name, std::string_view help,
                                        std::function<double()> read_value) {
  return AddCallbackGaugeFamily(
      name, help, {}, [read_value = std::move(read_value)]() -> std::vector<CallbackSample> {
        return {CallbackSample{.label_values = {}, .value = read_value()}};
      });
}

std::string Registry::Render() const {
  // Families are never removed (invariant 1), so their pointers outlive the lock; rendering
  // without it lets callbacks take locks of their own (invariant 4).
  std::vector<const Family*> families;
  {
    absl::MutexLock lock(&mu_);
    families.reserve(families_.size());
    for (const std::unique_ptr<Family>& family : families_) families.push_back(family.get());
  }
  std::string out;
  for (const Family* family : families) family->Render(out);
  return out;
}

}  // namespace memra::metrics
