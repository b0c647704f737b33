#include "server/metrics/metrics.h"

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra::metrics {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(FormatValueTest, IntegersHaveNoExponentOrFraction) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(-0.0), "0");
  EXPECT_EQ(FormatValue(3), "3");
  EXPECT_EQ(FormatValue(-42), "-42");
  EXPECT_EQ(FormatValue(1e6), "1000000");
  EXPECT_EQ(FormatValue(80e9), "80000000000");
}

TEST(FormatValueTest, FractionsAndSpecialValues) {
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(2.5e-5), "2.5e-05");
  EXPECT_EQ(FormatValue(1e300), "1e+300");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
}

TEST(EscapeTest, LabelValuesEscapeBackslashQuoteAndNewline) {
  EXPECT_EQ(EscapeLabelValue(R"(a\b"c)" "\n" "d"), R"(a\\b\"c\nd)");
  EXPECT_EQ(EscapeHelp("a\\b\"c\nd"), R"(a\\b"c\nd)");
}

TEST(RegistryTest, RendersUnlabelledCounterAndGauge) {
  Registry registry;
  absl::StatusOr<Counter*> counter = registry.AddCounter("memra_things_total", "Things done.");
  absl::StatusOr<Gauge*> gauge = registry.AddGauge("memra_level", "A level.");
  ASSERT_THAT(counter, IsOk());
  ASSERT_THAT(gauge, IsOk());
  (*counter)->Increment();
  (*counter)->Increment(41);
  (*gauge)->Set(2.5);
  (*gauge)->Add(-1);

  EXPECT_EQ(registry.Render(),
            "# HELP memra_things_total Things done.\n"
            "# TYPE memra_things_total counter\n"
            "memra_things_total 42\n"
            "# HELP memra_level A level.\n"
            "# TYPE memra_level gauge\n"
            "memra_level 1.5\n");
}

TEST(RegistryTest, RendersLabelledChildrenInLabelOrderWithEscapedValues) {
  Registry registry;
  absl::StatusOr<CounterFamily*> family =
      registry.AddCounterFamily("memra_calls_total", "Calls.\nBy method.", {"method", "code"});
  ASSERT_THAT(family, IsOk());
  // An empty labelled family still announces itself.
  EXPECT_EQ(registry.Render(),
            "# HELP memra_calls_total Calls.\\nBy method.\n"
            "# TYPE memra_calls_total counter\n");

  absl::StatusOr<Counter*> step_ok = (*family)->WithLabels({"/KvCache/Step", "OK"});
  ASSERT_THAT(step_ok, IsOk());
  (*step_ok)->Increment(2);
  absl::StatusOr<Counter*> odd = (*family)->WithLabels({"a\"b\\c\nd", "INTERNAL"});
  ASSERT_THAT(odd, IsOk());
  (*odd)->Increment();
  absl::StatusOr<Counter*> attach = (*family)->WithLabels({"/KvCache/Attach", "CANCELLED"});
  ASSERT_THAT(attach, IsOk());

  EXPECT_EQ(registry.Render(),
            "# HELP memra_calls_total Calls.\\nBy method.\n"
            "# TYPE memra_calls_total counter\n"
            "memra_calls_total{method=\"/KvCache/Attach\",code=\"CANCELLED\"} 0\n"
            "memra_calls_total{method=\"/KvCache/Step\",code=\"OK\"} 2\n"
            "memra_calls_total{method=\"a\\\"b\\\\c\\nd\",code=\"INTERNAL\"} 1\n");
}

TEST(RegistryTest, WithLabelsReturnsTheSameChildEachTime) {
  Registry registry;
  absl::StatusOr<GaugeFamily*> family = registry.AddGaugeFamily("memra_g", "G.", {"engine"});
  ASSERT_THAT(family, IsOk());
  absl::StatusOr<Gauge*> first = (*family)->WithLabels({"e1"});
  absl::StatusOr<Gauge*> again = (*family)->WithLabels({std::string("e1")});
  absl::StatusOr<Gauge*> other = (*family)->WithLabels({"e2"});
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT(other, IsOk());
  EXPECT_EQ(*first, *again);
  EXPECT_NE(*first, *other);
}

TEST(RegistryTest, WithLabelsRefusesTheWrongNumberOfValues) {
  Registry registry;
  absl::StatusOr<CounterFamily*> family =
      registry.AddCounterFamily("memra_calls_total", "Calls.", {"method", "code"});
  ASSERT_THAT(family, IsOk());
  EXPECT_THAT((*family)->WithLabels({"/KvCache/Step"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("\"memra_calls_total\"", "2 labels (method, code)",
                                  "but 1 label values")));
  EXPECT_EQ(registry.Render(),
            "# HELP memra_calls_total Calls.\n"
            "# TYPE memra_calls_total counter\n");
}

TEST(HistogramTest, RendersCumulativeBucketsWithInfSumAndCount) {
  Registry registry;
  absl::StatusOr<HistogramFamily*> family = registry.AddHistogramFamily(
      "memra_latency_seconds", "Latency.", {"method"}, {0.001, 0.5, 2});
  ASSERT_THAT(family, IsOk());
  absl::StatusOr<Histogram*> step = (*family)->WithLabels({"Step"});
  ASSERT_THAT(step, IsOk());
  for (double seconds : {0.0005, 0.001, 0.25, 0.5, 1.0, 3.0, 100.0}) (*step)->Observe(seconds);

  EXPECT_EQ(registry.Render(),
            "# HELP memra_latency_seconds Latency.\n"
            "# TYPE memra_latency_seconds histogram\n"
            "memra_latency_seconds_bucket{method=\"Step\",le=\"0.001\"} 2\n"
            "memra_latency_seconds_bucket{method=\"Step\",le=\"0.5\"} 4\n"
            "memra_latency_seconds_bucket{method=\"Step\",le=\"2\"} 5\n"
            "memra_latency_seconds_bucket{method=\"Step\",le=\"+Inf\"} 7\n"
            "memra_latency_seconds_sum{method=\"Step\"} 104.7515\n"
            "memra_latency_seconds_count{method=\"Step\"} 7\n");
}

TEST(HistogramTest, UnlabelledHistogramAndNaNLandsInInf) {
  Registry registry;
  absl::StatusOr<Histogram*> histogram = registry.AddHistogram("memra_h", "H.", {1});
  ASSERT_THAT(histogram, IsOk());
  (*histogram)->Observe(std::nan(""));
  (*histogram)->Observe(1);

  const Histogram::Snapshot snapshot = (*histogram)->TakeSnapshot();
  EXPECT_THAT(snapshot.cumulative_counts, ElementsAre(1, 2));
  EXPECT_EQ(snapshot.count, 2u);
  EXPECT_EQ(registry.Render(),
            "# HELP memra_h H.\n"
            "# TYPE memra_h histogram\n"
            "memra_h_bucket{le=\"1\"} 1\n"
            "memra_h_bucket{le=\"+Inf\"} 2\n"
            "memra_h_sum NaN\n"
            "memra_h_count 2\n");
}

TEST(HistogramTest, RefusesBoundsThatAreNotFiniteAndIncreasing) {
  Registry registry;
  EXPECT_THAT(registry.AddHistogram("memra_h", "H.", {1, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("\"memra_h\"", "bound 1 (1) is not above bound 0 (1)")));
  EXPECT_THAT(registry.AddHistogram("memra_h", "H.", {2, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("bound 1 (1) is not above bound 0 (2)")));
  EXPECT_THAT(registry.AddHistogram("memra_h", "H.", {1, std::numeric_limits<double>::infinity()}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("bucket bound 1 is +Inf", "must be finite")));
  EXPECT_THAT(registry.AddHistogram("memra_h", "H.", {std::nan("")}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bucket bound 0 is NaN")));
  EXPECT_THAT(registry.AddHistogramFamily("memra_h", "H.", {"le"}, {1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("label name \"le\" of histogram \"memra_h\" is reserved")));
  // Nothing refused was registered, so the name is still free.
  EXPECT_THAT(registry.AddHistogram("memra_h", "H.", {}), IsOk());
}

TEST(CallbackGaugeTest, ReadsValuesAtEveryRender) {
  Registry registry;
  double budget_bytes = 1024;
  ASSERT_THAT(registry.AddCallbackGauge("memra_budget_bytes", "Budget.",
                                        [&budget_bytes] { return budget_bytes; }),
              IsOk());
  std::vector<CallbackSample> per_engine = {{{"e2"}, 7}, {{"e1"}, 0.5}, {{"too", "many"}, 9}};
  ASSERT_THAT(registry.AddCallbackGaugeFamily("memra_engine_bytes", "Per engine.", {"engine"},
                                              [&per_engine] { return per_engine; }),
              IsOk());

  EXPECT_EQ(registry.Render(),
            "# HELP memra_budget_bytes Budget.\n"
            "# TYPE memra_budget_bytes gauge\n"
            "memra_budget_bytes 1024\n"
            "# HELP memra_engine_bytes Per engine.\n"
            "# TYPE memra_engine_bytes gauge\n"
            "memra_engine_bytes{engine=\"e1\"} 0.5\n"
            "memra_engine_bytes{engine=\"e2\"} 7\n");

  budget_bytes = 2048;
  per_engine.clear();
  EXPECT_EQ(registry.Render(),
            "# HELP memra_budget_bytes Budget.\n"
            "# TYPE memra_budget_bytes gauge\n"
            "memra_budget_bytes 2048\n"
            "# HELP memra_engine_bytes Per engine.\n"
            "# TYPE memra_engine_bytes gauge\n");
}

TEST(CallbackGaugeTest, CallbackMayUseTheRegistry) {
  // Render holds no registry lock while reading callbacks (invariant 4).
  Registry registry;
  ASSERT_THAT(registry.AddCallbackGauge("memra_nested_registration_ok", "Nested registration.",
                                        [&registry] {
                                          return static_cast<double>(
                                              registry.AddGauge("memra_late", "Late.").ok());
                                        }),
              IsOk());
  EXPECT_THAT(registry.Render(), HasSubstr("memra_nested_registration_ok 1\n"));
  EXPECT_THAT(registry.Render(), HasSubstr("memra_late 0\n"));
}

TEST(RegistryTest, ConcurrentUpdatesSumExactly) {
  Registry registry;
  absl::StatusOr<CounterFamily*> counters =
      registry.AddCounterFamily("memra_c_total", "C.", {"thread_group"});
  absl::StatusOr<Histogram*> histogram = registry.AddHistogram("memra_h", "H.", {0.5, 1});
  absl::StatusOr<Gauge*> gauge = registry.AddGauge("memra_g", "G.");
  ASSERT_THAT(counters, IsOk());
  ASSERT_THAT(histogram, IsOk());
  ASSERT_THAT(gauge, IsOk());

  constexpr int kThreads = 8;
  constexpr int kIterations = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIterations; ++i) {
        // Children are looked up (and the first time created) concurrently too.
        absl::StatusOr<Counter*> counter = (*counters)->WithLabels({t % 2 == 0 ? "even" : "odd"});
        if (counter.ok()) (*counter)->Increment(3);
        (*histogram)->Observe(i % 3);
        (*gauge)->Add(0.5);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  absl::StatusOr<Counter*> even = (*counters)->WithLabels({"even"});
  absl::StatusOr<Counter*> odd = (*counters)->WithLabels({"odd"});
  ASSERT_THAT(even, IsOk());
  ASSERT_THAT(odd, IsOk());
  EXPECT_EQ((*even)->Value(), uint64_t{3} * kIterations * kThreads / 2);
  EXPECT_EQ((*odd)->Value(), uint64_t{3} * kIterations * kThreads / 2);
  const Histogram::Snapshot snapshot = (*histogram)->TakeSnapshot();
  EXPECT_EQ(snapshot.count, uint64_t{kIterations} * kThreads);
  // i % 3 over 20000 iterations: 6667 zeros, 6667 ones, 6666 twos.
  EXPECT_THAT(snapshot.cumulative_counts, ElementsAre(6667 * kThreads, 2 * 6667 * kThreads,
                                                      uint64_t{kIterations} * kThreads));
  EXPECT_EQ(snapshot.sum, (6667.0 + 2 * 6666.0) * kThreads);
  EXPECT_EQ((*gauge)->Value(), 0.5 * kIterations * kThreads);
}

TEST(RegistryTest, RefusesInvalidNamesNamingThem) {
  Registry registry;
  EXPECT_THAT(registry.AddCounter("memra-bad", "Bad."),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("metric name \"memra-bad\" is invalid",
                                  "[a-zA-Z_:][a-zA-Z0-9_:]*")));
  EXPECT_THAT(registry.AddGauge("9lives", "Bad."),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("metric name \"9lives\" is invalid")));
  EXPECT_THAT(registry.AddCallbackGauge("", "Bad.", [] { return 0.0; }),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("metric name \"\" is invalid")));
  EXPECT_THAT(registry.AddCounterFamily("memra_ok_total", "Ok.", {"method", "bad:label"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("label name \"bad:label\" of metric \"memra_ok_total\"",
                                  "[a-zA-Z_][a-zA-Z0-9_]*")));
  EXPECT_THAT(registry.AddGaugeFamily("memra_ok", "Ok.", {"__name__"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("label name \"__name__\"", "reserved")));
  EXPECT_THAT(registry.AddGaugeFamily("memra_ok", "Ok.", {"engine", "engine"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("label name \"engine\" of metric \"memra_ok\" is given twice")));
  EXPECT_EQ(registry.Render(), "");
}

TEST(RegistryTest, RefusesADuplicateName) {
  Registry registry;
  ASSERT_THAT(registry.AddCounter("memra:calls_total", "Calls."), IsOk());
  EXPECT_THAT(registry.AddGaugeFamily("memra:calls_total", "Again.", {"x"}),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("metric \"memra:calls_total\" is already registered")));
  EXPECT_EQ(registry.Render(),
            "# HELP memra:calls_total Calls.\n"
            "# TYPE memra:calls_total counter\n"
            "memra:calls_total 0\n");
}

}  // namespace
}  // namespace memra::metrics
