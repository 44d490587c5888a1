# OrtHeaders.cmake -- locate the ONNX Runtime C/C++ API headers.
#
# After include(cmake/OrtHeaders.cmake):
#   ORT_INCLUDE_DIR      directory holding onnxruntime_c_api.h,
#                        onnxruntime_ep_c_api.h and onnxruntime_cxx_api.h
#                        (use it as an include directory; never link ORT).
#   ORT_HEADERS_API_VERSION  the ORT_API_VERSION those headers define.
#
# Order:
#   1. ONNXRUNTIME_INCLUDE_DIR (CMake cache variable, else environment variable):
#      used as is (it may also name the parent of an `onnxruntime/` directory);
#      a missing header is a fatal error.
#   2. Headers already fetched into the fetch directory: reused, no network.
#   3. Otherwise tools/fetch_ort_headers.sh downloads Debian sid's
#      libonnxruntime-dev (1.23.x) into the fetch directory with a private apt
#      state (nothing is installed into the system).
# The fetch directory is ${CMAKE_BINARY_DIR}/_deps/ort-headers, so a clean
# build tree fetches again; set the environment variable
# ONNX_LIGHT_ORT_HEADERS_CACHE to a directory to share one fetch across builds.
#
# The project is written against ORT_API_VERSION 23 (ORT 1.23); other
# versions only produce a warning.

# No include_guard: including it again (e.g. from a subdirectory) is cheap and
# sets ORT_INCLUDE_DIR in that scope too.

set(_ort_headers_required onnxruntime_c_api.h onnxruntime_ep_c_api.h onnxruntime_cxx_api.h)
set(_ort_headers_expected_api 23)

set(ONNXRUNTIME_INCLUDE_DIR "" CACHE PATH
    "Directory holding onnxruntime_c_api.h (ONNX Runtime 1.23 headers); empty = fetch Debian's libonnxruntime-dev into the build tree")

function(_ort_headers_missing dir out_var)
  set(missing "")
  foreach(h IN LISTS _ort_headers_required)
    if(NOT EXISTS "${dir}/${h}")
      list(APPEND missing "${h}")
    endif()
  endforeach()
  set(${out_var} "${missing}" PARENT_SCOPE)
endfunction()

# ---- 1. explicit override -------------------------------------------------
set(_ort_override "${ONNXRUNTIME_INCLUDE_DIR}")
set(_ort_override_from "CMake variable ONNXRUNTIME_INCLUDE_DIR")
if(_ort_override STREQUAL "" AND DEFINED ENV{ONNXRUNTIME_INCLUDE_DIR}
   AND NOT "$ENV{ONNXRUNTIME_INCLUDE_DIR}" STREQUAL "")
  set(_ort_override "$ENV{ONNXRUNTIME_INCLUDE_DIR}")
  set(_ort_override_from "environment variable ONNXRUNTIME_INCLUDE_DIR")
endif()

if(NOT _ort_override STREQUAL "")
  get_filename_component(_ort_override "${_ort_override}" ABSOLUTE)
  _ort_headers_missing("${_ort_override}" _ort_missing)
  if(_ort_missing AND EXISTS "${_ort_override}/onnxruntime/onnxruntime_c_api.h")
    # Accept the parent directory too (e.g. /usr/include).
    set(_ort_override "${_ort_override}/onnxruntime")
    _ort_headers_missing("${_ort_override}" _ort_missing)
  endif()
  if(_ort_missing)
    list(JOIN _ort_missing ", " _ort_missing)
    list(JOIN _ort_headers_required ", " _ort_required_text)
    message(FATAL_ERROR
      "OrtHeaders: ${_ort_override_from} = '${_ort_override}' does not contain "
      "${_ort_missing}; expected a directory holding ${_ort_required_text} "
      "(ONNX Runtime 1.23 headers). Unset it to fetch Debian's libonnxruntime-dev "
      "into the build tree instead.")
  endif()
  set(ORT_INCLUDE_DIR "${_ort_override}")
  message(STATUS "OrtHeaders: using ${ORT_INCLUDE_DIR} (from ${_ort_override_from})")

else()
  # ---- 2./3. reuse or fetch ---------------------------------------------
  if(DEFINED ENV{ONNX_LIGHT_ORT_HEADERS_CACHE} AND NOT "$ENV{ONNX_LIGHT_ORT_HEADERS_CACHE}" STREQUAL "")
    get_filename_component(_ort_fetch_dir "$ENV{ONNX_LIGHT_ORT_HEADERS_CACHE}" ABSOLUTE)
  else()
    set(_ort_fetch_dir "${CMAKE_BINARY_DIR}/_deps/ort-headers")
  endif()
  set(_ort_fetched_include "${_ort_fetch_dir}/root/usr/include/onnxruntime")

  _ort_headers_missing("${_ort_fetched_include}" _ort_missing)
  if(NOT _ort_missing)
    set(ORT_INCLUDE_DIR "${_ort_fetched_include}")
    message(STATUS "OrtHeaders: reusing ${ORT_INCLUDE_DIR}")
  else()
    set(_ort_fetch_script "${CMAKE_CURRENT_LIST_DIR}/../tools/fetch_ort_headers.sh")
    get_filename_component(_ort_fetch_script "${_ort_fetch_script}" ABSOLUTE)
    if(NOT EXISTS "${_ort_fetch_script}")
      message(FATAL_ERROR "OrtHeaders: ${_ort_fetch_script} is missing; set ONNXRUNTIME_INCLUDE_DIR")
    endif()
    find_program(ORT_HEADERS_BASH bash)
    if(NOT ORT_HEADERS_BASH)
      message(FATAL_ERROR "OrtHeaders: bash not found (needed by ${_ort_fetch_script}); set ONNXRUNTIME_INCLUDE_DIR")
    endif()
    message(STATUS "OrtHeaders: fetching Debian libonnxruntime-dev into ${_ort_fetch_dir}")
    execute_process(
      COMMAND "${ORT_HEADERS_BASH}" "${_ort_fetch_script}" "${_ort_fetch_dir}"
      RESULT_VARIABLE _ort_rc
      OUTPUT_VARIABLE _ort_out
      ERROR_VARIABLE _ort_err)
    if(NOT _ort_rc EQUAL 0)
      message(FATAL_ERROR
        "OrtHeaders: ${_ort_fetch_script} failed (exit ${_ort_rc}):\n${_ort_err}\n"
        "Set ONNXRUNTIME_INCLUDE_DIR (CMake or environment) to a directory "
        "holding the ONNX Runtime 1.23 headers to skip the download.")
    endif()
    if(NOT _ort_err STREQUAL "")
      string(STRIP "${_ort_err}" _ort_err)
      string(REPLACE "\n" ";" _ort_err "${_ort_err}")
      foreach(_ort_line IN LISTS _ort_err)
        message(STATUS "${_ort_line}")
      endforeach()
      unset(_ort_line)
    endif()
    string(STRIP "${_ort_out}" _ort_out)
    string(REGEX REPLACE "^.*\n" "" ORT_INCLUDE_DIR "${_ort_out}")  # last line
    _ort_headers_missing("${ORT_INCLUDE_DIR}" _ort_missing)
    if(_ort_missing)
      list(JOIN _ort_missing ", " _ort_missing)
      message(FATAL_ERROR
        "OrtHeaders: ${_ort_fetch_script} reported '${ORT_INCLUDE_DIR}', which lacks ${_ort_missing}")
    endif()
    message(STATUS "OrtHeaders: fetched ${ORT_INCLUDE_DIR}")
  endif()
endif()

# ---- version check ----------------------------------------------------------
file(STRINGS "${ORT_INCLUDE_DIR}/onnxruntime_c_api.h" _ort_api_line
     REGEX "^#define ORT_API_VERSION [0-9]+" LIMIT_COUNT 1)
string(REGEX REPLACE "^#define ORT_API_VERSION ([0-9]+).*$" "\\1" ORT_HEADERS_API_VERSION "${_ort_api_line}")
if(NOT ORT_HEADERS_API_VERSION MATCHES "^[0-9]+$")
  set(ORT_HEADERS_API_VERSION "")
  message(WARNING "OrtHeaders: no '#define ORT_API_VERSION' in ${ORT_INCLUDE_DIR}/onnxruntime_c_api.h")
elseif(NOT ORT_HEADERS_API_VERSION EQUAL _ort_headers_expected_api)
  message(WARNING
    "OrtHeaders: ${ORT_INCLUDE_DIR} has ORT_API_VERSION ${ORT_HEADERS_API_VERSION}; "
    "onnx-light-ep is written against ${_ort_headers_expected_api} (ONNX Runtime 1.23). "
    "The library reports the compiled-against version to ORT, so it would require "
    "onnxruntime >= 1.${ORT_HEADERS_API_VERSION} at run time.")
else()
  message(STATUS "OrtHeaders: ORT_API_VERSION ${ORT_HEADERS_API_VERSION}")
endif()

unset(_ort_override)
unset(_ort_override_from)
unset(_ort_missing)
unset(_ort_fetch_dir)
unset(_ort_fetched_include)
unset(_ort_fetch_script)
unset(_ort_rc)
unset(_ort_out)
unset(_ort_err)
unset(_ort_api_line)
