#include "kernels/device.h"

#include "common/status_macros.h"

namespace attnd {

absl::Status Device::CopyPages(Device& dst, const std::vector<PageCopy>& copies) {
  std::vector<uint8_t> staged;
  for (const PageCopy& c : copies) {
    if (c.rows <= 0) continue;
    staged.resize(layout_.StagedBytes(c.rows));
    RETURN_IF_ERROR(ReadPage(c.src, c.rows, staged.data()));
    RETURN_IF_ERROR(dst.WritePage(c.dst, c.rows, staged.data()));
  }
  return absl::OkStatus();
}

}  // namespace attnd
