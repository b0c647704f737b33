#ifndef MEMRA_SERVER_IDS_H_
#define MEMRA_SERVER_IDS_H_

// The daemon's strong ids for engines and sessions, in a leaf header so that code that only names
// an engine or a session (leases, the prefix store, the restart journal) does not pull in the
// session and its wire types.

#include <cstdint>

namespace memra {

// Never reused within a daemon's life; 0 is never issued.
struct SessionId {
  uint64_t value = 0;
};
struct EngineId {
  uint64_t value = 0;
  friend bool operator==(EngineId a, EngineId b) { return a.value == b.value; }
};

}  // namespace memra

#endif  // MEMRA_SERVER_IDS_H_
