// memra-kvctl: the operator's CLI for memra-kvd. Everything but argv and the standard streams is
// in tools/kvctl.h (exit codes there).

#include <iostream>
#include <string>
#include <vector>

#include "tools/kvctl.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  return memra::kvctl::RunKvctl(args, std::cout, std::cerr);
}
