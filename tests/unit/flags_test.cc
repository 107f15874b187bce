// attnd's command line: one flag table behind --help and the parser, --version, and refusals
// (unknown flags, stray arguments, bad values, trust flags that only make sense together).
#include "service/flags.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "common/build_version.h"

namespace attnd {
namespace {

absl::StatusOr<ServerFlags> Parse(std::vector<std::string> args) {
  args.insert(args.begin(), "attnd");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return ParseServerFlags(static_cast<int>(argv.size()), argv.data());
}

TEST(Flags, HelpListsEveryFlagOfTheTableWithinHundredColumns) {
  const std::string usage = ServerUsage();
  for (const std::string& name : ServerFlagNames())
    EXPECT_NE(usage.find("--" + name), std::string::npos) << name;
  std::istringstream lines(usage);
  for (std::string line; std::getline(lines, line);) EXPECT_LE(line.size(), 100u) << line;
  const auto help = Parse({"--help"});
  EXPECT_EQ(help.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(help.status().message(), usage);
}

TEST(Flags, HelpAndVersionAnswerWhateverElseTheLineHolds) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--threads=x", "--help"},
                                               {"--help", "--threads=x"},
                                               {"--bogus", "-h"},
                                               {"stray", "--help", "--shm="}}) {
    const auto help = Parse(args);
    EXPECT_EQ(help.status().code(), absl::StatusCode::kCancelled) << help.status();
    EXPECT_EQ(help.status().message(), ServerUsage()) << args[0];
  }
  const auto v = Parse({"--kv-cache-bytes=8X", "--version"});
  EXPECT_EQ(v.status().code(), absl::StatusCode::kCancelled) << v.status();
  EXPECT_EQ(v.status().message(), Parse({"--version"}).status().message());
}

TEST(Flags, VersionNamesTheBuild) {
  const auto v = Parse({"--version"});
  EXPECT_EQ(v.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(v.status().message(),
            std::string("attnd ") + BuildVersion() + " (" + BuildRevision() + ")\n");
  EXPECT_NE(std::string(BuildVersion()), "0.0.0") << "the CMake project version reaches the code";
}

TEST(Flags, ValuesSwitchesAndDefaults) {
  auto f = Parse({"--grpc-address=::", "--grpc-port", "0", "--metrics-port=0", "--shm",
                  "--shm-socket=/tmp/x.sock", "--devices=cpu:0,cpu:1", "--drain-peers=a:1,b:2",
                  "--kv-cache-fraction=0.9", "--executor-threads=3"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->grpc_address, "::");
  EXPECT_EQ(f->metrics_port, 0);
  EXPECT_TRUE(f->shm);
  EXPECT_EQ(f->devices.size(), 2u);
  EXPECT_EQ(f->drain_peers.size(), 2u);
  EXPECT_DOUBLE_EQ(f->kv_cache_fraction, 0.9);
  EXPECT_EQ(f->executor_threads, 3);
  const ServerFlags d = Parse({}).value();
  EXPECT_EQ(d.executor_threads, 8);
  EXPECT_EQ(d.metrics_port, 8002);
  EXPECT_TRUE(d.allow_metrics);
  EXPECT_EQ(d.auth, "none");
  EXPECT_FALSE(d.shm);
  EXPECT_TRUE(d.grpc_reflection);
  EXPECT_EQ(d.kv_cache_fraction, 0);  // sized by --kv-cache-bytes
  EXPECT_FALSE(d.reuse_grpc_port);    // a port in use is a startup error
  EXPECT_TRUE(Parse({"--reuse-grpc-port"}).value().reuse_grpc_port);
  EXPECT_EQ(d.replica_name, "");  // HOST:PORT once the port is bound
  EXPECT_EQ(Parse({"--replica-name=attnd-0.attnd:50051"}).value().replica_name,
            "attnd-0.attnd:50051");
}

// Sizes take units (powers of 1024), the last of a repeated flag wins, switches stand alone or
// take true/false, and --log-level has debug.
TEST(Flags, SizesWithUnitsRepeatsAndSwitches) {
  const auto f =
      Parse({"--kv-cache-bytes=8G", "--host-cache-bytes", "512MiB", "--gpu-scratch-bytes=3k",
             "--prefix-cache-bytes=all", "--standby-cache-bytes=2T", "--max-echo-bytes=1048576",
             "--kv-pages=10", "--kv-pages=20", "--shm", "--shm-socket=/tmp/x.sock",
             "--log-level=debug", "--reuse-grpc-port=false"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kv_cache_bytes, int64_t{8} << 30);
  EXPECT_EQ(f->host_cache_bytes, int64_t{512} << 20);
  EXPECT_EQ(f->gpu_scratch_bytes, 3 * 1024);
  EXPECT_EQ(f->prefix_cache_bytes, -1);
  EXPECT_EQ(f->standby_cache_bytes, int64_t{2} << 40);
  EXPECT_EQ(f->max_echo_bytes, 1048576);
  EXPECT_EQ(f->kv_pages, 20);
  EXPECT_TRUE(f->shm);
  EXPECT_EQ(f->log_level, "debug");
  EXPECT_FALSE(f->reuse_grpc_port);
  EXPECT_FALSE(Parse({"--shm=false"}).value().shm);
  // "--flag=" is an empty value: a list flag cleared after an earlier one.
  const auto cleared = Parse({"--drain-peers=a:1,b:2", "--drain-peers=", "--standby-peers="});
  ASSERT_TRUE(cleared.ok()) << cleared.status();
  EXPECT_TRUE(cleared->drain_peers.empty());
  EXPECT_TRUE(cleared->standby_peers.empty());
}

// Every flag attnd had (tests/data/attnd_flags.txt: 0.3.0's and those added since) is still
// there and takes a value of its kind; no flags at all give ServerFlags' defaults.
TEST(Flags, EveryFlagOfTheReleaseIsKeptWithItsDefaults) {
  std::ifstream in(ATTND_SOURCE_DIR "/tests/data/attnd_flags.txt");
  ASSERT_TRUE(in.good());
  const std::vector<std::string> now = ServerFlagNames();
  int seen = 0;
  for (std::string name; std::getline(in, name);) {
    if (name.empty() || name[0] == '#') continue;
    ++seen;
    EXPECT_NE(std::find(now.begin(), now.end(), name), now.end()) << "--" << name << " is gone";
  }
  EXPECT_GE(seen, 79);
  const auto d = Parse({});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(*d == ServerFlags{}) << "the parser changed a default";
  const std::string usage = ServerUsage();
  for (const char* unit : {"--kv-cache-bytes BYTES", "--log-level debug|info|warning|error"})
    EXPECT_NE(usage.find(unit), std::string::npos) << unit << "\n" << usage;
}

// --cache-dtype takes the short names and the API's datatype spellings alike.
TEST(Flags, CacheDtypeTakesTheApisSpellings) {
  const std::vector<std::pair<std::string, DType>> cases = {
      {"bf16", DType::kBF16},        {"BF16", DType::kBF16},        {"fp8", DType::kFP8E4M3},
      {"FP8_E4M3", DType::kFP8E4M3}, {"fp8_e4m3", DType::kFP8E4M3}, {"fp32", DType::kF32},
      {"FP32", DType::kF32}};
  for (const auto& [spelling, want] : cases) {
    const auto f = Parse({"--cache-dtype=" + spelling});
    ASSERT_TRUE(f.ok()) << spelling << ": " << f.status();
    EXPECT_EQ(f->cache_dtype, want) << spelling;
  }
}

TEST(Flags, RefusalsSayWhat) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--bogus=1"}, "unknown flag --bogus"},
      {{"--grpc-prot=1"}, "unknown flag --grpc-prot (did you mean --grpc-port?)"},
      {{"--kv-cache-bytes=8X"},
       "bad value '8X' for --kv-cache-bytes: bytes: an integer with an "
       "optional unit K, M, G or T"},
      {{"--kv-cache-bytes=99999999T"}, "at most 2^62"},
      {{"--kv-cache-bytes=5i"}, "bad value '5i' for --kv-cache-bytes"},
      {{"--kv-cache-bytes=5KB7"}, "bad value '5KB7' for --kv-cache-bytes"},
      {{"--threads=x", "--threads=2"}, "bad value 'x' for --threads"},  // not hidden by the later
      {{"--shm=maybe", "--shm-socket=/tmp/x"}, "bad value 'maybe' for --shm: true or false"},
      {{"--shm=", "--shm-socket=/tmp/x"}, "bad value '' for --shm: true or false"},
      {{"--check-finite="}, "bad value '' for --check-finite: true or false"},
      {{"stray"}, "unexpected argument 'stray'"},
      {{"--grpc-port=70000"}, "port out of range"},
      {{"--threads=-1"}, "bad value '-1' for --threads"},
      {{"--executor-threads=0"}, "bad value '0' for --executor-threads: an integer in [1, 1024]"},
      {{"--executor-threads=1025"}, "bad value '1025' for --executor-threads"},
      {{"--max-sequences=0"}, "bad value '0' for --max-sequences"},
      {{"--kv-pages=4294967360"}, "bad value"},
      {{"--drain-parallel=65"}, "--drain-parallel: at most 64"},
      {{"--drain-parallel=0"}, "bad value '0' for --drain-parallel"},
      {{"--kv-cache-fraction=0"}, "bad value '0' for --kv-cache-fraction"},
      {{"--kv-cache-fraction=1.5"}, "bad value '1.5' for --kv-cache-fraction"},
      {{"--kv-cache-fraction=nan"}, "bad value 'nan' for --kv-cache-fraction"},
      {{"--auth=mtls"}, "--auth=mtls needs --tls-client-ca"},
      {{"--auth=token"}, "--auth=token needs --auth-tokens"},
      {{"--tls-cert=a.pem"}, "--tls-cert and --tls-key go together"},
      {{"--shm"}, "--shm needs --shm-socket"},
      {{"--admin-tenant=ops"}, "--admin-tenant needs --auth"},
      {{"--grpc-port"}, "--grpc-port"},  // no value: CLI11 names the flag
      {{"--log-level=loud"},
       "bad value 'loud' for --log-level: one of debug, error, info, warning"},
      {{"--auth-tokens=tokens.txt"}, "--auth-tokens needs --auth=token"},
      {{"--sequence-idle-timeout-s=-1"}, "bad value '-1' for --sequence-idle-timeout-s"},
      {{"--sequence-idle-timeout-s=400000000"}, "--sequence-idle-timeout-s: at most ten years"},
      {{"--cache-dtype=FP16"}, "bad value 'FP16' for --cache-dtype"},
      {{"--replica-name=a/b"}, "--replica-name: at most 253 letters, digits"},
      {{"--replica-name=" + std::string(254, 'a')}, "--replica-name: at most 253"},
      {{"--data-plane=rdma"}, "bad value 'rdma' for --data-plane: one of off, ucx"},
      {{"--data-plane=ucx", "--tls-cert=a.pem", "--tls-key=a.key"},
       "UCX does not encrypt; add --data-plane-without-tls"},
      {{"--data-plane-region-bytes=100"}, "--data-plane-region-bytes: from 4096"},
      {{"--data-plane-max-planes=0"}, "--data-plane-max-planes: from 1 to 4096"},
      {{"--data-plane-timeout-ms=0"}, "bad value '0' for --data-plane-timeout-ms"},
      {{"--data-plane-keepalive-ms=50"}, "--data-plane-keepalive-ms: 0, or from 100 to 3600000"},
      {{"--data-plane-keepalive-ms=-1"}, "bad value '-1' for --data-plane-keepalive-ms"},
  };
  for (const auto& [args, want] : cases) {
    const auto f = Parse(args);
    ASSERT_FALSE(f.ok()) << args[0];
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << args[0];
    EXPECT_NE(f.status().message().find(want), std::string::npos) << f.status();
  }
}

}  // namespace
}  // namespace attnd

namespace attnd {
namespace {

// The CUDA kernel forms are flags (kernels/cuda/backend/kernel_choice.h), checked by name.
TEST(Flags, CudaKernelFormsAreFlagsOfKnownNames) {
  const auto d = Parse({});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->cuda_mla, "default");
  EXPECT_EQ(d->cuda_indexer, "default");
  EXPECT_EQ(d->cuda_topk, "attnd");
  const auto f = Parse({"--cuda-mla=flashinfer", "--cuda-indexer=simt", "--cuda-topk=flashinfer"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->cuda_mla, "flashinfer");
  EXPECT_EQ(f->cuda_indexer, "simt");
  EXPECT_EQ(f->cuda_topk, "flashinfer");
  for (const char* bad : {"--cuda-mla=fast", "--cuda-indexer=wgmma", "--cuda-topk=radix"}) {
    const auto r = Parse({bad});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace attnd
