#!/usr/bin/env bash
# cmake --install into a scratch prefix, then a tiny out-of-tree CMake project that finds the
# package (find_package(attnd)) and builds and runs a program using the client; and the same
# program through pkg-config.
set -euo pipefail
BUILD=$1
VERSION=$2  # MAJOR.MINOR of this build: what a user of this release asks find_package for
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cmake --install "$BUILD" --prefix "$WORK/prefix" >/dev/null
test -x "$WORK/prefix/bin/attnd" && test -x "$WORK/prefix/bin/attnctl"
# Headers under include/attnd/{client,common,v1}, the generated API once (not attnd/attnd/v1).
test -f "$WORK/prefix/include/attnd/client/attnd_client.h"
test -f "$WORK/prefix/include/attnd/v1/attention.pb.h"
if [ -e "$WORK/prefix/include/attnd/attnd" ]; then
  echo "install_test: headers under include/attnd/attnd"; exit 1
fi
"$WORK/prefix/bin/attnd" --version
mkdir -p "$WORK/app"
cat > "$WORK/app/main.cc" <<'CC'
#include <cstdio>
#include <attnd/client/attnd_client.h>  // the namespaced path; "client/attnd_client.h" works too
#include <attnd/v1/attention.grpc.pb.h>
int main() {
  const float x[4] = {1, 2, 3, 4};
  const attnd::v1::Tensor t = attnd::client::MakeTensor(attnd::DType::kF32, {2, 2}, x, sizeof(x));
  auto c = attnd::client::Client::Connect("127.0.0.1:1");  // nothing listens: Info fails cleanly
  const bool unavailable = c->Info().status().code() == absl::StatusCode::kUnavailable;
  std::printf("tensor %s %zu bytes, unreachable server: %s\n", t.datatype().c_str(),
              t.data().size(), unavailable ? "UNAVAILABLE" : "?");
  return t.data().size() == 16 && unavailable ? 0 : 1;
}
CC
cat > "$WORK/app/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.16)
project(attnd_app CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(attnd $VERSION REQUIRED)
add_executable(app main.cc)
target_link_libraries(app PRIVATE attnd::client)
CM
cmake -S "$WORK/app" -B "$WORK/app/build" -DCMAKE_PREFIX_PATH="$WORK/prefix" >/dev/null
cmake --build "$WORK/app/build" >/dev/null
"$WORK/app/build/app"
# pkg-config's flags point into the prefix given to cmake --install (not the configured one),
# and build and link the same program.
pc_dir=$(dirname "$(find "$WORK/prefix" -name attnd-client.pc | head -1)")
flags=$(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags --libs attnd-client)
case "$flags" in
  *"-I$WORK/prefix/"*) ;;
  *) echo "install_test: pkg-config's flags are not under the install prefix: $flags"; exit 1 ;;
esac
# shellcheck disable=SC2086
c++ -std=c++17 "$WORK/app/main.cc" -o "$WORK/app/app-pc" $flags
"$WORK/app/app-pc"
echo "install_test: find_package(attnd) and pkg-config attnd-client work"
