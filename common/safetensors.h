// Reading named tensors from Hugging Face safetensors checkpoints without reading the rest: a
// file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
// and byte range, then the data. A checkpoint directory holds model.safetensors, or shards listed
// by model.safetensors.index.json's weight_map. Only the header and the tensors asked for are read
// (pread), so taking 61 small tensors out of a 700 GB checkpoint costs what they weigh.
//
// The files are the operator's, but every header field is checked before use: header length
// (at most 100 MB), byte ranges inside the file, byte counts matching dtype x shape, shard names
// that stay inside the directory.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnd::safetensors {

struct TensorInfo {
  std::string dtype;           // "F32", "F16", "BF16", "F8_E4M3", ... as the header says
  std::vector<int64_t> shape;  // [] for a scalar
  uint64_t offset = 0;         // absolute byte offset in the file
  uint64_t nbytes = 0;
  int64_t num_elements() const;
};

class File {
 public:
  // NOT_FOUND (no such file), INVALID_ARGUMENT (not a safetensors file, naming what is wrong).
  static absl::StatusOr<std::unique_ptr<File>> Open(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  // Null when the file holds no tensor of that name.
  const TensorInfo* Find(absl::string_view name) const;
  const std::map<std::string, TensorInfo, std::less<>>& tensors() const { return tensors_; }
  // A tensor's values as fp32: F32, F16, BF16 and F8_E4M3 (unscaled) are read; other dtypes are
  // INVALID_ARGUMENT naming the tensor.
  absl::Status ReadF32(const TensorInfo& t, std::vector<float>* out) const;

 private:
  File(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
  std::map<std::string, TensorInfo, std::less<>> tensors_;
};

// A checkpoint directory: model.safetensors.index.json's weight_map when present, else every
// tensor of model.safetensors. Shards are opened when first needed.
class Checkpoint {
 public:
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);
  const std::string& dir() const { return dir_; }
  // The file holding `name` and its entry; NOT_FOUND naming the tensor and the checkpoint.
  absl::StatusOr<std::pair<const File*, const TensorInfo*>> Find(absl::string_view name);
  bool Has(absl::string_view name) const;
  absl::Status ReadF32(absl::string_view name, std::vector<int64_t>* shape,
                       std::vector<float>* values);

 private:
  explicit Checkpoint(std::string dir) : dir_(std::move(dir)) {}
  absl::StatusOr<const File*> Shard(const std::string& file);
  std::string dir_;
  std::map<std::string, std::string, std::less<>> weight_map_;  // tensor -> shard file name
  std::map<std::string, std::unique_ptr<File>> shards_;
};

}  // namespace attnd::safetensors
