// Prints RenderConfig(DaemonConfig{}): the source of deploy/memra-kv.conf.example.

#include <iostream>

#include "server/config.h"

int main() {
  std::cout << memra::RenderConfig(memra::DaemonConfig{});
  return 0;
}
