# Package.cmake: installing libgrpc_rdma.so and making a Debian package.
#
#   cmake --install build [--prefix DIR]   the library, its public headers
#                                          (with grpc_rdma/version.h), an
#                                          exported CMake package
#                                          (find_package(grpc_rdma),
#                                          grpc_rdma::grpc_rdma) and grpc_rdma.pc
#   scripts/package.sh                     a .deb of the same (CPack), which
#                                          depends on the exact libgrpc it was
#                                          built against
#
# softverbs, tests and benchmarks are not installed: they are for
# developing and checking the library on machines without RDMA hardware.
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(_gr_cmakedir ${CMAKE_INSTALL_LIBDIR}/cmake/grpc_rdma)

install(TARGETS grpc_rdma EXPORT grpc_rdmaTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS grpc_rdma_info RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/grpc_rdma/grpc_rdma.h
              ${PROJECT_SOURCE_DIR}/include/grpc_rdma/options.h
              ${PROJECT_SOURCE_DIR}/include/grpc_rdma/stats.h
              ${PROJECT_BINARY_DIR}/include/grpc_rdma/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/grpc_rdma)
install(EXPORT grpc_rdmaTargets NAMESPACE grpc_rdma:: DESTINATION ${_gr_cmakedir})

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/templates/grpc_rdmaConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/grpc_rdmaConfig.cmake
                              INSTALL_DESTINATION ${_gr_cmakedir})
# Built against one gRPC release: same major and minor of grpc-rdma only.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/grpc_rdmaConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/grpc_rdmaConfig.cmake
              ${PROJECT_BINARY_DIR}/grpc_rdmaConfigVersion.cmake
        DESTINATION ${_gr_cmakedir})

# pkg-config: the prefix is found from the .pc file's own place, so an
# install with --prefix (or DESTDIR) needs no reconfigure.
file(RELATIVE_PATH GRPC_RDMA_PC_TO_PREFIX "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
string(REGEX REPLACE "/$" "" GRPC_RDMA_PC_TO_PREFIX "${GRPC_RDMA_PC_TO_PREFIX}")
configure_file(${CMAKE_CURRENT_LIST_DIR}/templates/grpc_rdma.pc.in
               ${PROJECT_BINARY_DIR}/grpc_rdma.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/grpc_rdma.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
install(FILES ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/LICENSE
              ${PROJECT_SOURCE_DIR}/docs/usage.md
        DESTINATION ${CMAKE_INSTALL_DOCDIR})

# --- the Debian package ----------------------------------------------------
# The library plugs into libgrpc's internals: it depends on the very
# libgrpc package (name and version) it was built against, as dpkg knows it.
set(_gr_grpc_dep "")
find_program(GRPC_RDMA_DPKG_QUERY dpkg-query)
mark_as_advanced(GRPC_RDMA_DPKG_QUERY)
# (Debian's grpc.pc names /usr/lib as its libdir: ask the linker's paths.)
find_library(GRPC_RDMA_LIBGRPC NAMES grpc)
mark_as_advanced(GRPC_RDMA_LIBGRPC)
if(GRPC_RDMA_DPKG_QUERY AND GRPC_RDMA_LIBGRPC)
  get_filename_component(_gr_libgrpc "${GRPC_RDMA_LIBGRPC}" REALPATH)
  execute_process(COMMAND ${GRPC_RDMA_DPKG_QUERY} -S "${_gr_libgrpc}"
                  OUTPUT_VARIABLE _gr_out RESULT_VARIABLE _gr_rc ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_gr_rc EQUAL 0 AND _gr_out MATCHES "^([^:]+)(:[^:]+)?: ")
    set(_gr_pkg "${CMAKE_MATCH_1}")
    execute_process(COMMAND ${GRPC_RDMA_DPKG_QUERY} -W "-f=\${Version}" "${_gr_pkg}"
                    OUTPUT_VARIABLE _gr_ver RESULT_VARIABLE _gr_rc ERROR_QUIET
                    OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_gr_rc EQUAL 0 AND NOT _gr_ver STREQUAL "")
      set(_gr_grpc_dep "${_gr_pkg} (= ${_gr_ver})")
    endif()
  endif()
endif()
set(GRPC_RDMA_DEB_GRPC_DEPENDENCY "${_gr_grpc_dep}" CACHE INTERNAL "")

set(CPACK_PACKAGE_NAME grpc-rdma)
set(CPACK_PACKAGE_VENDOR "grpc-rdma")
set(CPACK_PACKAGE_CONTACT "grpc-rdma developers")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "gRPC over RDMA verbs (InfiniBand, RoCE) for the distribution's gRPC")
set(CPACK_PACKAGE_DESCRIPTION
    "libgrpc_rdma.so makes unmodified gRPC programs use RDMA verbs between hosts, \
linked or preloaded, configured by TF_RDMA_* variables, falling back to TCP \
where there is no RDMA. Built against gRPC ${GRPC_RDMA_GRPC_SOURCE_VERSION}.")
set(CPACK_GENERATOR DEB)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libs)
set(CPACK_STRIP_FILES ON)  # debug info stays in the build tree
# dpkg-shlibdeps (dpkg-dev) finds libibverbs1, librdmacm1, abseil, libgrpc;
# the exact libgrpc version comes on top.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "${GRPC_RDMA_DEB_GRPC_DEPENDENCY}")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "libgrpc++-dev, libabsl-dev, rdma-core")
include(CPack)
