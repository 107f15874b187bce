#pragma once

namespace attnd {

// The build's version ("0.3.0", from the CMake project) and git revision ("unknown" outside
// git). Defined in a source CMake writes when it configures (common/build_version.cc.in), so a
// new commit recompiles that one small file, not the files that print the version.
const char* BuildVersion();
const char* BuildRevision();

}  // namespace attnd
