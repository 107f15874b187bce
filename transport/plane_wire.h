// The UCX data plane's active messages (docs/data-plane.md): fixed little-endian headers,
// refused unless exactly this size.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace attnd::transport {

inline constexpr uint16_t kToServer = 1;  // client -> server: bytes into the plane's input region
inline constexpr uint16_t kToClient = 2;  // server -> client: an output into the client's region
inline constexpr uint16_t kPull = 3;      // client -> server: send me output `transfer` (a reply)
inline constexpr size_t kTokenBytes = 16;

// Header of kToServer: which plane (its id and the secret the handshake gave), the transfer id
// the layer call will name, and where in the input region the payload goes.
struct ToServerHeader {
  uint64_t plane = 0;
  uint8_t token[kTokenBytes] = {};
  uint64_t transfer = 0;
  int64_t offset = 0;
};
// Header of kToClient: the plane, the transfer id the layer call named for its output, and where
// in the client's output region the payload goes; `refused` nonzero (no payload): the server has
// no such output staged.
struct ToClientHeader {
  uint64_t plane = 0;
  uint64_t transfer = 0;
  int64_t offset = 0;
  uint64_t refused = 0;
};
// Header of kPull, sent with UCX's reply flag: the server answers on the endpoint the message
// came by (a plane that does not push never makes one from the client's address, which UCX does
// not validate). Transfer 0 (no output has it), sent without the flag, is a keepalive: the
// client lives (UcxPlaneClient::KeepAlive), nothing is answered.
struct PullHeader {
  uint64_t plane = 0;
  uint8_t token[kTokenBytes] = {};
  uint64_t transfer = 0;
  int64_t offset = 0;
  int64_t length = 0;
};

template <typename H>
std::string PackHeader(const H& h) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof(H));
}
template <typename H>
bool UnpackHeader(const void* data, size_t length, H* h) {
  if (length != sizeof(H)) return false;
  std::memcpy(h, data, sizeof(H));
  return true;
}

}  // namespace attnd::transport
