#include "server/store/remote/remote_tier.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <xxhash.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/sha256.h"
#include "server/base/streaming_checksum.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

constexpr char kMagic[4] = {'M', 'K', 'V', 'R'};
constexpr uint64_t kHeaderChecksummed = 64;

std::string Hex(const uint8_t* bytes, size_t size) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), size));
}

std::string ScopeHex(absl::string_view scope) {
  Sha256 hash;
  hash.Update(std::string_view(scope.data(), scope.size()));
  const PlanFingerprint digest = hash.Finish();
  return Hex(digest.data(), digest.size());
}

void PutLe(char* at, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) at[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}

uint64_t GetLe(const char* at, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{static_cast<uint8_t>(at[i])} << (8 * i);
  return value;
}

bool IsTransportFailure(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

// A value already in memory.
class OwnedValueSource : public RemoteValueSource {
 public:
  explicit OwnedValueSource(std::string value) : value_(std::move(value)) {}
  uint64_t bytes() const override { return value_.size(); }
  absl::Status Read(absl::Span<char> value) override {
    std::memcpy(value.data(), value_.data(), value_.size());
    return absl::OkStatus();
  }

 private:
  const std::string value_;
};

}  // namespace

std::string RemoteBlockKey(absl::string_view scope, const BlockKey& block) {
  return absl::StrCat("memra-kv/v2/", ScopeHex(scope), "/b/", Hex(block.data(), block.size()));
}

std::string RemoteBoundaryKey(absl::string_view scope, const BlockKey& last_block) {
  return absl::StrCat("memra-kv/v2/", ScopeHex(scope), "/s/",
                      Hex(last_block.data(), last_block.size()));
}

uint64_t ShapePrefix(const PlanFingerprint& key) {
  return GetLe(reinterpret_cast<const char*>(key.data()), 8);
}

uint64_t RemoteKeyDigest(absl::string_view key) { return XXH3_64bits(key.data(), key.size()); }

std::string EncodeRemoteHeader(absl::string_view key, const RemoteValueHeader& header) {
  std::string encoded(kRemoteHeaderBytes, '\0');
  char* h = encoded.data();
  std::memcpy(h, kMagic, 4);
  PutLe(h + 4, kRemoteValueVersion, 2);
  PutLe(h + 6, static_cast<uint8_t>(header.kind), 1);
  PutLe(h + 7, 0, 1);
  PutLe(h + 8, header.payload_bytes, 8);
  PutLe(h + 16, header.shape_prefix, 8);
  PutLe(h + 24, header.block_tokens, 4);
  PutLe(h + 28, header.slice_bytes, 4);
  PutLe(h + 32, header.boundary_tokens, 8);
  PutLe(h + 40, header.checksum, 8);
  PutLe(h + 48, header.layout_digest, 8);
  PutLe(h + 56, RemoteKeyDigest(key), 8);
  PutLe(h + kHeaderChecksummed, XXH3_64bits(h, kHeaderChecksummed), 8);
  return encoded;
}

std::string NewRemoteValue(absl::string_view key, const RemoteValueHeader& header) {
  std::string value = EncodeRemoteHeader(key, header);
  value.resize(kRemoteHeaderBytes + header.payload_bytes, '\0');
  return value;
}

absl::StatusOr<VerifiedRemoteValue> VerifyRemoteValue(absl::string_view key,
                                                      absl::string_view value,
                                                      const RemoteValueHeader& expected) {
  const auto short_value = [&] {
    return absl::DataLossError(absl::StrCat("remote value ", key, " holds ", value.size(),
                                            " bytes, under the ", kRemoteHeaderBytes,
                                            "-byte header"));
  };
  if (value.size() < 6) return short_value();
  const char* h = value.data();
  auto mismatch = [&](absl::string_view field, uint64_t found, uint64_t wanted) {
    return absl::FailedPreconditionError(absl::StrCat(
        "remote value ", key, ": shape mismatch: ", field, " ", found, ", this daemon expects ",
        wanted, " (another build or plan wrote it)"));
  };
  // Magic and version first: another format's header is sealed elsewhere (format 1 at 56), so
  // its checksum would read as corruption and the value would be deleted, not skipped.
  if (std::memcmp(h, kMagic, 4) != 0) return mismatch("magic", GetLe(h, 4), GetLe(kMagic, 4));
  if (GetLe(h + 4, 2) != kRemoteValueVersion) {
    return mismatch("format version", GetLe(h + 4, 2), kRemoteValueVersion);
  }
  if (value.size() < kRemoteHeaderBytes) return short_value();
  const uint64_t header_sum = XXH3_64bits(h, kHeaderChecksummed);
  if (header_sum != GetLe(h + kHeaderChecksummed, 8)) {
    return absl::DataLossError(absl::StrFormat(
        "remote value %s: header xxHash3 %016x, sealed as %016x", key, header_sum,
        GetLe(h + kHeaderChecksummed, 8)));
  }
  if (GetLe(h + 56, 8) != RemoteKeyDigest(key)) {
    return absl::DataLossError(absl::StrFormat(
        "remote value %s was written under another key (key digest %016x, this key's %016x); "
        "refused, never served",
        key, GetLe(h + 56, 8), RemoteKeyDigest(key)));
  }
  if (GetLe(h + 6, 1) != static_cast<uint8_t>(expected.kind)) {
    return mismatch("kind", GetLe(h + 6, 1), static_cast<uint8_t>(expected.kind));
  }
  const uint64_t payload_bytes = GetLe(h + 8, 8);
  if (payload_bytes != expected.payload_bytes) {
    return mismatch("payload bytes", payload_bytes, expected.payload_bytes);
  }
  if (GetLe(h + 16, 8) != expected.shape_prefix) {
    return mismatch("shape key prefix", GetLe(h + 16, 8), expected.shape_prefix);
  }
  if (GetLe(h + 24, 4) != expected.block_tokens) {
    return mismatch("block_tokens", GetLe(h + 24, 4), expected.block_tokens);
  }
  if (GetLe(h + 32, 8) != expected.boundary_tokens) {
    return mismatch("boundary tokens", GetLe(h + 32, 8), expected.boundary_tokens);
  }
  if (GetLe(h + 48, 8) != expected.layout_digest) {
    return mismatch("layout digest", GetLe(h + 48, 8), expected.layout_digest);
  }
  if (value.size() - kRemoteHeaderBytes != payload_bytes) {
    return absl::DataLossError(absl::StrCat("remote value ", key, ": the header says ",
                                            payload_bytes, " payload bytes, the value holds ",
                                            value.size() - kRemoteHeaderBytes));
  }
  VerifiedRemoteValue out;
  out.slice_bytes = static_cast<uint32_t>(GetLe(h + 28, 4));
  out.checksum = GetLe(h + 40, 8);
  if (out.slice_bytes == 0) {
    return absl::DataLossError(
        absl::StrCat("remote value ", key, ": checksum slice size 0 in a sealed header"));
  }
  out.payload = value.substr(kRemoteHeaderBytes);
  out.slice_checksums = SliceChecksums(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(out.payload.data()),
                          out.payload.size()),
      out.slice_bytes);
  const uint64_t found = PieceChecksum(out.slice_checksums);
  if (found != out.checksum) {
    return absl::DataLossError(absl::StrFormat(
        "remote value %s (%d payload bytes): xxHash3 %016x, sealed as %016x; refused, never "
        "served",
        key, payload_bytes, found, out.checksum));
  }
  return out;
}

struct RemoteTier::ReadCall {
  std::vector<std::function<absl::Status(RedisClusterClient&)>> jobs;
  size_t next = 0;        // next unclaimed job (under mu_)
  size_t remaining = 0;   // jobs not finished (under mu_)
  bool abandoned = false;  // the caller stopped waiting: unclaimed jobs are skipped
  absl::Status status;     // the first failure
};

absl::StatusOr<std::unique_ptr<RemoteTier>> RemoteTier::Create(RemoteTierOptions options) {
  if (options.queue_bytes == 0 || options.queue_entries == 0 || options.reader_queue == 0 ||
      options.reader_threads == 0 || options.reader_threads > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote tier: queue_bytes (", options.queue_bytes, "), queue_entries (",
        options.queue_entries, ") and reader_queue (", options.reader_queue,
        ") must be > 0 and reader_threads (", options.reader_threads, ") 1..64"));
  }
  if (options.breaker_initial <= absl::ZeroDuration() ||
      options.breaker_max < options.breaker_initial) {
    return absl::InvalidArgumentError(absl::StrCat(
        "remote tier: breaker back-off ", absl::FormatDuration(options.breaker_initial), " to ",
        absl::FormatDuration(options.breaker_max), " must be positive and not shrink"));
  }
  absl::StatusOr<std::unique_ptr<RedisClusterClient>> client =
      RedisClusterClient::Create(options.cluster);
  std::shared_ptr<RedisClusterClient> reached;
  if (client.ok()) {
    reached = *std::move(client);
  } else if (IsTransportFailure(client.status())) {
    spdlog::warn(
        "prefix remote tier: the Redis Cluster is down at start-up ({}); serving without it "
        "and probing every {} to {}",
        client.status().ToString(), absl::FormatDuration(options.breaker_initial),
        absl::FormatDuration(options.breaker_max));
  } else {
    return client.status();  // options or credentials that will never work
  }
  return std::unique_ptr<RemoteTier>(new RemoteTier(std::move(options), std::move(reached)));
}

RemoteTier::RemoteTier(RemoteTierOptions options, std::shared_ptr<RedisClusterClient> client)
    : options_(std::move(options)), client_(std::move(client)) {
  {
    absl::MutexLock lock(&mu_);
    backoff_ = options_.breaker_initial;
    if (client_ == nullptr) OpenBreakerLocked();
  }
  writer_ = std::thread([this] { WriterLoop(); });
  for (uint32_t i = 0; i < options_.reader_threads; ++i) {
    readers_.emplace_back([this] { ReaderLoop(); });
  }
}

RemoteTier::~RemoteTier() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  writer_.join();
  for (std::thread& reader : readers_) reader.join();
}

bool RemoteTier::UpLocked() const { return client_ != nullptr && !open_; }

bool RemoteTier::Up() const {
  absl::MutexLock lock(&mu_);
  return UpLocked();
}

void RemoteTier::OpenBreakerLocked() {
  if (!open_) ++stats_.breaker_opens;
  open_ = true;
  open_until_ = absl::Now() + backoff_;
  backoff_ = std::min(backoff_ * 2, options_.breaker_max);
  consecutive_read_failures_ = 0;
  consecutive_write_failures_ = 0;
}

void RemoteTier::Report(CallPath path, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  ReportLocked(path, status);
}

bool RemoteTier::AdmitLogLocked(LogWindow& window, uint64_t& skipped) {
  const absl::Time now = absl::Now();
  if (now - window.last < kLogInterval) {
    ++window.skipped;
    return false;
  }
  skipped = window.skipped;
  window = LogWindow{.last = now, .skipped = 0};
  return true;
}

void RemoteTier::ReportLocked(CallPath path, const absl::Status& status) {
  if (IsRedisNodeDownRefusal(status)) return;
  int& failures =
      path == CallPath::kRead ? consecutive_read_failures_ : consecutive_write_failures_;
  if (!IsTransportFailure(status)) {
    failures = 0;
    return;
  }
  if (open_) return;  // a call that started before the breaker opened
  if (++failures >= kBreakerFailures) {
    spdlog::warn("prefix remote tier: {} consecutive failures (last: {}); down for {}",
                 kBreakerFailures, status.ToString(), absl::FormatDuration(backoff_));
    OpenBreakerLocked();
  }
}

bool RemoteTier::AdmitWrite(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (UpLocked() && writes_.size() < options_.queue_entries &&
      bytes <= options_.queue_bytes - std::min(queued_bytes_, options_.queue_bytes)) {
    return true;
  }
  ++stats_.dropped_writes;
  return false;
}

bool RemoteTier::Enqueue(std::string key, std::unique_ptr<RemoteValueSource> source) {
  // A refused source is destroyed after mu_ is left (its destructor releases the caller's hold).
  std::unique_ptr<RemoteValueSource> refused;
  absl::MutexLock lock(&mu_);
  const uint64_t bytes = source->bytes();
  if (!UpLocked() || writes_.size() >= options_.queue_entries ||
      bytes > options_.queue_bytes - std::min(queued_bytes_, options_.queue_bytes)) {
    ++stats_.dropped_writes;
    refused = std::move(source);
    return false;
  }
  queued_bytes_ += bytes;
  writes_.push_back({std::move(key), std::move(source)});
  return true;
}

bool RemoteTier::Enqueue(std::string key, std::string value) {
  return Enqueue(std::move(key), std::make_unique<OwnedValueSource>(std::move(value)));
}

void RemoteTier::Discard(std::string key) {
  absl::MutexLock lock(&mu_);
  if (!UpLocked() || writes_.size() >= options_.queue_entries) return;
  writes_.push_back({std::move(key), nullptr});
}

bool RemoteTier::Flush(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return AwaitDrainedLocked(timeout);
}

bool RemoteTier::AwaitDrainedLocked(absl::Duration timeout) {
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return writes_.empty() && !writing_;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&drained), timeout);
}

uint64_t RemoteTier::FlushOrDrop(absl::Duration timeout) {
  std::deque<Write> dropped;  // destroyed after mu_ is released (their sources release holds)
  absl::MutexLock lock(&mu_);
  AwaitDrainedLocked(timeout);
  return DropQueuedLocked(dropped);
}

uint64_t RemoteTier::DropQueuedLocked(std::deque<Write>& dropped) {
  const uint64_t writes = std::count_if(writes_.begin(), writes_.end(),
                                        [](const Write& w) { return w.source != nullptr; });
  stats_.dropped_writes += writes;
  dropped.swap(writes_);
  writes_.clear();
  queued_bytes_ = 0;
  return writes;
}

void RemoteTier::Probe() {
  std::shared_ptr<RedisClusterClient> client;
  {
    absl::MutexLock lock(&mu_);
    client = client_;
    ++stats_.probes;
  }
  absl::Status status;
  if (client == nullptr) {
    absl::StatusOr<std::unique_ptr<RedisClusterClient>> created =
        RedisClusterClient::Create(options_.cluster);
    status = created.status();
    if (created.ok()) client = *std::move(created);
  } else {
    status = client->RefreshSlotMap();
  }
  absl::MutexLock lock(&mu_);
  if (status.ok()) {
    client_ = std::move(client);
    open_ = false;
    consecutive_read_failures_ = 0;
    consecutive_write_failures_ = 0;
    backoff_ = options_.breaker_initial;
    spdlog::info("prefix remote tier: the Redis Cluster answers; the tier is up");
  } else {
    OpenBreakerLocked();
  }
}

void RemoteTier::WriterLoop() {
  // One buffer for every value: the writer reads each source into it, then SETs it.
  std::string value;
  while (true) {
    Write write;
    std::deque<Write> dropped;  // destroyed below, outside mu_ (their sources release holds)
    std::shared_ptr<RedisClusterClient> client;
    bool probe = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !writes_.empty() || (open_ && absl::Now() >= open_until_);
      };
      // While down, wake for the probe; else for a write (or stop).
      const absl::Duration wait =
          open_ ? std::max(open_until_ - absl::Now(), absl::ZeroDuration()) : absl::Seconds(1);
      mu_.AwaitWithTimeout(absl::Condition(&ready), wait);
      if (stopping_) {
        dropped.swap(writes_);
        queued_bytes_ = 0;
        break;
      }
      if (open_) {
        // Down: queued writes are dropped (a lost write is a later miss), then one probe.
        DropQueuedLocked(dropped);
        probe = absl::Now() >= open_until_;
      } else if (!writes_.empty()) {
        write = std::move(writes_.front());
        writes_.pop_front();
        if (write.source != nullptr) queued_bytes_ -= write.source->bytes();
        writing_ = true;
        client = client_;
      }
    }
    dropped.clear();
    if (probe) {
      Probe();
      continue;
    }
    if (client == nullptr) continue;
    absl::Status status;
    const bool deletion = write.source == nullptr;
    if (deletion) {
      status = client->Del(write.key).status();
      Report(CallPath::kWrite, status);
    } else {
      // A key whose node is in back-off would be refused without I/O: not worth reading.
      status = client->KeyNodeBackOff(write.key);
      if (status.ok()) {
        if (options_.before_write_read) options_.before_write_read();
        value.resize(write.source->bytes());
        status = write.source->Read(absl::MakeSpan(value.data(), value.size()));
      }
      write.source.reset();  // the bytes are read: the caller's hold goes before the round trip
      if (status.ok()) {
        status = client->Set(write.key, value, options_.ttl);
        Report(CallPath::kWrite, status);
      }
    }
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (deletion) continue;
    if (status.ok()) {
      ++stats_.writes;
      stats_.written_bytes += value.size();
    } else {
      ++stats_.write_errors;
      if (uint64_t skipped = 0; AdmitLogLocked(write_failure_log_, skipped)) {
        spdlog::warn("prefix remote tier: write of {} failed: {} ({} failed writes not logged "
                     "in the {} before)",
                     write.key, status.ToString(), skipped, absl::FormatDuration(kLogInterval));
      }
    }
  }
}

void RemoteTier::ReaderLoop() {
  while (true) {
    std::shared_ptr<ReadCall> call;
    size_t job = 0;
    std::shared_ptr<RedisClusterClient> client;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !read_calls_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      call = read_calls_.front();
      if (call->abandoned) {
        call->remaining -= call->jobs.size() - call->next;
        call->next = call->jobs.size();
      }
      if (call->next >= call->jobs.size()) {
        read_calls_.pop_front();
        continue;
      }
      job = call->next++;
      if (call->next == call->jobs.size()) read_calls_.pop_front();
      client = client_;
    }
    absl::Status status = client == nullptr
                              ? absl::UnavailableError("remote tier: no Redis Cluster client")
                              : call->jobs[job](*client);
    absl::MutexLock lock(&mu_);
    // An abandoned call's caller already counted its deadline as the failure.
    if (!call->abandoned) ReportLocked(CallPath::kRead, status);
    if (!status.ok() && call->status.ok()) call->status = status;
    if (status.ok()) {
      ++stats_.reads;
    } else {
      ++stats_.read_errors;
    }
    --call->remaining;
  }
}

absl::Status RemoteTier::RunRead(std::vector<std::function<absl::Status(RedisClusterClient&)>> jobs,
                                 absl::Duration deadline) {
  auto call = std::make_shared<ReadCall>();
  call->remaining = jobs.size();
  call->jobs = std::move(jobs);
  if (call->jobs.empty()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  if (!UpLocked()) {
    ++stats_.read_refusals;
    return absl::UnavailableError("remote tier is down (circuit breaker open)");
  }
  if (read_calls_.size() >= options_.reader_queue) {
    ++stats_.read_refusals;
    return absl::UnavailableError(absl::StrCat("remote tier: ", read_calls_.size(),
                                               " read calls already wait for a reader"));
  }
  read_calls_.push_back(call);
  auto done = [&call]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return call->remaining == 0; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), deadline)) {
    call->abandoned = true;
    ++stats_.read_timeouts;
    absl::Status expired = absl::DeadlineExceededError(absl::StrCat(
        "remote tier: no answer within ", absl::FormatDuration(deadline), " (",
        call->remaining, " of ", call->jobs.size(), " calls outstanding)"));
    // A stalled node answers no one in time: the breaker must hear it now, not when (or
    // whether) the client's own timeout fails the call.
    ReportLocked(CallPath::kRead, expired);
    return expired;
  }
  return call->status;
}

absl::StatusOr<std::vector<bool>> RemoteTier::ExistsEach(std::vector<std::string> keys,
                                                         absl::Duration deadline) {
  auto result = std::make_shared<RedisExistsResult>();
  auto shared_keys = std::make_shared<std::vector<std::string>>(std::move(keys));
  std::vector<std::function<absl::Status(RedisClusterClient&)>> jobs;
  jobs.push_back([result, shared_keys](RedisClusterClient& client) -> absl::Status {
    RedisExistsResult answered = client.ExistsEach(*shared_keys);
    // Not one key answered: the call failed (the breaker hears why). Some answered: the
    // cluster is reachable, and the keys of the node that is not read as misses.
    if (!shared_keys->empty() && answered.unanswered == shared_keys->size()) {
      return answered.first_failure;
    }
    *result = std::move(answered);
    return absl::OkStatus();
  });
  absl::Status status = RunRead(std::move(jobs), deadline);
  if (!status.ok()) return status;
  if (result->unanswered > 0) {
    absl::MutexLock lock(&mu_);
    ++stats_.partial_lookups;
    if (uint64_t skipped = 0; AdmitLogLocked(partial_lookup_log_, skipped)) {
      spdlog::warn("prefix remote tier: {} of {} keys unanswered, read as misses (first: {}; "
                   "{} such lookups not logged in the {} before)",
                   result->unanswered, result->exists.size(), result->first_failure.ToString(),
                   skipped, absl::FormatDuration(kLogInterval));
    }
  }
  std::vector<bool> exists(result->exists.size());
  for (size_t i = 0; i < exists.size(); ++i) exists[i] = result->exists[i].value_or(false);
  return exists;
}

absl::StatusOr<std::vector<std::optional<std::string>>> RemoteTier::GetEach(
    std::vector<std::string> keys, absl::Duration deadline) {
  auto result = std::make_shared<std::vector<std::optional<std::string>>>(keys.size());
  auto shared_keys = std::make_shared<std::vector<std::string>>(std::move(keys));
  std::vector<std::function<absl::Status(RedisClusterClient&)>> jobs;
  for (size_t i = 0; i < shared_keys->size(); ++i) {
    jobs.push_back([result, shared_keys, i](RedisClusterClient& client) -> absl::Status {
      absl::StatusOr<std::optional<std::string>> value = client.Get((*shared_keys)[i]);
      if (!value.ok()) return value.status();
      (*result)[i] = *std::move(value);
      return absl::OkStatus();
    });
  }
  absl::Status status = RunRead(std::move(jobs), deadline);
  if (!status.ok()) return status;
  return std::move(*result);
}

void RemoteTier::RecordPull(const PullCounts& counts) {
  absl::MutexLock lock(&mu_);
  if (counts.pieces > 0) ++stats_.hits;
  stats_.pulled_pieces += counts.pieces;
  stats_.pulled_bytes += counts.bytes;
  stats_.corrupt += counts.corrupt;
  stats_.shape_mismatches += counts.shape_mismatches;
}

RemoteTierStats RemoteTier::Stats() const {
  std::shared_ptr<RedisClusterClient> client;
  RemoteTierStats stats;
  {
    absl::MutexLock lock(&mu_);
    stats = stats_;
    stats.up = UpLocked();
    stats.queued_bytes = queued_bytes_;
    stats.queued_writes = writes_.size() + (writing_ ? 1 : 0);
    client = client_;
  }
  if (client != nullptr) stats.cluster = client->Stats();
  return stats;
}

}  // namespace memra
