# GrpcNdebug.cmake: was the installed libgrpc built with NDEBUG?
#
# The glue includes gRPC's internal headers, and some of their types and
# inline functions change with NDEBUG (grpc_core::DebugLocation carries a
# file and line only without it; grpc_stream_refcount has an object_type
# field only without it). The glue must be compiled as libgrpc was, or it
# corrupts memory silently. Debian builds libgrpc without NDEBUG; another
# build of the same release may not.
#
# The library says which: gRPC declares grpc_stream_ref_init with a
# trailing `const char* object_type` only without NDEBUG, and the mangled
# name of the exported function carries its parameters (...PKc at the end).
#
#   grpc_rdma_grpc_ndebug(<libgrpc.so path> <out-var>)
#     sets <out-var> to ON (built with NDEBUG), OFF (without), or UNKNOWN
#     (no such symbol: not a libgrpc this project knows).
#
# Cache variable GRPC_RDMA_GRPC_NDEBUG: AUTO (default: detect), ON or OFF
# (for a libgrpc whose symbols cannot be read).

include_guard(GLOBAL)

function(grpc_rdma_grpc_ndebug library out)
  set(nm "${CMAKE_NM}")
  if(NOT nm)  # script mode (cmake -P)
    find_program(GRPC_RDMA_NM_PROGRAM NAMES nm)
    set(nm "${GRPC_RDMA_NM_PROGRAM}")
  endif()
  set(${out} UNKNOWN PARENT_SCOPE)
  if(NOT nm OR NOT EXISTS "${library}")
    return()
  endif()
  execute_process(COMMAND "${nm}" -D --defined-only "${library}"
                  OUTPUT_VARIABLE symbols RESULT_VARIABLE rc ERROR_QUIET)
  if(NOT rc EQUAL 0)
    return()
  endif()
  string(REGEX MATCH "_Z20grpc_stream_ref_initP20grpc_stream_refcount[A-Za-z0-9_]*" sym
         "${symbols}")
  if(sym STREQUAL "")
    return()
  elseif(sym MATCHES "PKc$")
    set(${out} OFF PARENT_SCOPE)
  else()
    set(${out} ON PARENT_SCOPE)
  endif()
endfunction()
