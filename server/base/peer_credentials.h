#ifndef MEMRA_SERVER_PEER_CREDENTIALS_H_
#define MEMRA_SERVER_PEER_CREDENTIALS_H_

// Who is at the other end of a Unix socket, as the kernel says (SO_PEERCRED, read when the
// engine connected to the handoff socket: server/edge/arena_handoff.h). What an engine is bound to
// at Attach, and what its default prefix-cache scope derives from.

#include <sys/types.h>

namespace memra {

struct PeerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_PEER_CREDENTIALS_H_
