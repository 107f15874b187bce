// Who is calling (docs/trust.md): the tenant of every RPC, from the mTLS client certificate or a
// bearer token, and whether the call came over the local Unix-socket listener (the only way to
// use shared memory). Tokens live in a file (reloaded when it changes) and are kept only as
// SHA-256 digests, compared in constant time, and never logged.
//
// Token file: one token per line, `TOKEN TENANT [pages=N] [sequences=N] [steps=N]
// [shm-regions=N]`; `#` starts a comment. The optional fields override the quota flags for that
// tenant (several tokens may name one tenant; their quota fields must agree).
#pragma once

#include <grpcpp/grpcpp.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kv_store/tenant_ledger.h"

namespace attnd {

enum class AuthMode { kNone, kToken, kMtls };
absl::StatusOr<AuthMode> ParseAuthMode(const std::string& name);
const char* AuthModeName(AuthMode mode);

// The caller of one RPC.
struct Caller {
  std::string tenant;     // the namespace it acts in ("" = the anonymous tenant)
  bool admin = false;     // the admin identity (--admin-tenant, or --admin-token-file's bearer)
  bool local = false;     // came over the Unix-socket listener
  bool loopback = false;  // came over TCP from this host (127.0.0.0/8, ::1, ::ffff:127.x)
  int socket_fd = -1;     // local: the connection's socket (for its peer credentials)
};

// Metadata an admin sets to act inside one tenant's namespace (e.g. handing its sequences off).
inline constexpr char kActAsTenantHeader[] = "attnd-tenant";

struct AuthOptions {
  AuthMode mode = AuthMode::kNone;
  std::string tokens_file;   // --auth-tokens; also identifies local callers under mtls
  std::string admin_tenant;  // --admin-tenant; empty = nobody
  // --admin-token-file (--auth=none only): a caller presenting this bearer token is the admin
  // from any address (the replicas' drains and standby copies, --drain-token-file); without it
  // the admin is whoever calls on loopback or the Unix socket.
  std::string admin_token_file;
};

// Whether a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000") is on this host's
// loopback. Unix-socket peers ("fd:N", "unix:...") are not TCP and answer false.
bool IsLoopbackPeer(absl::string_view peer);

// A parsed token file.
struct TokenTable {
  struct Entry {
    std::array<uint8_t, 32> digest;  // SHA-256 of the token
    std::string tenant;
  };
  std::vector<Entry> entries;
  // Per-tenant quota fields the file sets; the others come from the flags.
  struct Override {
    std::optional<int64_t> pages, sequences, steps, shm_regions;
  };
  absl::flat_hash_map<std::string, Override> quotas;
};
// INVALID_ARGUMENT naming the line (never quoting a token).
absl::StatusOr<TokenTable> ParseTokenFile(const std::string& text);
// Tenant names: 1 to 256 printable ASCII characters without spaces.
absl::Status CheckTenantName(const std::string& tenant);

class Authenticator {
 public:
  // Reads the token file when one is given.
  static absl::StatusOr<std::unique_ptr<Authenticator>> Create(AuthOptions options);

  // The caller, or UNAUTHENTICATED (no or unknown credentials) / PERMISSION_DENIED (acting as
  // another tenant without being the admin).
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContextBase& ctx) const;

  // Rereads the token file if it changed since the last read. Returns true when a new table was
  // loaded; an unreadable or malformed file keeps the old table and returns the error.
  absl::StatusOr<bool> ReloadIfChanged();
  // Quota overrides of the current token table (merge them over the flag quotas).
  absl::flat_hash_map<std::string, TenantQuota> QuotaOverrides(const TenantQuota& fallback) const;
  const AuthOptions& options() const { return options_; }

 private:
  explicit Authenticator(AuthOptions options) : options_(std::move(options)) {}
  absl::StatusOr<std::string> TenantOfToken(const grpc::ServerContextBase& ctx) const;

  AuthOptions options_;
  std::optional<std::array<uint8_t, 32>> admin_token_;  // SHA-256 of --admin-token-file's token
  mutable std::mutex mu_;
  std::shared_ptr<const TokenTable> tokens_;  // guarded by mu_ (the table itself is immutable)
  struct FileStamp {
    int64_t mtime_ns = 0, size = 0, inode = 0;
    bool operator==(const FileStamp&) const = default;
  };
  FileStamp stamp_;  // guarded by mu_
};

}  // namespace attnd
