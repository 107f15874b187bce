// How the simulation tests judge a mutated kernel (a barrier, fence or wait removed): caught when
// the simulation refuses the run (an error) or the run gives other results than the unmutated one.
#pragma once

#include <stdexcept>

namespace attnd::testing {

// `run` runs the mutated kernel and says whether its results differ from the unmutated run's.
template <typename Run>
bool RefusedOrChanged(Run run) {
  try {
    return run();
  } catch (const std::runtime_error&) {
    return true;
  }
}

}  // namespace attnd::testing
