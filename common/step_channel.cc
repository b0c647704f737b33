#include "common/step_channel.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace memra::step_channel {
namespace {

constexpr uint64_t kPageBytes = 4096;

uint64_t PageAligned(uint64_t bytes) { return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes; }

}  // namespace

Layout LayoutFor(uint32_t slots) {
  Layout layout;
  layout.submissions_offset = kHeaderBytes;
  layout.completions_offset =
      layout.submissions_offset + PageAligned(uint64_t{slots} * sizeof(SubmissionRecord));
  layout.submission_side_offset =
      layout.completions_offset + PageAligned(uint64_t{slots} * sizeof(CompletionRecord));
  layout.completion_side_offset =
      layout.submission_side_offset + PageAligned(uint64_t{slots} * kSubmissionSideBytes);
  layout.region_bytes =
      layout.completion_side_offset + PageAligned(uint64_t{slots} * kCompletionSideBytes);
  return layout;
}

LayerAppendRecord ToRecord(const LayerAppend& layer) {
  LayerAppendRecord record;
  record.layer = layer.layer;
  record.write_row = layer.write_row;
  if (layer.ring_append.has_value()) {
    const RingAppend& ring = *layer.ring_append;
    record.flags = kLayerRing;
    if (ring.kind == RingAppend::Kind::kRebase) {
      record.flags |= kLayerRebase;
      record.src_row = ring.src_row;
      record.keep_rows = ring.keep_rows;
      record.new_base = ring.new_base;
    }
  }
  return record;
}

LayerAppend FromRecord(const LayerAppendRecord& record) {
  LayerAppend layer;
  layer.layer = record.layer;
  layer.write_row = record.write_row;
  if ((record.flags & kLayerRing) != 0) {
    layer.ring_append = (record.flags & kLayerRebase) != 0
                            ? RingAppend::Rebase(record.src_row, record.keep_rows,
                                                 record.new_base, record.write_row)
                            : RingAppend::Contiguous(record.write_row);
  }
  return layer;
}

void InitializeHeader(void* region) {
  const Layout layout = LayoutFor(kSlots);
  auto* header = new (region) StepChannelHeader();
  header->magic = kMagic;
  header->version = kVersion;
  header->slots = kSlots;
  header->submission_record_bytes = sizeof(SubmissionRecord);
  header->completion_record_bytes = sizeof(CompletionRecord);
  header->submission_side_bytes = kSubmissionSideBytes;
  header->completion_side_bytes = kCompletionSideBytes;
  header->reserved0 = 0;
  header->region_bytes = layout.region_bytes;
  header->submissions_offset = layout.submissions_offset;
  header->completions_offset = layout.completions_offset;
  header->submission_side_offset = layout.submission_side_offset;
  header->completion_side_offset = layout.completion_side_offset;
  for (std::atomic<uint32_t>* word :
       {&header->sq_tail, &header->sq_head, &header->cq_tail, &header->engine_waiting,
        &header->cq_head, &header->daemon_sleeping, &header->closed}) {
    word->store(0, std::memory_order_relaxed);
  }
}

absl::Status CheckHeader(const StepChannelHeader& header, uint64_t bytes) {
  const Layout layout = LayoutFor(kSlots);
  const struct {
    const char* field;
    uint64_t got;
    uint64_t want;
  } fields[] = {
      {"magic", header.magic, kMagic},
      {"version", header.version, kVersion},
      {"slots", header.slots, kSlots},
      {"submission_record_bytes", header.submission_record_bytes, sizeof(SubmissionRecord)},
      {"completion_record_bytes", header.completion_record_bytes, sizeof(CompletionRecord)},
      {"submission_side_bytes", header.submission_side_bytes, kSubmissionSideBytes},
      {"completion_side_bytes", header.completion_side_bytes, kCompletionSideBytes},
      {"region_bytes", header.region_bytes, layout.region_bytes},
      {"submissions_offset", header.submissions_offset, layout.submissions_offset},
      {"completions_offset", header.completions_offset, layout.completions_offset},
      {"submission_side_offset", header.submission_side_offset, layout.submission_side_offset},
      {"completion_side_offset", header.completion_side_offset, layout.completion_side_offset},
  };
  for (const auto& field : fields) {
    if (field.got != field.want) {
      return absl::InvalidArgumentError(absl::StrCat("step channel header: ", field.field, " is ",
                                                     field.got, "; this library speaks ",
                                                     field.want));
    }
  }
  if (bytes < layout.region_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("step channel region of ", bytes,
                                                   " bytes; its layout needs ",
                                                   layout.region_bytes));
  }
  return absl::OkStatus();
}

void FutexWait(std::atomic<uint32_t>& word, uint32_t expected, absl::Duration timeout) {
  const timespec relative = absl::ToTimespec(timeout);
  // A shared futex: the word lives in a MAP_SHARED mapping another process waits on or wakes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &relative,
          nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

}  // namespace memra::step_channel
