#ifndef MEMRA_TESTS_E2E_OPERATOR_VIEW_H_
#define MEMRA_TESTS_E2E_OPERATOR_VIEW_H_

// What an operator sees of a running daemon, for end-to-end tests: calls on a client connected
// to the daemon's admin socket.

#include "client/client.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "tests/status_matchers.h"

namespace memra::testing {

// KvPrefixCache.ListPrefixes through `operator_client` (a test failure when it fails).
inline memra::kv::v1::ListPrefixesResponse ListPrefixes(KvClient& operator_client) {
  memra::kv::v1::ListPrefixesResponse response;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Prefix(operator_client)
                                 .ListPrefixes(ClientInternals::NewContext(operator_client).get(),
                                               {}, &response)),
              IsOk());
  return response;
}

}  // namespace memra::testing

#endif  // MEMRA_TESTS_E2E_OPERATOR_VIEW_H_
