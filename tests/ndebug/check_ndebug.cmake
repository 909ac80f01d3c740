# cmake -DMODULE_DIR=... -DDEBUG_LIB=... -DNDEBUG_LIB=... -DNONE_LIB=...
#       -DREAL_LIB=... -DREAL_EXPECTED=ON|OFF -P check_ndebug.cmake
# GrpcNdebug.cmake's answer for libraries built each way, and for the
# installed libgrpc (Debian's: without NDEBUG).
list(APPEND CMAKE_MODULE_PATH "${MODULE_DIR}")
include(GrpcNdebug)
set(failed 0)
foreach(case "DEBUG_LIB;OFF" "NDEBUG_LIB;ON" "NONE_LIB;UNKNOWN" "REAL_LIB;${REAL_EXPECTED}"
             "MISSING_LIB;UNKNOWN")
  list(GET case 0 var)
  list(GET case 1 want)
  if(var STREQUAL "MISSING_LIB")
    set(lib "/nonexistent/libgrpc.so")
  else()
    set(lib "${${var}}")
  endif()
  grpc_rdma_grpc_ndebug("${lib}" got)
  if(got STREQUAL want)
    message("ok   ${var} (${lib}): ${got}")
  else()
    message("FAIL ${var} (${lib}): ${got}, expected ${want}")
    set(failed 1)
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "GrpcNdebug.cmake answered wrongly")
endif()
