#include "service/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/enum_names.h"

namespace attnd {
namespace {

constexpr size_t kMinTokenBytes = 16;
constexpr size_t kMaxTenantBytes = 256;
constexpr char kBearer[] = "Bearer ";

std::array<uint8_t, 32> Digest(absl::string_view token) {
  std::array<uint8_t, 32> d{};
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), d.data());
  return d;
}

// The value of metadata `key`, if present exactly once.
std::optional<std::string> Metadata(const grpc::ServerContextBase& ctx, const char* key) {
  const auto& md = ctx.client_metadata();
  auto range = md.equal_range(key);
  if (range.first == range.second || std::next(range.first) != range.second) return std::nullopt;
  return std::string(range.first->second.data(), range.first->second.size());
}

}  // namespace

constexpr NamedValue<AuthMode> kAuthModeNames[] = {
    {AuthMode::kNone, "none"}, {AuthMode::kToken, "token"}, {AuthMode::kMtls, "mtls"}};

absl::StatusOr<AuthMode> ParseAuthMode(const std::string& name) {
  if (auto mode = ValueNamed(kAuthModeNames, absl::string_view(name))) return *mode;
  return absl::InvalidArgumentError(
      absl::StrCat("--auth: '", name, "' is not none, token or mtls"));
}

const char* AuthModeName(AuthMode mode) { return NameIn(kAuthModeNames, mode); }

absl::Status CheckTenantName(const std::string& tenant) {
  bool ok = !tenant.empty() && tenant.size() <= kMaxTenantBytes;
  for (char c : tenant) ok = ok && c > ' ' && c < 127;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("tenant names are 1 to ", kMaxTenantBytes,
                                                 " printable ASCII characters without spaces"));
}

absl::StatusOr<TokenTable> ParseTokenFile(const std::string& text) {
  TokenTable table;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (const size_t hash = line.find('#'); hash != absl::string_view::npos)
      line = line.substr(0, hash);
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (f.empty()) continue;
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("token file line ", line_no, ": ", why));
    };
    if (f.size() < 2)
      return bad(
          "want TOKEN TENANT [pages=N] [sequences=N] [steps=N] "
          "[shm-regions=N]");
    if (f[0].size() < kMinTokenBytes)
      return bad(absl::StrCat("token shorter than ", kMinTokenBytes, " characters"));
    const std::string tenant(f[1]);
    if (absl::Status s = CheckTenantName(tenant); !s.ok()) return bad(std::string(s.message()));
    TokenTable::Entry e{Digest(f[0]), tenant};
    for (const auto& other : table.entries)
      if (CRYPTO_memcmp(other.digest.data(), e.digest.data(), e.digest.size()) == 0)
        return bad("token repeated");
    table.entries.push_back(std::move(e));
    TokenTable::Override& q = table.quotas[tenant];
    for (size_t i = 2; i < f.size(); ++i) {
      std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(f[i], '=');
      int64_t v = 0;
      if (!absl::SimpleAtoi(kv.second, &v) || v < 0)
        return bad(absl::StrCat("'", kv.first, "' needs a non-negative integer"));
      std::optional<int64_t>* field = kv.first == "pages"         ? &q.pages
                                      : kv.first == "sequences"   ? &q.sequences
                                      : kv.first == "steps"       ? &q.steps
                                      : kv.first == "shm-regions" ? &q.shm_regions
                                                                  : nullptr;
      if (field == nullptr)
        return bad(absl::StrCat("unknown quota '", kv.first.substr(0, 32),
                                "' (pages, sequences, steps, shm-regions)"));
      if (field->has_value() && **field != v)
        return bad(
            absl::StrCat("tenant ", tenant, ": ", kv.first, "= differs from an earlier line"));
      *field = v;
    }
  }
  return table;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::Create(AuthOptions options) {
  if (options.mode == AuthMode::kToken && options.tokens_file.empty())
    return absl::InvalidArgumentError("--auth=token needs --auth-tokens=FILE");
  if (!options.admin_tenant.empty()) {
    if (options.mode == AuthMode::kNone)
      return absl::InvalidArgumentError("--admin-tenant needs --auth=token or --auth=mtls");
    if (absl::Status s = CheckTenantName(options.admin_tenant); !s.ok())
      return absl::InvalidArgumentError(absl::StrCat("--admin-tenant: ", s.message()));
  }
  if (!options.admin_token_file.empty() && options.mode != AuthMode::kNone)
    return absl::InvalidArgumentError(
        "--admin-token-file is for --auth=none (under --auth=token or mtls the admin is "
        "--admin-tenant)");
  std::unique_ptr<Authenticator> a(new Authenticator(std::move(options)));
  if (!a->options_.admin_token_file.empty()) {
    std::ifstream in(a->options_.admin_token_file);
    std::string token;
    if (!in || !std::getline(in, token))
      return absl::NotFoundError(
          absl::StrCat("--admin-token-file: cannot read ", a->options_.admin_token_file));
    token = std::string(absl::StripAsciiWhitespace(token));
    if (token.size() < kMinTokenBytes)
      return absl::InvalidArgumentError(
          absl::StrCat("--admin-token-file: the token (its first line) needs at least ",
                       kMinTokenBytes, " characters"));
    a->admin_token_ = Digest(token);
  }
  if (!a->options_.tokens_file.empty()) {
    auto loaded = a->ReloadIfChanged();
    if (!loaded.ok()) return loaded.status();
  }
  return a;
}

absl::StatusOr<bool> Authenticator::ReloadIfChanged() {
  if (options_.tokens_file.empty()) return false;
  struct stat st {};
  if (stat(options_.tokens_file.c_str(), &st) != 0)
    return absl::NotFoundError(absl::StrCat("--auth-tokens: cannot stat ", options_.tokens_file));
  const FileStamp stamp{int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec,
                        static_cast<int64_t>(st.st_size), static_cast<int64_t>(st.st_ino)};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (tokens_ != nullptr && stamp == stamp_) return false;
  }
  std::ifstream in(options_.tokens_file);
  if (!in)
    return absl::NotFoundError(absl::StrCat("--auth-tokens: cannot read ", options_.tokens_file));
  std::stringstream text;
  text << in.rdbuf();
  auto table = ParseTokenFile(text.str());
  if (!table.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens ", options_.tokens_file, ": ", table.status().message()));
  auto shared = std::make_shared<const TokenTable>(std::move(table).value());
  std::lock_guard<std::mutex> lock(mu_);
  tokens_ = std::move(shared);
  stamp_ = stamp;
  return true;
}

absl::flat_hash_map<std::string, TenantQuota> Authenticator::QuotaOverrides(
    const TenantQuota& fallback) const {
  std::shared_ptr<const TokenTable> t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    t = tokens_;
  }
  absl::flat_hash_map<std::string, TenantQuota> out;
  if (t == nullptr) return out;
  for (const auto& [tenant, o] : t->quotas) {
    TenantQuota q = fallback;
    q.pages = o.pages.value_or(q.pages);
    q.sequences = o.sequences.value_or(q.sequences);
    q.open_steps = o.steps.value_or(q.open_steps);
    q.shm_regions = o.shm_regions.value_or(q.shm_regions);
    out.emplace(tenant, q);
  }
  return out;
}

absl::StatusOr<std::string> Authenticator::TenantOfToken(const grpc::ServerContextBase& ctx) const {
  const std::optional<std::string> header = Metadata(ctx, "authorization");
  if (!header.has_value())
    return absl::UnauthenticatedError(
        "no credentials: send the metadata 'authorization: Bearer <token>' (once)");
  absl::string_view token(*header);
  if (!absl::ConsumePrefix(&token, kBearer))
    return absl::UnauthenticatedError("authorization: not a bearer token");
  std::shared_ptr<const TokenTable> t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    t = tokens_;
  }
  // Every entry is compared, in constant time each, whichever matches: the time taken says
  // nothing about the token.
  const std::array<uint8_t, 32> d = Digest(token);
  const std::string* tenant = nullptr;
  if (t != nullptr)
    for (const auto& e : t->entries)
      if (CRYPTO_memcmp(e.digest.data(), d.data(), d.size()) == 0) tenant = &e.tenant;
  if (tenant == nullptr) return absl::UnauthenticatedError("unknown or revoked bearer token");
  return *tenant;
}

bool IsLoopbackPeer(absl::string_view peer) {
  if (absl::ConsumePrefix(&peer, "ipv4:")) return absl::StartsWith(peer, "127.");
  if (!absl::ConsumePrefix(&peer, "ipv6:")) return false;
  if (!absl::ConsumePrefix(&peer, "[")) return false;
  const size_t close = peer.find(']');
  if (close == absl::string_view::npos) return false;
  const absl::string_view host = peer.substr(0, close);
  if (host == "::1") return true;
  absl::string_view v4 = host;
  return (absl::ConsumePrefix(&v4, "::ffff:") || absl::ConsumePrefix(&v4, "::FFFF:")) &&
         absl::StartsWith(v4, "127.");
}

absl::StatusOr<Caller> Authenticator::Authenticate(const grpc::ServerContextBase& ctx) const {
  Caller c;
  c.loopback = IsLoopbackPeer(ctx.peer());
  // Only the Unix-socket listener hands connections to gRPC by descriptor ("fd:N"); TCP peers
  // read "ipv4:..." or "ipv6:...".
  const std::string peer = ctx.peer();
  if (peer.rfind("fd:", 0) == 0) {
    int fd = -1;
    if (absl::SimpleAtoi(absl::string_view(peer).substr(3), &fd) && fd >= 0) {
      c.local = true;
      c.socket_fd = fd;
    }
  }
  switch (options_.mode) {
    case AuthMode::kNone: {
      // The anonymous tenant; the admin only by --admin-token-file's bearer token (any other
      // token is ignored, as without that flag).
      if (!admin_token_.has_value()) return c;
      const std::string header = Metadata(ctx, "authorization").value_or("");
      absl::string_view token(header);
      if (absl::ConsumePrefix(&token, kBearer)) {
        const std::array<uint8_t, 32> d = Digest(token);
        c.admin = CRYPTO_memcmp(d.data(), admin_token_->data(), d.size()) == 0;
      }
      return c;
    }
    case AuthMode::kToken: {
      auto tenant = TenantOfToken(ctx);
      if (!tenant.ok()) return tenant.status();
      c.tenant = *std::move(tenant);
      break;
    }
    case AuthMode::kMtls: {
      if (c.local) {
        // No certificate over the Unix socket: local callers present a token.
        if (options_.tokens_file.empty())
          return absl::UnauthenticatedError(
              "the Unix-socket listener under --auth=mtls needs --auth-tokens for its callers");
        auto tenant = TenantOfToken(ctx);
        if (!tenant.ok()) return tenant.status();
        c.tenant = *std::move(tenant);
        break;
      }
      const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
      const std::vector<grpc::string_ref> ids =
          auth ? auth->GetPeerIdentity() : std::vector<grpc::string_ref>{};
      if (auth == nullptr || !auth->IsPeerAuthenticated() || ids.empty())
        return absl::UnauthenticatedError("no verified client certificate");
      c.tenant.assign(ids[0].data(), ids[0].size());  // first SAN, else the CN
      if (!CheckTenantName(c.tenant).ok())
        return absl::UnauthenticatedError("the client certificate's identity is not a tenant name");
      break;
    }
  }
  c.admin = !options_.admin_tenant.empty() && c.tenant == options_.admin_tenant;
  if (const auto as = Metadata(ctx, kActAsTenantHeader); as.has_value()) {
    if (!c.admin)
      return absl::PermissionDeniedError(
          absl::StrCat(kActAsTenantHeader, ": only the admin identity may act as another tenant"));
    if (absl::Status s = CheckTenantName(*as); !s.ok())
      return absl::InvalidArgumentError(absl::StrCat(kActAsTenantHeader, ": ", s.message()));
    c.tenant = *as;
  }
  return c;
}

}  // namespace attnd
