#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/fp8.h"
#include "common/status_macros.h"

namespace attnd::safetensors {
namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // the format's own bound

// Bytes per element of the dtypes the format names (0: not one of them).
size_t ElementBytes(absl::string_view dtype) {
  static const std::map<std::string, size_t, std::less<>> sizes = {
      {"F64", 8},     {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1},
      {"F8_E5M2", 1}, {"I64", 8}, {"I32", 4}, {"I16", 2},  {"I8", 1},
      {"U64", 8},     {"U32", 4}, {"U16", 2}, {"U8", 1},   {"BOOL", 1}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

absl::Status ReadAt(int fd, uint64_t offset, void* dst, uint64_t n, const std::string& path) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      return absl::DataLossError(absl::StrCat(path, ": read failed at byte ", offset,
                                              got < 0 ? ": " : " (end of file)",
                                              got < 0 ? std::strerror(errno) : ""));
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::Status Bad(const std::string& path, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": not a valid safetensors file: ", why));
}

// A JSON value that is an integer in [0, 2^53] (exact in the double nlohmann may hold).
bool NonNegativeInt(const nlohmann::json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return *out <= (uint64_t{1} << 53);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < 0) return false;
    *out = static_cast<uint64_t>(i);
    return true;
  }
  return false;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

int64_t TensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<File>> File::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT
               ? absl::NotFoundError(absl::StrCat(path, ": no such file"))
               : absl::InvalidArgumentError(absl::StrCat(path, ": ", std::strerror(errno)));
  std::unique_ptr<File> file(new File(path, fd));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return Bad(path, "not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) return Bad(path, absl::StrCat("only ", size, " bytes"));
  uint8_t len_bytes[8];
  RETURN_IF_ERROR(ReadAt(fd, 0, len_bytes, 8, path));
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = header << 8 | len_bytes[i];
  if (header == 0 || header > kMaxHeaderBytes || header > size - 8)
    return Bad(path, absl::StrCat("header length ", header, " (file of ", size,
                                  " bytes; at most 100 MB)"));
  std::string text(header, '\0');
  RETURN_IF_ERROR(ReadAt(fd, 8, text.data(), header, path));
  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return Bad(path, "the header is not a JSON object");
  const uint64_t data_begin = 8 + header, data_size = size - data_begin;
  for (const auto& [name, entry] : doc.items()) {
    if (name == "__metadata__") continue;
    const std::string what = absl::StrCat("tensor '", name, "'");
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("data_offsets") ||
        !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2)
      return Bad(path, absl::StrCat(what, " needs dtype, shape and data_offsets [begin, end]"));
    TensorInfo t;
    t.dtype = entry["dtype"].get<std::string>();
    uint64_t elems = 1;
    for (const nlohmann::json& d : entry["shape"]) {
      uint64_t v;
      if (!NonNegativeInt(d, &v)) return Bad(path, absl::StrCat(what, ": a bad dimension"));
      t.shape.push_back(static_cast<int64_t>(v));
      // Bounded by the file: a product above its size cannot match its byte range.
      elems = v == 0 ? 0 : (elems > size / v ? size + 1 : elems * v);
    }
    uint64_t begin, end;
    if (!NonNegativeInt(entry["data_offsets"][0], &begin) ||
        !NonNegativeInt(entry["data_offsets"][1], &end) || begin > end || end > data_size)
      return Bad(path, absl::StrCat(what, ": data_offsets outside the ", data_size, " data bytes"));
    const size_t es = ElementBytes(t.dtype);
    if (es != 0 && (elems > size || elems * es != end - begin))
      return Bad(path, absl::StrCat(what, ": ", end - begin, " bytes for ", t.dtype, " of ", elems,
                                    " elements"));
    t.offset = data_begin + begin;
    t.nbytes = end - begin;
    file->tensors_.emplace(name, std::move(t));
  }
  return file;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* File::Find(absl::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status File::ReadF32(const TensorInfo& t, std::vector<float>* out) const {
  std::optional<DType> dt;
  if (t.dtype == "F32") dt = DType::kF32;
  if (t.dtype == "F16") dt = DType::kF16;
  if (t.dtype == "BF16") dt = DType::kBF16;
  if (t.dtype == "F8_E4M3") dt = DType::kFP8E4M3;
  if (!dt)
    return absl::InvalidArgumentError(absl::StrCat(path_, ": a tensor of dtype ", t.dtype,
                                                   "; attnd reads F32, F16, BF16 and F8_E4M3"));
  std::vector<uint8_t> raw(t.nbytes);
  RETURN_IF_ERROR(ReadAt(fd_, t.offset, raw.data(), t.nbytes, path_));
  const size_t n = t.nbytes / DTypeSize(*dt);
  out->resize(n);
  if (*dt == DType::kFP8E4M3) {
    for (size_t i = 0; i < n; ++i) (*out)[i] = fp8::E4M3ToF32(raw[i]);
  } else {
    ConvertToF32(*dt, raw.data(), out->data(), n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::unique_ptr<Checkpoint> c(new Checkpoint(dir));
  const std::string index = absl::StrCat(dir, "/model.safetensors.index.json");
  struct stat st;
  if (::stat(index.c_str(), &st) != 0) {
    ASSIGN_OR_RETURN(const File* single, c->Shard("model.safetensors"));
    for (const auto& [name, t] : single->tensors())
      c->weight_map_.emplace(name, "model.safetensors");
    return c;
  }
  ASSIGN_OR_RETURN(const std::string text, ReadText(index));
  const nlohmann::json doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("weight_map") ||
      !doc["weight_map"].is_object())
    return absl::InvalidArgumentError(
        absl::StrCat(index, ": not a JSON object with a weight_map object"));
  for (const auto& [name, file] : doc["weight_map"].items()) {
    if (!file.is_string())
      return absl::InvalidArgumentError(
          absl::StrCat(index, ": weight_map['", name, "'] is not a file name"));
    const std::string f = file.get<std::string>();
    // A shard is a file of this directory: no paths, so the index cannot point elsewhere.
    if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos ||
        f.find('\0') != std::string::npos)
      return absl::InvalidArgumentError(absl::StrCat(index, ": weight_map['", name, "'] = '", f,
                                                     "' is not a file of this directory"));
    c->weight_map_.emplace(name, f);
  }
  return c;
}

absl::StatusOr<const File*> Checkpoint::Shard(const std::string& file) {
  auto it = shards_.find(file);
  if (it != shards_.end()) return it->second.get();
  ASSIGN_OR_RETURN(std::unique_ptr<File> f, File::Open(absl::StrCat(dir_, "/", file)));
  return shards_.emplace(file, std::move(f)).first->second.get();
}

bool Checkpoint::Has(absl::string_view name) const { return weight_map_.count(name) != 0; }

absl::StatusOr<std::pair<const File*, const TensorInfo*>> Checkpoint::Find(absl::string_view name) {
  auto it = weight_map_.find(name);
  if (it == weight_map_.end())
    return absl::NotFoundError(absl::StrCat(dir_, ": the checkpoint has no tensor '", name, "'"));
  ASSIGN_OR_RETURN(const File* f, Shard(it->second));
  const TensorInfo* t = f->Find(name);
  if (t == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(f->path(), ": has no tensor '", name,
                                                   "' although the index says it holds it"));
  return std::make_pair(f, t);
}

absl::Status Checkpoint::ReadF32(absl::string_view name, std::vector<int64_t>* shape,
                                 std::vector<float>* values) {
  ASSIGN_OR_RETURN(auto found, Find(name));
  *shape = found.second->shape;
  return found.first->ReadF32(*found.second, values);
}

}  // namespace attnd::safetensors
