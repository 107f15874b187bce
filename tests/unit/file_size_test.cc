// Every product file (service, engine, kv_store, cluster, kernels, client, common, metrics,
// proto) stays under 700 lines: a file per concept (docs/architecture.md, "Layout of the tree").
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace {

constexpr int kLimit = 700;

int Lines(const std::filesystem::path& p) {
  std::ifstream in(p);
  int n = 0;
  std::string line;
  while (std::getline(in, line)) ++n;
  return n;
}

TEST(FileSizes, ProductFilesStayUnder700Lines) {
  const std::filesystem::path root = ATTND_SOURCE_DIR;
  int checked = 0;
  for (const char* dir : {"service", "engine", "kv_store", "cluster", "kernels", "client", "common",
                          "metrics", "proto"}) {
    if (!std::filesystem::exists(root / dir)) continue;
    for (const auto& e : std::filesystem::recursive_directory_iterator(root / dir)) {
      if (!e.is_regular_file()) continue;
      const std::string ext = e.path().extension().string();
      if (ext != ".cc" && ext != ".h" && ext != ".cu" && ext != ".cuh" && ext != ".inc" &&
          ext != ".py" && ext != ".proto")
        continue;
      const std::string rel = std::filesystem::relative(e.path(), root).string();
      if (rel.find("/tests/") != std::string::npos || rel.find("_pb2") != std::string::npos)
        continue;  // the Python client's tests and generated stubs are not product code
      const int n = Lines(e.path());
      ++checked;
      EXPECT_LE(n, kLimit) << rel << " has " << n << " lines: split it by concept";
    }
  }
  EXPECT_GT(checked, 100) << "the product folders were not found under " << root;
  // The engine's corridor (LayerRequest -> Engine::RunLayer -> Device::RunLayer) stays short.
  EXPECT_LE(Lines(root / "engine/engine.cc"), 600) << "engine/engine.cc: move a concept out";
}

}  // namespace
