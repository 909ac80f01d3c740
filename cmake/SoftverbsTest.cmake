# grpc_rdma_softverbs_gtest(TARGET PREFIX <p> SOURCES <files...> LIBS <libs...> [OWN_MAIN])
#
# A GoogleTest binary linked against the system's rdma-core and run over
# softverbs: softverbs' library directory comes first through the build
# RUNPATH, and every test gets one softverbs device, mlx5_0 on 127.0.0.1.
# OWN_MAIN: the sources define main() (e.g. to run child processes).
function(grpc_rdma_softverbs_gtest target)
  cmake_parse_arguments(A "OWN_MAIN" "PREFIX" "SOURCES;LIBS" ${ARGN})
  add_executable(${target} ${A_SOURCES})
  if(A_OWN_MAIN)
    target_link_libraries(${target} PRIVATE ${A_LIBS} GTest::gtest)
  else()
    target_link_libraries(${target} PRIVATE ${A_LIBS} GTest::gtest_main)
  endif()
  add_dependencies(${target} softverbs)
  set_target_properties(${target} PROPERTIES BUILD_RPATH ${SOFTVERBS_LIB_DIR})
  # One variable only: gtest_discover_tests splits list values.
  gtest_discover_tests(${target} TEST_PREFIX "${A_PREFIX}."
                       PROPERTIES ENVIRONMENT "SOFTVERBS_DEVICES=mlx5_0:127.0.0.1"
                       TIMEOUT 300 DISCOVERY_TIMEOUT 60)
endfunction()
