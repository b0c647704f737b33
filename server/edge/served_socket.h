#ifndef MEMRA_SERVER_SERVED_SOCKET_H_
#define MEMRA_SERVER_SERVED_SOCKET_H_

// Which of the daemon's two Unix sockets a service instance answers on (docs/security-model.md).
// The engine socket (socket_path) serves engines: the session calls and the read-only queries
// that tell nothing about other engines. The admin socket (admin_socket_path, mode 0600 by
// default) serves operators everything, including the calls that affect or reveal other engines
// (drain, undrain, eviction, plan import with registration, the lists of sessions, engines and
// prefixes). The daemon builds one instance of KvAdmin and of KvPrefixCache per socket.

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace memra {

struct ServedSocket {
  enum class Audience { kEngines, kOperators };
  Audience audience = Audience::kEngines;
  // The operators' socket, named in every refusal on the engine socket.
  std::string admin_socket_path;

  bool for_operators() const { return audience == Audience::kOperators; }
  // OK on the admin socket. On the engine socket PERMISSION_DENIED naming `rpc` (e.g.
  // "KvAdmin.Drain") and the admin socket.
  absl::Status AllowOperatorCall(absl::string_view rpc) const;
};

}  // namespace memra

#endif  // MEMRA_SERVER_SERVED_SOCKET_H_
