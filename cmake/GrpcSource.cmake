# GrpcSource.cmake: gRPC's internal headers, from a gRPC source tree.
#
# Debian's libgrpc++-dev installs gRPC's public headers only, but the RDMA
# endpoint plugs into gRPC's iomgr (src/core/lib/iomgr/endpoint.h and
# friends), and some tests reuse gRPC's own (test/core/iomgr/...). Those
# come from an unpacked source tree of the very same gRPC version as the
# installed libraries: scripts/fetch-grpc-source.sh fetches Debian's source
# package and prints its path, and scripts/setup.sh passes that path here.
#
# Input (cache variable):
#   GRPC_RDMA_GRPC_SOURCE_DIR  the tree's root, or empty. A relative path is
#                              taken relative to the top source directory.
#
# Output (normal variables, in the scope that includes this module):
#   GRPC_RDMA_HAVE_GRPC_SOURCE            ON when the tree is usable, else OFF
#   GRPC_RDMA_GRPC_INTERNAL_INCLUDE_DIRS  the tree's root (for "src/core/...",
#                                         "test/core/...") and its include/
#   GRPC_RDMA_GRPC_THIRD_PARTY_INCLUDE_DIRS
#                                         upb, its generated code and xxhash
#                                         from the tree; none of the iomgr,
#                                         transport or test/core/util headers
#                                         needs them, but headers of the xds
#                                         and json parts do
#   GRPC_RDMA_GRPC_SOURCE_VERSION         the tree's gRPC version (1.51.1)
#   GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION  its Debian version (1.51.1-3), if any
#   GRPC_RDMA_GRPC_INSTALLED_VERSION      the installed gRPC's version
#
# A tree whose version differs from the installed gRPC's is a fatal error:
# gRPC's internals change between releases, and headers that don't match
# the library would compile but misbehave at run time.

include_guard(GLOBAL)

set(GRPC_RDMA_GRPC_SOURCE_DIR "" CACHE PATH
    "An unpacked gRPC source tree of the installed version (for gRPC's internal headers)")

set(GRPC_RDMA_HAVE_GRPC_SOURCE OFF)
set(GRPC_RDMA_GRPC_INTERNAL_INCLUDE_DIRS "")
set(GRPC_RDMA_GRPC_THIRD_PARTY_INCLUDE_DIRS "")
set(GRPC_RDMA_GRPC_SOURCE_VERSION "")
set(GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION "")
set(GRPC_RDMA_GRPC_INSTALLED_VERSION "")

string(CONCAT _grpc_rdma_fix_hint
    "Fetch the matching tree with scripts/fetch-grpc-source.sh (it prints the "
    "tree's path on its last line) and configure with "
    "-DGRPC_RDMA_GRPC_SOURCE_DIR=<that path>, or just run scripts/setup.sh, "
    "which does both.")

if("${GRPC_RDMA_GRPC_SOURCE_DIR}" STREQUAL "")
  message(STATUS "gRPC source tree: none given (GRPC_RDMA_GRPC_SOURCE_DIR is "
                 "empty), so gRPC's internals are not available. ${_grpc_rdma_fix_hint}")
  unset(_grpc_rdma_fix_hint)
  return()
endif()

get_filename_component(_grpc_rdma_src "${GRPC_RDMA_GRPC_SOURCE_DIR}" ABSOLUTE
                       BASE_DIR "${CMAKE_SOURCE_DIR}")

if(NOT IS_DIRECTORY "${_grpc_rdma_src}")
  message(FATAL_ERROR
    "GRPC_RDMA_GRPC_SOURCE_DIR=${GRPC_RDMA_GRPC_SOURCE_DIR}: no such directory. "
    "${_grpc_rdma_fix_hint}")
endif()
if(NOT EXISTS "${_grpc_rdma_src}/src/core/lib/iomgr/endpoint.h")
  message(FATAL_ERROR
    "GRPC_RDMA_GRPC_SOURCE_DIR=${_grpc_rdma_src} is not a gRPC source tree: "
    "it has no src/core/lib/iomgr/endpoint.h. ${_grpc_rdma_fix_hint}")
endif()

# --- the tree's version --------------------------------------------------------
# Upstream's top CMakeLists.txt has set(PACKAGE_VERSION "1.51.1"); Debian's
# tree also has debian/changelog, whose first line is "grpc (1.51.1-3) ...".
set(_grpc_rdma_tree_version "")
if(EXISTS "${_grpc_rdma_src}/CMakeLists.txt")
  file(STRINGS "${_grpc_rdma_src}/CMakeLists.txt" _grpc_rdma_lines
       REGEX "^[ \t]*set\\([ \t]*PACKAGE_VERSION[ \t]")
  foreach(_grpc_rdma_line IN LISTS _grpc_rdma_lines)
    if(_grpc_rdma_line MATCHES "PACKAGE_VERSION[ \t]+\"([^\"]+)\"")
      set(_grpc_rdma_tree_version "${CMAKE_MATCH_1}")
      break()
    endif()
  endforeach()
endif()
if(EXISTS "${_grpc_rdma_src}/debian/changelog")
  file(STRINGS "${_grpc_rdma_src}/debian/changelog" _grpc_rdma_lines
       LIMIT_COUNT 1)
  if(_grpc_rdma_lines MATCHES "^[^ ]+ \\(([^)]+)\\)")
    set(GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION "${CMAKE_MATCH_1}")
    if(_grpc_rdma_tree_version STREQUAL "")
      # Upstream part: drop an epoch ("1:") and the Debian revision ("-3").
      string(REGEX REPLACE "^[0-9]+:" "" _grpc_rdma_tree_version
                           "${GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION}")
      string(REGEX REPLACE "-[^-]*$" "" _grpc_rdma_tree_version
                           "${_grpc_rdma_tree_version}")
    endif()
  endif()
endif()
if(_grpc_rdma_tree_version STREQUAL "")
  message(FATAL_ERROR
    "Cannot tell the gRPC version of the tree in GRPC_RDMA_GRPC_SOURCE_DIR="
    "${_grpc_rdma_src}: neither its CMakeLists.txt (set(PACKAGE_VERSION ...)) "
    "nor a debian/changelog says. ${_grpc_rdma_fix_hint}")
endif()
set(GRPC_RDMA_GRPC_SOURCE_VERSION "${_grpc_rdma_tree_version}")

# --- the installed gRPC's version ----------------------------------------------
set(_grpc_rdma_installed_from "")
if(DEFINED gRPC_VERSION AND NOT "${gRPC_VERSION}" STREQUAL "")
  # find_package(gRPC) has run already.
  set(GRPC_RDMA_GRPC_INSTALLED_VERSION "${gRPC_VERSION}")
  set(_grpc_rdma_installed_from "find_package(gRPC)")
else()
  find_program(GRPC_RDMA_PKG_CONFIG_EXECUTABLE NAMES pkg-config pkgconf
               HINTS "${PKG_CONFIG_EXECUTABLE}")
  mark_as_advanced(GRPC_RDMA_PKG_CONFIG_EXECUTABLE)
  if(GRPC_RDMA_PKG_CONFIG_EXECUTABLE)
    execute_process(
      COMMAND "${GRPC_RDMA_PKG_CONFIG_EXECUTABLE}" --modversion grpc++
      OUTPUT_VARIABLE _grpc_rdma_out RESULT_VARIABLE _grpc_rdma_rc
      ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_grpc_rdma_rc EQUAL 0 AND NOT _grpc_rdma_out STREQUAL "")
      set(GRPC_RDMA_GRPC_INSTALLED_VERSION "${_grpc_rdma_out}")
      set(_grpc_rdma_installed_from "pkg-config --modversion grpc++")
    endif()
  endif()
endif()

# Debian's view: the source version libgrpc++-dev was built from (a binNMU's
# "+bN" is on the binary's version only, so ${source:Version} lacks it).
set(_grpc_rdma_installed_debian_version "")
set(_grpc_rdma_installed_binary_version "")
find_program(GRPC_RDMA_DPKG_QUERY_EXECUTABLE dpkg-query)
mark_as_advanced(GRPC_RDMA_DPKG_QUERY_EXECUTABLE)
if(GRPC_RDMA_DPKG_QUERY_EXECUTABLE)
  execute_process(
    COMMAND "${GRPC_RDMA_DPKG_QUERY_EXECUTABLE}" -W
            "--showformat=\${Status}|\${Version}|\${source:Version}" libgrpc++-dev
    OUTPUT_VARIABLE _grpc_rdma_out RESULT_VARIABLE _grpc_rdma_rc
    ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_grpc_rdma_rc EQUAL 0
     AND _grpc_rdma_out MATCHES "^install ok installed\\|([^|]+)\\|([^|]*)$")
    set(_grpc_rdma_installed_binary_version "${CMAKE_MATCH_1}")
    set(_grpc_rdma_installed_debian_version "${CMAKE_MATCH_2}")
    if(_grpc_rdma_installed_debian_version STREQUAL "")
      set(_grpc_rdma_installed_debian_version "${_grpc_rdma_installed_binary_version}")
    endif()
    string(REGEX REPLACE "\\+b[0-9]+$" "" _grpc_rdma_installed_debian_version
                         "${_grpc_rdma_installed_debian_version}")
    if(GRPC_RDMA_GRPC_INSTALLED_VERSION STREQUAL "")
      string(REGEX REPLACE "^[0-9]+:" "" GRPC_RDMA_GRPC_INSTALLED_VERSION
                           "${_grpc_rdma_installed_debian_version}")
      string(REGEX REPLACE "-[^-]*$" "" GRPC_RDMA_GRPC_INSTALLED_VERSION
                           "${GRPC_RDMA_GRPC_INSTALLED_VERSION}")
      set(_grpc_rdma_installed_from "dpkg-query libgrpc++-dev")
    endif()
  endif()
endif()

# --- compare ---------------------------------------------------------------------
if(GRPC_RDMA_GRPC_INSTALLED_VERSION STREQUAL "")
  message(WARNING
    "Cannot tell the installed gRPC's version (no find_package(gRPC), "
    "pkg-config grpc++ or libgrpc++-dev package found), so the gRPC source "
    "tree ${_grpc_rdma_src} (gRPC ${GRPC_RDMA_GRPC_SOURCE_VERSION}) is used "
    "unchecked.")
elseif(NOT GRPC_RDMA_GRPC_INSTALLED_VERSION STREQUAL GRPC_RDMA_GRPC_SOURCE_VERSION)
  message(FATAL_ERROR
    "gRPC version mismatch: the source tree in GRPC_RDMA_GRPC_SOURCE_DIR="
    "${_grpc_rdma_src} is gRPC ${GRPC_RDMA_GRPC_SOURCE_VERSION}, but the "
    "installed gRPC is ${GRPC_RDMA_GRPC_INSTALLED_VERSION} (from "
    "${_grpc_rdma_installed_from}). Internal headers must come from the same "
    "version as the installed libraries. ${_grpc_rdma_fix_hint}")
endif()
if(NOT GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION STREQUAL ""
   AND NOT _grpc_rdma_installed_debian_version STREQUAL ""
   AND NOT GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION STREQUAL _grpc_rdma_installed_debian_version)
  message(FATAL_ERROR
    "gRPC version mismatch: the source tree in GRPC_RDMA_GRPC_SOURCE_DIR="
    "${_grpc_rdma_src} is Debian's grpc ${GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION}, "
    "but the installed libgrpc++-dev ${_grpc_rdma_installed_binary_version} was "
    "built from grpc ${_grpc_rdma_installed_debian_version}, whose patches may "
    "differ. ${_grpc_rdma_fix_hint}")
endif()

# --- results ---------------------------------------------------------------------
set(GRPC_RDMA_HAVE_GRPC_SOURCE ON)
set(GRPC_RDMA_GRPC_INTERNAL_INCLUDE_DIRS "${_grpc_rdma_src}" "${_grpc_rdma_src}/include")
foreach(_grpc_rdma_dir IN ITEMS third_party/upb src/core/ext/upb-generated
                                src/core/ext/upbdefs-generated third_party/xxhash)
  if(IS_DIRECTORY "${_grpc_rdma_src}/${_grpc_rdma_dir}")
    list(APPEND GRPC_RDMA_GRPC_THIRD_PARTY_INCLUDE_DIRS "${_grpc_rdma_src}/${_grpc_rdma_dir}")
  endif()
endforeach()

set(_grpc_rdma_what "gRPC ${GRPC_RDMA_GRPC_SOURCE_VERSION}")
if(NOT GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION STREQUAL "")
  string(APPEND _grpc_rdma_what " (Debian grpc ${GRPC_RDMA_GRPC_SOURCE_DEBIAN_VERSION})")
endif()
if(GRPC_RDMA_GRPC_INSTALLED_VERSION STREQUAL "")
  string(APPEND _grpc_rdma_what ", unchecked")
else()
  string(APPEND _grpc_rdma_what ", matches the installed gRPC ${GRPC_RDMA_GRPC_INSTALLED_VERSION}")
  if(NOT _grpc_rdma_installed_binary_version STREQUAL "")
    string(APPEND _grpc_rdma_what " (libgrpc++-dev ${_grpc_rdma_installed_binary_version})")
  endif()
endif()
message(STATUS "gRPC source tree: ${_grpc_rdma_src}: ${_grpc_rdma_what}")

unset(_grpc_rdma_src)
unset(_grpc_rdma_tree_version)
unset(_grpc_rdma_lines)
unset(_grpc_rdma_line)
unset(_grpc_rdma_out)
unset(_grpc_rdma_rc)
unset(_grpc_rdma_dir)
unset(_grpc_rdma_what)
unset(_grpc_rdma_installed_from)
unset(_grpc_rdma_installed_debian_version)
unset(_grpc_rdma_installed_binary_version)
unset(_grpc_rdma_fix_hint)
