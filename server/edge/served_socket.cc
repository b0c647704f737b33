#include "server/edge/served_socket.h"

#include "absl/strings/str_cat.h"

namespace memra {

absl::Status ServedSocket::AllowOperatorCall(absl::string_view rpc) const {
  if (for_operators()) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(rpc, " is an operator call: it is served only on the admin socket ",
                   admin_socket_path, " (memra-kvctl uses it), not on the engine socket"));
}

}  // namespace memra
