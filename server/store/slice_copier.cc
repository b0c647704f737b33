#include "server/store/slice_copier.h"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/status_macros.h"

namespace memra {
namespace {

// The part of `ranges` (as PieceRanges made them) that copies stored bytes [begin, end), the
// stored side moved to `stored_offset` (where the piece's span starts in its slab).
std::vector<CopyRange> SliceRanges(const std::vector<CopyRange>& ranges, bool toward_storage,
                                   uint64_t stored_offset, uint64_t begin, uint64_t end) {
  std::vector<CopyRange> slice;
  uint64_t at = 0;
  for (const CopyRange& range : ranges) {
    const uint64_t lo = std::max(at, begin);
    const uint64_t hi = std::min(at + range.bytes, end);
    if (lo < hi) {
      const uint64_t skip = lo - at;
      CopyRange part{.dst_offset = range.dst_offset + skip,
                     .src_offset = range.src_offset + skip,
                     .bytes = hi - lo};
      (toward_storage ? part.dst_offset : part.src_offset) += stored_offset;
      slice.push_back(part);
    }
    at += range.bytes;
  }
  return slice;
}

}  // namespace

uint64_t SliceCount(uint64_t bytes, uint64_t slice_bytes) {
  return bytes == 0 ? 1 : (bytes - 1) / slice_bytes + 1;
}


absl::StatusOr<std::vector<std::vector<uint64_t>>> SliceCopier::Copy(
    CopyDirection direction, ArenaId arena, const std::vector<PieceCopy>& pieces, bool checksum,
    EntryId entry, std::vector<absl::Status>* piece_failures) const {
  const uint64_t slice_bytes = options_.slice_bytes;
  const bool toward_storage = direction == CopyDirection::kToStorage;
  // Every slice of every piece is an independent range of the destination, so slices are copied
  // concurrently (DeviceBackend is thread-safe). Workers take the next job in piece order as
  // they finish one: on a loaded machine a thread that gets less CPU takes fewer slices instead
  // of holding up the copy.
  struct Job {
    uint32_t piece;
    uint32_t slice;
  };
  std::vector<Job> jobs;
  std::vector<std::vector<uint64_t>> checksums(pieces.size());
  uint64_t total = 0;
  if (piece_failures != nullptr) piece_failures->assign(pieces.size(), absl::OkStatus());
  for (size_t p = 0; p < pieces.size(); ++p) {
    const uint64_t slices = SliceCount(pieces[p].bytes, slice_bytes);
    checksums[p].resize(slices);
    if (direction == CopyDirection::kFromStorage) {
      const size_t stored = pieces[p].slice_checksums.size();
      if (stored != (slices == 1 ? 0 : slices)) {
        return absl::DataLossError(absl::StrCat(
            "prefix entry ", entry.value, ": stored piece ", p, " of ", pieces[p].bytes,
            " bytes carries ", stored, " slice checksums; ", slice_bytes,
            "-byte slices make ", slices, "; the entry is dropped, never served"));
      }
    }
    for (uint64_t s = 0; s < slices; ++s) {
      jobs.push_back({static_cast<uint32_t>(p), static_cast<uint32_t>(s)});
    }
    total += pieces[p].bytes;
  }
  auto run_job = [&](const Job& job) -> absl::Status {
    const PieceCopy& piece = pieces[job.piece];
    const uint64_t begin = uint64_t{job.slice} * slice_bytes;
    const uint64_t end = std::min(begin + slice_bytes, piece.bytes);
    const std::vector<CopyRange> ranges =
        SliceRanges(piece.ranges, toward_storage, piece.span.offset, begin, end);
    const ArenaId stored = piece.span.slab;
    const ArenaId dst = toward_storage ? stored : arena;
    const ArenaId src = toward_storage ? arena : stored;
    if (!checksum) {
      for (const CopyRange& range : ranges) {
        RETURN_IF_ERROR(backend_->Copy(dst, range.dst_offset, src, range.src_offset, range.bytes));
      }
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(const uint64_t digest, backend_->CopyRangesChecksummed(dst, src, ranges));
    checksums[job.piece][job.slice] = digest;
    if (direction == CopyDirection::kToStorage) return absl::OkStatus();
    const std::vector<uint64_t>& sealed = piece.slice_checksums;
    const uint64_t expected = sealed.empty() ? piece.checksum : sealed[job.slice];
    if (digest != expected) {
      return absl::DataLossError(absl::StrFormat(
          "prefix entry %d: stored piece %d (slab %d, offset %d), slice %d of %d (%d bytes), "
          "has xxHash3 %016x, captured as %016x; the entry is dropped, never served",
          piece.entry.value != 0 ? piece.entry.value : entry.value, job.piece, stored.value,
          piece.span.offset, job.slice,
          checksums[job.piece].size(), end - begin, digest, expected));
    }
    return absl::OkStatus();
  };
  uint64_t workers = 1;
  if (jobs.size() > 1 && total >= options_.parallel_copy_bytes) {
    workers = std::min<uint64_t>({options_.copy_threads, jobs.size(),
                                  std::max(1u, std::thread::hardware_concurrency())});
  }
  // Each worker's first failure and its job; the first failure in job order is returned.
  std::vector<std::pair<size_t, absl::Status>> failures(workers, {jobs.size(), absl::OkStatus()});
  std::atomic<size_t> next_job{0};
  std::atomic<bool> failed{false};
  absl::Mutex failures_mu;  // piece_failures: slices of one piece may fail at once
  auto run = [&](uint64_t worker) {
    while (!failed.load(std::memory_order_relaxed)) {
      const size_t i = next_job.fetch_add(1, std::memory_order_relaxed);
      if (i >= jobs.size()) return;
      absl::Status status = run_job(jobs[i]);
      if (!status.ok() && piece_failures != nullptr) {
        absl::MutexLock lock(&failures_mu);
        absl::Status& first = (*piece_failures)[jobs[i].piece];
        if (first.ok()) first = std::move(status);
        continue;
      }
      if (!status.ok()) {
        failures[worker] = {i, std::move(status)};
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (uint64_t worker = 1; worker < workers; ++worker) {
    try {
      threads.emplace_back(run, worker);
    } catch (const std::system_error&) {
      run(worker);  // no thread to be had: this one does the run itself
    }
  }
  run(0);
  for (std::thread& thread : threads) thread.join();
  const auto first = std::min_element(
      failures.begin(), failures.end(),
      [](const auto& a, const auto& b) { return a.first < b.first; });
  RETURN_IF_ERROR(first->second);
  return checksums;
}

}  // namespace memra
