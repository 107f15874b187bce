# Sourced by scripts/sanitize.sh and scripts/fuzz.sh: one configuration of the ASan+UBSan tree
# for both, so the fuzz targets link the objects the sanitizer tests were built from (the
# objects carry libFuzzer's coverage hooks, -fsanitize=fuzzer-no-link; the tests run with them
# unused) instead of compiling the whole tree a second time.
#   configure_sanitized DIR SANITIZERS [FUZZ=ON|OFF]
# -O1 -g1: what sanitizers are meant to run at (line numbers in reports, frames kept), and less
# to compile than -O2 -g after a header change.
configure_sanitized() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    -DATTND_SANITIZE="$2" -DATTND_FUZZ="${3:-OFF}" -DATTND_CUDA=OFF -DATTND_BUILD_BENCH=OFF \
    -DATTND_E2E_TESTS=OFF >/dev/null
}
# The ASan+UBSan tree both scripts use.
ASAN_TREE=${ASAN_TREE:-build-asan}
