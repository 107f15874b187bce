# The GPU libraries' pinned versions, read from scripts/fetch-gpu-libs.sh (the one place they are
# written): sets ATTND_PIN_<name> for each "name version sha256 path" entry there.
file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/../scripts/fetch-gpu-libs.sh" _attnd_pin_lines
     REGEX "^  \"[a-z-]+ [^ ]+ [0-9a-f]+ ")
foreach(_line IN LISTS _attnd_pin_lines)
  string(REGEX MATCH "^  \"([a-z-]+) ([^ ]+) " _m "${_line}")
  set(ATTND_PIN_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}")
endforeach()
# Where fetch-gpu-libs.sh unpacks them.
if(DEFINED ENV{ATTND_GPU_LIBS_DIR})
  set(ATTND_GPU_LIBS_DIR "$ENV{ATTND_GPU_LIBS_DIR}" CACHE PATH "GPU libraries' headers")
else()
  set(ATTND_GPU_LIBS_DIR "$ENV{HOME}/.cache/attnd/gpu-libs" CACHE PATH "GPU libraries' headers")
endif()
