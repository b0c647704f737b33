// The fuzz targets in the suite: every file of the corpus replayed (each crash or invariant
// break ever found is kept there as a regression input), then a short seeded mutation run over
// each target. The mutation run is deterministic (fixed seeds), so a failure reproduces from the
// log; a failing or crashing input is written to $TEST_UNDECLARED_OUTPUTS_DIR (bazel-testlogs/
// .../test.outputs), to be added to the corpus. Longer runs: docs/checking.md.

#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/codec.h"
#include "core/test_model_plans.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "tests/fuzz/fuzz_targets.h"
#include "tests/seeded_random.h"

namespace memra::fuzz {
namespace {

namespace fs = std::filesystem;
namespace pb = memra::kv::v1;
using Target = std::function<absl::Status(std::string_view)>;

// Iterations per seed: about a second per target under the default build (most mutated protos
// are refused at parsing, so decoding gets more).
constexpr int kDecodingRuns = 100000;
constexpr int kSessionRuns = 20000;
// Mutants are cut to this size (the seeds are smaller; a session input is two bytes per op).
constexpr size_t kMaxInputBytes = 512;
constexpr uint64_t kSeeds[] = {0x5eed0001, 0x5eed0002};

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

fs::path CorpusDir(std::string_view target) {
  return fs::path(std::getenv("TEST_SRCDIR")) / "memra_kv" / "tests/fuzz/corpus" / target;
}

std::vector<std::string> CorpusOf(std::string_view target) {
  std::vector<std::string> inputs;
  for (const fs::directory_entry& entry : fs::directory_iterator(CorpusDir(target))) {
    if (entry.is_regular_file()) inputs.push_back(ReadFile(entry.path()));
  }
  return inputs;
}

// Where a failing input is kept (bazel-testlogs/tests/fuzz/fuzz_test/test.outputs/).
fs::path PendingInputPath(std::string_view target) {
  const char* outputs = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  return fs::path(outputs != nullptr ? outputs : ::testing::TempDir()) /
         (std::string(target) + "-pending-input");
}

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : bytes) {
    hex.push_back(kDigits[c >> 4]);
    hex.push_back(kDigits[c & 15]);
  }
  return hex;
}

// libFuzzer-style mutations: bit flips, byte sets, interesting values, inserts, erases, chunk
// copies and splices with another input.
std::string Mutate(std::string input, const std::vector<std::string>& pool,
                   testing::SeededRandom& random) {
  static constexpr uint8_t kInteresting[] = {0, 1, 2, 4, 8, 0x7f, 0x80, 0xfe, 0xff};
  const int mutations = 1 + static_cast<int>(random.Below(4));
  for (int m = 0; m < mutations; ++m) {
    const size_t at = input.empty() ? 0 : random.Below(input.size());
    switch (random.Below(7)) {
      case 0:
        if (!input.empty()) input[at] ^= static_cast<char>(1u << random.Below(8));
        break;
      case 1:
        if (!input.empty()) input[at] = static_cast<char>(random.Below(256));
        break;
      case 2:
        if (!input.empty()) input[at] = static_cast<char>(kInteresting[random.Below(9)]);
        break;
      case 3:
        input.insert(input.begin() + at, static_cast<char>(random.Below(256)));
        break;
      case 4:
        if (!input.empty()) input.erase(at, 1 + random.Below(4));
        break;
      case 5:
        if (!input.empty()) {
          const std::string chunk = input.substr(at, 1 + random.Below(8));
          input.insert(random.Below(input.size() + 1), chunk);
        }
        break;
      default: {
        const std::string& other = pool[random.Below(pool.size())];
        const size_t from = other.empty() ? 0 : random.Below(other.size());
        input = input.substr(0, at) + other.substr(from);
        break;
      }
    }
  }
  if (input.size() > kMaxInputBytes) input.resize(kMaxInputBytes);
  return input;
}

// The input being run and where a crash leaves it: the fatal-signal handler writes it out with
// async-signal-safe calls only (open/write/close), then lets the signal kill the test.
const std::string* running_input = nullptr;
std::string crash_path;

void KeepInputAndDie(int signal_number) {
  if (running_input != nullptr) {
    const int fd = ::open(crash_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      const ssize_t written = ::write(fd, running_input->data(), running_input->size());
      (void)written;
      ::close(fd);
    }
  }
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}

void RunOne(const Target& target, std::string_view name, const std::string& input) {
  crash_path = PendingInputPath(name).string();
  running_input = &input;
  for (int signal_number : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL}) {
    std::signal(signal_number, KeepInputAndDie);
  }
  const absl::Status status = target(input);
  running_input = nullptr;
  if (!status.ok()) {
    std::ofstream(crash_path, std::ios::binary | std::ios::trunc) << input;
  }
  ASSERT_TRUE(status.ok()) << status << "\ninput (hex): " << Hex(input)
                           << "\nkept as: " << crash_path;
}

void ReplayCorpus(const Target& target, std::string_view name) {
  const std::vector<std::string> corpus = CorpusOf(name);
  ASSERT_FALSE(corpus.empty()) << "no corpus in " << CorpusDir(name);
  for (const std::string& input : corpus) {
    RunOne(target, name, input);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

void MutationRun(const Target& target, std::string_view name, std::vector<std::string> seeds,
                 int runs) {
  for (std::string& input : CorpusOf(name)) seeds.push_back(std::move(input));
  for (uint64_t seed : kSeeds) {
    testing::SeededRandom random(seed);
    std::vector<std::string> pool = seeds;
    for (int run = 0; run < runs; ++run) {
      std::string input = Mutate(pool[random.Below(pool.size())], pool, random);
      RunOne(target, name, input);
      if (::testing::Test::HasFatalFailure()) {
        ADD_FAILURE() << "seed " << seed << " run " << run;
        return;
      }
      // Keep some mutants to mutate further (no coverage feedback: a random walk).
      if (random.Below(8) == 0 && pool.size() < 512) pool.push_back(std::move(input));
    }
  }
}

// Serialized requests of realistic plans and shapes, tagged for FuzzRequestDecoding.
std::vector<std::string> DecodingSeeds() {
  std::vector<std::string> seeds;
  const ModelPlan plans[] = {test_plans::Llama3_8B(), test_plans::GemmaStyle(true),
                             test_plans::GlmStyleWithIndexer(64), test_plans::Qwen3NextStyle(),
                             test_plans::DeepSeekV3Style()};
  for (const ModelPlan& plan : plans) {
    pb::CostRequest request;
    *request.mutable_model()->mutable_plan() = ModelPlanToProto(plan);
    request.mutable_shape()->set_capacity(4096);
    request.mutable_shape()->set_spec_snapshot(true);
    seeds.push_back(std::string(1, '\0') + request.SerializeAsString());
  }
  pb::CostRequest json;
  json.mutable_model()->set_hf_config_json(
      R"({"architectures":["LlamaForCausalLM"],"num_hidden_layers":4,"hidden_size":256,)"
      R"("num_attention_heads":4,"num_key_value_heads":2})");
  json.mutable_shape()->set_capacity(128);
  seeds.push_back(std::string(1, '\0') + json.SerializeAsString());
  pb::PrepareAppendResponse appends;
  pb::LayerAppendPlan* layer = appends.add_layers();
  layer->set_layer(0);
  layer->set_write_row(3);
  layer->add_more_layers(1);
  seeds.push_back(std::string(1, '\1') + appends.SerializeAsString());
  return seeds;
}

TEST(FuzzTest, DecodingCorpusReplays) {
  ReplayCorpus(FuzzRequestDecoding, "decode");
}

TEST(FuzzTest, SessionCorpusReplays) {
  ReplayCorpus(FuzzSessionOps, "session");
}

TEST(FuzzTest, DecodingSurvivesSeededMutation) {
  MutationRun(FuzzRequestDecoding, "decode", DecodingSeeds(), kDecodingRuns);
}

TEST(FuzzTest, SessionOpsSurviveSeededMutation) {
  MutationRun(FuzzSessionOps, "session", {}, kSessionRuns);
}

}  // namespace
}  // namespace memra::fuzz
