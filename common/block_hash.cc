#include "common/block_hash.h"

#include <openssl/evp.h>

#include <memory>

namespace attnd {
namespace {

void PutU32(uint32_t v, uint8_t* out) {
  out[0] = static_cast<uint8_t>(v);
  out[1] = static_cast<uint8_t>(v >> 8);
  out[2] = static_cast<uint8_t>(v >> 16);
  out[3] = static_cast<uint8_t>(v >> 24);
}

constexpr char kDomain[] = "attnd prefix v1";  // hashed with its terminating 0x00

// SHA-256 through OpenSSL's EVP interface (one context, reset per digest).
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) {}
  void Begin() { EVP_DigestInit_ex2(ctx_.get(), Md(), nullptr); }
  void Add(const void* data, size_t n) { EVP_DigestUpdate(ctx_.get(), data, n); }
  BlockHash End() {
    BlockHash h;
    unsigned int n = 0;
    EVP_DigestFinal_ex(ctx_.get(), h.data(), &n);
    return h;
  }

 private:
  // The algorithm fetched once (OpenSSL 3 looks it up on every init by name otherwise).
  static const EVP_MD* Md() {
    static const EVP_MD* const md = [] {
      const EVP_MD* fetched = EVP_MD_fetch(nullptr, "SHA256", nullptr);
      return fetched != nullptr ? fetched : EVP_sha256();
    }();
    return md;
  }
  struct Free {
    void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
  };
  std::unique_ptr<EVP_MD_CTX, Free> ctx_;
};

BlockHash Chain(Sha256& sha, const BlockHash& parent, absl::Span<const uint32_t> tokens) {
  sha.Begin();
  sha.Add(parent.data(), parent.size());
  uint8_t buf[256];  // 64 tokens at a time
  for (size_t i = 0; i < tokens.size();) {
    size_t n = 0;
    for (; n < sizeof(buf) / 4 && i < tokens.size(); ++n, ++i) PutU32(tokens[i], buf + 4 * n);
    sha.Add(buf, 4 * n);
  }
  return sha.End();
}

}  // namespace

BlockHash PrefixRoot(int32_t block_size, std::string_view salt) {
  Sha256 sha;
  sha.Begin();
  sha.Add(kDomain, sizeof(kDomain));
  uint8_t size[4];
  PutU32(static_cast<uint32_t>(block_size), size);
  sha.Add(size, sizeof(size));
  sha.Add(salt.data(), salt.size());
  return sha.End();
}

BlockHash HashBlock(const BlockHash& parent, absl::Span<const uint32_t> tokens) {
  Sha256 sha;
  return Chain(sha, parent, tokens);
}

std::vector<BlockHash> HashBlocks(absl::Span<const uint32_t> tokens, int32_t block_size,
                                  std::string_view salt) {
  std::vector<BlockHash> out;
  if (block_size <= 0) return out;
  const size_t bs = static_cast<size_t>(block_size);
  out.reserve(tokens.size() / bs);
  BlockHash parent = PrefixRoot(block_size, salt);
  Sha256 sha;
  for (size_t b = 0; b + bs <= tokens.size(); b += bs) {
    parent = Chain(sha, parent, tokens.subspan(b, bs));
    out.push_back(parent);
  }
  return out;
}

std::string BlockHashHex(const BlockHash& h) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(2 * h.size(), '0');
  for (size_t i = 0; i < h.size(); ++i) {
    s[2 * i] = kHex[h[i] >> 4];
    s[2 * i + 1] = kHex[h[i] & 15];
  }
  return s;
}

}  // namespace attnd
