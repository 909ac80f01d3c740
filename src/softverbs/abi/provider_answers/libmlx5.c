/* What softverbs' stand-in for libmlx5.so.1 answers instead of trapping:
 * capability checks, which a program calls to decide whether to use the
 * mlx5 direct-verbs API at all (rdma-core's own tests do), must say "no"
 * rather than abort. Every other export of the stand-in still traps.
 * One function definition per line start, as build_provider_stub.sh reads
 * the names from here. */
_Bool mlx5dv_is_supported(void *device) {
  (void)device;
  return 0;
}
