// ThreadSanitizer annotations for Debian's abseil, linked only under --config=tsan
// (docs/checking.md). Debian's libabsl_synchronization is not built with TSan, so TSan never sees
// an absl::Mutex being taken and reports every ABSL_GUARDED_BY member touched by two threads as
// a race. This file defines absl::Mutex's and absl::CondVar's out-of-line lock operations, which
// interpose the library's (this library is loaded before it): each calls the real one
// (dlsym(RTLD_NEXT)) and tells TSan the happens-before edge it makes: __tsan_acquire(mutex)
// once a lock is held, __tsan_release(mutex) before it is let go (waits let go and retake it).
// Reader locks are annotated like writer locks: that adds edges between readers, which can hide a
// race between two readers (there is none: readers do not write) but never invents one.

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace {

#define MEMRA_STRINGIFY_INNER(x) #x
#define MEMRA_STRINGIFY(x) MEMRA_STRINGIFY_INNER(x)

// "_ZN4absl" <len><inline namespace> <rest>: the Itanium name of an absl:: member.
template <typename Function>
Function Real(const char* rest) {
  const std::string inline_namespace = MEMRA_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name =
      "_ZN4absl" + std::to_string(inline_namespace.size()) + inline_namespace + rest;
  void* symbol = dlsym(RTLD_NEXT, name.c_str());
  if (symbol == nullptr) {
    std::fprintf(stderr, "absl_mutex_annotations: %s not found after this library\n",
                 name.c_str());
    std::abort();
  }
  return reinterpret_cast<Function>(symbol);
}

// abseil's lock-order (deadlock) detector keeps a global graph behind an internal SpinLock that
// TSan cannot see either; its memmoves (which TSan intercepts even from uninstrumented code)
// then show up as races between any two threads taking any two mutexes, gRPC's included. TSan
// has no use for it here, so it is off in this configuration only.
[[maybe_unused]] const bool kDeadlockDetectionOff = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

void Acquired(const void* mutex) { __tsan_acquire(const_cast<void*>(mutex)); }
void Releasing(const void* mutex) { __tsan_release(const_cast<void*>(mutex)); }

// abseil evaluates a waiter's Condition with the mutex held but inside the real call (on the
// waiting thread or the one unlocking), between our Releasing and Acquired, and may then let the
// mutex go without returning to us: each evaluation is wrapped in an acquire (it sees what the
// last holder wrote) and a release (the next holder sees what it read).
struct AnnotatedCondition {
  const absl::Condition* condition;
  const absl::Mutex* mutex;
};

// The wrapper is written by the waiting thread and may be read by the one unlocking: published
// through its own address (Published / EvalSynchronized's first acquire).
void Published(AnnotatedCondition* annotated) { __tsan_release(annotated); }

bool EvalSynchronized(void* arg) {
  __tsan_acquire(arg);
  const auto* annotated = static_cast<const AnnotatedCondition*>(arg);
  Acquired(annotated->mutex);
  const bool met = annotated->condition->Eval();
  Releasing(annotated->mutex);
  return met;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex4LockEv");
  real(this);
  Acquired(this);
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  real(this);
  Acquired(this);
}

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) Acquired(this);
  return locked;
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) Acquired(this);
  return locked;
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex6UnlockEv");
  Releasing(this);
  real(this);
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  Releasing(this);
  real(this);
}

void Mutex::LockWhen(const Condition& condition) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  real(this, absl::Condition(&EvalSynchronized, &annotated));
  Acquired(this);
}

void Mutex::ReaderLockWhen(const Condition& condition) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  real(this, absl::Condition(&EvalSynchronized, &annotated));
  Acquired(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& condition, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  const bool met = real(this, absl::Condition(&EvalSynchronized, &annotated), timeout);
  Acquired(this);
  return met;
}

bool Mutex::LockWhenWithDeadline(const Condition& condition, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  const bool met = real(this, absl::Condition(&EvalSynchronized, &annotated), deadline);
  Acquired(this);
  return met;
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& condition, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  const bool met = real(this, absl::Condition(&EvalSynchronized, &annotated), timeout);
  Acquired(this);
  return met;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& condition, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  const bool met = real(this, absl::Condition(&EvalSynchronized, &annotated), deadline);
  Acquired(this);
  return met;
}

void Mutex::Await(const Condition& condition) {
  static const auto real =
      Real<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  Releasing(this);
  real(this, absl::Condition(&EvalSynchronized, &annotated));
  Acquired(this);
}

bool Mutex::AwaitWithTimeout(const Condition& condition, Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Duration)>(
      "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  Releasing(this);
  const bool met = real(this, absl::Condition(&EvalSynchronized, &annotated), timeout);
  Acquired(this);
  return met;
}

bool Mutex::AwaitWithDeadline(const Condition& condition, Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  AnnotatedCondition annotated{&condition, this};
  Published(&annotated);
  Releasing(this);
  const bool met = real(this, absl::Condition(&EvalSynchronized, &annotated), deadline);
  Acquired(this);
  return met;
}

void CondVar::Wait(Mutex* mutex) {
  static const auto real = Real<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  Releasing(mutex);
  real(this, mutex);
  Acquired(mutex);
}

bool CondVar::WaitWithTimeout(Mutex* mutex, Duration timeout) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Duration)>(
      "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  Releasing(mutex);
  const bool timed_out = real(this, mutex, timeout);
  Acquired(mutex);
  return timed_out;
}

bool CondVar::WaitWithDeadline(Mutex* mutex, Time deadline) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, Time)>(
      "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  Releasing(mutex);
  const bool timed_out = real(this, mutex, deadline);
  Acquired(mutex);
  return timed_out;
}

ABSL_NAMESPACE_END
}  // namespace absl

// The TSan suppressions of this configuration, compiled into every binary (a file named in
// TSAN_OPTIONS would need a path valid from every test's and daemon's directory). Only
// third-party false positives, each with its reason, and only entries that cannot match a report
// about our code; our own code is never listed.
//
// Debian's gRPC (libgrpc, libgpr) and abseil's Status and Cord (libabsl_status, libabsl_cord)
// are not instrumented: TSan cannot see the synchronisation with which they hand memory between
// threads (gRPC's completion queues and executor, abseil's atomic refcounts), but it does see
// the memcpy/memmove/recvmsg/operator delete calls they make, since those are intercepted.
// Reports whose access is such a call from inside them (e.g. grpc_slice_copy's memcpy racing
// the recvmsg that filled the slice on the poller thread; a Status payload freed by the last
// Unref on a gRPC thread) are that blindness, not races.
//
// Two more name a frame that appears only in such a handoff:
//   * grpc::Server::SyncRequestThreadManager::AddSyncMethod: its allocator makes a sync server's
//     per-call object on one gRPC thread; another deserializes the request into it after a
//     completion-queue handoff (the report's other side is gRPC's UnaryDeserializeHelper).
//   * status_internal::Payload: a Status's payloads, destroyed by whichever thread drops the
//     last reference (refcount in libabsl_status).
//
// Reports that these do not cover remain in the multi-process tests (docs/checking.md): gRPC's
// callback API hands reactors, tags and interceptors between threads, and an entry naming those
// frames would also hide races in our reactor callbacks, so there is none.
extern "C" const char* __tsan_default_suppressions() {
  return "called_from_lib:libgrpc.so\n"
         "called_from_lib:libgpr.so\n"
         "called_from_lib:libabsl_status.so\n"
         "called_from_lib:libabsl_cord.so\n"
         "race:grpc::Server::SyncRequestThreadManager::AddSyncMethod\n"
         "race:status_internal::Payload\n";
}
